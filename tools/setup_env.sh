#!/usr/bin/env bash
# Sets up everything flashattn_ext needs, in .venv at the repository root:
#   1. a virtualenv (reused when it exists and works),
#   2. torch >= 2.11 (kept when the venv already has one), the build tools and the
#      test dependencies,
#   3. the package itself, built and installed with
#      `pip install --no-build-isolation .` (CUDA kernels too where a CUDA toolkit
#      is found; see setup.py for FLASHATTN_SKIP_CUDA, FLASHATTN_CUDA_ARCHS, ...).
# Idempotent: a second run rebuilds only when the sources, the build environment
# variables or torch changed (FLASHATTN_REBUILD=1 forces it), and ninja reuses
# the objects in build/ for the files that did not change.
#
# Environment: PYTHON (interpreter for the venv, default python3),
#   FLASHATTN_VENV (default .venv), FLASHATTN_TORCH_SPEC (default "torch>=2.11"),
#   MAX_JOBS (parallel compile jobs, default: the number of cores), and the
#   build variables of setup.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${FLASHATTN_VENV:-.venv}"
PY="$VENV/bin/python"
TORCH_SPEC="${FLASHATTN_TORCH_SPEC:-torch>=2.11}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

say() { echo "setup_env: $*"; }

# ---- 1. the virtualenv --------------------------------------------------------------------
if [ -x "$PY" ] && "$PY" -c 'import sys, pip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    say "reusing $VENV ($("$PY" --version 2>&1))"
else
    BASE_PY="${PYTHON:-python3}"
    command -v "$BASE_PY" >/dev/null || { say "no $BASE_PY on PATH; set PYTHON"; exit 1; }
    "$BASE_PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { say "$BASE_PY is $("$BASE_PY" --version 2>&1); flashattn_ext needs Python >= 3.10"; exit 1; }
    say "creating $VENV with $("$BASE_PY" --version 2>&1)"
    if [ -e "$VENV" ]; then
        [ -f "$VENV/pyvenv.cfg" ] || { say "$VENV exists and is not a virtualenv; move it away"; exit 1; }
        rm -rf "$VENV"  # a venv whose interpreter no longer runs
    fi
    "$BASE_PY" -m venv "$VENV"
fi

# ---- 2. torch, build tools, test dependencies -------------------------------------------
if "$PY" - <<'EOF' 2>/dev/null
import re, sys
import torch
major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
sys.exit((major, minor) < (2, 11))
EOF
then
    say "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
else
    say "installing $TORCH_SPEC"
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
# Build requirements of pyproject.toml (needed with --no-build-isolation) and the
# test extras (transformers: tests/test_integration_transformers.py); pip leaves what
# is already satisfied alone.
"$PY" -m pip install -q "setuptools>=77" wheel ninja pytest numpy expecttest "transformers>=5.0"

# ---- 3. the package ---------------------------------------------------------------------
# The stamp: what the built package depends on. Unchanged stamp + an importable
# package = nothing to do.
stamp_now() {
    "$PY" - <<'EOF'
import hashlib, os, pathlib, sys
import torch
h = hashlib.sha256()
files = [pathlib.Path(p) for p in ("setup.py", "pyproject.toml")]
for folder in ("csrc", "flashattn_ext"):
    files += sorted(p for p in pathlib.Path(folder).rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so"))
for p in files:
    h.update(str(p).encode() + b"\0" + p.read_bytes() + b"\0")
for var in sorted(os.environ):
    if var.startswith("FLASHATTN_") and not var.startswith("FLASHATTN_TEST") \
            and var not in ("FLASHATTN_REBUILD", "FLASHATTN_VENV", "FLASHATTN_TORCH_SPEC") \
            or var in ("CUDA_HOME", "CUDA_PATH", "CC", "CXX", "CFLAGS", "CXXFLAGS"):
        h.update(f"{var}={os.environ[var]}\0".encode())
h.update(f"{torch.__version__} {sys.version}".encode())
print(h.hexdigest())
EOF
}
STAMP_FILE="$VENV/.flashattn_ext_build_stamp"
STAMP="$(stamp_now)"
installed_ok() {  # imported from outside the source tree, i.e. the installed copy
    (cd / && "$ROOT/$PY" -c 'import flashattn_ext' >/dev/null 2>&1)
}
if [ "${FLASHATTN_REBUILD:-0}" != "1" ] && [ -f "$STAMP_FILE" ] \
        && [ "$(cat "$STAMP_FILE")" = "$STAMP" ] && installed_ok; then
    say "flashattn_ext is up to date in $VENV (FLASHATTN_REBUILD=1 rebuilds)"
    rm -f build/setup_env_build_seconds
else
    export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}"
    mkdir -p build
    LOG="build/setup_env_build.log"
    say "building flashattn_ext (MAX_JOBS=$MAX_JOBS; full log in $LOG)"
    rm -f "$STAMP_FILE" build/setup_env_build_seconds
    START=$(date +%s)
    # The full verbose log goes to $LOG; the console gets the build's own messages
    # and one line per compile step (ninja's "[n/N]" and the source file).
    set +e
    "$PY" -m pip install -v --no-build-isolation --no-deps . 2>&1 | tee "$LOG" | awk '
        { sub(/^[ \t]+/, "") }  # pip -v indents the backend output
        /^flashattn_ext:/ { print "setup_env: " $0; fflush(); next }
        /^\[[0-9]+\/[0-9]+\] / {
            src = ""
            for (i = NF; i > 1; i--) if ($i ~ /\.(cu|cpp)$/) { src = $i; break }
            sub(".*/csrc/", "csrc/", src); sub(".*/build/generated/", "generated/", src)
            print "setup_env:   " $1 " " (src == "" ? "link" : src); fflush()
        }'
    status=${PIPESTATUS[0]}
    set -e
    END=$(date +%s)
    if [ "$status" -ne 0 ]; then
        tail -n 80 "$LOG"
        say "BUILD FAILED (pip exit $status) after $(( END - START )) s (full log: $LOG)"
        exit 1
    fi
    say "build + install took $(( END - START )) s"
    echo "$(( END - START ))" >build/setup_env_build_seconds
    echo "$STAMP" >"$STAMP_FILE"
fi

(cd / && "$ROOT/$PY" -m flashattn_ext) | sed 's/^/setup_env: /'
