#!/usr/bin/env bash
# A/B on the GPU machine in one call: this tree ("new") against another
# ("old", the tarball build/before.tgz, e.g. `git archive HEAD | gzip >
# build/before.tgz`, carried to the device), both built for sm_90a side by
# side; then, for each stage in AB_STAGES (default "test ktimes bench"):
#   test    pytest on the new tree (AB_TESTS, default the backward tests; -n 6)
#   ktimes  scripts/kernel_times.py on both (KT="workload dtype;...")
#   layerk  scripts/layer_kernels.py on both (LK="workload dtype impl;...")
#   bench   python -m benchmarks.run on both (BENCH: its arguments)
#   bitwise scripts/bitwise_outputs.py on both, then compared (the same kernels
#           must give the same bits)
#   host    benchmarks/host_overhead.py (this tree's) on both, alternated
#           HOST_ROUNDS times (default 4) on one core (HOST: its arguments)
# Logs and JSON under $OUT (all.tgz holds them together).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
NEW=$PWD OLD=/tmp/before
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
rm -rf $OLD; mkdir -p $OLD; tar xzf build/before.tgz -C $OLD
t0=$(date +%s)
(cd $OLD && python setup.py build_ext --inplace > "$OUT/build_old.log" 2>&1) &
(cd $NEW && MSDA_PTXAS_VERBOSE=1 python setup.py build_ext --inplace > "$OUT/build_new.log" 2>&1) || { tail -40 "$OUT/build_new.log"; echo BUILD FAILED; exit 1; }
wait || true
echo "built in $(( $(date +%s) - t0 )) s"
for s in ${AB_STAGES:-test ktimes bench}; do
  echo "=== $s $(date +%T)"
  case $s in
    test) python -m pytest -q -p no:cacheprovider ${AB_TESTS:-tests/ops/test_backward.py tests/ops/test_fused.py tests/ops/test_local_grad_value.py} -n 6 2>&1 | tee "$OUT/tests.log" | tail -8 ;;
    ktimes) for t in old new; do d=$NEW; [ $t = old ] && d=$OLD
        IFS=';' read -ra runs <<< "${KT:-ddetr_enc bf16}"
        for r in "${runs[@]}"; do (cd $d && python scripts/kernel_times.py $r) 2>&1 | sed "s/^/$t /"; done
      done | tee "$OUT/ktimes.txt" | grep -E "total|==|grad_value|dots|pack|Onesweep|cell_starts" ;;
    bench) for t in old new; do d=$NEW; [ $t = old ] && d=$OLD
        (cd $d && python -m benchmarks.run ${BENCH:---workloads ddetr_enc,ddetr_enc@smooth,m2f_enc,bevformer_tsa,dino5_enc --dtypes bf16,fp32 --backends baseline,deterministic --passes fwd,fwdbwd --target-ms 40} --no-plot --out "$OUT/bench_$t") > "$OUT/bench_$t.log" 2>&1
        echo "--- $t"; grep -E '^\|' "$OUT/bench_$t.log" | grep -v "| fwd |" | head -60
      done ;;
    layerk) for t in old new; do d=$NEW; [ $t = old ] && d=$OLD
        IFS=';' read -ra runs <<< "${LK:-ddetr_enc bf16 fused}"
        for r in "${runs[@]}"; do (cd $d && python scripts/layer_kernels.py $r) 2>&1 | sed "s/^/$t /"; done \
          | grep -E "total|==|grad_value|dots|pack|Onesweep|cell_starts|footprints"
      done | tee "$OUT/layerk.txt" ;;
    bitwise) for t in old new; do d=$NEW; [ $t = old ] && d=$OLD
        python scripts/bitwise_outputs.py save $d "$OUT/bitwise_$t.pt" 2>&1 | tail -1
      done
      python scripts/bitwise_outputs.py compare "$OUT/bitwise_old.pt" "$OUT/bitwise_new.pt" | tee "$OUT/bitwise.txt"
      rm -f "$OUT"/bitwise_*.pt ;;
    host) for i in $(seq ${HOST_ROUNDS:-4}); do for t in old new; do d=$NEW; [ $t = old ] && d=$OLD
        PYTHONPATH=$d taskset -c 3 python $NEW/benchmarks/host_overhead.py ${HOST:---workload ddetr_dec} 2>&1 \
          | grep -v Warn | sed "s/^/$t /"
      done; done | tee "$OUT/host.txt" ;;
  esac
done
cd "$OUT" && tar czf all.tgz *.log *.txt bench_* 2>/dev/null; ls "$OUT"
