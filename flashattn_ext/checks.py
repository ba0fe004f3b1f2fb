"""Argument checks of the Python API, mirroring those of csrc/attention_api.cpp.

Every message has the form of its C++ twin: it starts with "flashattn_ext: ",
names the argument, and says what it got and what was expected. They raise the
exception type the C++ check raises (RuntimeError; TypeError for Python-typed
arguments the C++ op never sees), so a caller's ``except`` works the same
whether the Python layer or the op caught the problem.

The same functions run in the fake (meta) kernels of flashattn_ext/ops.py, so a
bad call fails while torch.compile traces, with the message the real kernel
would give. They read only metadata (shapes, strides, dtypes, devices), never
data, so they are safe on FakeTensors and symbolic shapes.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch

# Keep in sync with kMaxHeadDim / kHeadDimAlignment in csrc/attention_api.h.
MAX_HEAD_DIM = 256
HEAD_DIM_ALIGNMENT = 8

LAYOUT = "(batch, seqlen, nheads, head_dim)"

# dtypes the kernels of each device type implement. "meta" carries no data: any
# dtype some backend supports is allowed there, so shape propagation works.
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CUDA_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = {"cpu": CPU_DTYPES, "cuda": CUDA_DTYPES, "meta": CPU_DTYPES}


def lse_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """As lse_dtype() in csrc/attention_api.h: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def check_is_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_rank(t: torch.Tensor, name: str, rank: int = 4, layout: str = LAYOUT) -> None:
    if t.dim() != rank:
        raise RuntimeError(
            f"flashattn_ext: {name} must have {rank} dimensions {layout}, "
            f"got {t.dim()} dimensions with shape {_shape(t)}"
        )


def check_size(t: torch.Tensor, name: str, dim: int, dim_name: str, expected, expected_from: str) -> None:
    if t.size(dim) != expected:
        raise RuntimeError(
            f"flashattn_ext: {name} {dim_name} (dim {dim}) must match {expected_from}: "
            f"got {t.size(dim)}, expected {expected}"
        )


def check_same_device(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    # torch.device equality includes the index: cuda:0 vs cuda:1 is a mismatch.
    if t.device != q.device:
        raise RuntimeError(
            f"flashattn_ext: {name} must be on the same device as q: got {t.device}, expected {q.device}"
        )


def check_same_dtype(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if t.dtype != q.dtype:
        raise RuntimeError(
            f"flashattn_ext: {name} must have the same dtype as q: got {t.dtype}, expected {q.dtype}"
        )


def check_dtype_supported(q: torch.Tensor) -> None:
    supported = SUPPORTED_DTYPES.get(q.device.type)
    if supported is None:
        raise RuntimeError(
            f"flashattn_ext: device type {q.device.type} is not supported (q is on {q.device}); "
            f"expected one of {sorted(SUPPORTED_DTYPES)}"
        )
    if q.dtype not in supported:
        names = ", ".join(str(d) for d in supported)
        raise RuntimeError(
            f"flashattn_ext: dtype {q.dtype} is not supported on {q.device.type.upper()} "
            f"(q, k and v must share a supported dtype): got {q.dtype}, expected one of {names}"
        )


def check_last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    # Only the head dim need be unit-stride: every other stride goes to the
    # kernel as given. Empty tensors address nothing, so any stride will do.
    if t.numel() != 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        raise RuntimeError(
            f"flashattn_ext: {name} must be contiguous in its last dimension (head_dim): "
            f"got stride {t.stride(-1)}, expected 1"
        )


def check_head_dim_limit(head_dim, name: str = "q") -> None:
    if head_dim > MAX_HEAD_DIM:
        raise RuntimeError(
            f"flashattn_ext: head_dim ({name} dim 3) must be at most {MAX_HEAD_DIM}, got {head_dim}"
        )


def check_head_dim_aligned(head_dim) -> None:
    if head_dim % HEAD_DIM_ALIGNMENT != 0:
        raise RuntimeError(
            f"flashattn_ext: head_dim (q dim 3) must be a multiple of {HEAD_DIM_ALIGNMENT} "
            f"(flash_attn_func pads it), got {head_dim}"
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel_layout: bool) -> None:
    """Shapes, dtypes, devices and strides of q, k, v.

    ``kernel_layout`` is True for the op itself, whose head dim must be a
    multiple of 8 and unit-stride, and False for flash_attn_func, which pads
    and copies to give the op that layout.
    """
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_is_tensor(t, name)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_rank(t, name)
    check_same_device(k, "k", q)
    check_same_device(v, "v", q)
    check_same_dtype(k, "k", q)
    check_same_dtype(v, "v", q)
    check_dtype_supported(q)

    batch, _, nheads, head_dim = q.shape
    nheads_kv = k.size(2)
    check_size(k, "k", 0, "batch size", batch, "q")
    check_size(v, "v", 0, "batch size", batch, "q")
    check_size(v, "v", 1, "seqlen", k.size(1), "k")
    check_size(v, "v", 2, "nheads", nheads_kv, "k")
    check_size(k, "k", 3, "head_dim", head_dim, "q")
    check_size(v, "v", 3, "head_dim", head_dim, "q")
    check_head_dim_limit(head_dim)
    if kernel_layout:
        check_head_dim_aligned(head_dim)
    if nheads_kv == 0 and nheads != 0:
        raise RuntimeError("flashattn_ext: k nheads (dim 2) must be positive when q has heads, got 0")
    if nheads_kv != 0 and nheads % nheads_kv != 0:
        raise RuntimeError(
            f"flashattn_ext: q nheads (dim 2) must be a multiple of k nheads (dim 2): "
            f"got {nheads} and {nheads_kv}"
        )
    if kernel_layout:
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            check_last_dim_contiguous(t, name)


def check_softmax_scale(softmax_scale) -> None:
    # Comparisons rather than math.isfinite, which torch.compile cannot trace
    # on a symbolic float (dynamic=True makes float arguments and a scale
    # derived from the head dim symbolic); NaN fails every comparison.
    if not (-math.inf < softmax_scale < math.inf):
        raise RuntimeError(f"flashattn_ext: softmax_scale must be finite, got {softmax_scale}")


def check_dropout_p(dropout_p) -> None:
    if not (0.0 <= dropout_p < 1.0):
        raise RuntimeError(f"flashattn_ext: dropout_p must be in [0, 1), got {dropout_p}")


def check_softcap(softcap) -> None:
    if not (0.0 <= softcap < math.inf):  # comparisons: see check_softmax_scale
        raise RuntimeError(
            f"flashattn_ext: softcap must be finite and >= 0 (0 turns it off), got {softcap}"
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


def check_alibi_slopes(alibi_slopes: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if alibi_slopes is None:
        return
    check_is_tensor(alibi_slopes, "alibi_slopes")
    check_same_device(alibi_slopes, "alibi_slopes", q)
    if alibi_slopes.dtype != torch.float32:
        raise RuntimeError(f"flashattn_ext: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    batch, nheads = q.size(0), q.size(2)
    shape = tuple(alibi_slopes.shape)
    if shape not in ((nheads,), (batch, nheads)):
        raise RuntimeError(
            f"flashattn_ext: alibi_slopes must have shape (nheads,) = ({nheads},) or "
            f"(batch, nheads) = ({batch}, {nheads}), got {list(shape)}"
        )
    if alibi_slopes.stride(-1) != 1:
        raise RuntimeError(
            "flashattn_ext: alibi_slopes must be contiguous in its last dimension: "
            f"got stride {alibi_slopes.stride(-1)}, expected 1"
        )


def check_rng_state(rng_state: Optional[torch.Tensor], dropout_p) -> None:
    if dropout_p > 0.0:
        if rng_state is None:
            raise RuntimeError(
                "flashattn_ext: rng_state (int64 [seed, offset]) is required when dropout_p > 0"
            )
        if rng_state.dtype != torch.int64 or rng_state.numel() != 2:
            raise RuntimeError(
                "flashattn_ext: rng_state must be an int64 tensor of 2 elements [seed, offset], "
                f"got {rng_state.dtype} of shape {_shape(rng_state)}"
            )


def check_forward_args(q, k, v, softmax_scale, softcap, alibi_slopes, dropout_p, rng_state,
                       *, kernel_layout: bool) -> None:
    """Every check of the op's forward arguments except the per-backend feature
    support (softcap/ALiBi/dropout), which only the C++ backend knows."""
    check_qkv(q, k, v, kernel_layout=kernel_layout)
    check_softmax_scale(softmax_scale)
    check_dropout_p(dropout_p)
    check_softcap(softcap)
    check_alibi_slopes(alibi_slopes, q)
    check_rng_state(rng_state, dropout_p)


def check_backward_args(dout, q, k, v, out, lse, softmax_scale, softcap, alibi_slopes, dropout_p,
                        rng_state) -> None:
    check_forward_args(q, k, v, softmax_scale, softcap, alibi_slopes, dropout_p, rng_state,
                       kernel_layout=True)
    for t, name in ((dout, "dout"), (out, "out")):
        check_is_tensor(t, name)
        check_rank(t, name)
        check_same_device(t, name, q)
        check_same_dtype(t, name, q)
        if t.shape != q.shape:
            raise RuntimeError(
                f"flashattn_ext: {name} must have the shape of q: got {_shape(t)}, expected {_shape(q)}"
            )
        check_last_dim_contiguous(t, name)
    check_is_tensor(lse, "lse")
    check_same_device(lse, "lse", q)
    if lse.dtype != lse_dtype(q.dtype):
        expected = str(lse_dtype(q.dtype)).removeprefix("torch.")
        raise RuntimeError(f"flashattn_ext: lse must be {expected} (float64 for float64 inputs, "
                           f"else float32), got {lse.dtype}")
    expected = [q.size(0), q.size(2), q.size(1)]
    if list(lse.shape) != expected:
        raise RuntimeError(
            f"flashattn_ext: lse must have shape (batch, nheads, seqlen_q) = {expected}, got {_shape(lse)}"
        )


def check_packed(t: torch.Tensor, name: str, count: int, layout: str) -> None:
    """qkv (batch, seqlen, 3, nheads, head_dim) or kv (batch, seqlen, 2, nheads_kv, head_dim)."""
    check_is_tensor(t, name)
    check_rank(t, name, rank=5, layout=layout)
    if t.size(2) != count:
        raise RuntimeError(
            f"flashattn_ext: {name} dim 2 must be {count} {layout}: got {t.size(2)}, expected {count}"
        )
