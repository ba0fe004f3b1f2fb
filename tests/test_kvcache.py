"""flash_attn_with_kvcache against an fp64 reference built from the definition.

The reference here shares nothing with the op: it writes the expected cache by hand
(the new rows, rotated, at cache_seqlens[b] of the sequence's cache row or blocks, and
nothing else), rotates with complex multiplication (the op uses real pairs), then runs
tests/reference.py's attention on each sequence's keys, cache_leftpad[b] ..
cache_seqlens[b] + seqlen_new - 1. out and lse are held to the error rule of
reference.py (2x the error of the same computation run by PyTorch in the inputs' dtype);
the caches must be bit-for-bit the expected ones outside the new rows, the new v rows
exact, the new k rows exact without rotary and within one rounding with it.

The CPU cases run every num_splits (1, 2, 3, 0): the CPU backend splits the keys
literally and merges the parts by log-sum-exp, which is the specification of the CUDA
combine step. GPU-marked tests run the same cases in bf16/fp16 once the op has a CUDA
kernel, plus a CUDA graph of one decode step replayed with new cache_seqlens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cuda_inputs import hopper_build
from flashattn_ext import flash_attn_with_kvcache, ops
from kvcache_inputs import CASES, CASES_BY_NAME, KvcacheCase, KvcacheInputs, make_inputs, seqlens_values
from reference import assert_error_rule, attention_reference

KVCACHE_OP = torch.ops.flashattn_ext.attention_kvcache_forward.default
HAS_CUDA_KERNEL = ops.has_kernel("attention_kvcache_forward", "CUDA")
SPLITS = (1, 2, 3, 0)


# ---- the reference -------------------------------------------------------------------------

def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            interleaved: bool, dtype: torch.dtype) -> torch.Tensor:
    """x (batch, rows, nheads, head_dim) with the first rotary_dim columns of row r of batch
    entry b multiplied, as complex numbers, by cos + i sin of row positions[b, r]; computed in
    fp64 for dtype fp64, else in fp32, and returned in dtype. The complex number of pair p is
    (x[2p], x[2p + 1]) interleaved (GPT-J), (x[p], x[p + half]) not (GPT-NeoX)."""
    half = cos.size(1)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    x = x.to(work)
    head = x[..., :2 * half]
    pairs = head.unflatten(-1, (half, 2)) if interleaved else head.unflatten(-1, (2, half)).transpose(-1, -2)
    rotation = torch.complex(cos.to(work)[positions], sin.to(work)[positions]).unsqueeze(2)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * rotation)
    head = turned.flatten(-2) if interleaved else turned.transpose(-1, -2).flatten(-2)
    return torch.cat([head, x[..., 2 * half:]], dim=-1).to(dtype)


def sequence_rows(case: KvcacheCase, inputs: KvcacheInputs, b: int) -> list:
    """(cache index, row) of each of sequence b's capacity rows."""
    if inputs.block_table is None:
        row = int(inputs.cache_batch_idx[b]) if inputs.cache_batch_idx is not None else b
        return [(row, r) for r in range(case.capacity)]
    blocks = inputs.block_table[b].tolist()
    return [(blocks[r // case.page_size], r % case.page_size) for r in range(case.capacity)]


def expected_caches(case: KvcacheCase, inputs: KvcacheInputs, seqlens: torch.Tensor):
    """The caches after the call, and a bool mask of the rows the call writes."""
    k_cache, v_cache = inputs.k_cache.cpu().clone(), inputs.v_cache.cpu().clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    if inputs.k is None:
        return k_cache, v_cache, written
    k_new, v_new = inputs.k.cpu(), inputs.v.cpu()
    if inputs.rotary_cos is not None:
        positions = seqlens.view(-1, 1) + torch.arange(case.seqlen_new).view(1, -1)
        k_new = rotated(k_new, inputs.rotary_cos.cpu(), inputs.rotary_sin.cpu(), positions,
                        case.rotary_interleaved, torch.float64).to(k_cache.dtype)
    for b in range(case.batch):
        rows = sequence_rows(case, inputs, b)
        for t in range(case.seqlen_new):
            index, row = rows[int(seqlens[b]) + t]
            k_cache[index, row] = k_new[b, t]
            v_cache[index, row] = v_new[b, t]
            written[index, row] = True
    return k_cache, v_cache, written


def reference_attention(case: KvcacheCase, inputs: KvcacheInputs, k_cache, v_cache, seqlens,
                        compute_dtype: torch.dtype):
    """(out, lse) of q, rotated, over each sequence's keys in the expected caches."""
    q = inputs.q.cpu()
    if inputs.rotary_cos is not None:
        advance = case.causal or any(0 <= w < case.capacity for w in case.window)
        steps = torch.arange(case.seqlen_q) if advance else torch.zeros(case.seqlen_q, dtype=torch.int64)
        q = rotated(q, inputs.rotary_cos.cpu(), inputs.rotary_sin.cpu(), seqlens.view(-1, 1) + steps.view(1, -1),
                    case.rotary_interleaved, compute_dtype)
    leftpad = inputs.cache_leftpad.cpu() if inputs.cache_leftpad is not None else torch.zeros_like(seqlens)
    outs, lses = [], []
    for b in range(case.batch):
        rows = sequence_rows(case, inputs, b)[int(leftpad[b]):int(seqlens[b]) + case.seqlen_new]
        index = torch.tensor([i for i, _ in rows], dtype=torch.long)
        row = torch.tensor([r for _, r in rows], dtype=torch.long)
        keys, values = k_cache.cpu()[index, row].unsqueeze(0), v_cache.cpu()[index, row].unsqueeze(0)
        sink = inputs.learnable_sink.cpu() if inputs.learnable_sink is not None else None
        slopes = inputs.alibi_slopes.cpu() if inputs.alibi_slopes is not None else None
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b:b + 1]
        out, lse = attention_reference(q[b:b + 1], keys, values, causal=case.causal, window=case.window,
                                       softcap=case.softcap, alibi_slopes=slopes, learnable_sink=sink,
                                       compute_dtype=compute_dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check_call(case: KvcacheCase, dtype: torch.dtype, device: str, num_splits: int, seed: int = 0):
    """Runs flash_attn_with_kvcache on fresh inputs and checks the caches, out and lse."""
    inputs = make_inputs(case, dtype, device, seed)
    seqlens = seqlens_values(case, torch.Generator().manual_seed(seed))
    expected_k, expected_v, written = expected_caches(case, inputs, seqlens)
    ref = reference_attention(case, inputs, expected_k, expected_v, seqlens, torch.float64)
    low = reference_attention(case, inputs, expected_k, expected_v, seqlens, dtype)
    out, lse = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.func_kwargs(case),
                                       num_splits=num_splits, return_softmax_lse=True)
    check_caches(case, inputs, expected_k, expected_v, written)
    context = f"{case.name} num_splits={num_splits}"
    assert out.shape == inputs.q.shape and out.dtype == dtype
    assert lse.shape == (case.batch, case.nheads, case.seqlen_q)
    assert_error_rule(("out", "lse"), (out.cpu(), lse.cpu()), ref, low, dtype, context)
    return out, lse


def check_caches(case, inputs, expected_k, expected_v, written):
    k_cache, v_cache = inputs.k_cache.cpu(), inputs.v_cache.cpu()
    assert torch.equal(k_cache[~written], expected_k.cpu()[~written]), f"{case.name}: k_cache rows not appended changed"
    assert torch.equal(v_cache[~written], expected_v.cpu()[~written]), f"{case.name}: v_cache rows not appended changed"
    assert torch.equal(v_cache[written], expected_v.cpu()[written]), f"{case.name}: v_cache new rows"
    if inputs.rotary_cos is None:
        assert torch.equal(k_cache[written], expected_k.cpu()[written]), f"{case.name}: k_cache new rows"
    else:
        # Rotated in the backend's precision and rounded once: one rounding step of the dtype.
        torch.testing.assert_close(k_cache[written], expected_k.cpu()[written],
                                   msg=f"{case.name}: k_cache new rows (rotated)")


# ---- CPU -----------------------------------------------------------------------------------

CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_cpu(case, dtype, num_splits):
    check_call(case, dtype, "cpu", num_splits)


@pytest.mark.parametrize("page_size", (16, 64, 256))
def test_paged_equals_contiguous(page_size):
    """The same sequences in a paged cache and in a dense one give the same results, and
    the same rows written."""
    case = KvcacheCase("paged", batch=2, seqlen_q=3, seqlen_new=3, capacity=2 * page_size, nheads=4,
                       nheads_kv=2, page_size=page_size, rotary_dim=16, leftpad=True)
    paged = make_inputs(case, torch.float32)
    blocks = paged.block_table.long()
    dense = dataclasses.replace(paged, block_table=None,
                                k_cache=paged.k_cache[blocks].flatten(1, 2).clone(),
                                v_cache=paged.v_cache[blocks].flatten(1, 2).clone())
    dense_case = dataclasses.replace(case, page_size=None)
    for num_splits in (1, 3):
        p, d = paged.clone_caches(), dense.clone_caches()
        out_p, lse_p = KVCACHE_OP(*p.op_args(case, num_splits))
        out_d, lse_d = KVCACHE_OP(*d.op_args(dense_case, num_splits))
        torch.testing.assert_close(out_p, out_d, rtol=0, atol=0)
        torch.testing.assert_close(lse_p, lse_d, rtol=0, atol=0)
        torch.testing.assert_close(p.k_cache[blocks].flatten(1, 2), d.k_cache, rtol=0, atol=0)
        torch.testing.assert_close(p.v_cache[blocks].flatten(1, 2), d.v_cache, rtol=0, atol=0)


def test_more_splits_than_keys():
    """Parts without keys (num_splits > the sequence's keys) weigh nothing in the merge."""
    check_call(dataclasses.replace(CASES_BY_NAME["chunk_causal_rotary"], seqlens="zero"),
               torch.float64, "cpu", num_splits=8)


def test_rows_without_keys():
    """Queries that see no key (causal, more queries than keys) get out 0 and lse +inf."""
    case = CASES_BY_NAME["more_queries_than_keys"]
    out, lse = check_call(case, torch.float32, "cpu", num_splits=2)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isinf(lse[..., :3]).all() and (lse[..., :3] > 0).all()


def test_returns_out_alone_by_default():
    case = CASES_BY_NAME["decode_mqa"]
    inputs = make_inputs(case, torch.float32)
    out = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.func_kwargs(case))
    assert isinstance(out, torch.Tensor) and out.shape == inputs.q.shape


def test_no_backward():
    """The op has no derivative (nor has flash-attn's): a backward through out raises."""
    case = CASES_BY_NAME["cache_only"]
    inputs = make_inputs(case, torch.float32)
    q = inputs.q.requires_grad_(True)
    out = flash_attn_with_kvcache(q, inputs.k_cache, inputs.v_cache, **inputs.func_kwargs(case))
    with pytest.raises(RuntimeError, match="attention_kvcache_forward"):
        out.sum().backward()


# ---- argument checks -----------------------------------------------------------------------

def _error_cases():
    base = CASES_BY_NAME["paged16"]
    dense = CASES_BY_NAME["decode_gqa4_rotary_gptj"]

    def change(case, call_kwargs=None, **fields):
        """The case, a function changing its inputs' fields (a value, or a function of the
        inputs), and extra keyword arguments of the call."""
        def apply(inputs):
            for name, value in fields.items():
                setattr(inputs, name, value(inputs) if callable(value) else value)
        return case, apply, call_kwargs or {}

    return [
        ("cache_too_short_for_new", *change(dense, cache_seqlens=lambda i: torch.full_like(i.cache_seqlens, 48)),
         RuntimeError, r"cache is too short for k_new: cache_seqlens\[0\] \+ seqlen_new = 48 \+ 1"),
        ("k_new_longer_than_cache", *change(dense, k=lambda i: i.k.expand(2, 49, 2, 64),
                                            v=lambda i: i.v.expand(2, 49, 2, 64)),
         RuntimeError, r"cache is too short for k_new: k_new has seqlen_new = 49 rows"),
        ("block_table_out_of_range", *change(base, block_table=lambda i: i.block_table.clone().fill_(99)),
         RuntimeError, r"block_table\[0\]\[0\] must be in \[0, num_blocks = 9\), got 99"),
        ("block_table_int64", *change(base, block_table=lambda i: i.block_table.long()),
         RuntimeError, r"block_table must be int32, got Long"),
        ("block_table_shape", *change(base, block_table=lambda i: i.block_table[:1]),
         RuntimeError, r"block_table must have shape \(batch, max_blocks_per_seq\) with batch = 2"),
        ("cache_seqlens_int64", *change(dense, cache_seqlens=lambda i: i.cache_seqlens.long()),
         RuntimeError, r"cache_seqlens must be int32, got Long"),
        ("cache_seqlens_shape", *change(dense, cache_seqlens=lambda i: i.cache_seqlens[:1]),
         RuntimeError, r"cache_seqlens must have batch = 2 elements, got 1"),
        ("cache_seqlens_negative", *change(dense, cache_seqlens=lambda i: torch.full_like(i.cache_seqlens, -1)),
         RuntimeError, r"cache_seqlens\[0\] must be >= 0, got -1"),
        ("k_without_v", *change(dense, v=None), RuntimeError, r"k_new and v_new .* must be given together: got k_new alone"),
        ("v_without_k", *change(dense, k=None), RuntimeError, r"must be given together: got v_new alone"),
        ("k_cache_dtype", *change(dense, k_cache=lambda i: i.k_cache.double()),
         RuntimeError, r"k_cache must have the same dtype as q: got Double, expected Float"),
        ("k_new_dtype", *change(dense, k=lambda i: i.k.double()),
         RuntimeError, r"k_new must have the same dtype as q: got Double, expected Float"),
        ("v_cache_shape", *change(dense, v_cache=lambda i: i.v_cache[:, :40]),
         RuntimeError, r"v_cache seqlen_cache \(dim 1\) must match k_cache: got 40, expected 48"),
        ("k_new_heads", *change(dense, k=lambda i: i.k.repeat(1, 1, 2, 1)),
         RuntimeError, r"k_new nheads \(dim 2\) must match k_cache: got 4, expected 2"),
        ("q_rank", *change(dense, q=lambda i: i.q[0]), RuntimeError, r"q must have 4 dimensions"),
        ("cache_batch", *change(dense, k_cache=lambda i: i.k_cache[:1], v_cache=lambda i: i.v_cache[:1]),
         RuntimeError, r"k_cache batch size \(dim 0\) must match q's when no cache_batch_idx is given"),
        ("batch_idx_out_of_range", *change(dense, cache_batch_idx=lambda i: torch.tensor([0, 2], dtype=torch.int32)),
         RuntimeError, r"cache_batch_idx\[1\] must be in \[0, batch_cache = 2\), got 2"),
        ("batch_idx_with_block_table", *change(base, cache_batch_idx=lambda i: torch.tensor([0, 1], dtype=torch.int32)),
         RuntimeError, r"cache_batch_idx cannot be combined with block_table"),
        ("leftpad_past_seqlens", *change(dense, cache_leftpad=lambda i: i.cache_seqlens + 1),
         RuntimeError, r"cache_leftpad\[0\] must be in \[0, cache_seqlens\[0\] = \d+\], got \d+"),
        ("page_size", *change(base, k_cache=lambda i: i.k_cache[:, :8], v_cache=lambda i: i.v_cache[:, :8]),
         RuntimeError, r"k_cache page_size \(dim 1, block_table given\) must be a positive multiple of 16, got 8"),
        ("rotary_without_sin", *change(dense, rotary_sin=None), RuntimeError,
         r"rotary_cos and rotary_sin must be given together: got rotary_cos alone"),
        ("rotary_without_k", *change(dense, k=None, v=None), RuntimeError,
         r"rotary_cos and rotary_sin need k_new and v_new"),
        ("rotary_dim_too_large", *change(dense, rotary_cos=lambda i: i.rotary_cos.repeat(1, 3),
                                         rotary_sin=lambda i: i.rotary_sin.repeat(1, 3)),
         RuntimeError, r"rotary_dim \(2 \* rotary_cos dim 1\) must be at most head_dim: got 96, expected <= 64"),
        ("rotary_too_short", *change(dense, rotary_cos=lambda i: i.rotary_cos[:0], rotary_sin=lambda i: i.rotary_sin[:0]),
         RuntimeError, r"rotary_cos and rotary_sin must have a row for every rotated position"),
        ("new_keys_without_seqlens", *change(dense, cache_seqlens=None, rotary_cos=None, rotary_sin=None),
         RuntimeError, r"k_new and v_new need cache_seqlens"),
        ("alibi_shape", *change(dense, alibi_slopes=torch.ones(3)), RuntimeError,
         r"alibi_slopes must have shape \(nheads,\) = \(8,\) or \(batch, nheads\) = \(2, 8\), got \[3\]"),
        ("num_splits_negative", *change(dense, dict(num_splits=-1)), RuntimeError, r"num_splits must be >= 0"),
        ("head_dim_not_multiple_of_8", *change(dense, q=lambda i: i.q[..., :60], k_cache=lambda i: i.k_cache[..., :60],
                                               v_cache=lambda i: i.v_cache[..., :60], k=lambda i: i.k[..., :60],
                                               v=lambda i: i.v[..., :60], rotary_cos=None, rotary_sin=None),
         RuntimeError, r"head_dim \(q's last dim\) must be a multiple of 8 \(flash_attn_with_kvcache cannot pad it: "
                        r"the caches are written in place\), got 60"),
    ]


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("name,case,apply,call_kwargs,error,message", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_argument_errors(name, case, apply, call_kwargs, error, message):
    inputs = make_inputs(case, torch.float32)
    apply(inputs)
    k_before, v_before = inputs.k_cache.clone(), inputs.v_cache.clone()
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.func_kwargs(case), **call_kwargs)
    # A refused call writes nothing.
    assert torch.equal(inputs.k_cache, k_before) and torch.equal(inputs.v_cache, v_before)


def test_cache_seqlens_type():
    case = CASES_BY_NAME["cache_only"]
    inputs = make_inputs(case, torch.float32)
    with pytest.raises(TypeError, match=r"cache_seqlens must be an int, got float"):
        flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=3.0)


# ---- Meta kernel, torch.compile (opcheck: tests/test_opcheck.py) ----------------------------------------------------------------

def test_meta_kernel_runs_the_checks():
    case = CASES_BY_NAME["decode_gqa4_rotary_gptj"]
    inputs = make_inputs(case, torch.float32, device="meta")
    out, lse = KVCACHE_OP(*inputs.op_args(case))
    assert out.shape == inputs.q.shape and lse.shape == (case.batch, case.nheads, case.seqlen_q)
    inputs.k = inputs.k[:, :, :1]
    with pytest.raises(RuntimeError, match=r"k_new nheads \(dim 2\) must match k_cache"):
        KVCACHE_OP(*inputs.op_args(case))


def test_compile_decode_step():
    """A decode step (append + attention) under torch.compile(fullgraph=True): one op
    call in the graph, the caches written as in eager, no recompile for new values."""
    case = CASES_BY_NAME["decode_gqa4_rotary_gptj"]

    def step(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=cache_seqlens,
                                       causal=True, return_softmax_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            eager, traced = make_inputs(case, torch.float32, seed=seed), make_inputs(case, torch.float32, seed=seed)
            args = lambda i: (i.q, i.k_cache, i.v_cache, i.k, i.v, i.rotary_cos, i.rotary_sin, i.cache_seqlens)
            expected = step(*args(eager))
            actual = compiled(*args(traced))
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, rtol=0, atol=0)
            torch.testing.assert_close(traced.k_cache, eager.k_cache, rtol=0, atol=0)
            torch.testing.assert_close(traced.v_cache, eager.v_cache, rtol=0, atol=0)


# ---- CUDA ----------------------------------------------------------------------------------

needs_cuda_kernel = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_CUDA_KERNEL,
                                       reason="needs a CUDA device and the op's CUDA kernel")


def poison_outputs():
    """NaN in the caching allocator's next blocks, so an output element never written shows."""
    torch.empty(1 << 26, dtype=torch.float32, device="cuda").fill_(float("nan"))


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_cuda(case, dtype, num_splits):
    """The CPU cases on the GPU: the CUDA kernels take every argument."""
    poison_outputs()
    check_call(case, dtype, "cuda", num_splits)


# Caches of many key blocks (the CUDA kernel's blocks are 64 or 32 keys), so that every
# split has blocks of its own, runs of them end mid-sequence and mid-page, and short
# sequences leave late splits empty.
LONG_CUDA_CASES = [
    KvcacheCase("long_decode_gqa4_d128", batch=3, nheads=16, nheads_kv=4, head_dim=128, capacity=4096,
                rotary_dim=64),
    KvcacheCase("long_chunk_paged64_gqa8_d64", batch=2, seqlen_q=40, seqlen_new=40, nheads=8, nheads_kv=1,
                head_dim=64, capacity=2048, page_size=64, rotary_dim=32, rotary_interleaved=False),
    KvcacheCase("long_paged16_leftpad_d256", batch=2, seqlen_q=3, seqlen_new=3, nheads=4, nheads_kv=2,
                head_dim=256, capacity=1024, page_size=16, leftpad=True),
    KvcacheCase("long_batch_idx_d96", batch=2, seqlen_q=2, seqlen_new=2, nheads=6, nheads_kv=3,
                head_dim=96, capacity=1440, batch_idx=True),
    KvcacheCase("long_paged48_d128", batch=2, seqlen_q=1, seqlen_new=1, nheads=8, nheads_kv=2, head_dim=128,
                capacity=1440, page_size=48),
    KvcacheCase("long_window_d128", batch=2, seqlen_q=8, seqlen_new=8, causal=False, window=(300, 0), nheads=8,
                nheads_kv=8, head_dim=128, capacity=3000),
    # softcap in every split, the sink once in the combine (splits must not each add it).
    KvcacheCase("long_softcap_sink_paged64_gqa4_d128", batch=2, seqlen_q=3, seqlen_new=3, nheads=8, nheads_kv=2,
                head_dim=128, capacity=2048, page_size=64, softcap=20.0, sink=True),
    KvcacheCase("long_sink_decode_d64", batch=3, nheads=4, nheads_kv=4, head_dim=64, capacity=1500, sink=True),
    # Chunks of >= 128 rows on a contiguous cache whose 128-row tiles (batch x heads x
    # ceil(seqlen_q / 128): 72-96 here) number 3/8 of an H200's 132 SMs: the dense Hopper
    # forward on Hopper devices (seqused_k = cache_seqlens + the appended rows); the last
    # case is too thin for it and stays on the split kernel.
    KvcacheCase("long_chunk_dense_gqa4_d128", batch=3, seqlen_q=160, seqlen_new=160, nheads=16, nheads_kv=4,
                head_dim=128, capacity=2000),
    KvcacheCase("long_chunk_dense_window_no_append_d64", batch=3, seqlen_q=130, seqlen_new=0, causal=False,
                window=(200, 50), nheads=16, nheads_kv=16, head_dim=64, capacity=1500),
    KvcacheCase("long_chunk_dense_softcap_sink_d256", batch=2, seqlen_q=128, seqlen_new=128, nheads=40,
                nheads_kv=4, head_dim=256, capacity=1024, softcap=15.0, sink=True),
    KvcacheCase("long_chunk_dense_whole_rows_d128", batch=2, seqlen_q=200, seqlen_new=0, causal=False, nheads=24,
                nheads_kv=8, head_dim=128, capacity=777, seqlens="none"),
    KvcacheCase("long_chunk_dense_empty_caches_d128", batch=2, seqlen_q=128, seqlen_new=64, nheads=36,
                nheads_kv=36, head_dim=128, capacity=512, seqlens="zero"),
    KvcacheCase("long_chunk_split_d128", batch=1, seqlen_q=128, seqlen_new=128, nheads=8, nheads_kv=2,
                head_dim=128, capacity=1000),
    # ALiBi: one query head per tile (its slope), K/V of the head's group; per-batch slopes
    # of batch entries (not of cache rows); the dense chunk with the slopes.
    KvcacheCase("long_alibi_decode_gqa4_d128", batch=3, nheads=16, nheads_kv=4, head_dim=128, capacity=4096,
                rotary_dim=64, alibi="nheads"),
    KvcacheCase("long_alibi_softcap_paged16_leftpad_d256", batch=2, seqlen_q=3, seqlen_new=3, nheads=4,
                nheads_kv=2, head_dim=256, capacity=1024, page_size=16, leftpad=True, softcap=10.0,
                alibi="batch_nheads"),
    KvcacheCase("long_alibi_batch_idx_window_d64", batch=2, seqlen_q=5, seqlen_new=2, causal=False, window=(400, 3),
                nheads=6, nheads_kv=2, head_dim=64, capacity=1500, batch_idx=True, alibi="batch_nheads"),
    KvcacheCase("long_chunk_dense_alibi_gqa4_d128", batch=3, seqlen_q=160, seqlen_new=160, nheads=16, nheads_kv=4,
                head_dim=128, capacity=2000, alibi="batch_nheads", sink=True),
]


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("num_splits", (0, 1, 3, 16, 200))
@pytest.mark.parametrize("case", LONG_CUDA_CASES, ids=str)
def test_kvcache_cuda_long(case, num_splits, kernel_family):
    poison_outputs()
    check_call(case, torch.bfloat16, "cuda", num_splits)


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("case_name,dense", [("long_chunk_dense_gqa4_d128", True),
                                             ("long_chunk_dense_whole_rows_d128", True),
                                             ("long_chunk_dense_alibi_gqa4_d128", True),
                                             ("long_chunk_split_d128", False),
                                             ("long_decode_gqa4_d128", False)])
def test_long_chunks_run_the_dense_kernel(case_name, dense):
    """Where a call goes on a Hopper build: a long chunk on a contiguous cache to the dense
    wgmma forward (2.3 x the split kernel at 512 rows), a thin chunk and decoding to the
    split kernel. Read from the kernels the profiler saw launched."""
    if not hopper_build():
        pytest.skip("the dense chunk path needs the Hopper kernels")
    case = next(c for c in LONG_CUDA_CASES if c.name == case_name)
    inputs = make_inputs(case, torch.bfloat16, "cuda", 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.func_kwargs(case))
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("attention_forward_sm90_kernel" in n for n in kernels) == dense, kernels
    assert any("kvcache_forward_kernel" in n for n in kernels) == (not dense), kernels


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("paged", (False, True), ids=("dense", "paged"))
@pytest.mark.parametrize("num_splits", (0, 1, 3))
def test_cuda_graph_decode_step(paged, num_splits):
    """One decode step (append k/v + attention) captured in a CUDA graph and replayed with new
    cache_seqlens values (and new q, k, v), each replay checked against the reference; one
    split, and splits merged by the combine kernel."""
    case = KvcacheCase("graph", batch=3, nheads=8, nheads_kv=2, head_dim=128, capacity=256,
                       page_size=64 if paged else None, rotary_dim=64)
    dtype = torch.bfloat16
    static = make_inputs(case, dtype, "cuda", seed=0)
    kwargs = static.func_kwargs(case)

    def step():
        return flash_attn_with_kvcache(static.q, static.k_cache, static.v_cache, **kwargs, num_splits=num_splits,
                                       return_softmax_lse=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture (allocations, lazy initialisation)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for seed in (1, 2, 3):
        fresh = make_inputs(case, dtype, "cuda", seed=seed)
        # Every tensor the graph reads gets the new inputs' values (the block table and the
        # rotary tables are drawn anew with the seed too).
        for field in dataclasses.fields(static):
            tensor = getattr(static, field.name)
            if isinstance(tensor, torch.Tensor):
                tensor.copy_(getattr(fresh, field.name))
        seqlens = seqlens_values(case, torch.Generator().manual_seed(seed))
        expected_k, expected_v, written = expected_caches(case, fresh, seqlens)
        ref = reference_attention(case, fresh, expected_k, expected_v, seqlens, torch.float64)
        low = reference_attention(case, fresh, expected_k, expected_v, seqlens, dtype)
        graph.replay()
        torch.cuda.synchronize()
        check_caches(case, static, expected_k, expected_v, written)
        assert_error_rule(("out", "lse"), (out.cpu(), lse.cpu()), ref, low, dtype, f"replay {seed}")
