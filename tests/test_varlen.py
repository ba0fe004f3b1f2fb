"""Variable-length batches: flash_attn_varlen_func and its packed forms, and the ops'
sequence arguments (cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k).

Every case of sample_inputs.VARLEN_CASES, forward and backward, is checked
  (a) against each sequence run alone through the dense flash_attn_func, within
      the dtype's rounding (bit for bit on the CPU on one thread, where both run
      the same dense algorithm: with more threads, a problem of one task lets BLAS
      use the threads itself, which can round its sums differently), and
  (b) against the fp64 reference run per sequence, under the error rule of
      reference.py (2x the low-precision PyTorch error for out and lse, 3x for
      the gradients).
The rows past seqused, and those of sequences without keys, must be out 0,
lse +inf (lse = sink with a learnable_sink) and zero gradients in both; the sink's
gradient is the sum of the sequences' own. On CUDA the outputs come from an allocator
pool poisoned with NaN, so a row no kernel writes shows up.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch

import flashattn_ext
from flashattn_ext import (flash_attn_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                           flash_attn_varlen_qkvpacked_func)

from reference import (BASELINE_DTYPES, SINK_GRADIENT, assert_error_rule, attention_reference_with_grads,
                       backward_d_allowances)
from sample_inputs import VARLEN_CASES, VARLEN_CASES_BY_NAME, VarlenCase, paged_keys

NAMES = ("out", "lse", "dq", "dk", "dv")


def names_of(inputs):
    """NAMES, and dsink for a call with a learnable_sink."""
    return NAMES + ((SINK_GRADIENT,) if inputs.learnable_sink is not None else ())

CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
CUDA_DTYPES = (torch.bfloat16, torch.float16)

forward_op = torch.ops.flashattn_ext.attention_forward
backward_op = torch.ops.flashattn_ext.attention_backward


def run_varlen(case: VarlenCase, inputs, page_size=None, deterministic: bool = False):
    """(out, lse, dq, dk, dv[, dsink]), gradients of <out, dout>: through flash_attn_varlen_func
    when both sides are variable-length, else through the op (its autograd formula). With a
    page_size, k and v in pages (block_table), the gradients of the pages brought back to the
    packed rows, and those of the rows that hold no key checked to be 0."""
    cu_q, cu_k, used_q, used_k, max_q, max_k = inputs.sequence_args
    if page_size is not None:
        paged = paged_keys(inputs.k, inputs.v, case.seqlens_k, page_size, requires_grad=True)
        out, lse, _ = flash_attn_varlen_func(inputs.q, paged.k_cache, paged.v_cache, cu_q, cu_k, max_q, max_k,
                                             **inputs.func_kwargs(), return_attn_probs=True,
                                             deterministic=deterministic, block_table=paged.block_table,
                                             seqused_q=used_q, seqused_k=used_k)
        sink = () if inputs.learnable_sink is None else (inputs.learnable_sink,)
        dq, dk_cache, dv_cache, *dsink = torch.autograd.grad(
            out, (inputs.q, paged.k_cache, paged.v_cache, *sink), inputs.dout)
        for name, grad in (("dk", dk_cache), ("dv", dv_cache)):
            assert not paged.rows_holding_no_key(grad).any(), f"{case.name}: {name} of a page row holding no key"
        return (out, lse, dq, paged.packed(dk_cache), paged.packed(dv_cache), *dsink)
    if not (case.dense_q or case.dense_k):
        out, lse, probs = flash_attn_varlen_func(inputs.q, inputs.k, inputs.v, cu_q, cu_k, max_q, max_k,
                                                 **inputs.func_kwargs(), return_attn_probs=True,
                                                 deterministic=deterministic, seqused_q=used_q, seqused_k=used_k)
        assert probs is None  # no dropout: flash-attn 2 forms no S_dmask
    else:
        out, lse = forward_op(*inputs.forward_op_args(deterministic))
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    return (out, lse, *grads)


def sequence_rows(case: VarlenCase):
    """Per sequence: (first row, rows used) of q's side and of k's side."""
    starts_q = [0, *itertools.accumulate(case.seqlens_q)]
    starts_k = [0, *itertools.accumulate(case.seqlens_k)]
    used_q, used_k = case.used_lengths()
    for b in range(case.batch):
        yield ((0 if case.dense_q else starts_q[b], used_q[b]),
               (0 if case.dense_k else starts_k[b], used_k[b]))


def rows_view(t, dense: bool, b: int, start: int, length: int, lse: bool = False):
    """Sequence b's rows of t as a batch of 1: (1, length, ...), lse (1, nheads, length)."""
    if lse:
        return (t[b:b + 1] if dense else t[None]).narrow(2, start, length)
    return (t[b:b + 1] if dense else t[None]).narrow(1, start, length)


def per_sequence(case: VarlenCase, inputs, attention, dtype, out=None):
    """(out, lse, dq, dk, dv[, dsink]) in the case's layout, each sequence computed alone
    by attention(q, k, v, dout, alibi_slopes[, out]) on its used rows (a batch of 1; out: the
    sequence's rows of `out` where given); the rows past seqused stay out 0, lse +inf,
    gradients 0; dsink sums the sequences' own."""
    q, k, v, dout = (t.detach() for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    lse_shape = ((q.size(0), q.size(2), q.size(1)) if case.dense_q else (q.size(1), q.size(0)))
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    results = [torch.zeros_like(q, dtype=dtype),
               torch.full(lse_shape, float("inf"), dtype=lse_dtype, device=q.device),
               torch.zeros_like(q, dtype=dtype), torch.zeros_like(k, dtype=dtype),
               torch.zeros_like(v, dtype=dtype)]
    if inputs.learnable_sink is not None:
        # Summed in fp32 at least: the kernel's dsink is fp32 for every dtype.
        results.append(torch.zeros_like(inputs.learnable_sink, dtype=torch.promote_types(dtype, torch.float32)))
    for b, ((start_q, len_q), (start_k, len_k)) in enumerate(sequence_rows(case)):
        q_rows = lambda t, lse=False: rows_view(t, case.dense_q, b, start_q, len_q, lse)  # noqa: E731
        k_rows = lambda t: rows_view(t, case.dense_k, b, start_k, len_k)  # noqa: E731
        slopes = inputs.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b:b + 1]
        sequence = attention(q_rows(q), k_rows(k), k_rows(v), q_rows(dout), slopes,
                             *(() if out is None else (q_rows(out.detach()),)))
        for result, value, view in zip(results, sequence, (q_rows, lambda t: q_rows(t, True),
                                                           q_rows, k_rows, k_rows)):
            view(result).copy_(value)
        if inputs.learnable_sink is not None:
            results[-1] += sequence[-1]
    return results


def reference_attention(inputs, compute_dtype):
    def attention(q, k, v, dout, alibi_slopes):
        kwargs = {**inputs.reference_kwargs(), "alibi_slopes": alibi_slopes}
        return attention_reference_with_grads(q, k, v, dout, compute_dtype=compute_dtype, **kwargs)
    return attention


def d_term_allowances(inputs):
    """An attention function for per_sequence: the bounds of backward_d_allowances of the
    sequence's rows of the kernel's out (zeros for out, lse, dv)."""
    def attention(q, k, v, dout, alibi_slopes, out):
        kwargs = {**inputs.reference_kwargs(), "alibi_slopes": alibi_slopes}
        dq, dk, dsink = backward_d_allowances(q, k, v, dout, out, **kwargs)
        lse = dq.new_zeros(q.size(0), q.size(2), q.size(1))
        return (torch.zeros_like(dq), lse, dq, dk, torch.zeros_like(dk), *(() if dsink is None else (dsink,)))
    return attention


def dense_flash_attention(inputs):
    def attention(q, k, v, dout, alibi_slopes):
        # Views of the varlen tensors' own storage, not copies: BLAS results can depend on
        # the alignment of the data, and the comparison is bit for bit.
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        kwargs = {**inputs.func_kwargs(), "alibi_slopes": alibi_slopes}
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        sink = () if inputs.learnable_sink is None else (inputs.learnable_sink,)
        return (out, lse, *torch.autograd.grad(out, (q, k, v, *sink), dout))
    return attention


def check_case(case: VarlenCase, dtype, device, page_size=None, deterministic: bool = False):
    inputs = case.make(dtype, device=device, requires_grad=True)
    if device == "cuda":
        from cuda_inputs import poison_allocator
        poison_allocator()
    actual = run_varlen(case, inputs, page_size, deterministic)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name, tensor in zip(NAMES, actual):
        assert tensor.dtype == (lse_dtype if name == "lse" else dtype), name
        assert not torch.isnan(tensor).any(), f"{case.name}: {name} has NaN (a row left unwritten?)"

    names = names_of(inputs)
    dense = per_sequence(case, inputs, dense_flash_attention(inputs), dtype)
    for name, a, e in zip(names, actual, dense):
        torch.testing.assert_close(a, e.to(a.dtype), msg=f"{case.name}: {name} vs flash_attn_func per sequence")

    reference = per_sequence(case, inputs, reference_attention(inputs, torch.float64), torch.float64)
    low_precision = None
    if dtype in BASELINE_DTYPES:
        low_precision = per_sequence(case, inputs, reference_attention(inputs, dtype), dtype)
    allowances = per_sequence(case, inputs, d_term_allowances(inputs), torch.float64, out=actual[0])
    assert_error_rule(names, actual, reference, low_precision, dtype, context=case.name,
                      allowances={name: a for name, a in zip(names, allowances) if name in ("dq", "dk", SINK_GRADIENT)})


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_cpu(case, dtype):
    check_case(case, dtype, "cpu")


# Paged keys (block_table): the cases whose keys flash_attn_varlen_func takes packed, each
# with a page size: 1, a multiple of 16, and sizes that divide no sequence.
PAGED_CASES = [(case, (16, 5, 1, 64, 7)[i % 5])
               for i, case in enumerate(c for c in VARLEN_CASES if not (c.dense_q or c.dense_k))]
PAGED_IDS = [f"{case.name}-page{page_size}" for case, page_size in PAGED_CASES]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case,page_size", PAGED_CASES, ids=PAGED_IDS)
def test_varlen_paged_cpu(case, page_size, dtype):
    check_case(case, dtype, "cpu", page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("kernel_family")
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("case,page_size", PAGED_CASES, ids=PAGED_IDS)
def test_varlen_paged_cuda(case, page_size, dtype):
    check_case(case, dtype, "cuda", page_size)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_cpu_is_the_dense_algorithm_per_sequence(case):
    inputs = case.make(torch.float32, requires_grad=True)
    actual = run_varlen(case, inputs)
    dense = per_sequence(case, inputs, dense_flash_attention(inputs), torch.float32)
    for name, a, e in zip(NAMES, actual, dense):
        assert torch.equal(a, e), f"{case.name}: {name} differs from flash_attn_func per sequence"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("kernel_family")
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_cuda(case, dtype):
    check_case(case, dtype, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_rows_past_seqused_are_zero_with_infinite_lse(device):
    case = VARLEN_CASES_BY_NAME["seqused_causal"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    inputs = case.make(dtype, device=device, requires_grad=True)
    out, lse, dq, dk, dv = run_varlen(case, inputs)
    for (start_q, used_q), length_q in zip((rows for rows, _ in sequence_rows(case)), case.seqlens_q):
        unused = slice(start_q + used_q, start_q + length_q)
        assert torch.equal(out[unused], torch.zeros_like(out[unused]))
        assert torch.isposinf(lse[:, unused]).all()
        assert torch.equal(dq[unused], torch.zeros_like(dq[unused]))
    for (_, (start_k, used_k)), length_k in zip(sequence_rows(case), case.seqlens_k):
        unused = slice(start_k + used_k, start_k + length_k)
        assert torch.equal(dk[unused], torch.zeros_like(dk[unused]))
        assert torch.equal(dv[unused], torch.zeros_like(dv[unused]))


def test_packed_variants_match_flash_attn_varlen_func():
    case = dataclasses.replace(VARLEN_CASES_BY_NAME["mixed_lengths"], nheads=4, nheads_kv=4, causal=True)
    inputs = case.make(torch.float32)
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args
    q, k, v = (t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    expected, expected_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                       return_attn_probs=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), inputs.dout)

    qkv = torch.stack([inputs.q, inputs.k, inputs.v], dim=1).requires_grad_()
    out, lse, probs = flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, causal=True, return_attn_probs=True)
    assert probs is None  # no dropout: flash-attn 2 forms no S_dmask
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    (dqkv,) = torch.autograd.grad(out, qkv, inputs.dout)
    assert torch.equal(dqkv, torch.stack(expected_grads, dim=1))

    kv = torch.stack([inputs.k, inputs.v], dim=1).requires_grad_()
    q2 = inputs.q.clone().requires_grad_()
    out = flash_attn_varlen_kvpacked_func(q2, kv, cu_q, cu_k, max_q, max_k, causal=True)
    dq, dkv = torch.autograd.grad(out, (q2, kv), inputs.dout)
    assert torch.equal(out, expected) and torch.equal(dq, expected_grads[0])
    assert torch.equal(dkv, torch.stack(expected_grads[1:], dim=1))


def test_gradcheck_varlen():
    case = VarlenCase("gc_varlen", seqlens_q=(3, 0, 5, 2), seqlens_k=(4, 2, 3, 0), head_dim=8,
                      nheads=2, nheads_kv=1, causal=True, alibi="batch_nheads", seqused_q=(2, 0, 5, 2),
                      seqused_k=(4, 1, 3, 0))
    inputs = case.make(torch.float64, requires_grad=True)
    cu_q, cu_k, used_q, used_k, max_q, max_k = inputs.sequence_args

    def attention(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q, seqused_k=used_k,
                                      **inputs.func_kwargs())

    assert torch.autograd.gradcheck(attention, (inputs.q, inputs.k, inputs.v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_vmap_refuses_varlen():
    inputs = VARLEN_CASES_BY_NAME["max_seqlen_slack"].make(torch.float32)
    args = inputs.forward_op_args()
    stacked = torch.stack([inputs.q, inputs.q])
    with pytest.raises(NotImplementedError, match=r"torch.vmap over a call with cu_seqlens or seqused"):
        torch.vmap(lambda q: forward_op(q, *args[1:])[0])(stacked)


def test_signatures_match_flash_attn():
    # flash-attn 2.x: flash_attn_interface.py; seqused_q/k as FA3 and learnable_sink as FA4
    # (keyword only here).
    common = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
              "deterministic", "return_attn_probs"]
    expected = {
        flash_attn_varlen_func: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                 "max_seqlen_k", *common, "block_table", "seqused_q", "seqused_k",
                                 "learnable_sink"],
        flash_attn_varlen_qkvpacked_func: ["qkv", "cu_seqlens", "max_seqlen", *common, "learnable_sink"],
        flash_attn_varlen_kvpacked_func: ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                          "max_seqlen_k", *common, "learnable_sink"],
    }
    for func, names in expected.items():
        params = inspect.signature(func).parameters
        assert list(params) == names, func.__name__
        assert params["learnable_sink"].kind is inspect.Parameter.KEYWORD_ONLY, func.__name__
        assert hasattr(flashattn_ext, func.__name__) and func.__name__ in flashattn_ext.__all__


# ---------------------------------------------------------------------------
# Bad inputs: every message names the argument. Metadata checks run through
# flash_attn_varlen_func (checks.py), through the op on CPU tensors (the C++ checks)
# and on meta tensors (the fake kernel's checks, checks.py again); value checks
# (data) only where there is data, in the C++ kernels.


def varlen_args(device, **changes):
    """Valid arguments of a varlen call (3 sequences, q rows 3, 0, 7; k rows 4, 5, 3),
    with changes: a function of (the value, the device), or a value."""
    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    args = dict(q=torch.randn(10, 2, 16, device=device), k=torch.randn(12, 2, 16, device=device),
                v=torch.randn(12, 2, 16, device=device), cu_seqlens_q=int32([0, 3, 3, 10]),
                cu_seqlens_k=int32([0, 4, 9, 12]), max_seqlen_q=7, max_seqlen_k=5, seqused_q=None,
                seqused_k=None, alibi_slopes=None)
    for name, change in changes.items():
        args[name] = change(args[name], device) if callable(change) else change
    return args


def call_function(args):
    return flash_attn_varlen_func(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                  args["max_seqlen_q"], args["max_seqlen_k"], alibi_slopes=args["alibi_slopes"],
                                  seqused_q=args["seqused_q"], seqused_k=args["seqused_k"])


def call_op(args):
    return forward_op(args["q"], args["k"], args["v"], 0.25, False, -1, -1, 0.0, args["alibi_slopes"], 0.0,
                      None, False, args["cu_seqlens_q"], args["cu_seqlens_k"], args["seqused_q"],
                      args["seqused_k"], args["max_seqlen_q"], args["max_seqlen_k"])


def int32(values):
    return lambda _, device: torch.tensor(values, dtype=torch.int32, device=device)


def dense(shape):
    return lambda _, device: torch.randn(*shape, device=device)


BOTH, OP = ("function", "op"), ("op",)

METADATA_CHECKS = [
    ("cu_seqlens_q_int64", dict(cu_seqlens_q=lambda t, _: t.long()), RuntimeError,
     r"flashattn_ext: cu_seqlens_q must be int32, got .*(Long|int64)", BOTH),
    ("cu_seqlens_k_float", dict(cu_seqlens_k=lambda t, _: t.float()), RuntimeError,
     r"cu_seqlens_k must be int32, got .*(Float|float32)", BOTH),
    ("cu_seqlens_k_other_device", dict(cu_seqlens_k=lambda t, device: torch.zeros(
        4, dtype=torch.int32, device="meta" if device == "cpu" else "cpu")),
     RuntimeError, r"cu_seqlens_k must be on the same device as q: got (meta|cpu), expected (cpu|meta)", BOTH),
    ("cu_seqlens_k_length", dict(cu_seqlens_k=int32([0, 4, 12])), RuntimeError,
     r"cu_seqlens_k must have the length of cu_seqlens_q = 4 elements, got 3", BOTH),
    ("cu_seqlens_q_2d", dict(cu_seqlens_q=lambda t, _: t[None]), RuntimeError,
     r"cu_seqlens_q must be 1-d with batch \+ 1 >= 1 elements, got shape \[1, 4\]", BOTH),
    ("cu_seqlens_q_empty", dict(cu_seqlens_q=int32([])), RuntimeError,
     r"cu_seqlens_q must be 1-d with batch \+ 1 >= 1 elements, got shape \[0\]", BOTH),
    ("cu_seqlens_q_strided", dict(cu_seqlens_q=lambda t, _: t.repeat_interleave(2)[::2]), RuntimeError,
     r"cu_seqlens_q must be contiguous: got stride 2, expected 1", BOTH),
    ("q_rank", dict(q=lambda t, _: t[None]), RuntimeError,
     r"q must have 3 dimensions \(total, nheads, head_dim\) \(cu_seqlens given\), got 4 dimensions", BOTH),
    ("v_rank", dict(v=lambda t, _: t[None]), RuntimeError,
     r"v must have 3 dimensions \(total, nheads, head_dim\) \(cu_seqlens given\), got 4", BOTH),
    ("v_total_rows", dict(v=lambda t, _: t[:11]), RuntimeError,
     r"v total rows \(dim 0\) must match k: got 11, expected 12", BOTH),
    ("k_head_dim", dict(k=lambda t, _: t[..., :8]), RuntimeError,
     r"k head_dim \(dim 2\) must match q: got 8, expected 16", BOTH),
    ("nheads_not_divisible", dict(q=dense((10, 3, 16))), RuntimeError,
     r"q nheads \(dim 1\) must be a multiple of k nheads \(dim 1\): got 3 and 2", BOTH),
    ("k_3d_without_cu_seqlens_k", dict(cu_seqlens_k=None), RuntimeError,
     r"k must have 4 dimensions \(batch, seqlen, nheads, head_dim\) \(no cu_seqlens given\), got 3", OP),
    ("dense_k_batch", dict(cu_seqlens_k=None, max_seqlen_k=-1, k=dense((2, 4, 2, 16)), v=dense((2, 4, 2, 16))),
     RuntimeError, r"k batch size \(dim 0\) must match cu_seqlens_q's length - 1: got 2, expected 3", OP),
    ("dense_k_max_seqlen", dict(cu_seqlens_k=None, k=dense((3, 4, 2, 16)), v=dense((3, 4, 2, 16))),
     RuntimeError, r"max_seqlen_k without cu_seqlens_k must be -1 or k's seqlen \(dim 1\) = 4, got 5", OP),
    ("missing_max_seqlen_q", dict(max_seqlen_q=-1), RuntimeError,
     r"max_seqlen_q must be given \(>= 0\) with cu_seqlens_q, got -1", BOTH),
    ("missing_max_seqlen_k", dict(max_seqlen_k=-1), RuntimeError,
     r"max_seqlen_k must be given \(>= 0\) with cu_seqlens_k, got -1", BOTH),
    ("max_seqlen_none", dict(max_seqlen_q=None), TypeError, r"max_seqlen_q must be an int, got NoneType",
     ("function",)),
    ("cu_seqlens_none", dict(cu_seqlens_k=None), TypeError, r"cu_seqlens_k must be a torch.Tensor, got NoneType",
     ("function",)),
    ("seqused_q_length", dict(seqused_q=int32([1, 0])), RuntimeError,
     r"seqused_q must have batch = 3 elements, got 2", BOTH),
    ("seqused_k_int64", dict(seqused_k=lambda _, d: torch.zeros(3, dtype=torch.int64, device=d)), RuntimeError,
     r"seqused_k must be int32, got", BOTH),
    ("alibi_one_row_per_sequence", dict(alibi_slopes=lambda _, d: torch.ones(2, 2, device=d)), RuntimeError,
     r"alibi_slopes must have shape \(nheads,\) = \(2,\) or \(batch, nheads\) = \(3, 2\), got \[2, 2\]", BOTH),
]

METADATA_PARAMS = [
    pytest.param(changes, exception, pattern, path, device, id=f"{name}-{path}-{device}")
    for name, changes, exception, pattern, paths in METADATA_CHECKS
    for path, device in (("function", "cpu"), ("op", "cpu"), ("op", "meta"))
    if path in paths
]


@pytest.mark.parametrize("changes,exception,pattern,path,device", METADATA_PARAMS)
def test_metadata_checks(changes, exception, pattern, path, device):
    call = call_function if path == "function" else call_op
    with pytest.raises(exception, match=pattern) as info:
        call(varlen_args(device, **changes))
    assert "flashattn_ext: " in str(info.value)


VALUE_CHECKS = [
    ("cu_seqlens_q_last_not_total", dict(cu_seqlens_q=int32([0, 3, 3, 9])),
     r"cu_seqlens_q\[-1\] \(the total rows\) must equal q's dim 0: got 9, expected 10"),
    ("cu_seqlens_k_first_not_zero", dict(cu_seqlens_k=int32([1, 4, 9, 12])), r"cu_seqlens_k\[0\] must be 0, got 1"),
    ("cu_seqlens_q_decreasing", dict(cu_seqlens_q=int32([0, 3, 2, 10]), max_seqlen_q=8),
     r"cu_seqlens_q must be non-decreasing: got cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 3"),
    ("sequence_longer_than_max_seqlen_q", dict(max_seqlen_q=6),
     r"sequence 2 of cu_seqlens_q has 7 rows, more than max_seqlen_q = 6"),
    ("sequence_longer_than_max_seqlen_k", dict(max_seqlen_k=0),
     r"sequence 0 of cu_seqlens_k has 4 rows, more than max_seqlen_k = 0"),
    ("seqused_q_past_its_sequence", dict(seqused_q=int32([3, 1, 7])),
     r"seqused_q\[1\] must be in \[0, 0\] \(the rows of sequence 1\), got 1"),
    ("seqused_k_negative", dict(seqused_k=int32([4, -1, 3])),
     r"seqused_k\[1\] must be in \[0, 5\] \(the rows of sequence 1\), got -1"),
]


@pytest.mark.parametrize("changes,pattern", [c[1:] for c in VALUE_CHECKS], ids=[c[0] for c in VALUE_CHECKS])
def test_value_checks(changes, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call_function(varlen_args("cpu", **changes))
    # The fake kernel sees no data: the same call traces (the kernel reports it).
    assert call_op(varlen_args("meta", **changes))[0].shape == (10, 2, 16)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_backward_checks(device):
    args = varlen_args(device)
    q = args["q"]
    backward_args = (args["cu_seqlens_q"], args["cu_seqlens_k"], None, None, 7, 5)
    with pytest.raises(RuntimeError, match=r"lse must have shape \(nheads, total_q\) = \[2, 10\], got \[1, 2, 10\]"):
        backward_op(torch.randn_like(q), q, args["k"], args["v"], torch.randn_like(q),
                    torch.zeros(1, 2, 10, device=device), 0.25, False, -1, -1, 0.0, None, 0.0, None, False,
                    *backward_args)
    if device == "cpu":  # the backward checks the values too
        bad_cu = torch.tensor([0, 4, 3, 12], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"cu_seqlens_k must be non-decreasing"):
            backward_op(torch.randn_like(q), q, args["k"], args["v"], torch.randn_like(q), torch.zeros(2, 10),
                        0.25, False, -1, -1, 0.0, None, 0.0, None, False, args["cu_seqlens_q"], bad_cu,
                        None, None, 7, 5)


def test_packed_shape_checks():
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"qkv must have 4 dimensions \(total, 3, nheads, head_dim\), got 5"):
        flash_attn_varlen_qkvpacked_func(torch.randn(1, 10, 3, 2, 16), cu, 10)
    with pytest.raises(RuntimeError, match=r"kv dim 1 must be 2 \(total_k, 2, nheads_kv, head_dim\): got 3"):
        flash_attn_varlen_kvpacked_func(torch.randn(10, 2, 16), torch.randn(10, 3, 2, 16), cu, cu, 10, 10)


def ints(values):
    return torch.tensor(values, dtype=torch.int32)


def paged_args(**changes):
    """A valid paged call (varlen_args' sequences, k and v in pages of 2 rows), with changes:
    a function of the value, or a value."""
    args = varlen_args("cpu")
    paged = paged_keys(args["k"], args["v"], (4, 5, 3), page_size=2)
    args.update(k=paged.k_cache, v=paged.v_cache, block_table=paged.block_table)
    for name, change in changes.items():
        args[name] = change(args[name]) if callable(change) else change
    return args


def call_paged(args):
    return flash_attn_varlen_func(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                  args["max_seqlen_q"], args["max_seqlen_k"], seqused_k=args["seqused_k"],
                                  block_table=args["block_table"])


PAGED_CHECKS = [
    ("table_int64", dict(block_table=lambda t: t.long()), r"block_table must be int32, got torch.int64"),
    ("table_other_device", dict(block_table=lambda t: t.to("meta")),
     r"block_table must be on the same device as q: got meta, expected cpu"),
    ("table_1d", dict(block_table=lambda t: t[0]),
     r"block_table must have 2 dimensions \(batch, max_blocks_per_seq\), got 1"),
    ("table_rows", dict(block_table=lambda t: t[:2]), r"block_table must have batch = 3 rows \(one per sequence\), got 2"),
    ("k_3d", dict(k=lambda t: t[0]), r"k must have 4 dimensions \(num_blocks, page_size, nheads_kv, head_dim\)"),
    ("v_shape", dict(v=lambda t: t[:-1]), r"k and v must have the same shape .* got k \[\d+, 2, 2, 16\], v"),
    ("cu_seqlens_k_length", dict(cu_seqlens_k=ints([0, 4, 9])),
     r"cu_seqlens_k must have the length of cu_seqlens_q = 4 elements, got 3"),
    ("seqused_k_int64", dict(seqused_k=torch.zeros(3, dtype=torch.int64)), r"seqused_k must be int32"),
    ("max_seqlen_k_missing", dict(max_seqlen_k=-1), r"max_seqlen_k must be given \(>= 0\) with cu_seqlens_k, got -1"),
    # Values: the entries of the pages a sequence uses, and the lengths.
    ("entry_negative", dict(block_table=lambda t: t.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(-3, dtype=torch.int32))),
     r"block_table\[1\]\[2\] must be in \[0, num_blocks = \d+\) \(a block of sequence 1's keys\), got -3"),
    ("entry_past_the_cache", dict(block_table=lambda t: t.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(999, dtype=torch.int32))),
     r"block_table\[0\]\[0\] must be in \[0, num_blocks = \d+\) \(a block of sequence 0's keys\), got 999"),
    ("cu_seqlens_k_decreasing", dict(cu_seqlens_k=ints([0, 4, 3, 12])),
     r"cu_seqlens_k must be non-decreasing: got cu_seqlens_k\[2\] = 3 < cu_seqlens_k\[1\] = 4"),
    ("seqused_k_negative", dict(seqused_k=ints([4, -1, 3])), r"seqused_k\[1\] must be >= 0, got -1"),
    ("longer_than_max_seqlen_k", dict(max_seqlen_k=4), r"sequence 1 of cu_seqlens_k has 5 rows, more than max_seqlen_k = 4"),
    ("longer_than_the_table_row", dict(block_table=lambda t: t[:, :2], max_seqlen_k=9, cu_seqlens_k=ints([0, 4, 13, 16])),
     r"sequence 1 of cu_seqlens_k has 9 rows, more than the max_blocks_per_seq \* page_size = 2 \* 2 = 4 rows"),
]


@pytest.mark.parametrize("changes,pattern", [c[1:] for c in PAGED_CHECKS], ids=[c[0] for c in PAGED_CHECKS])
def test_paged_checks(changes, pattern):
    with pytest.raises(RuntimeError, match=pattern) as info:
        call_paged(paged_args(**changes))
    assert "flashattn_ext: " in str(info.value)


def test_paged_entries_past_a_sequence_are_never_read():
    """flash-attn's rule: only the blocks holding a sequence's keys are looked up; the rest of
    its table row may hold anything (paged_keys leaves out-of-range entries there)."""
    args = varlen_args("cpu")
    expected = call_function(args)
    paged = paged_keys(args["k"], args["v"], (4, 5, 3), page_size=2)
    assert (paged.block_table < 0).any() and (paged.block_table >= paged.k_cache.size(0)).any()
    args.update(k=paged.k_cache, v=paged.v_cache, block_table=paged.block_table)
    torch.testing.assert_close(call_paged(args), expected, rtol=0, atol=0)


def test_paged_dropout_and_probabilities_match_packed_keys():
    """The dropout mask is a function of positions within each sequence: paged keys draw the
    packed call's mask, and return_attn_probs the same S_dmask."""
    case = VARLEN_CASES_BY_NAME["q_k_differ_causal"]
    inputs = case.make(torch.float32)
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args
    paged = paged_keys(inputs.k, inputs.v, case.seqlens_k, page_size=3)
    results = []
    for k, v, table in ((inputs.k, inputs.v, None), (paged.k_cache, paged.v_cache, paged.block_table)):
        torch.manual_seed(5)
        results.append(flash_attn_varlen_func(inputs.q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.3, causal=True,
                                              return_attn_probs=True, block_table=table))
    for name, packed, in_pages in zip(("out", "lse", "S_dmask"), *results):
        torch.testing.assert_close(in_pages, packed, rtol=0, atol=0, msg=name)


def test_paged_shared_prefix():
    """Sequences whose table rows share blocks (a common prefix, as prefix caching does): each
    reads the shared keys, and the shared blocks' gradient is the sum of both sequences'."""
    gen = torch.Generator().manual_seed(3)
    page, nheads, d = 4, 2, 16
    prefix_k, prefix_v, tail_k, tail_v = (torch.randn(n, nheads, d, generator=gen, dtype=torch.float64)
                                          for n in (8, 8, 6, 6))
    k = torch.cat([prefix_k, prefix_k, tail_k]).requires_grad_()  # sequence 0: the prefix; 1: prefix + tail
    v = torch.cat([prefix_v, prefix_v, tail_v]).requires_grad_()
    q = torch.randn(9, nheads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = ints([0, 3, 9]), ints([0, 8, 22])
    expected = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 14, causal=True)
    dout = torch.randn_like(expected)
    dq, dk, dv = torch.autograd.grad(expected, (q, k, v), dout)

    k_cache = torch.cat([prefix_k, tail_k, torch.zeros(2, nheads, d, dtype=torch.float64)]).view(4, page, nheads, d)
    v_cache = torch.cat([prefix_v, tail_v, torch.zeros(2, nheads, d, dtype=torch.float64)]).view(4, page, nheads, d)
    k_cache.requires_grad_(), v_cache.requires_grad_()
    table = ints([[0, 1, 0, 0], [0, 1, 2, 3]])
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 6, 14, causal=True, block_table=table)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    dq_paged, dk_cache, dv_cache = torch.autograd.grad(out, (q, k_cache, v_cache), dout)
    torch.testing.assert_close(dq_paged, dq, rtol=1e-12, atol=1e-12)
    for cache_grad, grad in ((dk_cache, dk), (dv_cache, dv)):
        rows = cache_grad.flatten(0, 1)
        torch.testing.assert_close(rows[:8], grad[:8] + grad[8:16], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rows[8:14], grad[16:], rtol=1e-12, atol=1e-12)
        assert not rows[14:].any()


def decode_inputs(device, dtype, grad=False):
    """A decoding step in varlen form: one query row per sequence (keys 0, 1, 37, 100, 64),
    GQA 8/2, d 64; keys and values packed, and the same in pages of 16 rows."""
    gen = torch.Generator().manual_seed(11)
    lengths = (0, 1, 37, 100, 64)
    q, k, v = (torch.randn(n, heads, 64, generator=gen).to(device, dtype)
               for n, heads in ((len(lengths), 8), (sum(lengths), 2), (sum(lengths), 2)))
    paged = paged_keys(k, v, lengths, page_size=16)
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    if grad:
        q.requires_grad_()
    return q, k, v, paged, cu_q, cu_k, max(lengths)


DECODE_VARIANTS = [dict(causal=True), dict(window_size=(20, 0), softcap=5.0),
                   dict(learnable_sink=torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5, 0.3, 1.5])),
                   dict(causal=True, alibi_slopes=torch.linspace(0.05, 0.6, 8))]
DECODE_IDS = ("causal", "window_softcap", "sink", "alibi")


@pytest.fixture
def kvcache_op_calls(monkeypatch):
    """A list that grows by one at each call of flash_attn_with_kvcache's op."""
    calls = []
    kvcache_op = flashattn_ext.ops.attention_kvcache_forward
    monkeypatch.setattr(flashattn_ext.ops, "attention_kvcache_forward",
                        lambda *args: calls.append(1) or kvcache_op(*args))
    return calls


def check_decode_in_place(device, dtype, kwargs, calls, tolerance):
    """A decoding step reads the pages through flash_attn_with_kvcache's op, once, and gives
    the packed call's out and lse."""
    q, k, v, paged, cu_q, cu_k, max_k = decode_inputs(device, dtype)
    kwargs = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    expected = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max_k, return_attn_probs=True, **kwargs)
    assert not calls
    out, lse, probs = flash_attn_varlen_func(q, paged.k_cache, paged.v_cache, cu_q, cu_k, 1, max_k,
                                             return_attn_probs=True, block_table=paged.block_table, **kwargs)
    assert len(calls) == 1 and probs is None
    assert out.shape == expected[0].shape and lse.shape == expected[1].shape and lse.is_contiguous()
    torch.testing.assert_close(out, expected[0], **tolerance)
    torch.testing.assert_close(lse, expected[1], **tolerance)


@pytest.mark.parametrize("kwargs", DECODE_VARIANTS, ids=DECODE_IDS)
def test_paged_decode_reads_pages_in_place(kwargs, kvcache_op_calls):
    check_decode_in_place("cpu", torch.float32, kwargs, kvcache_op_calls, dict(rtol=1e-5, atol=1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kwargs", DECODE_VARIANTS, ids=DECODE_IDS)
def test_paged_decode_reads_pages_in_place_cuda(kwargs, kvcache_op_calls):
    check_decode_in_place("cuda", torch.bfloat16, kwargs, kvcache_op_calls, dict(rtol=2e-2, atol=2e-2))


def test_paged_decode_with_a_strided_q():
    q, k, v, paged, cu_q, cu_k, max_k = decode_inputs("cpu", torch.float32)
    strided = torch.stack([q, -q], dim=-1)[..., 0]  # q's values, last-dim stride 2
    assert strided.stride(-1) == 2
    out = flash_attn_varlen_func(strided, paged.k_cache, paged.v_cache, cu_q, cu_k, 1, max_k,
                                 block_table=paged.block_table)
    torch.testing.assert_close(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max_k), rtol=1e-5, atol=1e-6)


def test_paged_decode_with_a_gradient_or_dropout_gathers(kvcache_op_calls):
    """What flash_attn_with_kvcache's op cannot do (a gradient, dropout) gathers the pages."""
    q, k, v, paged, cu_q, cu_k, max_k = decode_inputs("cpu", torch.float32, grad=True)
    out = flash_attn_varlen_func(q, paged.k_cache, paged.v_cache, cu_q, cu_k, 1, max_k, block_table=paged.block_table)
    torch.testing.assert_close(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max_k), rtol=0, atol=0)
    assert torch.autograd.grad(out.sum(), q)[0].shape == q.shape
    with torch.no_grad():
        flash_attn_varlen_func(q, paged.k_cache, paged.v_cache, cu_q, cu_k, 1, max_k, dropout_p=0.1,
                               block_table=paged.block_table)
    assert not kvcache_op_calls


def test_paged_decode_checks_cu_seqlens_q():
    """One row per sequence is read from the shapes (max_seqlen_q = 1, as many rows as
    sequences); cu_seqlens_q that says otherwise is refused by name, not trusted."""
    q, k, v, paged, _, cu_k, max_k = decode_inputs("cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"sequence 2 of cu_seqlens_q has 2 rows, more than max_seqlen_q = 1"):
        flash_attn_varlen_func(q, paged.k_cache, paged.v_cache, ints([0, 1, 1, 3, 4, 5]), cu_k, 1, max_k,
                               block_table=paged.block_table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_cuda_graph_replay():
    """A paged call captured in a CUDA graph and replayed with new lengths and a new block
    table gives the eager result (no host synchronisation in the gather)."""
    case = VARLEN_CASES_BY_NAME["mixed_lengths"]
    inputs = case.make(torch.bfloat16, device="cuda")
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args
    paged = paged_keys(inputs.k, inputs.v, case.seqlens_k, page_size=16)
    static = dict(cu_k=cu_k.clone(), table=paged.block_table.clone())

    def call():
        return flash_attn_varlen_func(inputs.q, paged.k_cache, paged.v_cache, cu_q, static["cu_k"], max_q, max_k,
                                      causal=True, block_table=static["table"])

    expected_first = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.testing.assert_close(captured, expected_first, rtol=0, atol=0)
    # Shorter keys for every sequence (lengths 5, 0, 1, 130, 17 -> 3, 0, 1, 64, 17).
    static["cu_k"].copy_(ints([0, 3, 3, 4, 68, 85]).cuda())
    graph.replay()
    expected = call()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)


def test_meta_shapes():
    args = varlen_args("meta")
    out, lse = call_op(args)
    assert out.shape == (10, 2, 16) and lse.shape == (2, 10) and lse.dtype == torch.float32
