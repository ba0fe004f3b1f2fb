"""flashattn_ext: exact, IO-aware attention (FlashAttention) for PyTorch.

Hand-written CUDA kernels and a tiled C++ CPU implementation behind the ops
``torch.ops.flashattn_ext.attention_forward``, ``attention_backward`` and
``attention_kvcache_forward``, and a flash-attn 2.x compatible Python API on top of
them: flash_attn_func and its packed forms, the variable-length flash_attn_varlen_func
and its packed forms, and flash_attn_with_kvcache.
"""

import importlib.machinery
import os

import torch  # noqa: F401  (first: _C links against libtorch/libc10, which torch loads)

# Libraries of a CUDA build of torch: an _C that cannot find one was built against a
# CUDA torch, and this torch is CPU-only or of another CUDA version.
_TORCH_CUDA_LIBRARIES = ("libc10_cuda", "libtorch_cuda", "libcudart")


def _extension_import_error(error: ImportError, package_dir: str) -> str:
    """What went wrong loading the compiled extension _C from package_dir, and what to do.

    Python's own message for a missing _C ("cannot import name '_C' from partially
    initialized module ... circular import") points the wrong way."""
    has_extension = any(os.path.exists(os.path.join(package_dir, "_C" + suffix))
                        for suffix in importlib.machinery.all_suffixes())
    if not has_extension:
        if os.path.exists(os.path.join(os.path.dirname(package_dir), "setup.py")):
            return (f"flashattn_ext: imported from its source tree ({package_dir}), which has no "
                    "compiled extension _C: run Python from another directory to use the installed "
                    "package (the current directory comes first on sys.path, so the source tree "
                    "shadows it), or build in place with `pip install --no-build-isolation -e .`")
        return (f"flashattn_ext: the compiled extension _C is missing from {package_dir}: the "
                "install is incomplete; reinstall flashattn_ext from its source tree with "
                "`pip install --no-build-isolation --force-reinstall --no-deps .`")
    this_torch = f"torch {torch.__version__} " + (
        f"(CUDA {torch.version.cuda})" if torch.version.cuda else "(CPU-only)")
    rebuild = ("rebuild flashattn_ext against this torch: `pip install --no-build-isolation "
               "--force-reinstall --no-deps .` in its source tree")
    if any(name in str(error) for name in _TORCH_CUDA_LIBRARIES):
        return (f"flashattn_ext: the compiled extension _C in {package_dir} was built against a "
                f"CUDA build of torch whose libraries this {this_torch} lacks ({error}); install "
                f"the torch it was built for, or {rebuild}")
    if "undefined symbol" in str(error):
        return (f"flashattn_ext: the compiled extension _C in {package_dir} needs symbols that "
                f"this {this_torch} lacks, so it was probably built against another torch version "
                f"({error}); {rebuild}")
    return f"flashattn_ext: loading the compiled extension _C in {package_dir} failed: {error}"


try:
    from . import _C  # noqa: F401  (loads the C++ library: registers the ops and their kernels)
except ImportError as e:
    raise ImportError(_extension_import_error(e, os.path.dirname(os.path.abspath(__file__)))) from e
from . import ops  # noqa: F401  (autograd and vmap of the ops)
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)


def build_info() -> dict:
    """What the loaded binary was built from and for: version, torch_version,
    cuda_version, cuda_archs, head_dim_tiles, cuda_kernels ("yes"/"no")."""
    return dict(_C.build_info())


# The version compiled into the binary, so the Python files and the library
# cannot disagree about it (both come from setup.py's VERSION).
__version__ = build_info()["version"]

__all__ = [
    "__version__",
    "build_info",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
