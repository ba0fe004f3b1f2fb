"""Argument checks of the Python API, mirroring those of csrc/attention_api.cpp.

Every message has the form of its C++ twin: it starts with "flashattn_ext: ",
names the argument, and says what it got and what was expected. They raise the
exception type the C++ check raises (RuntimeError; TypeError for Python-typed
arguments the C++ op never sees), so a caller's ``except`` works the same
whether the Python layer or the op caught the problem.

The same functions run in the fake (meta) kernels of flashattn_ext/ops.py, so a
bad call fails while torch.compile traces, with the message the real kernel
would give. They read only metadata (shapes, strides, dtypes, devices), never
data, so they are safe on FakeTensors and symbolic shapes. The values of
cu_seqlens / seqused (non-decreasing, within max_seqlen, ...) are data: only the
kernels check them (check_sequence_values in csrc/attention_api.cpp).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch

# Keep in sync with kMaxHeadDim / kHeadDimAlignment in csrc/attention_api.h.
MAX_HEAD_DIM = 256
HEAD_DIM_ALIGNMENT = 8

LAYOUT = "(batch, seqlen, nheads, head_dim)"
VARLEN_LAYOUT = "(total, nheads, head_dim)"

# dtypes the kernels of each device type implement. "meta" carries no data: any
# dtype some backend supports is allowed there, so shape propagation works.
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CUDA_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = {"cpu": CPU_DTYPES, "cuda": CUDA_DTYPES, "meta": CPU_DTYPES}


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

    @property
    def is_dense(self) -> bool:
        return all(t is None for t in (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_q,
                                       self.seqused_k))

    def op_args(self) -> tuple:
        """The ops' trailing arguments, in schema order."""
        return (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_q, self.seqused_k,
                self.max_seqlen_q, self.max_seqlen_k)


DENSE = SequenceLayout()


def batch_of(q: torch.Tensor, layout: SequenceLayout):
    """The number of sequences: q's dim 0, or len(cu_seqlens_q) - 1."""
    return layout.cu_seqlens_q.size(0) - 1 if layout.varlen_q else q.size(0)


def lse_shape(q: torch.Tensor, layout: SequenceLayout) -> list:
    """(batch, nheads, seqlen_q), or (nheads, total_q) for a variable-length q."""
    if layout.varlen_q:
        return [q.size(1), q.size(0)]
    return [q.size(0), q.size(2), q.size(1)]


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


def check_sequence_rank(t: torch.Tensor, name: str, varlen: bool) -> None:
    """q, k, v, out, dout: 4-d dense, 3-d when that side is variable-length."""
    if varlen:
        check_rank(t, name, 3, f"{VARLEN_LAYOUT} (cu_seqlens given)")
    else:
        check_rank(t, name, 4, f"{LAYOUT} (no cu_seqlens given)")


def check_size(t: torch.Tensor, name: str, dim: int, dim_name: str, expected, expected_from: str) -> None:
    dim = dim + t.dim() if dim < 0 else dim
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


def check_head_dim_limit(head_dim) -> None:
    if head_dim > MAX_HEAD_DIM:
        raise RuntimeError(
            f"flashattn_ext: head_dim (q's last dim) must be at most {MAX_HEAD_DIM}, got {head_dim}"
        )


def check_head_dim_aligned(head_dim) -> None:
    if head_dim % HEAD_DIM_ALIGNMENT != 0:
        raise RuntimeError(
            f"flashattn_ext: head_dim (q's last dim) must be a multiple of {HEAD_DIM_ALIGNMENT} "
            f"(flash_attn_func pads it), got {head_dim}"
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel_layout: bool,
              layout: SequenceLayout = DENSE) -> None:
    """Shapes, dtypes, devices and strides of q, k, v, and the metadata of the
    sequence arguments, in the order of check_forward_inputs (csrc/attention_api.cpp).

    ``kernel_layout`` is True for the op itself, whose head dim must be a
    multiple of 8 and unit-stride, and False for flash_attn_func, which pads
    and copies to give the op that layout.
    """
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_is_tensor(t, name)
    check_sequence_rank(q, "q", layout.varlen_q)
    check_sequence_rank(k, "k", layout.varlen_k)
    check_sequence_rank(v, "v", layout.varlen_k)
    check_same_device(k, "k", q)
    check_same_device(v, "v", q)
    check_same_dtype(k, "k", q)
    check_same_dtype(v, "v", q)
    check_dtype_supported(q)

    nheads, head_dim = q.size(-2), q.size(-1)
    nheads_kv = k.size(-2)
    if not layout.varlen_k:
        check_size(v, "v", 0, "batch size", k.size(0), "k")
    check_size(v, "v", -3, "total rows" if layout.varlen_k else "seqlen", k.size(-3), "k")
    check_size(v, "v", -2, "nheads", nheads_kv, "k")
    check_size(k, "k", -1, "head_dim", head_dim, "q")
    check_size(v, "v", -1, "head_dim", head_dim, "q")
    check_head_dim_limit(head_dim)
    if kernel_layout:
        check_head_dim_aligned(head_dim)
    if nheads_kv == 0 and nheads != 0:
        raise RuntimeError(
            f"flashattn_ext: k nheads (dim {k.dim() - 2}) must be positive when q has heads, got 0")
    if nheads_kv != 0 and nheads % nheads_kv != 0:
        raise RuntimeError(
            f"flashattn_ext: q nheads (dim {q.dim() - 2}) must be a multiple of k nheads "
            f"(dim {k.dim() - 2}): got {nheads} and {nheads_kv}"
        )
    if kernel_layout:
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            check_last_dim_contiguous(t, name)
    check_sequence_layout(q, k, layout)


def check_sequence_tensor(t: Optional[torch.Tensor], name: str, expected_len, expected_from: str,
                          q: torch.Tensor) -> None:
    """cu_seqlens (batch + 1) or seqused (batch): int32, 1-d, contiguous, on q's device."""
    if t is None:
        return
    check_is_tensor(t, name)
    check_same_device(t, name, q)
    if t.dtype != torch.int32:
        raise RuntimeError(f"flashattn_ext: {name} must be int32, got {t.dtype}")
    if t.dim() != 1:
        raise RuntimeError(f"flashattn_ext: {name} must have 1 dimension, got shape {_shape(t)}")
    if t.size(0) != expected_len:
        raise RuntimeError(
            f"flashattn_ext: {name} must have {expected_from} = {expected_len} elements, got {t.size(0)}")
    if t.size(0) > 1 and t.stride(0) != 1:
        raise RuntimeError(f"flashattn_ext: {name} must be contiguous: got stride {t.stride(0)}, expected 1")


def check_sequence_layout(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout) -> None:
    """The sequence arguments against q and k (check_sequence_layout in csrc/attention_api.cpp)."""
    for cu, name in ((layout.cu_seqlens_q, "cu_seqlens_q"), (layout.cu_seqlens_k, "cu_seqlens_k")):
        if cu is not None:
            check_is_tensor(cu, name)
            if cu.dim() != 1 or cu.size(0) < 1:
                raise RuntimeError(
                    f"flashattn_ext: {name} must be 1-d with batch + 1 >= 1 elements, got shape {_shape(cu)}")
    batch = batch_of(q, layout)
    if layout.varlen_q:
        check_sequence_tensor(layout.cu_seqlens_q, "cu_seqlens_q", batch + 1, "batch + 1", q)
        if layout.max_seqlen_q < 0:
            raise RuntimeError("flashattn_ext: max_seqlen_q must be given (>= 0) with cu_seqlens_q, "
                               f"got {layout.max_seqlen_q}")
    elif not (layout.max_seqlen_q == -1 or layout.max_seqlen_q == q.size(1)):
        raise RuntimeError("flashattn_ext: max_seqlen_q without cu_seqlens_q must be -1 or q's seqlen "
                           f"(dim 1) = {q.size(1)}, got {layout.max_seqlen_q}")
    if layout.varlen_k:
        check_sequence_tensor(layout.cu_seqlens_k, "cu_seqlens_k", batch + 1,
                              "the length of cu_seqlens_q" if layout.varlen_q else "q's batch + 1", q)
        if layout.max_seqlen_k < 0:
            raise RuntimeError("flashattn_ext: max_seqlen_k must be given (>= 0) with cu_seqlens_k, "
                               f"got {layout.max_seqlen_k}")
    else:
        check_size(k, "k", 0, "batch size", batch, "cu_seqlens_q's length - 1" if layout.varlen_q else "q")
        if not (layout.max_seqlen_k == -1 or layout.max_seqlen_k == k.size(1)):
            raise RuntimeError("flashattn_ext: max_seqlen_k without cu_seqlens_k must be -1 or k's seqlen "
                               f"(dim 1) = {k.size(1)}, got {layout.max_seqlen_k}")
    check_sequence_tensor(layout.seqused_q, "seqused_q", batch, "batch", q)
    check_sequence_tensor(layout.seqused_k, "seqused_k", batch, "batch", q)


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


def check_alibi_slopes(alibi_slopes: Optional[torch.Tensor], q: torch.Tensor,
                       layout: SequenceLayout = DENSE) -> None:
    if alibi_slopes is None:
        return
    check_is_tensor(alibi_slopes, "alibi_slopes")
    check_same_device(alibi_slopes, "alibi_slopes", q)
    if alibi_slopes.dtype != torch.float32:
        raise RuntimeError(f"flashattn_ext: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    batch, nheads = batch_of(q, layout), q.size(-2)
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


def check_learnable_sink(learnable_sink: Optional[torch.Tensor], q: torch.Tensor) -> None:
    """fp32 (nheads,), contiguous, on q's device (check_options in csrc/attention_api.cpp)."""
    if learnable_sink is None:
        return
    check_is_tensor(learnable_sink, "learnable_sink")
    check_same_device(learnable_sink, "learnable_sink", q)
    if learnable_sink.dtype != torch.float32:
        raise RuntimeError(f"flashattn_ext: learnable_sink must be float32, got {learnable_sink.dtype}")
    nheads = q.size(-2)
    if tuple(learnable_sink.shape) != (nheads,):
        raise RuntimeError(f"flashattn_ext: learnable_sink must have shape (nheads,) = ({nheads},), "
                           f"got {_shape(learnable_sink)}")
    if learnable_sink.dim() == 1 and learnable_sink.size(0) > 1 and learnable_sink.stride(0) != 1:
        raise RuntimeError("flashattn_ext: learnable_sink must be contiguous: "
                           f"got stride {learnable_sink.stride(0)}, expected 1")


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
                       *, kernel_layout: bool, layout: SequenceLayout = DENSE,
                       learnable_sink: Optional[torch.Tensor] = None) -> None:
    """Every check of the op's forward arguments except the per-backend feature
    support (softcap/ALiBi/dropout/learnable_sink), which only the C++ backend knows,
    and the values of the sequence tensors."""
    check_qkv(q, k, v, kernel_layout=kernel_layout, layout=layout)
    check_softmax_scale(softmax_scale)
    check_dropout_p(dropout_p)
    check_softcap(softcap)
    check_alibi_slopes(alibi_slopes, q, layout)
    check_learnable_sink(learnable_sink, q)
    check_rng_state(rng_state, dropout_p)


def check_backward_args(dout, q, k, v, out, lse, softmax_scale, softcap, alibi_slopes, dropout_p,
                        rng_state, layout: SequenceLayout = DENSE,
                        learnable_sink: Optional[torch.Tensor] = None) -> None:
    check_forward_args(q, k, v, softmax_scale, softcap, alibi_slopes, dropout_p, rng_state,
                       kernel_layout=True, layout=layout, learnable_sink=learnable_sink)
    for t, name in ((dout, "dout"), (out, "out")):
        check_is_tensor(t, name)
        check_sequence_rank(t, name, layout.varlen_q)
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
    expected = lse_shape(q, layout)
    if list(lse.shape) != expected:
        names = "(nheads, total_q)" if layout.varlen_q else "(batch, nheads, seqlen_q)"
        raise RuntimeError(f"flashattn_ext: lse must have shape {names} = {expected}, got {_shape(lse)}")


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


def check_max_seqlen(max_seqlen, name: str) -> int:
    """max_seqlen_q / max_seqlen_k of the varlen functions: an int (>= 0, which the op checks)."""
    if not _is_int(max_seqlen):
        raise TypeError(f"flashattn_ext: {name} must be an int, got {type(max_seqlen).__name__}")
    return max_seqlen if isinstance(max_seqlen, torch.SymInt) else operator.index(max_seqlen)
