"""The compiler's resource report for the shipped CUDA kernels (issue: "no register
spills in the shipped configurations"): every instantiation file (generated from
csrc/SOURCES.txt by setup.py's write_tile_sources, as the build does) compiles for
sm_80 and sm_90a with no spill stores or loads, and the Hopper kernels with no
wgmma serialisation (ptxas's "wgmma.mma_async instructions are serialized", C7512 for
want of registers, C7514 / C7515 for patterns it cannot follow: it then waits for each
wgmma, which once cost the forward its overlap silently). Needs nvcc, not a GPU."""

import concurrent.futures
import fnmatch
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from cmake_build import REPO_ROOT, setup_py_module

CSRC = REPO_ROOT / "csrc"


def _nvcc():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (pathlib.Path(root) / "bin" / "nvcc").exists():
            return str(pathlib.Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _write_instantiation_files(out_dir):
    """Every (kind, tile width, score-mod variant) translation unit of SOURCES.txt, written
    into out_dir by setup.py's own generator."""
    setup_py = setup_py_module()
    groups = setup_py.read_sources()
    return [pathlib.Path(p) for p in setup_py.write_tile_sources(groups["cuda_tile"], groups["tiles"], groups["score_mods"],
                                                                  out_dir)]


@pytest.fixture(scope="module")
def resource_reports(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (set CUDA_HOME)")
    generated = tmp_path_factory.mktemp("generated")
    (generated / "flashattn_build_config.h").write_text("#pragma once\n")
    # The flags of setup.py's nvcc line that change code generation, and the
    # defines torch's cpp_extension adds.
    flags = ["-std=c++20", "-O3", "--expt-relaxed-constexpr", "-Xptxas=-v",
             "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
             "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
             "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
             f"-I{CSRC}", f"-I{generated}"]
    out_dir = tmp_path_factory.mktemp("objects")

    def compile_one(source):
        run = subprocess.run([nvcc, *flags, "-c", str(source), "-o", str(out_dir / (source.stem + ".o"))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return source.name, run.returncode, run.stdout

    sources = _write_instantiation_files(generated)
    # FLASHATTN_RESOURCE_FILES=<glob> (e.g. "bwd_hdim64_*"): only the matching files, for a quick
    # check while changing a kernel (every file takes minutes even on many cores). CI leaves
    # it unset: the check that counts compiles every variant with these flags.
    pattern = os.environ.get("FLASHATTN_RESOURCE_FILES")
    if pattern:
        sources = [source for source in sources if fnmatch.fnmatch(source.name, pattern)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(compile_one, sources))


def test_instantiations_compile_without_spills(resource_reports):
    assert resource_reports, "no instantiation files found (or none matching FLASHATTN_RESOURCE_FILES)"
    for name, returncode, report in resource_reports:
        assert returncode == 0, f"{name} failed to compile:\n{report[-3000:]}"
    # Every spilling file at once: a register budget change tends to tip several.
    spilling = {name: [line.strip() for line in report.splitlines()
                       if re.search(r"[1-9]\d* bytes spill (stores|loads)", line)]
                for name, _, report in resource_reports}
    spilling = {name: lines for name, lines in spilling.items() if lines}
    assert not spilling, "instantiations that spill registers:\n" + "\n".join(
        f"{name}: {lines}" for name, lines in sorted(spilling.items()))


def test_hopper_kernels_keep_wgmma_asynchronous(resource_reports):
    for name, _, report in resource_reports:
        serialised = [line for line in report.splitlines() if "wgmma" in line and "serialized" in line]
        assert not serialised, f"{name}: ptxas serialises wgmma:\n" + "\n".join(serialised)


def test_hopper_backward_adds_dq_with_reductions(tmp_path):
    """The Hopper backward's per-thread dQ adds (d 256) are `red`, which returns nothing: as
    atomicAdd, followed by the deterministic path's fence, ptxas kept each add's unused result
    and waited for it (ATOMG), which made the non-deterministic d 256 backward 20 % slower
    (benchmarks/RESULTS.md, 2026-12-04)."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (set CUDA_HOME)")
    (tmp_path / "flashattn_build_config.h").write_text("#pragma once\n")
    source = next(p for p in _write_instantiation_files(tmp_path) if p.name == "bwd_hdim256_kNone.cu")
    ptx = tmp_path / "bwd.ptx"
    run = subprocess.run([nvcc, "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90a", "-ptx",
                          f"-I{CSRC}", f"-I{tmp_path}", str(source), "-o", str(ptx)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
    text = ptx.read_text()
    assert re.search(r"red\.global\.add\.v2\.f32", text), "no vector red of dQ in the Hopper backward"
    returning = re.findall(r"atom\.global[.\w]*\.v2\.f32", text)
    assert not returning, f"dQ added with atom (a returned value ptxas may wait for): {returning[:3]}"

