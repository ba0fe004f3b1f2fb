#!/usr/bin/env bash
# Every benchmark of benchmarks/ in --quick form, in one command for the GPU machine:
#
#   bash benchmarks/run_all.sh [OUT_DIR]      (default: $OUT, else benchmarks/results)
#
# Results go to OUT_DIR/<benchmark>/ (CSV, JSON, PNG), logs to OUT_DIR/logs/, and a short
# summary (OUT_DIR/summary.md) is printed last. Each step has a soft time limit (points
# past it are recorded as skipped, files still written) and a hard one (timeout), and the
# whole run is held under RUN_ALL_BUDGET_S seconds (default 540: the device tool allows
# 600 s per command). A failing step does not stop the others; the exit status is
# non-zero if any step failed.
#
# Environment: PYTHON (default .venv/bin/python when it exists, else python, else python3), DEVICE (auto|cuda|cpu; cpu = tiny dry run),
# RUN_ALL_BUDGET_S, RUN_ALL_STEPS (space-separated subset of the step names below).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${1:-${OUT:-benchmarks/results}}"
# The venv of tools/setup_env.sh (the README's setup) when there is one: a python on
# PATH need not be the one flashattn_ext is installed into.
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x "${FLASHATTN_VENV:-.venv}/bin/python" ]; then
    PY="${FLASHATTN_VENV:-.venv}/bin/python"
else
    PY="$(command -v python || command -v python3)"
fi
DEVICE="${DEVICE:-auto}"
BUDGET_S="${RUN_ALL_BUDGET_S:-540}"
STEPS="${RUN_ALL_STEPS:-attention decode memory hbm recompute e2e}"
LOGS="$OUT_DIR/logs"
mkdir -p "$LOGS"
: > "$LOGS/steps.txt"
export PYTHONUNBUFFERED=1
START=$(date +%s)

# Fail in seconds, not minutes, when the extension is not built (or built without CUDA).
if ! "$PY" - "$DEVICE" "$OUT_DIR" > "$LOGS/preflight.log" 2>&1 <<'PYEOF'
import sys
# In place of the working directory (the repository root, which `python -` puts first):
# there, flashattn_ext/ is the source tree, not the installed package with its library.
sys.path[0] = "benchmarks"
from pathlib import Path
import bench_common as bc
device = bc.resolve_device(sys.argv[1])
bc.import_ours(device)
bc.write_json(bc.environment_info(device), Path(sys.argv[2]) / "environment.json")
PYEOF
then
    cat "$LOGS/preflight.log"
    echo "preflight failed: flashattn_ext is not importable by $PY for device=$DEVICE (log: $LOGS/preflight.log)"
    exit 1
fi
cat "$LOGS/preflight.log"   # the dry-run note, on the cpu
command -v nvidia-smi > /dev/null && nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1

FAILED=0
# run_step NAME SOFT_LIMIT_S HARD_LIMIT_S SCRIPT [ARGS...]
run_step() {
    local name="$1" soft="$2" hard="$3" script="$4"
    shift 4
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local now remaining
    now=$(date +%s)
    remaining=$(( BUDGET_S - (now - START) - 10 ))
    if (( remaining < 20 )); then
        echo "$name: not run (run budget spent)" | tee -a "$LOGS/steps.txt"
        FAILED=1
        return 0
    fi
    (( hard > remaining )) && hard=$remaining
    (( soft > hard - 15 )) && soft=$(( hard - 15 ))
    echo "== $name (soft ${soft}s, hard ${hard}s) -> $LOGS/$name.log"
    local t0=$(date +%s)
    timeout --kill-after=10 "$hard" "$PY" "benchmarks/$script" --quick --device "$DEVICE" \
        --out "$OUT_DIR/$name" --time-limit-s "$soft" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    local secs=$(( $(date +%s) - t0 ))
    (( rc != 0 )) && FAILED=1
    [[ $rc == 124 || $rc == 137 ]] && rc="$rc (timeout)"
    echo "$name: rc=$rc, ${secs}s" | tee -a "$LOGS/steps.txt"
    # The last table of the step, so the console shows results as they come.
    grep -v '|' "$LOGS/$name.log" | tail -n 12
}

#         name       soft hard script
run_step attention   150  185  bench_attention.py
run_step decode       35   70  bench_decode.py --budget-ms 60
run_step memory       35   70  bench_memory.py
run_step hbm          50  150  bench_hbm_traffic.py
run_step recompute    30   60  bench_recompute.py
run_step e2e          75  120  bench_e2e.py

echo "total: $(( $(date +%s) - START ))s" | tee -a "$LOGS/steps.txt"
echo
"$PY" benchmarks/summarize.py "$OUT_DIR"
exit $FAILED
