"""Configuring and building the CMake project (CMakeLists.txt) from a test, for
test_cmake_build.py and test_cpp_traced_module.py; the one CPU-only build they share
is conftest.py's session fixture cmake_cpu_build.

build() skips the calling test, with the reason, where cmake is missing, and where
torch is a CUDA build but no CUDA toolkit exists (libtorch's CMake config then
refuses to configure even a CPU-only library).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGURE_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 3600


class CMakeBuild(NamedTuple):
    directory: pathlib.Path
    library: pathlib.Path        # libflashattn_ext.so
    config_header: pathlib.Path  # the generated flashattn_build_config.h
    log: str                     # what configure and build printed


def setup_py_module():
    """setup.py loaded as a module: its source list (read_sources) and its generator of the
    kernels' translation units (write_tile_sources), which the CMake build must match."""
    spec = importlib.util.spec_from_file_location("flashattn_ext_setup", REPO_ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_tool(name: str):
    """`name` on PATH, or next to this interpreter (a venv's bin/, not always on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    beside = pathlib.Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def _is_cuda_toolkit(root: str) -> bool:
    return all(os.path.exists(os.path.join(root, p))
               for p in ("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart.so"))


def cuda_toolkit():
    """The toolkit root by the rule of setup.py and CMakeLists.txt, or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var] if _is_cuda_toolkit(os.environ[var]) else None
    candidates = ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    return next((c for c in candidates + ["/opt/cuda", "/usr/lib/cuda"] if _is_cuda_toolkit(c)), None)


def run_step(cmd, cwd, timeout, what):
    """Runs cmd; fails the test with its output when it exits non-zero. Returns the output."""
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n"
                    f"{proc.stdout[-20000:]}", pytrace=False)
    return proc.stdout


def build(build_dir: pathlib.Path, cmake_args) -> CMakeBuild:
    """Configures the repository into build_dir with cmake_args and builds every target."""
    cmake = find_tool("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed (apt-get install cmake, or pip install cmake)")
    if torch.version.cuda is not None and cuda_toolkit() is None:
        pytest.skip(f"torch {torch.__version__} is a CUDA build and no CUDA toolkit was found: "
                    "libtorch's CMake config needs one even for FLASHATTN_WITH_CUDA=OFF "
                    "(set CUDA_HOME, or use a CPU build of torch)")
    ninja = find_tool("ninja")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    configure = [cmake, "-S", str(REPO_ROOT), "-B", str(build_dir), *generator,
                 f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", *cmake_args]
    log = run_step(configure, build_dir, CONFIGURE_TIMEOUT_S, "cmake configure")
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 2)
    log += run_step([cmake, "--build", str(build_dir), "--parallel", jobs], build_dir,
                    BUILD_TIMEOUT_S, "cmake --build")
    libraries = sorted(build_dir.glob("libflashattn_ext*.so")) + sorted(build_dir.glob("*flashattn_ext*.dylib"))
    assert libraries, f"no libflashattn_ext.so in {build_dir}:\n{log[-5000:]}"
    return CMakeBuild(build_dir, libraries[0], build_dir / "generated" / "flashattn_build_config.h", log)
