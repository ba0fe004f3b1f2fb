"""Packaging: the import errors of a missing or mismatched extension."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import flashattn_ext

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


def test_source_tree_without_extension_says_it_shadows_the_install(tmp_path):
    # A source checkout: setup.py beside flashattn_ext/, nothing built in place.
    (tmp_path / "setup.py").write_text("")
    package = _copy_python_files(tmp_path / "flashattn_ext")
    stderr = _import_error(tmp_path)
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: flashattn_ext: imported from its source tree"), stderr
    assert str(package) in last_line and "run Python from another directory" in last_line
    assert "pip install --no-build-isolation -e ." in last_line
    assert "circular import" in stderr  # Python's own message, kept as the cause


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
    import torch
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
