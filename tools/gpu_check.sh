#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: build the extension with the
# CUDA kernels, run the GPU tests, the forward tile sweep and the benchmarks.
# Logs and result files are written under a work folder and packed into one
# archive, $OUT/gpu_results.tgz (the device tool brings back only a few files).
#
#   bash tools/gpu_check.sh [build] [compare] [tests] [suite] [sanitize] [sweep] [bwd-check] [profile] [bench]
#       [bench-full]   (default: build tests)
#
# Environment: OUT (default /tmp/flashattn_gpu_out), GPU_WORK (the work folder),
# MAX_JOBS (default 16),
# FLASHATTN_CUDA_ARCHS (default 90a: only the GPU's own target, for a quick build),
# FLASHATTN_HEAD_DIMS (restrict the compiled tiles while iterating; the tests report the other
# tiles' head dims as skipped),
# PYTEST_ARGS (extra pytest arguments, e.g. "-k d128"), TEST_FILES (the tests stage's files,
# default every tests/test_*cuda*.py),
# PROFILE_KERNEL, PROFILE_ARGS (the profile stage: a regex of the kernel's name, default the
# Hopper backward; tools/profile_case.py's arguments, default d 128, N 8192),
# COMPARE_PREV, COMPARE_ARGS (the compare stage: a copy of an earlier commit, made here with
# `git archive <commit> | (mkdir -p .prev_tree && tar x -C .prev_tree)`, which the build stage
# then builds in place beside this tree, MAX_JOBS shared; tools/compare_builds.sh's
# benchmark arguments; BENCH=decode compares bench_decode.py's runs instead of the dense grid).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/flashattn_gpu_out}"
WORK="${GPU_WORK:-/tmp/flashattn_gpu_work}"
mkdir -p "$OUT" "$WORK"
trap 'tar czf "$OUT/gpu_results.tgz" -C "$WORK" . 2>/dev/null' EXIT
export MAX_JOBS="${MAX_JOBS:-16}" FLASHATTN_FORCE_CUDA=1 FLASHATTN_CUDA_ARCHS="${FLASHATTN_CUDA_ARCHS:-90a}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build tests)
status=0

in_dir() { local dir="$1"; shift; (cd "$dir" && exec "$@"); }

run_stage() {
  local name="$1"; shift
  local start=$SECONDS
  echo "=== $name: $*"
  "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s (log: $name.log)"
  tail -n "${TAIL_LINES:-25}" "$WORK/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
      # Editable: the source tree is the installed package, so scripts run from the
      # repository root (benchmarks/) import the built extension too.
      build_jobs=$MAX_JOBS
      if [ -n "${COMPARE_PREV:-}" ]; then
        # The earlier tree builds at the same time, with part of the jobs.
        prev_jobs=$(( MAX_JOBS * 2 / 5 > 1 ? MAX_JOBS * 2 / 5 : 1 ))
        build_jobs=$(( MAX_JOBS - prev_jobs > 1 ? MAX_JOBS - prev_jobs : 1 ))
        (cd "$COMPARE_PREV" && MAX_JOBS=$prev_jobs "$PY" setup.py build_ext --inplace > "$WORK/build_prev.log" 2>&1) &
        prev_build=$!
      fi
      MAX_JOBS=$build_jobs run_stage build "$PY" -m pip install --no-build-isolation --no-deps -v -e . || exit 1
      if [ -n "${COMPARE_PREV:-}" ]; then
        wait "$prev_build" || { echo "=== build of $COMPARE_PREV failed (log: build_prev.log)"; tail -20 "$WORK/build_prev.log"; exit 1; }
        echo "=== built $COMPARE_PREV beside it"
      fi
      in_dir /tmp "$PY" -m flashattn_ext | tee "$WORK/environment.txt"
      # The toolchain facts behind the crash on C++ argument errors seen on this
      # machine (benchmarks/RESULTS.md): the link command's flags, and whether
      # libstdc++'s stream/locale code ended up defined inside the extension.
      {
        "$PY" -c 'import sysconfig; print("LDSHARED:", sysconfig.get_config_var("LDSHARED"))'
        env | grep -E '^(CFLAGS|CXXFLAGS|LDFLAGS|CPPFLAGS)=' || echo "no *FLAGS in the environment"
        c++ --version | head -1
        echo "libstdc++ stream/locale symbols defined in _C: $(nm -C --defined-only flashattn_ext/_C*.so \
          | grep -cE 'std::(basic_ostream|codecvt|locale|num_put)')"
        echo "link line: $(grep -E -- ' -shared ' "$WORK/build.log" | tail -1 | tr ' ' '\n' \
          | grep -vE '^-I|\.o$' | tr '\n' ' ')"
        readelf -d flashattn_ext/_C*.so | grep NEEDED
        nm -C --defined-only flashattn_ext/_C*.so | grep -E 'codecvt|basic_ostream' | head -5
        in_dir /tmp "$PY" -c 'import torch, flashattn_ext
q = torch.randn(1, 4, 2, 64)
try:
    torch.ops.flashattn_ext.attention_forward(q[0], q, q, 0.1, False, -1, -1, 0.0, None, 0.0, None)
except RuntimeError as e:
    print("a C++ argument error raises:", str(e)[:60])'
        echo "argument-error probe exit status: $? (139 = the crash)"
      } 2>&1 | tee "$WORK/toolchain.txt" ;;
    compare)
      # This tree against COMPARE_PREV, runs A B A B (tools/compare_builds.sh); the table is also
      # copied to $OUT/compare.txt.
      read -ra compare_args <<< "${COMPARE_ARGS:-}"
      TAIL_LINES=60 run_stage compare env OUT="$WORK" bash tools/compare_builds.sh "${COMPARE_PREV:?compare needs COMPARE_PREV}" \
        "${compare_args[@]}" && cp "$WORK/compare/compare.txt" "$OUT/compare.txt" ;;
    tests)
      # One pytest process per file, so a crash in one file still reports the others;
      # from /tmp, as CI runs them (pytest from outside the source root).
      # The files run side by side (the GPU has room for both; nothing here is timed).
      # At the time limit pytest gets SIGINT, which still prints the failures so far (a plain
      # kill lost the messages of 15 failures once). TEST_FILES (paths from the repository root)
      # runs those files instead, their GPU-marked cases.
      for test_file in ${TEST_FILES:-tests/test_*cuda*.py}; do
        test_file="$ROOT/${test_file#"$ROOT"/}"
        run_stage "gpu_$(basename "$test_file" .py)" in_dir /tmp timeout -s INT -k 30 "${TEST_TIMEOUT_S:-400}" \
          "$PY" -m pytest -q -rfE --tb=line --maxfail=40 -p no:cacheprovider -m gpu ${PYTEST_ARGS:-} \
          "$test_file" > "$WORK/stage_$(basename "$test_file" .py).txt" &
      done
      wait
      cat "$WORK"/stage_test_*.txt
      grep -q "exit [1-9]" "$WORK"/stage_test_*.txt && status=1 ;;
    suite)
      # Every other test file, on this machine's torch (the CPU backend, the Python layer
      # and the integrations; the GPU-marked cases among them run too), 8 processes.
      TAIL_LINES=15 run_stage suite in_dir /tmp timeout -s INT -k 30 "${TEST_TIMEOUT_S:-400}" "$PY" -m pytest -q -rfE \
        --tb=short -p no:cacheprovider -n 8 $(ls "$ROOT"/tests/test_*.py | grep -v -e _cuda -e cmake_build) ;;
    sanitize)
      # memcheck and racecheck over odd shapes, both kernel families (tools/sanitizer_shapes.py;
      # SANITIZE_FAMILIES="default" for the Hopper kernels alone).
      for tool in memcheck racecheck; do
        for family in ${SANITIZE_FAMILIES:-default sm80}; do
          disable=""; [ "$family" = sm80 ] && disable=1
          TAIL_LINES=8 run_stage "sanitize_${tool}_${family}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
            FLASHATTN_DISABLE_HOPPER_KERNELS="$disable" timeout "${SANITIZE_TIMEOUT_S:-200}" \
            compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" tools/sanitizer_shapes.py
        done
      done ;;
    sweep)
      # The Hopper kernel's shapes (SWEEP_SHAPES_HEADER: a header defining
      # FLASHATTN_SWEEP_SHAPES, to try others) and the sm80 kernel's.
      run_stage sweep_build nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc \
        -DFLASHATTN_SWEEP_SM90 ${SWEEP_SHAPES_HEADER:+-include "$SWEEP_SHAPES_HEADER"} \
        benchmarks/kernels/forward_tile_sweep.cu -o /tmp/forward_tile_sweep_sm90 &&
      TAIL_LINES=80 run_stage sweep_sm90 timeout 300 /tmp/forward_tile_sweep_sm90 ;;
    bwd-check)
      # The Hopper backward against an fp32 reference and the sm80 kernel, then timed.
      run_stage bwd_check_build nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc \
        benchmarks/kernels/backward_sm90_check.cu -o /tmp/backward_sm90_check &&
      TAIL_LINES=12 run_stage bwd_check timeout 300 /tmp/backward_sm90_check ;;
    profile)
      # Nsight Compute on one kernel of one call: throughput and warp-state sections, then the
      # SASS instructions that hold the most stall samples (tools/ncu_hotspots.py).
      run_stage profile_ncu timeout 300 ncu -k "regex:${PROFILE_KERNEL:-attention_backward_sm90}" --launch-count 1 \
        --import-source no --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section SourceCounters -f -o "$WORK/profile" "$PY" tools/profile_case.py ${PROFILE_ARGS:-} &&
      run_stage profile_details ncu -i "$WORK/profile.ncu-rep" --page details &&
      run_stage profile_sass bash -c "ncu -i '$WORK/profile.ncu-rep' --page source --csv --print-source sass \
        > '$WORK/profile_sass.csv'" &&
      TAIL_LINES=100 run_stage profile_hotspots "$PY" tools/ncu_hotspots.py "$WORK/profile_sass.csv" &&
      TAIL_LINES=40 run_stage profile_regions "$PY" tools/ncu_hotspots.py "$WORK/profile_sass.csv" --regions 1.5 ;;
    bench)
      TAIL_LINES=80 run_stage bench "$PY" benchmarks/bench_attention.py --quick --out "$WORK/bench" ;;
    bench-full)
      TAIL_LINES=120 run_stage bench_full bash benchmarks/run_all.sh "$WORK/bench_full" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
