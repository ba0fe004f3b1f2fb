"""The mask's block-level geometry against its one definition (tests/mask_geometry_check.cpp):
built with the host's C++ compiler against csrc/common, run, and every (query, key) pair of
the small sizes it walks must agree."""

import pathlib
import shutil
import subprocess

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_mask_geometry_agrees_with_key_visible(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    program = tmp_path / "mask_geometry_check"
    build = subprocess.run([compiler, "-std=c++17", "-O2", "-I", str(REPO_ROOT / "csrc"),
                            str(REPO_ROOT / "tests" / "mask_geometry_check.cpp"), "-o", str(program)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pairs agree" in run.stdout
