#!/usr/bin/env bash
# One call on the GPU machine: build for sm_90a with all cores, run the whole
# test suite, run the benchmark; logs, JSON and PNG go under $OUT when set
# (./gpu_out otherwise). Exits non-zero if the build or any test fails.
#
#   STAGES="build test bench"   stages to run (also: sanitize, stress, fuzz, ktimes, model,
#                               profile, peer, source, sass, cpp, cputhreads, layerk, paths,
#                               wheel, deploy)
#   BENCH_ARGS="--full"         arguments for python -m benchmarks.run
#   BENCH_OUT=results/full      its --out, kept by the warm machine between calls
#                               (--resume continues it; default $OUT)
#   PYTEST_ARGS=""              extra pytest arguments
#   SANITIZE_ARGS=""            arguments for tests/reliability/sanitize_suite.py (e.g. --backends blocked)
#   MSDA_COMMIT=<sha>           commit recorded in bench.json (the copy on the
#                               GPU machine has no git history)
#   PACK=1                      at the end, $OUT packed into $OUT/all.tgz when it
#                               holds more than 8 files (what the device tool
#                               brings back; profile, source and peer write more)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test bench"}
BENCH_ARGS=${BENCH_ARGS:---full}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
status=0

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  git log -1 --format='commit %h %s' 2>/dev/null; git status --short 2>/dev/null | head -20
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    build)
      if ! MSDA_PTXAS_VERBOSE=1 $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
        tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
      fi
      grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -5 ;;
    test)
      # The huge-tensor tests run alone afterwards: beside parallel workers
      # (PYTEST_ARGS="-n ...") they skip for lack of free GPU memory.
      $PY -m pytest -q -ra -p no:cacheprovider tests --ignore=tests/reliability/test_huge.py ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/tests.log" | tail -40
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "TESTS FAILED ($rc)"; status=1; }
      $PY -m pytest -q -ra -p no:cacheprovider tests/reliability/test_huge.py 2>&1 | tee "$OUT/tests_huge.log" | tail -5
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "HUGE TESTS FAILED ($rc)"; status=1; } ;;
    bench)
      # BENCH_OUT: a folder the warm machine keeps between calls (ignored,
      # e.g. results/full), for a run continued with --resume; what it holds
      # is copied into $OUT.
      bench_out=${BENCH_OUT:-$OUT}
      mkdir -p "$bench_out"
      # A Triton cache carried as .gpu_deps/triton_cache.tgz (a folder
      # triton_cache/ of .json and .cubin files filled on another machine,
      # docs/development.md) serves the Triton peer's compiles; its group
      # files name absolute paths, rewritten to where it is unpacked.
      if [ -f .gpu_deps/triton_cache.tgz ] && [ -z "${TRITON_CACHE_DIR:-}" ]; then
        if [ ! -d results/triton_cache ]; then
          mkdir -p results && tar xzf .gpu_deps/triton_cache.tgz -C results
          sed -i -E "s#\"/[^\"]*/([A-Z0-9]{52})/#\"$PWD/results/triton_cache/\1/#g" \
            results/triton_cache/*/__grp__*.json
        fi
        export TRITON_CACHE_DIR=$PWD/results/triton_cache
      fi
      $PY -m benchmarks.run $BENCH_ARGS --out "$bench_out" 2>&1 | tee "$OUT/bench.log" | tail -80
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "BENCH FAILED"; status=1; }
      [ "$bench_out" = "$OUT" ] || cp "$bench_out"/bench.* "$OUT"/ 2>/dev/null ;;
    paths)
      # The backward by grad_value path, one benchmarks.run each
      # (MS_DEFORM_ATTN_GRAD_VALUE = atomic, sorted, local; PATHS_ARGS: its
      # arguments; JSON under $OUT/path_<path>).
      for path in ${GRAD_VALUE_PATHS:-atomic sorted local}; do
        echo "--- grad_value path $path"
        MS_DEFORM_ATTN_GRAD_VALUE=$path $PY -m benchmarks.run \
          ${PATHS_ARGS:---workloads rtdetr_dec,dino_dec,ddetr_dec --dtypes bf16,fp32 --backends baseline --target-ms 60} \
          --no-plot --out "$OUT/path_$path" 2>&1 | tee "$OUT/path_$path.log" | grep -E '^\|' | tail -12
        [ "${PIPESTATUS[0]}" = 0 ] || { echo "PATH BENCH FAILED ($path)"; status=1; }
      done ;;
    cpp)
      # The C++ example (examples/cpp) against the in-place build: CPU and CUDA.
      { rm -rf /tmp/msda-cpp
        cmake -S examples/cpp -B /tmp/msda-cpp -DCMAKE_PREFIX_PATH="$($PY -m ms_deform_attn --cmake-prefix-path)" \
          && cmake --build /tmp/msda-cpp -j "$(nproc)" && /tmp/msda-cpp/msda_example
      } > "$OUT/cpp.log" 2>&1
      rc=$?; tail -25 "$OUT/cpp.log"; [ "$rc" = 0 ] || { echo "C++ EXAMPLE FAILED ($rc)"; status=1; } ;;
    cputhreads)
      $PY -m benchmarks.cpu_threads 2>&1 | tee "$OUT/cpu_threads.md" | tail -12 ;;
    profile)
      # Nsight Compute on one forward per backend and the backward (ddetr_enc
      # by default; PROFILE_ARGS="workload dtype").
      ncu --clock-control none --profile-from-start off -k regex:"forward|backward" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
        --section Occupancy --section LaunchStats --section SchedulerStats \
        --metrics l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_atom.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_atom.sum,smsp__inst_executed_op_shared_atom.sum \
        $PY scripts/profile_kernels.py ${PROFILE_ARGS:-} > "$OUT/ncu.txt" 2>&1 || status=1
      grep -E "forward_kernel|dots_kernel|Duration|stalled|atom|Throughput|Hit Rate|Achieved Occupancy|Stall|wavefronts|requests|sectors|inst_executed|No Eligible|Issued Warp" "$OUT/ncu.txt" | head -150 ;;
    sanitize)
      # compute-sanitizer over the small suite, the tools (SANITIZE_TOOLS) side
      # by side in separate processes (the run is CPU-bound); any report fails
      # the stage. initcheck skips host API copies (it flags PyTorch's own
      # device-to-host copies of initialised tensors). It must instrument every
      # kernel: with a kernel-name filter, memory written by PyTorch's kernels
      # (randn, zeros) reads as uninitialised in ours.
      tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
      for tool in $tools; do
        extra=""; [ $tool = initcheck ] && extra="--check-api-memory-access no"
        ( compute-sanitizer --tool $tool $extra --error-exitcode 9 --print-limit 20 \
            $PY tests/reliability/sanitize_suite.py ${SANITIZE_ARGS:-} > "$OUT/sanitize_$tool.txt" 2>&1
          echo $? > "$OUT/sanitize_$tool.rc" ) &
      done
      wait
      for tool in $tools; do
        if [ "$(cat "$OUT/sanitize_$tool.rc")" = 0 ]; then
          echo "sanitize $tool: clean ($(grep -h 'sanitize suite' "$OUT/sanitize_$tool.txt"); $(grep -h 'ERROR SUMMARY' "$OUT/sanitize_$tool.txt" | tail -1))"
        else
          echo "sanitize $tool: FAILED"; tail -40 "$OUT/sanitize_$tool.txt"; status=1
        fi
      done ;;
    stress)
      $PY tests/reliability/stress.py --iterations ${STRESS_ITERATIONS:-3000} 2>&1 | tee "$OUT/stress.txt" | tail -5
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "STRESS FAILED"; status=1; } ;;
    fuzz)
      MSDA_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-1000} $PY -m pytest -q -p no:cacheprovider tests/reliability/test_fuzz.py \
        --hypothesis-show-statistics 2>&1 | tee "$OUT/fuzz.txt" | tail -15
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FUZZ FAILED"; status=1; } ;;
    ktimes)
      # Per-kernel backward times (KTIMES_ARGS="workload dtype", repeatable
      # with ';' between runs).
      IFS=';' read -ra runs <<< "${KTIMES_ARGS:-ddetr_enc bf16}"
      for r in "${runs[@]}"; do $PY scripts/kernel_times.py $r; done 2>&1 | tee -a "$OUT/ktimes.txt" ;;
    layerk)
      # Per-kernel GPU times of the attention layer's forward + backward
      # (LAYERK_ARGS="workload dtype impl ...").
      $PY scripts/layer_kernels.py ${LAYERK_ARGS:-ddetr_enc bf16 ours fused} 2>&1 | tee -a "$OUT/layerk.txt" | head -120 ;;
    model)
      # The full-size DeformableDetrModel training step (benchmarks.layer
      # --model; MODEL_ARGS, JSON under $OUT/model).
      $PY -m benchmarks.layer --model ${MODEL_ARGS:---paths swapped --compile} --out "$OUT/model" 2>&1 \
        | tee "$OUT/model.log" | grep -v Warning | tail -20
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "MODEL BENCH FAILED"; status=1; } ;;
    source)
      # Nsight Compute source counters (instructions and stalls a source line)
      # of one kernel (SOURCE_KERNEL, a regex) for each run of
      # SOURCE_SCRIPT (scripts/profile_kernels.py; scripts/peer_profile.py for
      # the Triton peer's kernel) with SOURCE_ARGS (';' between runs); the
      # reports and their CUDA-line and SASS pages as CSV under $OUT.
      IFS=';' read -ra runs <<< "${SOURCE_ARGS:-rtdetr_dec bf16 backward}"
      i=0
      for r in "${runs[@]}"; do
        ncu --clock-control none --profile-from-start off -k regex:"${SOURCE_KERNEL:-grad_value_local_kernel}" \
          --section SourceCounters --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
          --import-source yes -f -o "$OUT/source_$i" $PY ${SOURCE_SCRIPT:-scripts/profile_kernels.py} $r > "$OUT/source_$i.log" 2>&1 \
          || { echo "SOURCE PROFILE FAILED ($r)"; tail -5 "$OUT/source_$i.log"; status=1; }
        for page in cuda sass; do
          ncu -i "$OUT/source_$i.ncu-rep" --page source --csv --print-source $page > "$OUT/source_${i}_$page.csv" 2>&1
        done
        ncu -i "$OUT/source_$i.ncu-rep" --page details > "$OUT/source_${i}_details.txt" 2>&1
        echo "--- source $i: $r"; grep -E "Duration|Executed Ipc|Issued Warp|No Eligible" "$OUT/source_${i}_details.txt" | head -8
        i=$((i + 1))
      done ;;
    wheel)
      # The wheel in dist/ (one carried here, or, when there is none, built
      # here for TORCH_CUDA_ARCH_LIST against this machine's torch): installed
      # into a fresh target folder and the suite run against it from outside
      # the checkout (MSDA_EXPECT_INSTALLED=1 makes conftest check which one runs).
      if ! ls dist/torch_msda-*.whl > /dev/null 2>&1; then
        if ! FORCE_CUDA=1 $PY -m pip wheel -q --no-build-isolation --no-deps --no-index -w dist . \
            > "$OUT/wheel_build.log" 2>&1; then
          tail -30 "$OUT/wheel_build.log"; echo "WHEEL BUILD FAILED"; status=1; continue
        fi
      fi
      whl=$(ls dist/torch_msda-*.whl | head -1); echo "$whl"
      rm -rf /tmp/msda-site /tmp/msda-tests && mkdir -p /tmp/msda-tests
      if ! $PY -m pip install -q --no-deps --no-index --target /tmp/msda-site "$whl" > "$OUT/wheel_install.log" 2>&1; then
        cat "$OUT/wheel_install.log"; echo "WHEEL INSTALL FAILED"; status=1; continue
      fi
      for dep in dist/deps/*.whl; do  # wheels carried for the deploy stage (onnxruntime)
        [ -e "$dep" ] && $PY -m pip install -q --no-deps --no-index --target /tmp/msda-site "$dep" >> "$OUT/wheel_install.log" 2>&1
      done
      cp -r tests pyproject.toml /tmp/msda-tests/
      ( cd /tmp/msda-tests && PYTHONPATH=/tmp/msda-site MSDA_EXPECT_INSTALLED=1 \
          $PY -m pytest -q -ra -p no:cacheprovider tests --ignore=tests/reliability/test_huge.py ${PYTEST_ARGS:-} ) 2>&1 \
        | tee "$OUT/wheel_tests.log" | tail -15
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "WHEEL TESTS FAILED ($rc)"; status=1; } ;;
    deploy)
      # One image through the small detector of examples/aoti on every path
      # that runs here: eager PyTorch and ONNX Runtime (benchmarks/deployment.py;
      # DEPLOY_ONNX: an export made beside this torch elsewhere), and the
      # AOTInductor packages for the CPU and CUDA run by the C++ program. Uses
      # the wheel installed by stage wheel when there is one, else the build here.
      # DEPLOY_DEVICES: the AOTInductor packages to build and run (cpu cuda).
      size=${DEPLOY_SIZE:-512x512}
      site=""; [ -d /tmp/msda-site ] && site=/tmp/msda-site
      repo=$PWD
      rm -rf /tmp/msda-deploy && mkdir -p /tmp/msda-deploy
      ( cd /tmp/msda-deploy && export PYTHONPATH=${site:-$repo}
        $PY -m pip list 2>/dev/null | grep -iE "^(onnx|onnxruntime|transformers) " || true
        for dev in ${DEPLOY_DEVICES:-cpu cuda}; do
          $PY "$repo/examples/aoti/export_detector.py" --device $dev --size $size --out aoti-$dev || exit 1
        done
        cmake -S "$repo/examples/aoti" -B build -DCMAKE_PREFIX_PATH="$($PY -m ms_deform_attn --cmake-prefix-path)" > cmake.log 2>&1 \
          && cmake --build build -j "$(nproc)" > build.log 2>&1 || { tail -30 cmake.log build.log; exit 1; }
        fail=0
        for dev in ${DEPLOY_DEVICES:-cpu cuda}; do ./build/aoti_detector aoti-$dev/model.pt2 aoti-$dev/io.pt 50 || fail=1; done
        $PY "$repo/benchmarks/deployment.py" --size $size --runs 50 ${DEPLOY_ONNX:+--onnx "$repo/$DEPLOY_ONNX"} || fail=1
        exit $fail
      ) 2>&1 | grep -v Warning | tee "$OUT/deploy.log" | tail -30
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "DEPLOY FAILED"; status=1; } ;;
    peer)
      # Nsight Compute on one forward of ours and of the Triton peer side by
      # side (scripts/peer_profile.py; PEER_ARGS: its arguments, ';' between
      # runs), every stall reason and the L1 traffic; reports under $OUT.
      IFS=';' read -ra runs <<< "${PEER_ARGS:-ddetr_enc fp32}"
      i=0
      for r in "${runs[@]}"; do
        ncu --clock-control none --profile-from-start off -k regex:forward \
          --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct,l1tex__m_xbar2l1tex_read_sectors.sum,lts__t_sector_hit_rate.pct,l1tex__throughput.avg.pct_of_peak_sustained_active" \
          -o "$OUT/peer_$i" $PY scripts/peer_profile.py $r > "$OUT/peer_$i.log" 2>&1 || status=1
        ncu -i "$OUT/peer_$i.ncu-rep" --page details > "$OUT/peer_${i}_details.txt" 2>&1
        echo "--- peer $i: $r"; grep -E "rel. error|profiled" "$OUT/peer_$i.log"
        grep -E "^  [a-zA-Z_]|Duration|Registers Per|Issued Warp|No Eligible|Achieved Occupancy|inst_executed|wavefronts|hit_rate|xbar2l1tex|stalled_(long|short|lg|mio|wait|barrier|not_sel|math|tex|no_inst|branch|dispatch)" \
          "$OUT/peer_${i}_details.txt" | head -80
        i=$((i + 1))
      done ;;
    sass)
      cuobjdump --dump-sass ms_deform_attn/_C*.so > "$OUT/sass.txt" 2>&1 || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
if [ "${PACK:-0}" = 1 ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/gpu_check_out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check_out.tgz "$OUT/all.tgz"
fi
echo "=== done $(date +%T) status $status"
exit $status
