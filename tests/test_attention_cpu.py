"""Forward and backward of the CPU kernels against the fp64 reference, through
the public API (flash_attn_func and the packed variants) and the ops.

Error rule: see reference.py (2x / 3x the low-precision PyTorch error for
bf16/fp16, 1e-4 relative for fp32, 1e-10 for fp64)."""

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashattn_ext
from flashattn_ext import checks
from flashattn_ext import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

from reference import (BASELINE_DTYPES, GRADIENTS, SINK_GRADIENT, assert_error_rule, attention_reference,
                       attention_reference_with_grads, max_abs_error, tolerance)
from sample_inputs import CASES, CASES_BY_NAME, DTYPES, EMPTY_CASES, AttentionCase

NAMES = ("out", "lse", "dq", "dk", "dv")


def run_flash_attn(inputs, **extra):
    """(out, lse, dq, dk, dv[, dsink]) of flash_attn_func, gradients of <out, dout>."""
    out, lse = flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True, **inputs.func_kwargs(),
                               **extra)[:2]
    return (out, lse, *torch.autograd.grad(out, inputs.differentiable(), inputs.dout))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype):
    inputs = case.make(dtype, requires_grad=True)
    actual = run_flash_attn(inputs)
    names = NAMES + ((SINK_GRADIENT,) if case.sink else ())
    for name, tensor in zip(names, actual):
        expected_dtype = {"lse": checks.lse_dtype(dtype), SINK_GRADIENT: torch.float32}.get(name, dtype)
        assert tensor.dtype == expected_dtype, f"{name} dtype"
        assert torch.isfinite(tensor).all() or name == "lse", f"{name} has non-finite values"
    assert not torch.isnan(actual[1]).any(), "lse has NaN"

    kwargs = inputs.reference_kwargs()
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    low_precision = None
    if dtype in BASELINE_DTYPES:
        low_precision = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                                                       compute_dtype=dtype, **kwargs)
    assert_error_rule(names, actual, reference, low_precision, dtype, context=case.name)


@pytest.mark.parametrize("case", [
    AttentionCase("q4096_k2_gqa8", batch=2, seqlen_q=4096, seqlen_k=2, nheads=8, nheads_kv=1, head_dim=32),
    AttentionCase("q8192_k3_gqa8", batch=1, seqlen_q=8192, seqlen_k=3, nheads=8, nheads_kv=1, head_dim=32),
], ids=str)
def test_gradients_summed_over_thousands_of_query_rows(case):
    """A key's dk and dv sum over every query row of its kv head's group. The
    fp32 rule's relative floor (1e-4 x scale) lies far above both our error and
    PyTorch's here and would hide an error several times PyTorch's, so the
    gradients are held to 3x the fp32 PyTorch error alone (scale 0). Causal
    masking has no such case: with seqlen_q >> seqlen_k only the last rows see
    a key, and with seqlen_q = seqlen_k a key's weights decay along the sum."""
    inputs = case.make(torch.float32, requires_grad=True)
    actual = run_flash_attn(inputs)[2:]
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout)[2:]
    baseline = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                                              compute_dtype=torch.float32)[2:]
    errors = {name: (max_abs_error(a, r), tolerance(name, torch.float32, r, b, scale=0.0))
              for name, a, r, b in zip(GRADIENTS, actual, reference, baseline)}
    assert all(error <= allowed for error, allowed in errors.values()), errors


@pytest.mark.parametrize("case", EMPTY_CASES, ids=str)
def test_empty_inputs(case):
    inputs = case.make(torch.float32, requires_grad=True)
    out, lse, dq, dk, dv = run_flash_attn(inputs)
    b, sq, h, d = inputs.q.shape
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    assert dq.shape == inputs.q.shape and dk.shape == inputs.k.shape and dv.shape == inputs.v.shape
    # No key at all: every row sees nothing, so out = 0, lse = +inf, dq = 0.
    assert torch.equal(out, torch.zeros_like(out))
    if inputs.k.size(1) == 0:
        assert torch.isinf(lse).all() and (lse > 0).all()
    for grad in (dq, dk, dv):
        assert torch.equal(grad, torch.zeros_like(grad))
    if case.op_compatible:
        # The ops themselves, with the same conventions.
        args = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs.forward_op_args()]
        out_op, lse_op = torch.ops.flashattn_ext.attention_forward(*args)
        assert torch.equal(out_op, out) and torch.equal(lse_op, lse)
        dq_op, dk_op, dv_op, dsink_op = torch.ops.flashattn_ext.attention_backward(
            inputs.dout, *args[:3], out_op, lse_op, *args[3:], False)
        assert torch.equal(dq_op, dq) and torch.equal(dk_op, dk) and torch.equal(dv_op, dv)
        assert dsink_op.shape == (inputs.q.size(0), 0) and dsink_op.dtype == torch.float32


def test_fully_masked_rows_are_zero_with_infinite_lse():
    # Causal with seqlen_q > seqlen_k: rows 0..(sq - sk - 1) see no key.
    inputs = CASES_BY_NAME["q203_k113_causal"].make(torch.float32, requires_grad=True)
    out, lse, dq, _, _ = run_flash_attn(inputs)
    blind_rows = inputs.q.size(1) - inputs.k.size(1)
    assert torch.equal(out[:, :blind_rows], torch.zeros_like(out[:, :blind_rows]))
    assert torch.isposinf(lse[:, :, :blind_rows]).all()
    assert torch.isfinite(lse[:, :, blind_rows:]).all()
    assert torch.equal(dq[:, :blind_rows], torch.zeros_like(dq[:, :blind_rows]))


@pytest.mark.parametrize("case_name", ["basic", "all_features", "mixed_strides", "sink_all_features"])
def test_op_autograd_matches_flash_attn_func(case_name):
    """The op's own autograd formula (ops.py, register_autograd) gives the same
    results as flash_attn_func's autograd.Function."""
    inputs = CASES_BY_NAME[case_name].make(torch.float32, requires_grad=True)
    out, lse = torch.ops.flashattn_ext.attention_forward(*inputs.forward_op_args())
    assert not lse.requires_grad, "lse must not be differentiable"
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    expected = run_flash_attn(inputs)
    for name, a, e in zip(NAMES, (out, lse, *grads), expected):
        assert torch.equal(a, e), name


def test_packed_variants_match_flash_attn_func():
    case = AttentionCase("packed", batch=2, seqlen_q=37, seqlen_k=37, nheads=4, nheads_kv=4,
                         head_dim=24, causal=True)
    inputs = case.make(torch.float32)
    qkv = torch.stack([inputs.q, inputs.k, inputs.v], dim=2).requires_grad_()
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    (dqkv,) = torch.autograd.grad(out, qkv, inputs.dout)
    assert dqkv.shape == qkv.shape

    q, k, v = (t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    expected = flash_attn_func(q, k, v, causal=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), inputs.dout)
    assert torch.equal(out, expected)
    assert torch.equal(dqkv, torch.stack(expected_grads, dim=2))

    kv = torch.stack([inputs.k, inputs.v], dim=2).requires_grad_()
    q2 = inputs.q.clone().requires_grad_()
    out_kv, lse_kv, probs = flash_attn_kvpacked_func(q2, kv, causal=True, return_attn_probs=True)
    assert probs is None and lse_kv.shape == (2, 4, 37)  # no dropout: no S_dmask
    dq2, dkv = torch.autograd.grad(out_kv, (q2, kv), inputs.dout)
    assert torch.equal(out_kv, expected)
    assert torch.equal(dq2, expected_grads[0])
    assert torch.equal(dkv, torch.stack(expected_grads[1:], dim=2))


def test_kvpacked_gqa_matches_reference():
    case = AttentionCase("kv_gqa", batch=1, seqlen_q=20, seqlen_k=33, nheads=6, nheads_kv=2, head_dim=16)
    inputs = case.make(torch.float64)
    kv = torch.stack([inputs.k, inputs.v], dim=2)
    out = flash_attn_kvpacked_func(inputs.q, kv)
    expected, _ = attention_reference(inputs.q, inputs.k, inputs.v)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_default_softmax_scale_uses_the_unpadded_head_dim():
    inputs = CASES_BY_NAME["head_dim_59_padded"].make(torch.float64)
    out = flash_attn_func(inputs.q, inputs.k, inputs.v)
    assert out.shape == inputs.q.shape
    assert torch.equal(out, flash_attn_func(inputs.q, inputs.k, inputs.v, softmax_scale=59 ** -0.5))
    assert not torch.equal(out, flash_attn_func(inputs.q, inputs.k, inputs.v, softmax_scale=64 ** -0.5))


class RecordOps(TorchDispatchMode):
    """Records the ops dispatched at the Python level (not those inside the kernels)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case_name", ["mixed_strides", "expanded_kv_heads"])
def test_strided_inputs_are_not_copied(case_name):
    """Only the head dim must be unit-stride: q/k/v/dout of any other strides go to
    the kernels as they are, so the only ops dispatched are the two kernels."""
    inputs = CASES_BY_NAME[case_name].make(torch.float32, requires_grad=True)
    assert not inputs.q.is_contiguous() or not inputs.k.is_contiguous()
    with RecordOps() as recorder:
        out = flash_attn_func(inputs.q, inputs.k, inputs.v)
        torch.autograd.grad(out, (inputs.q, inputs.k, inputs.v), inputs.dout)
    kernels = {torch.ops.flashattn_ext.attention_forward.default,
               torch.ops.flashattn_ext.attention_backward.default}
    copies = [op for op in recorder.ops if op not in kernels]
    # Autograd itself may add no-op bookkeeping; no copy or clone may appear.
    assert not [op for op in copies if "copy" in str(op) or "clone" in str(op) or "contiguous" in str(op)], copies
    assert torch.ops.flashattn_ext.attention_forward.default in recorder.ops
    assert torch.ops.flashattn_ext.attention_backward.default in recorder.ops


def test_gradient_of_any_strides():
    """out.sum() sends an expanded (all-stride-0) gradient into the backward."""
    inputs = CASES_BY_NAME["basic"].make(torch.float32, requires_grad=True)
    out = flash_attn_func(inputs.q, inputs.k, inputs.v)
    grads = torch.autograd.grad(out.sum(), (inputs.q, inputs.k, inputs.v), retain_graph=True)
    expected = torch.autograd.grad(out, (inputs.q, inputs.k, inputs.v), torch.ones_like(out),
                                   retain_graph=True)
    for a, e in zip(grads, expected):
        assert torch.equal(a, e)
    # A gradient whose last dim is strided (here: a transposed view).
    dout = torch.randn(out.shape[:-2] + out.shape[-1:] + out.shape[-2:-1]).transpose(-1, -2)
    assert dout.stride(-1) != 1
    grads = torch.autograd.grad(out, (inputs.q, inputs.k, inputs.v), dout, retain_graph=True)
    expected = torch.autograd.grad(out, (inputs.q, inputs.k, inputs.v), dout.contiguous())
    for a, e in zip(grads, expected):
        assert torch.equal(a, e)


def test_deterministic_backward_is_reproducible():
    inputs = CASES_BY_NAME["mqa_8_causal"].make(torch.float32, requires_grad=True)
    first = run_flash_attn(inputs, deterministic=True)
    second = run_flash_attn(inputs, deterministic=True)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", [
    AttentionCase("five_blocks_gqa_all_features", batch=1, seqlen_q=4 * 128 + 9, seqlen_k=4 * 128 + 30, nheads=4,
                  nheads_kv=2, head_dim=32, causal=True, window=(200, -1), softcap=3.0, alibi="batch_nheads",
                  sink=True, layout="mixed_strides"),
    AttentionCase("five_blocks_mqa", batch=1, seqlen_q=5 * 128, seqlen_k=4 * 128 + 1, nheads=3, nheads_kv=1,
                  head_dim=40),
    CASES_BY_NAME["mixed_strides_causal"],
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_does_not_depend_on_the_thread_count(case, dtype):
    """One thread runs the backward in one pass per (batch entry, kv head); eight run these cases'
    one or two (batch entry, kv head) pairs as two passes of smaller tasks. Both sum the same
    terms in the same order: the same bits, dropout's included. mixed_strides_causal's second
    pass is a single task (70 keys), which a worker thread runs too, its BLAS calls
    single-threaded (on the calling thread they used all eight, and dk and dv differed in the
    last bits)."""
    inputs = case.make(dtype, requires_grad=True)
    names = NAMES + ((SINK_GRADIENT,) if case.sink else ())
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 8):
            torch.set_num_threads(count)
            torch.manual_seed(7)
            results.append(run_flash_attn(inputs, dropout_p=0.25))
    finally:
        torch.set_num_threads(threads)
    for name, one, many in zip(names, *results):
        assert torch.equal(one, many), f"{case.name}: {name} differs between 1 and 8 threads"


def test_lse_is_not_differentiable():
    inputs = CASES_BY_NAME["basic"].make(torch.float32, requires_grad=True)
    out, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


def test_dropout_rng_state_comes_from_torch_generator():
    from flashattn_ext.interface import _draw_rng_state

    torch.manual_seed(1234)
    first = _draw_rng_state(torch.device("cpu"))
    second = _draw_rng_state(torch.device("cpu"))
    torch.manual_seed(1234)
    assert torch.equal(_draw_rng_state(torch.device("cpu")), first)
    assert first.dtype == torch.int64 and first.shape == (2,)
    assert not torch.equal(first, second), "consecutive calls must get different masks"


def test_signatures_match_flash_attn():
    # flash-attn 2.x: flash_attn_interface.py
    # learnable_sink: FA4's, keyword only after them.
    common = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
              ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
              ("deterministic", False), ("return_attn_probs", False), ("learnable_sink", None)]
    expected = {
        flash_attn_func: ["q", "k", "v"],
        flash_attn_qkvpacked_func: ["qkv"],
        flash_attn_kvpacked_func: ["q", "kv"],
    }
    for func, tensors in expected.items():
        params = inspect.signature(func).parameters
        assert list(params) == tensors + [name for name, _ in common], func.__name__
        for name, default in common:
            assert params[name].default == default, (func.__name__, name)
        assert params["learnable_sink"].kind is inspect.Parameter.KEYWORD_ONLY, func.__name__


def test_public_api():
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "build_info", "__version__"):
        assert hasattr(flashattn_ext, name), name
    info = flashattn_ext.build_info()
    assert set(info) >= {"version", "torch_version", "cuda_version", "cuda_archs", "head_dim_tiles",
                         "cuda_kernels"}
    assert info["version"] == flashattn_ext.__version__
    assert info["cuda_kernels"] in ("yes", "no")
