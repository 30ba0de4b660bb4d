# PROTO (measurement only; removed in the next commit).
# Builds this tree and a copy whose gather_row gathers nothing (the rest of
# the kernel as is), then times both.
set -u
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=8
rm -rf /tmp/nog && mkdir -p /tmp/nog && tar cf - --exclude=./build --exclude=./gpu_out . | tar xf - -C /tmp/nog
sed -i 's/int gathers = valid && active;/int gathers = 0;/' /tmp/nog/csrc/cuda/device/sampler.cuh
grep -c "int gathers = 0;" /tmp/nog/csrc/cuda/device/sampler.cuh
t0=$(date +%s)
(python3 setup.py build_ext --inplace > $OUT/build.log 2>&1) &
(cd /tmp/nog && python3 setup.py build_ext --inplace > $OUT/build_nog.log 2>&1) &
wait; echo "built $(( $(date +%s)-t0 )) s"
PYTHONPATH=$PWD python3 scripts/probes/overhead.py full
(cd /tmp/nog && PYTHONPATH=/tmp/nog python3 scripts/probes/overhead.py nogather)
PYTHONPATH=$PWD python3 scripts/probes/overhead.py full
