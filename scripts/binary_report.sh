#!/usr/bin/env bash
# Kernels and cubin bytes per source file and per GPU architecture in the
# operator library (cuobjdump from the CUDA toolkit):
#   bash scripts/binary_report.sh [ms_deform_attn/lib/libms_deform_attn.so]
# .ci/run prints them on every run.
set -euo pipefail
lib=$(realpath "${1:-ms_deform_attn/lib/libms_deform_attn.so}")
command -v cuobjdump > /dev/null || { echo "binary_report: no cuobjdump on the PATH"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && cuobjdump -xelf all "$lib" > /dev/null)
printf "%-34s %8s %12s\n" cubin kernels bytes
for f in "$tmp"/*.cubin; do
  printf "%-34s %8s %12s\n" "$(basename "$f")" "$(cuobjdump -res-usage "$f" | grep -c "^ *Function" || true)" \
    "$(stat -c %s "$f")"
done | sort -k1,1 | tee "$tmp/rows"
echo "per architecture:"
sed -E 's/^[^ ]*\.(sm_[0-9]+a?)\.cubin/\1/' "$tmp/rows" \
  | awk '{k[$1] += $2; b[$1] += $3} END {for (a in k) printf "  %-8s %5d kernels %9.2f MB\n", a, k[a], b[a] / 1e6}' | sort
echo "ptx: $(cuobjdump --list-ptx "$lib" 2>/dev/null | grep -c . || true) entries"
