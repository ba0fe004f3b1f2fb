"""Packaging: the import errors of a missing or mismatched extension, setup.py's
choice of a CUDA or CPU-only build, what the build prints, the sdist and the license."""

import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

import flashattn_ext

from conftest import INSTALL_KIND

# An editable install's import hook serves flashattn_ext._C from the source tree
# to any copy of the package, so a copy without _C cannot be made there.
needs_regular_install = pytest.mark.skipif(
    INSTALL_KIND == "editable", reason="an editable install provides _C to every copy of the package")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIR = pathlib.Path(flashattn_ext.__file__).resolve().parent


def _import_error(cwd):
    """stderr of `import flashattn_ext` run in cwd (which Python puts first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", "import flashattn_ext"], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, "the import succeeded"
    return result.stderr


def _copy_python_files(destination):
    """The installed package's Python files, without the compiled _C."""
    destination.mkdir(parents=True)
    for source in PACKAGE_DIR.glob("*.py"):
        shutil.copy(source, destination / source.name)
    return destination


@needs_regular_install
def test_source_tree_without_extension_says_it_shadows_the_install(tmp_path):
    # A source checkout: setup.py beside flashattn_ext/, nothing built in place.
    (tmp_path / "setup.py").write_text("")
    package = _copy_python_files(tmp_path / "flashattn_ext")
    stderr = _import_error(tmp_path)
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: flashattn_ext: imported from its source tree"), stderr
    assert str(package) in last_line and "run Python from another directory" in last_line
    assert "pip install --no-build-isolation -e ." in last_line
    # Python's own error, kept as the cause.
    assert "cannot import name '_C'" in stderr and "was the direct cause" in stderr


@needs_regular_install
def test_extension_missing_from_an_install_says_reinstall(tmp_path):
    package = _copy_python_files(tmp_path / "site" / "flashattn_ext")
    last_line = _import_error(package.parent).strip().splitlines()[-1]
    assert last_line.startswith(f"ImportError: flashattn_ext: the compiled extension _C is missing "
                                f"from {package}"), last_line
    assert "--force-reinstall" in last_line


@pytest.mark.parametrize("cuda_library", ["libc10_cuda.so", "libcudart.so.13"])
def test_extension_built_for_a_cuda_torch_says_which_torch(tmp_path, cuda_library):
    # What loading a binary built against a CUDA torch gives under a CPU-only torch
    # (or one of another CUDA version): the dynamic loader's ImportError.
    package = _copy_python_files(tmp_path / "site" / "flashattn_ext")
    loader_error = f"{cuda_library}: cannot open shared object file: No such file or directory"
    (package / "_C.py").write_text(f"raise ImportError({loader_error!r})\n")
    last_line = _import_error(package.parent).strip().splitlines()[-1]
    assert last_line.startswith(f"ImportError: flashattn_ext: the compiled extension _C in {package} "
                                "was built against a CUDA build of torch"), last_line
    assert f"torch {torch.__version__}" in last_line and loader_error in last_line
    assert "rebuild flashattn_ext against this torch" in last_line


def test_extension_message_names_undefined_symbols_and_keeps_other_errors(tmp_path):
    package = _copy_python_files(tmp_path / "flashattn_ext")
    (package / "_C.py").write_text("")
    undefined = ImportError("_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKc")
    message = flashattn_ext._extension_import_error(undefined, str(package))
    assert "probably built against another torch version" in message and str(undefined) in message
    other = ImportError("_C.so: ELF load command address/offset not properly aligned")
    assert flashattn_ext._extension_import_error(other, str(package)) == (
        f"flashattn_ext: loading the compiled extension _C in {package} failed: {other}")


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("flashattn_ext_setup", REPO_ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLKIT = "/usr/local/cuda-13.0"
TORCH_VERSION = "2.13.0+cpu"


@pytest.mark.parametrize("skip, force, toolkit, torch_cuda, expected", [
    (False, False, TOOLKIT, "13.0", TOOLKIT),
    (False, True, TOOLKIT, "13.0", TOOLKIT),
    (True, False, None, "13.0", "FLASHATTN_SKIP_CUDA is set"),
    (False, False, None, "13.0", "no CUDA toolkit was found (set CUDA_HOME to use one)"),
    (False, False, None, None, "no CUDA toolkit was found (set CUDA_HOME to use one)"),
    # A CPU-only torch cannot compile CUDA code: its cpp_extension has no CUDA_HOME.
    (False, False, TOOLKIT, None, f"torch {TORCH_VERSION} is a CPU-only build, so the CUDA toolkit at {TOOLKIT} "
                                  "is not used"),
])
def test_cuda_build_choice(setup_py, skip, force, toolkit, torch_cuda, expected):
    cuda_home, cpu_only_reason = setup_py.cuda_toolkit_for_build(skip, force, toolkit, TORCH_VERSION,
                                                                 torch_cuda)
    if expected == TOOLKIT:
        assert (cuda_home, cpu_only_reason) == (TOOLKIT, None)
    else:
        assert cuda_home is None and cpu_only_reason.startswith(expected), cpu_only_reason


@pytest.mark.parametrize("skip, toolkit, torch_cuda, expected", [
    (True, None, "13.0", "FLASHATTN_SKIP_CUDA and FLASHATTN_FORCE_CUDA are both set; unset one"),
    (False, None, "13.0", "FLASHATTN_FORCE_CUDA=1 but no CUDA toolkit was found; set CUDA_HOME"),
    (False, TOOLKIT, None, f"FLASHATTN_FORCE_CUDA=1 but torch {TORCH_VERSION} is a CPU-only build"),
])
def test_forced_cuda_build_that_cannot_be_met_exits(setup_py, skip, toolkit, torch_cuda, expected):
    with pytest.raises(SystemExit) as exit_info:
        setup_py.cuda_toolkit_for_build(skip, True, toolkit, TORCH_VERSION, torch_cuda)
    assert str(exit_info.value.code).startswith(f"flashattn_ext: {expected}"), exit_info.value.code
    if torch_cuda is None:
        assert "install a CUDA build of torch" in exit_info.value.code


def test_setup_py_outside_the_build_prints_and_writes_nothing(tmp_path):
    # pip runs setup.py once for the metadata and again for the build: the build
    # messages (and the generated header) belong to the build alone.
    shutil.copy(REPO_ROOT / "setup.py", tmp_path / "setup.py")
    (tmp_path / "csrc").mkdir()
    shutil.copy(REPO_ROOT / "csrc" / "SOURCES.txt", tmp_path / "csrc" / "SOURCES.txt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHATTN_")}
    env["FLASHATTN_SKIP_CUDA"] = "1"
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == flashattn_ext.__version__
    assert "flashattn_ext:" not in result.stdout + result.stderr
    assert not (tmp_path / "build").exists()


def test_sdist_holds_the_sources_and_license(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO_ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHATTN_")}
    env["FLASHATTN_SKIP_CUDA"] = "1"  # the sdist must hold the CUDA sources all the same
    result = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                            cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    csrc = {path.relative_to(tree).as_posix() for path in (tree / "csrc").rglob("*") if path.is_file()}
    assert csrc - names == set(), "csrc files missing from the sdist"
    assert {"LICENSE", "setup.py", "pyproject.toml", "README.md", "CMakeLists.txt",
            "examples/run_traced_module.cpp"} <= names


def test_installed_metadata_names_the_license():
    try:
        dist = importlib.metadata.distribution("flashattn_ext")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("flashattn_ext is not installed (imported from a path)")
    assert "LICENSE" in dist.metadata.get_all("License-File", []), dict(dist.metadata)
    license_files = [f for f in dist.files if f.name == "LICENSE"]
    assert license_files, "no LICENSE among the installed files"
    assert license_files[0].read_text().startswith("BSD 3-Clause License")
