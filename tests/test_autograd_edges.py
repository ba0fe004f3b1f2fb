"""Autograd at the edges a new user reaches first: double backward, empty inputs
with gradients from a reduction, inputs whose last dimension is not contiguous,
and the single autograd path (the ops' own formulas) seen from torch.jit.trace."""

import numpy as np
import pytest
import torch

from flashattn_ext import flash_attn_func, flash_attn_qkvpacked_func

from reference import attention_reference

forward_op = torch.ops.flashattn_ext.attention_forward


def random_qkv(batch=2, seqlen_q=9, seqlen_k=11, nheads=4, nheads_kv=2, head_dim=16,
               dtype=torch.float64):
    make = lambda *shape: torch.randn(*shape, dtype=dtype, requires_grad=True)  # noqa: E731
    return (make(batch, seqlen_q, nheads, head_dim), make(batch, seqlen_k, nheads_kv, head_dim),
            make(batch, seqlen_k, nheads_kv, head_dim))


def test_double_backward_raises():
    q, k, v = random_qkv()
    out = flash_attn_func(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match=r"flashattn_ext: double backward .* is not supported"):
        torch.autograd.grad(dq.sum(), q)


def test_double_backward_through_the_op_raises():
    q, k, v = random_qkv()
    out, _ = forward_op(q, k, v, 0.25, False, -1, -1, 0.0, None, 0.0, None)
    (dk,) = torch.autograd.grad(out.square().sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward"):
        torch.autograd.grad(dk.sum(), v)


@pytest.mark.parametrize("shape", [
    dict(batch=0), dict(seqlen_q=0), dict(seqlen_k=0), dict(nheads=0, nheads_kv=0),
    dict(batch=0, head_dim=12),  # padded head dim
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_empty_inputs_backward_from_a_reduction(shape):
    # out.sum() hands the backward a stride-0 (expanded) gradient.
    q, k, v = random_qkv(**shape, dtype=torch.float32)
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape
        assert torch.equal(t.grad, torch.zeros_like(t))


def non_contiguous_last_dim(t):
    """t's values as a view whose last dimension has stride 2."""
    wide = torch.randn(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t.detach()
    return wide[..., ::2].requires_grad_()


@pytest.mark.parametrize("head_dim", [16, 12])
def test_non_contiguous_last_dim_is_copied(head_dim):
    q, k, v = random_qkv(head_dim=head_dim)
    strided = [non_contiguous_last_dim(t) for t in (q, k, v)]
    assert all(t.stride(-1) == 2 for t in strided)
    dout = torch.randn(q.shape, dtype=q.dtype)

    out = flash_attn_func(*strided, causal=True)
    grads = torch.autograd.grad(out, strided, dout)
    expected_out = flash_attn_func(q, k, v, causal=True)
    expected_grads = torch.autograd.grad(expected_out, (q, k, v), dout)
    assert torch.equal(out, expected_out)
    for grad, expected in zip(grads, expected_grads):
        assert torch.equal(grad, expected)
    reference, _ = attention_reference(q.detach(), k.detach(), v.detach(), causal=True)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)


def test_packed_qkv_with_strided_head_dim():
    qkv = torch.randn(2, 7, 3, 2, 32, dtype=torch.float64)[..., ::2].requires_grad_()
    out = flash_attn_qkvpacked_func(qkv)
    out.sum().backward()
    reference, _ = attention_reference(*(t.detach() for t in qkv.unbind(2)))
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    assert qkv.grad.shape == qkv.shape


def test_deterministic_reaches_the_backward_op():
    # The flag travels with the forward op (no Python-side autograd.Function):
    # what autograd records is the op, with deterministic=True as its argument.
    q, k, v = random_qkv()
    seen = []

    class RecordBackwardArgs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.flashattn_ext.attention_backward.default:
                seen.append(args[-1])
            return func(*args, **(kwargs or {}))

    out = flash_attn_func(q, k, v, deterministic=True)
    with RecordBackwardArgs():
        out.sum().backward()
    assert seen == [True]


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::FutureWarning")
def test_jit_trace_records_the_ops():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flash_attn_func(q, k, v, causal=True)

    q, k, v = (t.detach() for t in random_qkv())
    traced = torch.jit.trace(Attention(), (q, k, v), check_trace=False)
    assert "flashattn_ext::attention_forward" in str(traced.graph)
    torch.testing.assert_close(traced(q, k, v), flash_attn_func(q, k, v, causal=True))


@pytest.mark.filterwarnings("error")  # the per-entry fallback loop warns; the rule must be used
@pytest.mark.parametrize("q_dim", [0, 3])
def test_vmap_folds_into_the_batch(q_dim):
    q, k, v = random_qkv(batch=2, nheads=4, nheads_kv=2)
    stacked_q = torch.randn(3, *q.shape, dtype=q.dtype, requires_grad=True)
    slopes = torch.rand(3, 4)
    out = torch.vmap(lambda q, s: flash_attn_func(q, k, v, causal=True, alibi_slopes=s),
                     in_dims=(q_dim, 0))(stacked_q.movedim(0, q_dim), slopes)
    expected = torch.stack([flash_attn_func(one_q, k, v, causal=True, alibi_slopes=s)
                            for one_q, s in zip(stacked_q, slopes)])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (stacked_q, k, v), dout)
    expected_grads = torch.autograd.grad(expected, (stacked_q, k, v), dout)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window_size", [
    torch.tensor([3, 1]), (np.int64(3), np.int32(1)), [3, 1],
], ids=["tensor", "numpy", "list"])
def test_window_size_as_flash_attn_tests_pass_it(window_size):
    q, k, v = (t.detach() for t in random_qkv())
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window_size),
                               flash_attn_func(q, k, v, window_size=(3, 1)), rtol=0, atol=0)


def test_window_size_tensor_of_floats_is_refused():
    q, k, v = (t.detach() for t in random_qkv())
    with pytest.raises(TypeError, match=r"window_size must be a pair of ints"):
        flash_attn_func(q, k, v, window_size=torch.tensor([3.0, 1.0]))
