"""flashattn_ext: exact, IO-aware attention (FlashAttention) for PyTorch.

Hand-written CUDA kernels and a tiled C++ CPU implementation behind two ops,
``torch.ops.flashattn_ext.attention_forward`` and ``attention_backward``, and a
flash-attn 2.x compatible Python API on top of them.
"""

import torch  # noqa: F401  (first: _C links against libtorch/libc10, which torch loads)

from . import _C  # noqa: F401  (loads the C++ library: registers the ops and their kernels)
from . import ops  # noqa: F401  (fake kernels and autograd of the ops)
from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


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
]
