#!/usr/bin/env bash
# Times two builds side by side on one GPU, in one call: this working tree (built by
# tools/gpu_check.sh build, or here) and a copy of an earlier commit, built in place in its
# own folder. Runs A B A B (A: the earlier commit), so the spread between a build's two runs
# shows the run-to-run noise that a difference between the builds has to beat.
#
#   git archive <commit> | (mkdir -p .prev_tree && tar x -C .prev_tree)   # here
#   bash tools/compare_builds.sh .prev_tree [benchmark arguments]          # on the GPU machine
#
# BENCH: attention (default: bench_attention.py, the dense grid) or decode (bench_decode.py).
# A_ENV / B_ENV: environment assignments for the A / B runs only, so that one build can be
# timed two ways (PREV_TREE the working tree itself, e.g. A_ENV=FLASHATTN_FORWARD_SCHEDULER=static).
#
# Output: $OUT/compare/{A,B}{1,2}/ (the benchmark's files) and the merged table compare.txt
# (tools/compare_runs.py).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREV="$(cd "${1:?usage: compare_builds.sh PREV_TREE [bench args]}" && pwd)"
shift
OUT="${OUT:-/tmp/flashattn_gpu_out}"
DEST="$OUT/compare"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
export FLASHATTN_FORCE_CUDA=1 FLASHATTN_CUDA_ARCHS="${FLASHATTN_CUDA_ARCHS:-90a}" PYTHONUNBUFFERED=1
BENCH="${BENCH:-attention}"
BENCH_ARGS=("$@")
case "$BENCH" in
  attention)
    [ ${#BENCH_ARGS[@]} -gt 0 ] || BENCH_ARGS=(--impls ours --modes fwd bwd --seqlens 1024 2048 4096 8192 16384) ;;
  decode) [ ${#BENCH_ARGS[@]} -gt 0 ] || BENCH_ARGS=(--cuda-graph --impls ours sdpa_cudnn) ;;
  *) echo "compare_builds: BENCH must be attention or decode, got '$BENCH'" >&2; exit 2 ;;
esac

if ! ls "$PREV"/flashattn_ext/_C*.so > /dev/null 2>&1; then
  echo "=== building $PREV in place"
  (cd "$PREV" && MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace > "$DEST/prev_build.log" 2>&1) ||
    { tail -20 "$DEST/prev_build.log"; exit 1; }
fi

run() {  # run <label> <tree> [VAR=value ...]: the tree's own benchmark script and package (PYTHONPATH first)
  echo "=== $1: $2 ${*:3}"
  (cd "$2" && env PYTHONPATH="$2" "${@:3}" "$PY" "benchmarks/bench_$BENCH.py" "${BENCH_ARGS[@]}" --out "$DEST/$1" \
    > "$DEST/$1.log" 2>&1) || { tail -20 "$DEST/$1.log"; return 1; }
}
read -ra A_VARS <<< "${A_ENV:-}"
read -ra B_VARS <<< "${B_ENV:-}"
run A1 "$PREV" "${A_VARS[@]}" && run B1 "$ROOT" "${B_VARS[@]}" && run A2 "$PREV" "${A_VARS[@]}" &&
  run B2 "$ROOT" "${B_VARS[@]}" || exit 1

"$PY" "$ROOT/tools/compare_runs.py" "$DEST" --bench "$BENCH" | tee "$DEST/compare.txt"
