"""What the Python API checks itself: the arguments the ops never see as given
(window_size as a pair, the packed qkv / kv tensors, max_seqlen or cache_seqlens as an
int, Python types). Every argument the ops take is checked once, in C++
(csrc/attention_api.cpp), by every backend and by the Meta kernels that
torch.compile traces with; the Python functions only make sure that what they do
before calling an op (padding the head dim, unbinding a packed tensor) never hides
a bad argument from those checks.

Messages have the form of the C++ ones: "flashattn_ext: ", the argument, what was
got and what was expected.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch

from . import _C

# The op's limits on the head dim, from the C++ library (csrc/attention_api.h).
MAX_HEAD_DIM = _C.MAX_HEAD_DIM
HEAD_DIM_ALIGNMENT = _C.HEAD_DIM_ALIGNMENT


def lse_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """As lse_dtype() in csrc/attention_api.h: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """The ops' sequence arguments (SequenceLayout in csrc/attention_api.h); all absent:
    dense. cu_seqlens_q (int32, batch + 1) makes q variable-length, (total_q, nheads,
    head_dim), with max_seqlen_q >= its longest sequence; likewise k and v with
    cu_seqlens_k. seqused_q / seqused_k (int32, batch) keep the first seqused[b] rows
    of each sequence."""

    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_q: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = -1
    max_seqlen_k: int = -1

    @property
    def varlen_q(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def varlen_k(self) -> bool:
        return self.cu_seqlens_k is not None

    def op_args(self) -> tuple:
        """The ops' trailing arguments, in schema order."""
        return (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_q, self.seqused_k,
                self.max_seqlen_q, self.max_seqlen_k)


DENSE = SequenceLayout()


def check_is_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_rank(t: torch.Tensor, name: str, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise RuntimeError(
            f"flashattn_ext: {name} must have {rank} dimensions {layout}, "
            f"got {t.dim()} dimensions with shape {list(t.shape)}"
        )


def _is_int(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, torch.SymInt)):
        return True
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def check_window_size(window_size) -> tuple:
    """window_size must be a pair of ints (left, right): a tuple or list (of Python or
    numpy integers) or a 2-element integer tensor, as flash-attn's own tests pass it;
    returns it as a tuple of ints."""
    if (isinstance(window_size, torch.Tensor) and window_size.shape == (2,)
            and not window_size.dtype.is_floating_point and window_size.dtype != torch.bool):
        window_size = window_size.tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
        _is_int(w) for w in window_size
    ):
        raise TypeError(
            "flashattn_ext: window_size must be a pair of ints (left, right), -1 meaning unbounded: "
            f"got {window_size!r}"
        )
    left, right = window_size
    if isinstance(left, torch.SymInt) or isinstance(right, torch.SymInt):
        return left, right
    return operator.index(left), operator.index(right)


def check_packed(t: torch.Tensor, name: str, count: int, layout: str, packed_dim: int = 2) -> None:
    """qkv (batch, seqlen, 3, nheads, head_dim) or kv (batch, seqlen, 2, nheads_kv, head_dim);
    variable-length, packed_dim 1: qkv (total, 3, nheads, head_dim), kv (total_k, 2, ...)."""
    check_is_tensor(t, name)
    check_rank(t, name, rank=packed_dim + 3, layout=layout)
    if t.size(packed_dim) != count:
        raise RuntimeError(
            f"flashattn_ext: {name} dim {packed_dim} must be {count} {layout}: "
            f"got {t.size(packed_dim)}, expected {count}"
        )


def check_int(value, name: str) -> int:
    """An int argument the op takes as given (max_seqlen_q / max_seqlen_k, cache_seqlens
    as one length for every sequence, num_splits): a Python or numpy integer or a SymInt,
    not a bool; the op checks its value."""
    if not _is_int(value):
        raise TypeError(f"flashattn_ext: {name} must be an int, got {type(value).__name__}")
    return value if isinstance(value, torch.SymInt) else operator.index(value)
