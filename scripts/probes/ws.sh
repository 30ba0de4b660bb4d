# PROTO (lost, reverted in the next commit): builds this tree, checks MSDA_PROTO_WS against blocked and times its variants.
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
MSDA_PTXAS_VERBOSE=1 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head; tail -5 $OUT/build.log; exit 1; }
grep -A1 "ws_forward" $OUT/build.log | grep -E "registers|spill" | head -3
MS_DEFORM_ATTN_POISON=1 PYTHONPATH=$PWD timeout 120 python3 scripts/probes/ws.py check || echo "CHECK FAILED $?"
PYTHONPATH=$PWD timeout 240 python3 scripts/probes/ws.py time
