"""The CMake build (CMakeLists.txt): configure and build the op library from the
same csrc/SOURCES.txt as setup.py, then load it with torch.ops.load_library in a
fresh interpreter that imports nothing but torch, and run the ops against a
plain softmax(QKᵀ)V written here.

The fresh subprocess matters: this test process has already imported the pybind
module flashattn_ext._C, which registers the same ops, so loading the CMake
library here would test nothing (and fail on the duplicate TORCH_LIBRARY).

Default: the session's CPU-only build (conftest.py's cmake_cpu_build, shared with
test_cpp_traced_module.py). FLASHATTN_TEST_CMAKE_CUDA=1 adds a build with the CUDA
kernels (head-dim tile 64 only, to keep it short), which also runs them where a GPU
is present. Skipped, with the reason, where cmake or a needed CUDA toolkit is
missing (cmake_build.build()).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from cmake_build import REPO_ROOT, build, cuda_toolkit, setup_py_module


def _sources_lines():
    for line in (REPO_ROOT / "csrc" / "SOURCES.txt").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            yield words


def _read_tiles():
    for words in _sources_lines():
        if words[0] == "tiles":
            return words[1:]
    raise AssertionError("csrc/SOURCES.txt has no `tiles` line")


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    if os.environ.get("FLASHATTN_TEST_CMAKE_CUDA") != "1":
        pytest.skip("the CMake CUDA build is opt-in: set FLASHATTN_TEST_CMAKE_CUDA=1")
    if cuda_toolkit() is None:
        pytest.skip("FLASHATTN_TEST_CMAKE_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME)")
    return build(tmp_path_factory.mktemp("cmake_cuda"),
                 ["-DFLASHATTN_WITH_CUDA=ON", "-DFLASHATTN_HEAD_DIMS=64",
                  "-DCMAKE_CUDA_ARCHITECTURES=80-real;90a-real;90-virtual"])


# Runs in a fresh interpreter: loads the library and checks the ops; prints one
# JSON line with what it saw.
CHECK_SCRIPT = textwrap.dedent(r"""
    import json, math, sys
    import torch

    path, want_cuda = sys.argv[1], sys.argv[2] == "1"
    def has(op, key):
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
        except RuntimeError:  # no such operator (yet)
            return False
    assert "flashattn_ext" not in sys.modules, "the pybind module must not be loaded here"
    before = has("flashattn_ext::attention_forward", "CPU")
    torch.ops.load_library(path)
    report = {
        "cpu_kernel_before_load": before,
        "cpu_kernels": [has(f"flashattn_ext::{op}", "CPU")
                        for op in ("attention_forward", "attention_backward")],
        "cuda_kernels": [has(f"flashattn_ext::{op}", "CUDA")
                         for op in ("attention_forward", "attention_backward")],
        "checks": [],
    }
    ops = torch.ops.flashattn_ext

    def reference(q, k, v, scale, causal):
        # softmax(Q Kᵀ scale) V from the definition, fp64; GQA by repeating kv heads,
        # causal aligned bottom-right.
        q, k, v = (t.double() for t in (q, k, v))
        group = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            i = torch.arange(sq).view(-1, 1)
            j = torch.arange(sk).view(1, -1)
            s = s.masked_fill(j > i + (sk - sq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v), lse

    def check(device, dtype, b, sq, sk, h, hkv, d, causal, tol):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64)
        dout = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
        scale = 1.0 / math.sqrt(d)
        q_r, k_r, v_r = (t.clone().requires_grad_() for t in (q, k, v))
        out_r, lse_r = reference(q_r, k_r, v_r, scale, causal)
        out_r.backward(dout)
        args = [t.to(device, dtype) for t in (q, k, v)]
        out, lse = ops.attention_forward(*args, scale, causal, -1, -1, 0.0, None, 0.0, None)
        dq, dk, dv, _ = ops.attention_backward(dout.to(device, dtype), *args, out, lse, scale, causal,
                                               -1, -1, 0.0, None, 0.0, None, False)
        errors = {name: (got.double().cpu() - want).abs().max().item()
                  for name, got, want in (("out", out, out_r), ("lse", lse, lse_r.detach()),
                                          ("dq", dq, q_r.grad), ("dk", dk, k_r.grad),
                                          ("dv", dv, v_r.grad))}
        # lse is fp32 whatever the inputs' dtype.
        tols = {name: max(tol, 1e-5) if name == "lse" else tol for name in errors}
        report["checks"].append({"case": f"{device} {dtype} b={b} sq={sq} sk={sk} h={h} "
                                         f"hkv={hkv} d={d} causal={causal}",
                                 "errors": errors, "tols": tols,
                                 "ok": all(errors[n] <= tols[n] for n in errors)})

    check("cpu", torch.float32, 2, 37, 37, 4, 4, 64, False, 1e-4)
    check("cpu", torch.float32, 1, 131, 150, 4, 2, 32, True, 1e-4)   # GQA, causal, sq < sk
    check("cpu", torch.float64, 1, 260, 260, 2, 1, 16, True, 1e-10)  # MQA, causal
    if want_cuda and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        check("cuda", torch.bfloat16, 2, 300, 300, 4, 4, 64, True, 6e-2)
    print("REPORT " + json.dumps(report))
""")


def _load_and_check(library, want_cuda):
    # Only torch: no flashattn_ext on the path of the child, whatever this process imported.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, str(library), "1" if want_cuda else "0"],
                          cwd=str(library.parent), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"loading {library} failed:\n{proc.stdout[-20000:]}"
    return json.loads(lines[-1][len("REPORT "):])


def _macros(header: pathlib.Path) -> dict:
    """name (with its parameters, for a function-like macro) -> value, or None."""
    macros = {}
    for line in header.read_text().splitlines():
        m = re.match(r"#define (\w+(?:\(\w*\))?)(?: (.*))?$", line)
        if m:
            macros[m.group(1)] = m.group(2)
    return macros


def _setup_py_version() -> str:
    return re.search(r'^VERSION = "([^"]+)"', (REPO_ROOT / "setup.py").read_text(), re.M).group(1)


def test_cmake_cpu_library_loads_and_matches_reference(cmake_cpu_build):
    report = _load_and_check(cmake_cpu_build.library, want_cuda=False)
    assert not report["cpu_kernel_before_load"], "the ops existed before the library was loaded"
    assert report["cpu_kernels"] == [True, True], report
    assert report["cuda_kernels"] == [False, False], report
    bad = [c for c in report["checks"] if not c["ok"]]
    assert not bad, json.dumps(bad, indent=1)


def test_cmake_cpu_build_config_header(cmake_cpu_build):
    # The CPU-only header of setup.py's write_build_config: the version and nothing else.
    assert _macros(cmake_cpu_build.config_header) == {
        "FLASHATTN_BUILD_VERSION": f'"{_setup_py_version()}"'}


@pytest.mark.slow
def test_cmake_cuda_library(cuda_build, tmp_path):
    macros = _macros(cuda_build.config_header)
    cuda_version = re.search(r"release (\d+\.\d+)", subprocess.run(
        [os.path.join(cuda_toolkit(), "bin", "nvcc"), "--version"],
        stdout=subprocess.PIPE, text=True).stdout).group(1)
    assert macros == {
        "FLASHATTN_BUILD_VERSION": f'"{_setup_py_version()}"',
        "FLASHATTN_WITH_CUDA": None,
        "FLASHATTN_BUILD_CUDA_VERSION": f'"{cuda_version}"',
        "FLASHATTN_BUILD_CUDA_ARCHS": '"80;90a+PTX"',
        "FLASHATTN_BUILD_HEAD_DIM_TILES": '"64"',
        "FLASHATTN_FOR_EACH_TILE(X)": "X(64)",
        "FLASHATTN_BUILD_SM90A": None,
    }
    assert "64" in _read_tiles()
    generated = sorted(p.relative_to(cuda_build.directory / "generated").as_posix()
                       for p in (cuda_build.directory / "generated").rglob("*.cu"))
    # The same translation units as setup.py's generator writes for the width.
    setup_py = setup_py_module()
    groups = setup_py.read_sources()
    expected_dir = tmp_path / "setup_py_generated"
    expected = setup_py.write_tile_sources(groups["cuda_tile"], ["64"], groups["score_mods"], str(expected_dir))
    assert generated == sorted(pathlib.Path(p).relative_to(expected_dir).as_posix() for p in expected)
    assert {"fwd", "bwd", "kvcache"} <= {pathlib.PurePosixPath(g).name.split("_")[0] for g in generated}
    report = _load_and_check(cuda_build.library, want_cuda=True)
    assert report["cpu_kernels"] == [True, True], report
    assert report["cuda_kernels"] == [True, True], report
    bad = [c for c in report["checks"] if not c["ok"]]
    assert not bad, json.dumps(bad, indent=1)
