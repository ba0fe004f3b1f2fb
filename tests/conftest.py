"""Shared setup of the test suite.

The tests run against the installed package, so that a packaging mistake (a
module or the compiled library missing from the install) fails them. tests/ is
not a package and nothing here puts the repository root on sys.path; pytest
puts tests/ itself there (rootdir-less "prepend" import mode), which is how the
test modules import reference.py and sample_inputs.py.
"""

import importlib.metadata
import json
import os
import pathlib
import tempfile

# torch.compile's on-disk cache outlives a rebuild: code compiled against an older
# schema of the ops would be replayed against the new library. Each test session
# compiles into its own folder (before torch reads the setting).
_INDUCTOR_CACHE = tempfile.TemporaryDirectory(prefix="flashattn_ext_inductor_")  # removed at exit
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_CACHE.name)

import pytest  # noqa: E402
import torch  # noqa: E402

import flashattn_ext
import flashattn_ext._C  # noqa: F401  (the compiled library itself must import, not just the .py files)

import cmake_build

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIR = pathlib.Path(flashattn_ext.__file__).resolve().parent


def _install_kind() -> str:
    """'editable', 'installed' or 'not installed' (imported from a path on sys.path)."""
    try:
        dist = importlib.metadata.distribution("flashattn_ext")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    direct_url = dist.read_text("direct_url.json")
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable", False):
        return "editable"
    return "installed"


INSTALL_KIND = _install_kind()

# An editable install runs the source tree by design. Otherwise the package must
# not be the source tree's flashattn_ext/ (a .venv inside the repository is
# fine): a source-tree import (e.g. `python -m pytest` from the repository root,
# which puts the working directory on sys.path) would test files that the
# install may not contain.
if (INSTALL_KIND != "editable" and PACKAGE_DIR == REPO_ROOT / "flashattn_ext"
        and os.environ.get("FLASHATTN_TEST_SOURCE_TREE") != "1"):
    raise pytest.UsageError(
        f"flashattn_ext was imported from the source tree ({PACKAGE_DIR}) but is {INSTALL_KIND} "
        "as a package: run `pytest` (not `python -m pytest`) from outside the source root, or "
        "install it (`pip install --no-build-isolation .` or `-e .`); set "
        "FLASHATTN_TEST_SOURCE_TREE=1 to test an in-place build on purpose"
    )


def pytest_report_header(config):
    info = flashattn_ext.build_info()
    return [
        f"flashattn_ext {flashattn_ext.__version__} from {PACKAGE_DIR} ({INSTALL_KIND}); "
        f"built against torch {info['torch_version']}, CUDA kernels: {info['cuda_kernels']}",
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"CUDA available: {torch.cuda.is_available()}",
    ]


# A build of some of SOURCES.txt's tile widths only (FLASHATTN_HEAD_DIMS, to build and test one
# kernel change quickly on the GPU machine) refuses the other head dims by design; their cases
# are reported as skipped there, with the refusal as the reason. A build of every width never
# refuses one, so nothing is skipped this way in CI or a full build.
_COMPILED_TILES = set(flashattn_ext.build_info()["head_dim_tiles"].split())
_SOME_TILES_ONLY = bool(_COMPILED_TILES) and (
    _COMPILED_TILES < set(cmake_build.setup_py_module().read_sources()["tiles"]))
_TILE_NOT_COMPILED = "needs a tile width this build did not compile"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (_SOME_TILES_ONLY and report.failed and call.excinfo is not None
            and call.excinfo.errisinstance(NotImplementedError)
            and _TILE_NOT_COMPILED in str(call.excinfo.value)):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


@pytest.fixture(scope="session")
def cmake_cpu_build(tmp_path_factory):
    """The CPU-only CMake build with the examples (about a minute and a half on two
    cores), built once for test_cmake_build.py and test_cpp_traced_module.py."""
    return cmake_build.build(tmp_path_factory.mktemp("cmake_cpu"),
                             ["-DFLASHATTN_WITH_CUDA=OFF", "-DFLASHATTN_BUILD_EXAMPLES=ON"])


@pytest.fixture(params=("default", "sm80"))
def kernel_family(request, monkeypatch):
    """Runs a CUDA test twice: with the kernels the build picks for the GPU (the
    wgmma/TMA kernels on an H100/H200 where the build has sm_90a code) and with
    the mma.sync kernels forced (FLASHATTN_DISABLE_HOPPER_KERNELS), so that on a
    Hopper GPU both families are held to the same checks."""
    if request.param == "sm80":
        from cuda_inputs import hopper_build
        if not hopper_build():
            pytest.skip("the default kernels are the sm80 family here")
        monkeypatch.setenv("FLASHATTN_DISABLE_HOPPER_KERNELS", "1")
    return request.param
