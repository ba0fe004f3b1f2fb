"""The torch-free kernel harnesses of benchmarks/kernels (the forward tile sweep and the Hopper
backward check, run on the GPU machine by tools/gpu_check.sh) still compile against the
kernels' headers: nothing else builds them, and the sweep once fell behind the params struct
and a template argument without a sign until a device call failed. Needs nvcc, not a GPU."""

import subprocess

import pytest

from cmake_build import REPO_ROOT
from test_kernel_resources import _nvcc

KERNELS = REPO_ROOT / "benchmarks" / "kernels"


def _compile_harness(tmp_path, harness, defines, shapes):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (set CUDA_HOME)")
    include = []
    if isinstance(shapes, str):
        header = tmp_path / "shapes.h"
        header.write_text(f"#define FLASHATTN_SWEEP_SHAPES {shapes}\n")
        include = ["-include", str(header)]
    elif shapes is not None:
        include = ["-include", str(shapes)]
    return subprocess.run([nvcc, "-std=c++20", "-O1", "-gencode=arch=compute_90a,code=sm_90a", *defines, *include,
                           f"-I{REPO_ROOT / 'csrc'}", "-c", str(KERNELS / harness), "-o", str(tmp_path / "h.o")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.mark.parametrize("harness, defines, shapes", [
    # One shape of each family is enough for what rots: the launch calls and the params.
    ("forward_tile_sweep.cu", [], "ForwardTileShape<64, 128, 64, 4>"),
    ("forward_tile_sweep.cu", ["-DFLASHATTN_SWEEP_SM90"], "Sm90ForwardShape<64, 128, 1, 3>"),
    # The shapes headers prepared for a device call (SWEEP_SHAPES_HEADER), whole.
    ("forward_tile_sweep.cu", ["-DFLASHATTN_SWEEP_SM90"], KERNELS / "sweep_shapes_persistent.h"),
    ("backward_sm90_check.cu", [], None),
], ids=["sweep_sm80", "sweep_sm90", "sweep_persistent", "backward_check"])
def test_kernel_harness_compiles(tmp_path, harness, defines, shapes):
    run = _compile_harness(tmp_path, harness, defines, shapes)
    assert run.returncode == 0, run.stdout[-4000:]


def test_shape_whose_blocks_do_not_fit_an_sm_is_refused(tmp_path):
    # Two blocks of one consumer warpgroup at d 128 with 128-key blocks need 2 x 145 KB: the
    # launch bounds would cut the registers for a second block that never fits (it ran at one
    # block per SM in the sweep, 25-30 % slower than the shipped shape).
    run = _compile_harness(tmp_path, "forward_tile_sweep.cu", ["-DFLASHATTN_SWEEP_SM90"],
                           "Sm90ForwardShape<128, 128, 1, 2>")
    assert run.returncode != 0 and "shared memory for kBlocksPerSM blocks" in run.stdout, run.stdout[-4000:]
