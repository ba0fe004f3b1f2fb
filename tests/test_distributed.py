"""Tests of flashattn_ext.distributed (ring and zigzag ring attention).

* The block plan (which op calls, with which trimmed rows, keys and window,
  each step of the ring makes) against the global mask of reference.py,
  exhaustively on small sizes: every visible (query, key) pair computed exactly
  once, nothing else.
* merge_attention_outputs against one call over all the keys, and on empty rows.
* World sizes 2 and 4 as gloo processes on this machine (tests/distributed_worker.py),
  forward and gradients gathered and compared with flash_attn_func on the global
  tensors and with the fp64 reference, under the error rule of reference.py
  (fp64 inputs to the fp64 rule: their lse and merge are fp64 too).
* Argument errors, in a one-rank gloo group in this process.
* On a GPU: the same comparison in bf16 with NCCL, one rank per GPU (one or two).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_worker as worker
import flashattn_ext
from flashattn_ext import distributed as fd
from flashattn_ext import ops
from reference import assert_error_rule, attention_reference_with_grads, max_abs_error, tolerance, \
    visibility_mask

CPU_DTYPES = (torch.float32, torch.float64)
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (False, (5, 2)), (False, (-1, 0)),
         (False, (0, -1)), (False, (0, 0)), (True, (0, -1)), (False, (2, 9)), (False, (-1, 3))]


# ---- the block plan --------------------------------------------------------------------------

def planned_mask(layout, rank, source, world_size, local_len, causal, window):
    """(local_len, local_len) count of the op calls that cover each (query, key)
    pair of the rank's queries and the source's keys, from the op's own mask."""
    lo, hi = fd._mask_bounds(causal, window)
    covered = torch.zeros(local_len, local_len, dtype=torch.int64)
    calls = fd._block_calls(fd._segments(layout, rank, world_size, local_len),
                            fd._segments(layout, source, world_size, local_len), lo, hi)
    for qs, qe, ks, ke, left, right in calls:
        covered[qs:qe, ks:ke] += visibility_mask(qe - qs, ke - ks, False, (left, right)).long()
    return covered, calls


def positions(layout, rank, world_size, local_len):
    return torch.cat([torch.arange(start, start + n)
                      for start, n in fd._segments(layout, rank, world_size, local_len)])


@pytest.mark.parametrize("layout", ("ring", "zigzag"))
def test_block_plan_covers_the_global_mask_once(layout):
    for world_size in (1, 2, 3, 4):
        for local_len in (2, 4, 6):
            seqlen = world_size * local_len
            for causal, window in MASKS:
                full = visibility_mask(seqlen, seqlen, causal, window)
                for rank in range(world_size):
                    rows = positions(layout, rank, world_size, local_len)
                    for source in range(world_size):
                        keys = positions(layout, source, world_size, local_len)
                        covered, _ = planned_mask(layout, rank, source, world_size, local_len,
                                                  causal, window)
                        expected = full[rows][:, keys].long()
                        assert torch.equal(covered, expected), (
                            f"{layout} P={world_size} L={local_len} causal={causal} "
                            f"window={window} rank {rank} holding {source}'s keys")


def test_zigzag_causal_plan_is_one_call_per_step():
    # The balance zigzag exists for: one launch per step, the diagonal step a causal
    # one over the whole shard, every other step the same number of visible pairs.
    world_size, local_len = 4, 6
    for step in range(world_size):
        sizes = set()
        for rank in range(world_size):
            covered, calls = planned_mask("zigzag", rank, (rank - step) % world_size, world_size,
                                          local_len, True, (-1, -1))
            assert len(calls) == 1, (step, rank, calls)
            sizes.add(int(covered.sum()))
        assert len(sizes) == 1, f"step {step}: visible pairs per rank {sizes}"


# ---- the merge -------------------------------------------------------------------------------

def op_attention(q, k, v):
    return ops.attention_forward(q, k, v, q.size(-1) ** -0.5, False, -1, -1, 0.0, None, 0.0, None,
                                 False)


def test_merge_of_two_key_halves_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    # Scores of very different sizes in the two halves: one half dominates some rows.
    k[:, :5] *= 4.0
    whole_out, whole_lse = op_attention(q, k, v)
    out, lse = fd.merge_attention_outputs(*op_attention(q, k[:, :5], v[:, :5]),
                                          *op_attention(q, k[:, 5:], v[:, 5:]))
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert max_abs_error(out, whole_out) < 1e-12
    assert max_abs_error(lse, whole_lse) < 1e-12


def test_merge_empty_rows_and_large_lse():
    out_a = torch.randn(1, 3, 2, 8)
    lse_a = torch.tensor([[[0.5, math.inf, 3000.0], [-2.0, math.inf, -3000.0]]])
    out_b = torch.randn(1, 3, 2, 8)
    lse_b = torch.tensor([[[math.inf, math.inf, 3000.0], [math.inf, math.inf, -3000.0]]])
    out_b[:, :2] = 0.0  # what the op returns for rows that see no key
    out, lse = fd.merge_attention_outputs(out_a, lse_a, out_b, lse_b)
    assert torch.isfinite(out).all()
    # Empty in b: a alone. Empty in both: out 0, lse +inf.
    assert torch.equal(out[:, 0], out_a[:, 0]) and torch.equal(lse[..., 0], lse_a[..., 0])
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert torch.equal(lse[..., 1], torch.full_like(lse[..., 1], math.inf))
    # Equal lse of size 3000 (exp overflows fp32): the average, and lse + log 2.
    torch.testing.assert_close(out[:, 2], (out_a[:, 2] + out_b[:, 2]) / 2)
    torch.testing.assert_close(lse[..., 2], lse_a[..., 2] + math.log(2.0))


# ---- several ranks ---------------------------------------------------------------------------

def spawn_ranks(tmp_path, world_size, backend, dtypes):
    result_path = tmp_path / "results.pt"
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(worker.run, args=(world_size, init_method, backend, dtypes, str(result_path)),
                       nprocs=world_size, join=True, start_method="spawn")
    return torch.load(result_path)


def single_process(case, dtype, device):
    """flash_attn_func's (out, lse, dq, dk, dv[, dsink]) on the global tensors."""
    q, k, v, dout = case.global_inputs(dtype, device)
    sink = case.learnable_sink(device)
    leaves = (q, k, v) + (() if sink is None else (sink,))
    for t in leaves:
        t.requires_grad_(True)
    out, lse, _ = flashattn_ext.flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sink,
                                                **case.kwargs())
    out.backward(dout)
    return [t.detach().cpu() for t in (out, lse)] + [t.grad.cpu() for t in leaves]


def check_against_single_process(results, case, dtype, device):
    q, k, v, dout = case.global_inputs(dtype)
    mask = dict(causal=case.causal, window=case.window, softcap=case.softcap,
                learnable_sink=case.learnable_sink())
    reference = attention_reference_with_grads(q, k, v, dout, **mask)
    # The rule's baseline: the same reference in the inputs' precision (none for fp64,
    # whose rule is absolute).
    baseline = [None] * len(case.outputs)
    if dtype != torch.float64:
        baseline = attention_reference_with_grads(q, k, v, dout, compute_dtype=dtype, **mask)
    ring = [results[(case.name, str(dtype))][name] for name in case.outputs]
    context = f"{case.name} ({case.layout})"
    assert_error_rule(case.outputs, ring, reference, baseline, dtype, context)
    # And next to flash_attn_func on one device, within the same allowance.
    single = single_process(case, dtype, device)
    gradient_scale = max(r.abs().max().item() for r in reference[2:5])
    for name, a, s, r, b in zip(case.outputs, ring, single, reference, baseline):
        scale = gradient_scale if name in ("dq", "dk", "dv") else None
        assert max_abs_error(a, s) <= tolerance(name, dtype, r, b, scale), (context, name)


@pytest.fixture(scope="module", params=(2, 4), ids=lambda p: f"world{p}")
def gloo_results(request, tmp_path_factory):
    return spawn_ranks(tmp_path_factory.mktemp("gloo"), request.param, "gloo", CPU_DTYPES)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", worker.CASES, ids=str)
def test_gloo_ranks_match_single_process(gloo_results, case, dtype):
    check_against_single_process(gloo_results, case, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL")
def test_nccl_ranks_match_single_process_bf16(tmp_path):
    # One rank per GPU; two where there are two, so that the hops really travel.
    world_size = min(torch.cuda.device_count(), 2)
    results = spawn_ranks(tmp_path, world_size, "nccl", (torch.bfloat16,))
    for case in worker.CASES:
        check_against_single_process(results, case, torch.bfloat16, "cuda")


# ---- arguments -------------------------------------------------------------------------------

def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ring_flash_attn_func(q, q, q)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_argument_errors():
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(RuntimeError, match=r"same local seqlen \(dim 1\): got 6 and 4"):
        fd.ring_flash_attn_func(q, q[:, :4], q[:, :4])
    with pytest.raises(RuntimeError, match=r"even local seqlen.*got 5"):
        fd.zigzag_ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5])
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fd.ring_flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fd.zigzag_ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(RuntimeError, match="dropout_p must be in"):
        fd.ring_flash_attn_func(q, q, q, dropout_p=1.5)
    with pytest.raises(RuntimeError, match="learnable_sink"):
        fd.ring_flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    with pytest.raises(RuntimeError, match="softcap must be"):
        fd.zigzag_ring_flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(RuntimeError, match=r"x dim 1 \(seqlen\) into 4 equal parts.*got length 6"):
        fd.ring_shard(q, 0, 4)
    with pytest.raises(RuntimeError, match=r"into 8 equal parts for world size 4: got length 12"):
        fd.zigzag_shard(torch.randn(1, 12, 2, 8), 1, 4)
    with pytest.raises(RuntimeError, match="must be even, got 5"):
        fd.zigzag_gather(q[:, :5])


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("func", (fd.ring_flash_attn_func, fd.zigzag_ring_flash_attn_func),
                         ids=("ring", "zigzag"))
def test_one_rank_is_flash_attn_func(func):
    # Without hops, including the head-dim padding and return_attn_probs.
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 10, h, 12, generator=gen) for h in (4, 2, 2))
    kwargs = dict(causal=True, window_size=(4, -1), softmax_scale=0.3, softcap=2.0, return_attn_probs=True,
                  learnable_sink=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    out, lse, probs = func(q, k, v, **kwargs)
    expected_out, expected_lse, _ = flashattn_ext.flash_attn_func(q, k, v, **kwargs)
    assert probs is None
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
