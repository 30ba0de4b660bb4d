# PROTO (measurement only; removed in the next commit): ncu counters of blocked_forward on ddetr_enc and m2f_enc fp32.
set -u
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail $OUT/build.log; exit 1; }
M="breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_sector_hit_rate.pct,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,gpu__time_duration.sum"
for w in ddetr_enc m2f_enc; do
  echo "=== blocked $w fp32"
  PYTHONPATH=$PWD ncu --clock-control none -k regex:blocked_forward --launch-skip 1 --launch-count 1 --metrics "$M" \
    python3 scripts/probes/once.py $w 2>&1 | grep -vE "^==PROF==|^ *---|Section" | sed -n '/blocked_forward/,$p' | head -70
done
