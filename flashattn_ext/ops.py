"""Autograd and vmap of the ops defined in csrc/ops_schema.cpp.

The ops themselves (schemas, the CPU/CUDA kernels, and the Meta kernels that
torch.compile / torch.export / FakeTensor run: the C++ checks of
csrc/attention_api.cpp on symbolic shapes, then the outputs' metadata) come from
the C++ library, loaded by ``import flashattn_ext._C``. This module adds what the
C++ side leaves to Python:

* ``register_autograd`` for ``attention_forward``: its backward is the
  ``attention_backward`` op, which recomputes the attention blocks from q, k
  and the saved log-sum-exp. This is the one autograd path: flash_attn_func
  calls the forward op directly.
* ``register_vmap`` for both ops: the vmapped dimension is folded into the
  batch dimension, so ``torch.vmap`` costs one kernel launch. Calls with
  cu_seqlens or seqused are refused (NotImplementedError), and so are a vmapped
  rng_state or learnable_sink (one per call).
* ``register_autograd`` for ``attention_backward``, which refuses: the backward
  has no derivative of its own (double backward), and an op without one would
  otherwise give zero second derivatives with only a warning.

Gradient conventions:

* q, k, v and learnable_sink get gradients. The backward op returns the sink's
  gradient per batch entry, (batch, nheads); the formula here sums it over the batch.
* Only out carries a gradient. The returned lse (log-sum-exp of each row) is
  treated as a non-differentiable by-product, as in flash-attn: a gradient
  flowing into it is ignored (the backward never reads it).
* The other scalar and optional arguments (softmax_scale, causal, window, softcap,
  alibi_slopes, dropout_p, rng_state, deterministic, and the sequence arguments
  cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k) get no gradient; the sequence
  arguments are handed to the backward op as the forward got them.
* The forward op's ``deterministic`` argument is handed to the backward op;
  the backward op also honours ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library: defines the ops and their C++ kernels)

attention_forward = torch.ops.flashattn_ext.attention_forward.default
attention_backward = torch.ops.flashattn_ext.attention_backward.default
# flash_attn_with_kvcache's op: it writes the caches in place (a mutable schema), so its
# "no derivative" autograd kernel is registered in C++ (csrc/ops_schema.cpp), not here.
attention_kvcache_forward = torch.ops.flashattn_ext.attention_kvcache_forward.default
# return_attn_probs' matrix (a testing aid, no derivative: registered in C++ like the KV cache op's).
attention_probabilities = torch.ops.flashattn_ext.attention_probabilities.default


def has_kernel(op_name: str, dispatch_key: str) -> bool:
    """Whether the C++ library registered a kernel of ``flashattn_ext::op_name`` for the key."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"flashattn_ext::{op_name}", dispatch_key)


# Read once at import: the set of kernels is fixed when the library loads, and a
# module constant is something torch.compile can read without a graph break.
HAS_CUDA_KERNELS = has_kernel("attention_forward", "CUDA") and has_kernel("attention_backward", "CUDA")


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
     rng_state, deterministic, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
     max_seqlen_k, learnable_sink) = inputs
    out, lse = output
    # alibi_slopes, rng_state, the sequence tensors and the sink are saved as tensors
    # too (None is allowed): the backward must see exactly the slopes, the dropout mask,
    # the sequences and the sink of the forward.
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k,
                          seqused_q, seqused_k, learnable_sink)
    ctx.max_seqlen_q = max_seqlen_q
    ctx.max_seqlen_k = max_seqlen_k
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.window_left = window_left
    ctx.window_right = window_right
    ctx.softcap = softcap
    ctx.dropout_p = dropout_p
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def unit_stride_last_dim(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (or of size <= 1), else a contiguous copy.

    Gradients produced by autograd may have any strides (``out.sum()`` yields
    an expanded dout with stride 0 everywhere); the kernels need only the head
    dim to be unit-stride, so only then is a copy made.
    """
    if t.size(-1) <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def run_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                 softcap, alibi_slopes, dropout_p, rng_state, deterministic, *trailing_args):
    """attention_backward on a gradient of any strides; returns (dq, dk, dv, dsink).
    trailing_args: the op's sequence arguments (cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k, max_seqlen_q, max_seqlen_k) and learnable_sink, none for a dense call
    without a sink."""
    return attention_backward(unit_stride_last_dim(dout), q, k, v, out, lse, softmax_scale, causal,
                              window_left, window_right, softcap, alibi_slopes, dropout_p,
                              rng_state, deterministic, *trailing_args)


def _backward(ctx, dout, dlse):
    del dlse  # lse is not differentiable (see the module docstring)
    (q, k, v, out, lse, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_q,
     seqused_k, learnable_sink) = ctx.saved_tensors
    dq, dk, dv, dsink = run_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                     ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes,
                                     ctx.dropout_p, rng_state, ctx.deterministic, cu_seqlens_q,
                                     cu_seqlens_k, seqused_q, seqused_k, ctx.max_seqlen_q,
                                     ctx.max_seqlen_k, learnable_sink)
    dsink = dsink.sum(0) if learnable_sink is not None else None
    # One entry per forward input: q, k, v, None for the 15 non-differentiable ones, the sink.
    return (dq, dk, dv) + (None,) * 15 + (dsink,)


torch.library.register_autograd("flashattn_ext::attention_forward", _backward,
                                setup_context=_setup_context)


def _double_backward(ctx, *grads):
    raise RuntimeError(
        "flashattn_ext: double backward (differentiating the attention backward, e.g. a second "
        "torch.autograd.grad through a gradient taken with create_graph=True) is not supported; "
        "use torch.nn.functional.scaled_dot_product_attention's math backend for higher-order "
        "gradients"
    )


torch.library.register_autograd("flashattn_ext::attention_backward", _double_backward)


def _fold_into_batch(t: torch.Tensor, dim, size: int) -> torch.Tensor:
    """t with the vmapped dimension ``dim`` (None: not vmapped) merged into dim 0."""
    t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
    return unit_stride_last_dim(t.reshape(size * t.size(1), *t.shape[2:]))


def _fold_alibi_slopes(slopes, dim, size: int, batch: int):
    """alibi_slopes for the folded batch: (nheads,) stays, anything else becomes
    (size * batch, nheads)."""
    if slopes is None or (dim is None and slopes.dim() == 1):
        return slopes
    slopes = slopes.movedim(dim, 0) if dim is not None else slopes.expand(size, *slopes.shape)
    if slopes.dim() == 2:  # (size, nheads): one set per vmapped entry, shared by its batch
        slopes = slopes[:, None].expand(size, batch, slopes.size(-1))
    return slopes.reshape(size * batch, slopes.size(-1)).contiguous()


def _check_not_vmapped(dim, name: str, expected: str) -> None:
    """rng_state and learnable_sink hold one value for the whole call, which folding the
    vmapped dimension into the batch keeps."""
    if dim is not None:
        raise RuntimeError(f"flashattn_ext: {name} cannot be vmapped over: got a batched {name}, "
                           f"expected {expected} for the whole call")


def _check_call_constants_not_vmapped(in_dims, rng_state_index: int, learnable_sink_index: int) -> None:
    # in_dims has an entry per argument given: a defaulted learnable_sink has none.
    def dim_of(index):
        return in_dims[index] if index < len(in_dims) else None

    _check_not_vmapped(dim_of(rng_state_index), "rng_state", "one [seed, offset]")
    _check_not_vmapped(dim_of(learnable_sink_index), "learnable_sink", "one (nheads,) sink")


def _check_dense_for_vmap(*sequence_tensors) -> None:
    """Folding the vmapped dimension into the batch would need new cu_seqlens offsets;
    refused rather than guessed."""
    if any(t is not None for t in sequence_tensors):
        raise NotImplementedError(
            "flashattn_ext: torch.vmap over a call with cu_seqlens or seqused (variable-length "
            "batches) is not supported; concatenate the sequences into one varlen call instead")


@torch.library.register_vmap("flashattn_ext::attention_forward")
def _attention_forward_vmap(info, in_dims, q, k, v, softmax_scale, causal, window_left,
                            window_right, softcap, alibi_slopes, dropout_p, rng_state,
                            deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                            seqused_q=None, seqused_k=None, max_seqlen_q=-1, max_seqlen_k=-1,
                            learnable_sink=None):
    size = info.batch_size
    _check_call_constants_not_vmapped(in_dims, 10, 18)
    _check_dense_for_vmap(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    q, k, v = (_fold_into_batch(t, d, size) for t, d in zip((q, k, v), in_dims[:3]))
    batch = q.size(0) // size if size else 0
    out, lse = attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                 _fold_alibi_slopes(alibi_slopes, in_dims[8], size, batch),
                                 dropout_p, rng_state, deterministic, max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink)
    return (out.unflatten(0, (size, batch)), lse.unflatten(0, (size, batch))), (0, 0)


@torch.library.register_vmap("flashattn_ext::attention_backward")
def _attention_backward_vmap(info, in_dims, dout, q, k, v, out, lse, softmax_scale, causal,
                             window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
                             deterministic, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                             seqused_k=None, max_seqlen_q=-1, max_seqlen_k=-1, learnable_sink=None):
    size = info.batch_size
    _check_call_constants_not_vmapped(in_dims, 13, 21)
    _check_dense_for_vmap(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    dout, q, k, v, out, lse = (_fold_into_batch(t, d, size)
                               for t, d in zip((dout, q, k, v, out, lse), in_dims[:6]))
    batch = q.size(0) // size if size else 0
    grads = attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                               window_right, softcap,
                               _fold_alibi_slopes(alibi_slopes, in_dims[11], size, batch),
                               dropout_p, rng_state, deterministic, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink)
    # dsink is per batch entry like the others, so each vmapped entry gets its own.
    return tuple(g.unflatten(0, (size, batch)) for g in grads), (0, 0, 0, 0)
