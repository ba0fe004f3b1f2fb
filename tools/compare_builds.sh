#!/usr/bin/env bash
# Times the dense benchmark grid of two builds side by side on one GPU, in one call:
# this working tree (built by tools/gpu_check.sh build, or here) and a copy of an
# earlier commit, built in place in its own folder. Runs A B A B (A: the earlier
# commit), so the spread between a build's two runs shows the run-to-run noise that
# a difference between the builds has to beat.
#
#   git archive <commit> | (mkdir -p .prev_tree && tar x -C .prev_tree)   # here
#   bash tools/compare_builds.sh .prev_tree [bench_attention.py arguments]  # on the GPU machine
#
# A_ENV / B_ENV: environment assignments for the A / B runs only, so that one build can be
# timed two ways (PREV_TREE the working tree itself, e.g. A_ENV=FLASHATTN_FORWARD_SCHEDULER=static).
#
# Output: $OUT/compare/{A,B}{1,2}/attention_speed.csv and the merged table compare.txt.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREV="$(cd "${1:?usage: compare_builds.sh PREV_TREE [bench args]}" && pwd)"
shift
OUT="${OUT:-/tmp/flashattn_gpu_out}"
DEST="$OUT/compare"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
export FLASHATTN_FORCE_CUDA=1 FLASHATTN_CUDA_ARCHS="${FLASHATTN_CUDA_ARCHS:-90a}" PYTHONUNBUFFERED=1
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -gt 0 ] || BENCH_ARGS=(--impls ours --modes fwd bwd --seqlens 1024 2048 4096 8192 16384)

if ! ls "$PREV"/flashattn_ext/_C*.so > /dev/null 2>&1; then
  echo "=== building $PREV in place"
  (cd "$PREV" && MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace > "$DEST/prev_build.log" 2>&1) ||
    { tail -20 "$DEST/prev_build.log"; exit 1; }
fi

run() {  # run <label> <tree> [VAR=value ...]: the tree's own benchmark script and package (PYTHONPATH first)
  echo "=== $1: $2 ${*:3}"
  (cd "$2" && env PYTHONPATH="$2" "${@:3}" "$PY" benchmarks/bench_attention.py "${BENCH_ARGS[@]}" --out "$DEST/$1" \
    > "$DEST/$1.log" 2>&1) || { tail -20 "$DEST/$1.log"; return 1; }
}
read -ra A_VARS <<< "${A_ENV:-}"
read -ra B_VARS <<< "${B_ENV:-}"
run A1 "$PREV" "${A_VARS[@]}" && run B1 "$ROOT" "${B_VARS[@]}" && run A2 "$PREV" "${A_VARS[@]}" &&
  run B2 "$ROOT" "${B_VARS[@]}" || exit 1

"$PY" - "$DEST" <<'EOF' | tee "$DEST/compare.txt"
import csv, statistics, sys, pathlib
dest = pathlib.Path(sys.argv[1])
def load(label):
    rows = csv.DictReader(open(dest / label / "attention_speed.csv"))
    return {(r["head_dim"], r["causal"], r["seqlen"], r["mode"]): float(r["tflops"])
            for r in rows if r["impl"] == "ours" and r["status"] == "ok"}
runs = {label: load(label) for label in ("A1", "A2", "B1", "B2")}
print(f"{'d':>4} {'causal':>6} {'N':>6} {'mode':>4} | {'A1':>6} {'A2':>6} {'B1':>6} {'B2':>6} | B/A   noise")
worst = float("inf")
for key in sorted(runs["A1"], key=lambda k: (int(k[0]), k[1], int(k[2]), k[3])):
    vals = [runs[l].get(key) for l in ("A1", "A2", "B1", "B2")]
    if None in vals:
        continue
    a, b = statistics.mean(vals[:2]), statistics.mean(vals[2:])
    noise = max(abs(vals[0] - vals[1]) / a, abs(vals[2] - vals[3]) / b)
    worst = min(worst, b / a)
    print(f"{key[0]:>4} {key[1]:>6} {key[2]:>6} {key[3]:>4} | " + " ".join(f"{v:6.0f}" for v in vals)
          + f" | {b / a:.3f} {noise:.3f}")
print(f"lowest B/A: {worst:.3f}")
EOF
