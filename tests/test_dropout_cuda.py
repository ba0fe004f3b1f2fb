"""GPU tests of dropout in the CUDA kernels, forward and backward (skipped without a CUDA
device; on a Hopper GPU each test runs for both kernel families).

The mask is held to its definition (tests/dropout_reference.py, written from
csrc/common/philox.h's description and checked against Random123's known answers in
test_variants_cpu.py): Philox-4x32-7 of (offset + column group, row group, b * nheads + h)
keyed by the seed, one byte per element, kept iff the byte >= round(p * 256).

* The mask the forward applies is read from its output (v = identity, keys in chunks of
  head_dim), the backward's from dv (dout = identity, query rows in chunks): each equals the
  reference mask bit for bit, and the CPU backend's for the same rng_state [seed, offset]
  (an offset whose column groups carry into the counter's second word too).
* Every case of DROPOUT_CASES runs flash_attn_func with the seed torch's generator gives it
  (its first torch.randint(0, 2**62) on the GPU after torch.manual_seed) and its backward, and
  holds out, lse, dq, dk, dv (and dsink) to the error rule of tests/reference.py against the
  fp64 reference computed with the reference mask of that seed: dropout alone at head dims
  64, 128, 256 (the Hopper tiles), 96 and 80 (mma.sync only); causal and not; sliding
  windows; GQA and MQA; ragged lengths; past 1024 keys; with softcap, ALiBi, a learnable sink
  and all three; fp16 and bf16; p 0.1, 0.17 (not a multiple of 1/256) and 0.5.
* flash_attn_varlen_func: sequence b draws the mask of batch entry b at positions within
  the sequence (sequences without queries or keys among them).
* Reproducibility: the same torch.manual_seed gives the same bits, the next call another
  mask; deterministic=True gives bit-identical gradients; a captured CUDA graph of a
  training step draws a fresh seed on each replay, and each replay matches the reference
  with the mask of the seed it drew.
* The kept fraction over 4M elements is within 5 sigma of 1 - round(p * 256) / 256.
* return_attn_probs=True: flash-attn's S_dmask, the probabilities from the CUDA forward's
  lse, negative exactly where the reference mask drops.

Outputs and gradients come from an allocator pool poisoned with NaN (cuda_inputs.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import flashattn_ext.interface
from flashattn_ext import flash_attn_func, flash_attn_varlen_func
import dropout_reference
from cuda_inputs import LOW_PRECISION, poison_allocator
from dropout_reference import identity_values, revealed_columns
from reference import (SINK_GRADIENT, assert_error_rule, assert_s_dmask, attention_reference_with_grads,
                       visibility_mask)
from sample_inputs import AttentionCase, VarlenCase

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("kernel_family"),
]

NAMES = ("out", "lse", "dq", "dk", "dv")
forward_op = torch.ops.flashattn_ext.attention_forward
backward_op = torch.ops.flashattn_ext.attention_backward


def names_of(inputs):
    return NAMES + ((SINK_GRADIENT,) if inputs.learnable_sink is not None else ())


# (case, dropout_p). Each case runs in fp16 and bf16.
DROPOUT_CASES = [
    # Dropout alone, at each head dim.
    (AttentionCase("d64_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2, head_dim=64),
     0.17),
    # Causal with seqlen_q > seqlen_k: rows 0..42 see no key (out 0, lse +inf).
    (AttentionCase("d128_causal_q300_k257", batch=2, seqlen_q=300, seqlen_k=257, nheads=4, nheads_kv=4,
                   head_dim=128, causal=True), 0.1),
    (AttentionCase("d256_causal_gqa_q257_k300", batch=1, seqlen_q=257, seqlen_k=300, nheads=4, nheads_kv=2,
                   head_dim=256, causal=True), 0.5),
    (AttentionCase("d96_mqa_q1_k239", batch=2, seqlen_q=1, seqlen_k=239, nheads=8, nheads_kv=1, head_dim=96), 0.17),
    # One key: dq = dk = 0 exactly, which the backward reaches through D = rowsum(dout * out) of the
    # rounded out; p = 0.5 keeps out = 2 v exact (with p = 0.1, out = v / 0.9 rounds, and D's
    # rounding, about 2^-9 of the gradients' scale, is more than the rule's floor for a gradient
    # that the low-precision baseline gets exactly 0).
    (AttentionCase("d80_q239_k1", batch=2, seqlen_q=239, seqlen_k=1, nheads=4, nheads_kv=4, head_dim=80), 0.5),
    (AttentionCase("d128_q128_k128", batch=2, seqlen_q=128, seqlen_k=128, nheads=4, nheads_kv=4, head_dim=128),
     0.5),
    # Sliding windows.
    (AttentionCase("d128_window_gqa_q300_k257", batch=1, seqlen_q=300, seqlen_k=257, nheads=4, nheads_kv=2,
                   head_dim=128, window=(64, 16)), 0.17),
    (AttentionCase("d64_causal_window_mqa_q257_k300", batch=1, seqlen_q=257, seqlen_k=300, nheads=4, nheads_kv=1,
                   head_dim=64, causal=True, window=(100, -1)), 0.5),
    # Past 1024 keys: several key blocks, the diagonal's masked tiles and unmasked ones.
    (AttentionCase("d128_causal_gqa_q1100_k1300", batch=1, seqlen_q=1100, seqlen_k=1300, nheads=4, nheads_kv=2,
                   head_dim=128, causal=True), 0.1),
    # With each modifier (softcap 30 with scores about half the cap, where tanh bends them).
    (AttentionCase("softcap_d128_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                   head_dim=128, softcap=30.0, softmax_scale=1.3), 0.17),
    (AttentionCase("alibi_batch_heads_d64_causal_q257_k300", batch=2, seqlen_q=257, seqlen_k=300, nheads=4,
                   nheads_kv=4, head_dim=64, causal=True, alibi="batch_nheads"), 0.1),
    (AttentionCase("sink_d256_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                   head_dim=256, sink=True), 0.5),
    # Rows 0..89 see only the sink.
    (AttentionCase("sink_d80_causal_q203_k113", batch=2, seqlen_q=203, seqlen_k=113, nheads=4, nheads_kv=4,
                   head_dim=80, causal=True, sink=True), 0.17),
    # softcap + ALiBi + sink, every tensor in a different non-contiguous layout.
    (AttentionCase("all_d64_mqa_causal_window_mixed_strides_q300_k257", batch=1, seqlen_q=300, seqlen_k=257,
                   nheads=8, nheads_kv=1, head_dim=64, causal=True, window=(32, -1), softcap=2.0, alibi="nheads",
                   softmax_scale=0.15, sink=True, layout="mixed_strides"), 0.17),
    (AttentionCase("all_d128_causal_gqa_q1100_k1300", batch=1, seqlen_q=1100, seqlen_k=1300, nheads=8,
                   nheads_kv=2, head_dim=128, causal=True, softcap=2.0, alibi="nheads", sink=True), 0.1),
    (AttentionCase("all_d256_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                   head_dim=256, softcap=2.0, alibi="batch_nheads", softmax_scale=0.15, sink=True), 0.5),
    (AttentionCase("all_d96_causal_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                   head_dim=96, causal=True, softcap=2.0, alibi="batch_nheads", sink=True), 0.17),
]
assert len({case.name for case, _ in DROPOUT_CASES}) == len(DROPOUT_CASES), "case names must be unique"


def run_dropout(inputs, dropout_p, manual_seed, deterministic=False):
    """(seed, (out, lse, dq, dk, dv[, dsink])): flash_attn_func after torch.manual_seed(manual_seed)
    and its backward, each allocated from a pool poisoned with NaN; seed is the one it drew."""
    device = inputs.q.device
    seed = dropout_reference.seed_after_manual_seed(manual_seed, device)  # leaves the generator reseeded
    poison_allocator(device)
    out, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, dropout_p=dropout_p, deterministic=deterministic,
                                  return_attn_probs=True, **inputs.func_kwargs())
    poison_allocator(device)
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    torch.cuda.synchronize(device)
    return seed, (out, lse, *grads)


def check_against_reference(case: AttentionCase, inputs, dropout_p, seed, actual, dtype, context="", without=()):
    """actual held to the error rule against the fp64 reference with the reference mask of seed;
    actual lacks the outputs named in `without`."""
    mask = dropout_reference.dropout_keep_mask(seed, 0, dropout_p, case.batch, case.nheads, case.seqlen_q,
                                               case.seqlen_k, device=inputs.q.device)
    kwargs = dict(inputs.reference_kwargs(), dropout_mask=mask, dropout_p=dropout_p)
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    low_precision = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, compute_dtype=dtype,
                                                   **kwargs)
    kept = [i for i, name in enumerate(names_of(inputs)) if name not in without]
    assert_error_rule([names_of(inputs)[i] for i in kept], actual, [reference[i] for i in kept],
                      [low_precision[i] for i in kept], dtype, context=f"{case.name} p={dropout_p} {context}")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case,dropout_p", [pytest.param(case, p, id=f"{case.name}-p{p}")
                                            for case, p in DROPOUT_CASES])
def test_dropout_matches_reference(case, dropout_p, dtype):
    inputs = case.make(dtype, device="cuda", requires_grad=True)
    seed, actual = run_dropout(inputs, dropout_p, manual_seed=17)
    names = names_of(inputs)
    dtypes = (dtype, torch.float32, dtype, dtype, dtype, torch.float32)
    assert [t.dtype for t in actual] == list(dtypes[:len(names)]), case.name
    check_against_reference(case, inputs, dropout_p, seed, actual, dtype)


# ---- The mask itself, bit for bit -------------------------------------------------------------

# (batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, causal, window): keys in chunks of
# head_dim where seqlen_k > head_dim.
MASK_SHAPES = {
    "q113_k100_gqa": (2, 4, 2, 113, 100, 128, False, (-1, -1)),
    "q300_k128_causal": (1, 4, 4, 300, 128, 128, True, (-1, -1)),
    "q257_k300_mqa_window": (2, 2, 1, 257, 300, 128, False, (90, 40)),
    "q130_k1100_d256": (1, 2, 1, 130, 1100, 256, False, (-1, -1)),
    "q1_k239_d64": (3, 2, 2, 1, 239, 64, False, (-1, -1)),
}
# [seed, offset]: an offset whose column groups carry into the counter's second word, a seed
# with its high word set.
RNG_STATES = {"seed_offset0": (123456789, 0), "high_seed_offset_carry": (2**62 - 7, 2**32 - 5)}


# One kv head per query head: dv holds one head's mask.
BACKWARD_MASK_SHAPES = {
    "q300_k128_causal": MASK_SHAPES["q300_k128_causal"],
    "q130_k1100_d256": (1, 2, 2, 130, 1100, 256, False, (-1, -1)),
    "q200_k333_d64_window": (2, 3, 3, 200, 333, 64, False, (70, 30)),
}


def mask_inputs(shape):
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, causal, window = shape
    case = AttentionCase("mask", batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads,
                         nheads_kv=nheads_kv, head_dim=head_dim, causal=causal, window=window)
    return case, case.make(torch.float32)


def forward_runner(inputs, dropout_p, rng, device, dtype):
    """v -> the forward op's out on device in dtype, with the explicit rng_state rng."""
    q, k = (t.to(device=device, dtype=dtype) for t in (inputs.q, inputs.k))
    rng_state = torch.tensor(rng, dtype=torch.int64, device=device)

    def run(v):
        return forward_op(q, k, v.to(device=device, dtype=dtype), inputs.resolved_scale(), inputs.causal,
                          inputs.window[0], inputs.window[1], 0.0, None, dropout_p, rng_state)[0]
    return run


def expected_mask(case, rng, dropout_p):
    visible = visibility_mask(case.seqlen_q, case.seqlen_k, case.causal, case.window)
    return dropout_reference.dropout_keep_mask(*rng, dropout_p, case.batch, case.nheads, case.seqlen_q,
                                               case.seqlen_k) & visible


def assert_same_mask(actual, expected, what):
    mismatches = (actual != expected).sum().item()
    assert mismatches == 0, f"{what}: {mismatches} of {expected.numel()} elements differ from the reference mask"


@pytest.mark.parametrize("rng", list(RNG_STATES.values()), ids=list(RNG_STATES))
@pytest.mark.parametrize("shape", list(MASK_SHAPES.values()), ids=list(MASK_SHAPES))
def test_forward_mask_is_the_reference_and_the_cpu_mask(shape, rng):
    """The forward's mask (out with v = identity) on CUDA and on the CPU for the same
    rng_state: both the reference mask, on every visible element."""
    dropout_p = 0.17
    case, inputs = mask_inputs(shape)
    expected = expected_mask(case, rng, dropout_p)
    masks = {}
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        run = forward_runner(inputs, dropout_p, rng, device, dtype)
        masks[device] = revealed_columns(run, inputs.v.to(device), case.seqlen_k).permute(0, 2, 1, 3).cpu()
    assert_same_mask(masks["cuda"], expected, "CUDA forward")
    assert_same_mask(masks["cpu"], expected, "CPU forward")


@pytest.mark.parametrize("rng", list(RNG_STATES.values()), ids=list(RNG_STATES))
@pytest.mark.parametrize("shape", list(BACKWARD_MASK_SHAPES.values()), ids=list(BACKWARD_MASK_SHAPES))
def test_backward_mask_is_the_reference_and_the_cpu_mask(shape, rng):
    """The backward's regenerated mask, read from dv = (P * mask / (1 - p))^T dout with
    dout = identity over query rows (in chunks of head_dim rows; one kv head per query
    head, so dv holds one head's mask): the reference mask, on CUDA and on the CPU."""
    dropout_p = 0.5
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, causal, window = shape
    assert nheads == nheads_kv
    case, inputs = mask_inputs(shape)
    expected = expected_mask(case, rng, dropout_p)
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        q, k, v, dout = (t.to(device=device, dtype=dtype) for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
        rng_state = torch.tensor(rng, dtype=torch.int64, device=device)
        args = (inputs.resolved_scale(), causal, window[0], window[1], 0.0, None, dropout_p, rng_state)
        out, lse = forward_op(q, k, v, *args)
        chunks = []
        for first in range(0, seqlen_q, head_dim):
            dv = backward_op(identity_values(dout, None, first), q, k, v, out, lse, *args, False)[2]
            # dv[b, j, h, c] = P[b, h, first + c, j] * mask / (1 - p)
            chunks.append((dv[..., :min(head_dim, seqlen_q - first)] != 0).permute(0, 2, 3, 1))
        assert_same_mask(torch.cat(chunks, dim=2).cpu(), expected, f"{device} backward")


@pytest.mark.parametrize("dropout_p", (0.1, 0.17))
def test_kept_fraction_is_one_minus_p(dropout_p):
    """4M elements (no attention mask): the kept fraction within 5 sigma of the keep rate of p's
    byte threshold (within 1/512 of 1 - p)."""
    case = AttentionCase("fraction", batch=2, seqlen_q=1024, seqlen_k=256, nheads=8, nheads_kv=8, head_dim=256)
    inputs = case.make(torch.bfloat16, device="cuda")
    torch.manual_seed(3)
    with torch.no_grad():
        out = flash_attn_func(inputs.q, inputs.k, identity_values(inputs.v), dropout_p=dropout_p)
    trials = out.numel()
    kept = (out != 0).sum().item()
    keep = dropout_reference.keep_probability(dropout_p)
    sigma = math.sqrt(keep * (1 - keep) / trials)
    assert abs(kept / trials - keep) <= 5 * sigma, (kept / trials, keep, sigma)


# ---- Variable-length batches ------------------------------------------------------------------

VARLEN_DROPOUT_CASES = [
    (VarlenCase("varlen_gqa_causal_sink", seqlens_q=(113, 0, 1, 257, 40, 16), seqlens_k=(203, 7, 239, 300, 0, 16),
                nheads=4, nheads_kv=2, head_dim=128, causal=True, sink=True), 0.17),
    (VarlenCase("varlen_window_softcap_alibi_d64", seqlens_q=(300, 1, 64, 239, 0), seqlens_k=(257, 239, 64, 1, 30),
                nheads=4, nheads_kv=4, head_dim=64, window=(48, 16), softcap=2.0, alibi="batch_nheads"), 0.5),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case,dropout_p", [pytest.param(case, p, id=f"{case.name}-p{p}")
                                            for case, p in VARLEN_DROPOUT_CASES])
def test_varlen_dropout_draws_each_sequence_by_its_position(case, dropout_p, dtype):
    """flash_attn_varlen_func: sequence b's mask is the reference mask of batch entry b, rows
    and columns within the sequence (read from out with v = identity); out, lse, dq, dk, dv
    per sequence, and dsink summed over them, against the fp64 reference with that mask."""
    inputs = case.make(dtype, device="cuda", requires_grad=True)
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args
    manual_seed = 8
    seed = dropout_reference.seed_after_manual_seed(manual_seed, "cuda")
    masks = dropout_reference.varlen_dropout_keep_masks(seed, 0, dropout_p, case.nheads, case.seqlens_q,
                                                        case.seqlens_k, device="cuda")

    def run(q, k, v):
        torch.manual_seed(manual_seed)
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                      return_attn_probs=True, **inputs.func_kwargs())

    # Revealed in bf16 whatever the dtype: fp16 would flush the far keys' ALiBi-scaled weights to 0.
    q16, k16, v16 = (t.detach().bfloat16() for t in (inputs.q, inputs.k, inputs.v))
    key_positions = torch.arange(inputs.v.size(0), device="cuda") - cu_k[:-1].repeat_interleave(cu_k.diff())
    revealed = revealed_columns(lambda v: run(q16, k16, v)[0], v16, max(case.seqlens_k), key_positions)

    poison_allocator()
    out, lse, _ = run(inputs.q, inputs.k, inputs.v)
    poison_allocator()
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    torch.cuda.synchronize()

    sink_sums = None
    for b, (seqlen_q, seqlen_k) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
        rows_q = slice(cu_q[b].item(), cu_q[b + 1].item())
        rows_k = slice(cu_k[b].item(), cu_k[b + 1].item())
        visible = visibility_mask(seqlen_q, seqlen_k, case.causal, case.window, device="cuda")
        assert_same_mask(revealed[rows_q, :, :seqlen_k].permute(1, 0, 2)[None], masks[b] & visible,
                         f"sequence {b}")

        kwargs = dict(inputs.reference_kwargs(), dropout_mask=masks[b], dropout_p=dropout_p)
        if inputs.alibi_slopes is not None and inputs.alibi_slopes.dim() == 2:
            kwargs["alibi_slopes"] = inputs.alibi_slopes[b:b + 1]
        sequence = [t[rows][None].detach() for t, rows in ((inputs.q, rows_q), (inputs.k, rows_k),
                                                           (inputs.v, rows_k), (inputs.dout, rows_q))]
        reference = attention_reference_with_grads(*sequence, **kwargs)
        low_precision = attention_reference_with_grads(*sequence, compute_dtype=dtype, **kwargs)
        actual = (out[rows_q][None], lse[:, rows_q][None], grads[0][rows_q][None], grads[1][rows_k][None],
                  grads[2][rows_k][None])
        assert_error_rule(NAMES, actual, reference[:5], low_precision[:5], dtype,
                          context=f"{case.name} sequence {b}")
        if inputs.learnable_sink is not None:
            sums = (reference[5], low_precision[5].double())
            sink_sums = sums if sink_sums is None else tuple(s + t for s, t in zip(sink_sums, sums))
    if inputs.learnable_sink is not None:
        assert_error_rule((SINK_GRADIENT,), grads[3:], sink_sums[:1], sink_sums[1:], dtype, context=case.name)


# ---- Reproducibility --------------------------------------------------------------------------

REPRO_CASE = AttentionCase("repro_all_gqa_causal_q500_k700", batch=2, seqlen_q=500, seqlen_k=700, nheads=4,
                           nheads_kv=2, head_dim=128, causal=True, softcap=30.0, softmax_scale=1.3, alibi="nheads",
                           sink=True)


def test_same_manual_seed_same_bits_and_a_fresh_mask_per_call():
    dropout_p = 0.17
    inputs = REPRO_CASE.make(torch.bfloat16, device="cuda", requires_grad=True)
    seed, first = run_dropout(inputs, dropout_p, manual_seed=11)
    check_against_reference(REPRO_CASE, inputs, dropout_p, seed, first, torch.bfloat16)
    seed_again, again = run_dropout(inputs, dropout_p, manual_seed=11)
    assert seed_again == seed
    # Without deterministic=True, dq (and dsink) may add their blocks' shares in any order.
    for name, a, b in zip(names_of(inputs), first, again):
        if name in ("out", "lse", "dk", "dv"):
            assert torch.equal(a, b), f"{name}: the same seed must give the same bits"
        else:  # dq in bf16: its default tolerance; dsink in fp32: a few ulps of a long sum
            tolerance = dict(rtol=1e-4, atol=1e-5) if name == SINK_GRADIENT else {}
            torch.testing.assert_close(a, b, msg=name, **tolerance)
    # Without reseeding, the next call draws a new seed: another mask, the same lse.
    out, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, dropout_p=dropout_p, return_attn_probs=True,
                                  **inputs.func_kwargs())
    assert not torch.equal(out, first[0])
    assert torch.equal(lse, first[1])
    # lse is that of the undropped probabilities.
    _, lse_without, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True,
                                        **inputs.func_kwargs())
    torch.testing.assert_close(lse, lse_without)


def test_deterministic_backward_with_dropout_is_bit_identical():
    dropout_p = 0.1
    inputs = REPRO_CASE.make(torch.bfloat16, device="cuda", requires_grad=True)
    seed, first = run_dropout(inputs, dropout_p, manual_seed=12, deterministic=True)
    check_against_reference(REPRO_CASE, inputs, dropout_p, seed, first, torch.bfloat16, "deterministic")
    for _ in range(2):
        _, again = run_dropout(inputs, dropout_p, manual_seed=12, deterministic=True)
        for name, a, b in zip(names_of(inputs), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


def test_cuda_graph_replays_draw_fresh_masks(monkeypatch):
    """A training step (forward and backward with dropout) captured in a CUDA graph: each
    replay draws a new seed inside the graph, so two replays give different outputs, and each
    matches the reference with the mask of the seed it drew (read back from the rng_state
    tensor flash_attn_func drew, which lives in the graph's memory)."""
    dropout_p = 0.17
    case = AttentionCase("graph_gqa_causal_sink_q257_k300", batch=2, seqlen_q=257, seqlen_k=300, nheads=4,
                         nheads_kv=2, head_dim=128, causal=True, sink=True)
    inputs = case.make(torch.bfloat16, device="cuda", requires_grad=True)
    drawn = []
    draw = flashattn_ext.interface._draw_rng_state

    def recording_draw(device):
        drawn.append(draw(device))
        return drawn[-1]

    monkeypatch.setattr(flashattn_ext.interface, "_draw_rng_state", recording_draw)

    # Without return_attn_probs: its S_dmask is formed on the CPU, which a capture refuses.
    def step():
        out = flash_attn_func(inputs.q, inputs.k, inputs.v, dropout_p=dropout_p, **inputs.func_kwargs())
        return (out, *torch.autograd.grad(out, inputs.differentiable(), inputs.dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    drawn.clear()
    with torch.cuda.graph(graph):
        static = step()
    assert len(drawn) == 1
    rng_state = drawn[0]

    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        seed, offset = rng_state.tolist()
        assert offset == 0
        replays.append((seed, tuple(t.clone() for t in static)))
    (seed_a, a), (seed_b, b) = replays
    assert seed_a != seed_b, "each replay must draw a new seed"
    assert not torch.equal(a[0], b[0]), "each replay must apply a new mask"
    for seed, actual in replays:
        assert not any(torch.isnan(t).any() for t in actual)
        check_against_reference(case, inputs, dropout_p, seed, actual, torch.bfloat16, f"replay seed {seed}",
                                without=("lse",))


# ---- The ops' registration -------------------------------------------------------------------

def dropout_op_args(inputs, dropout_p, rng_state):
    args = list(inputs.forward_op_args())
    args[9:11] = [dropout_p, rng_state]
    return args


def test_opcheck_dropout_forward_and_backward():
    case = AttentionCase("opcheck_dropout_gqa_causal_sink", batch=2, seqlen_q=70, seqlen_k=90, nheads=4,
                         nheads_kv=2, head_dim=64, causal=True, softcap=2.0, sink=True)
    inputs = case.make(torch.bfloat16, device="cuda", requires_grad=True)
    rng_state = torch.tensor([1234, 0], dtype=torch.int64, device="cuda")
    torch.library.opcheck(forward_op.default, tuple(dropout_op_args(inputs, 0.2, rng_state)))
    inputs = case.make(torch.bfloat16, device="cuda", requires_grad=False)
    out, lse = forward_op(*dropout_op_args(inputs, 0.2, rng_state))
    backward_args = list(inputs.backward_op_args(out, lse))
    backward_args[12:14] = [0.2, rng_state]
    torch.library.opcheck(backward_op.default, tuple(backward_args))


def test_rng_state_must_be_contiguous_on_q_device():
    """The kernels read rng_state where they run: a CPU or strided one is refused by name."""
    inputs = AttentionCase("rng_state_checks", batch=1, seqlen_q=16, seqlen_k=16, nheads=2, head_dim=64).make(
        torch.bfloat16, device="cuda")
    for rng_state in (torch.tensor([1234, 0], dtype=torch.int64),
                      torch.tensor([1234, 7, 0, 7], dtype=torch.int64, device="cuda")[::2]):
        with pytest.raises(RuntimeError, match=r"rng_state must be contiguous and on q's device"):
            forward_op(*dropout_op_args(inputs, 0.2, rng_state))


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_return_attn_probs_is_flash_attn_s_dmask(dropout_p):
    """flash-attn's S_dmask of a CUDA call: |S_dmask| the probabilities from the CUDA forward's
    lse, negative exactly where the kernels' mask drops (computed by the CPU backend)."""
    case = AttentionCase("s_dmask", batch=2, seqlen_q=140, seqlen_k=203, nheads=4, nheads_kv=2, head_dim=64,
                         causal=True, softcap=30.0, alibi="nheads", softmax_scale=1.0, sink=True)
    inputs = case.make(torch.bfloat16, device="cuda")
    s_dmask, keep = dropout_reference.s_dmask_and_keep_mask(flash_attn_func, case, inputs, 9, dropout_p, "cuda")
    if dropout_p == 0:
        assert s_dmask is None, "flash-attn 2 forms S_dmask only with dropout"
        return
    assert_s_dmask(s_dmask, inputs.q, inputs.k, keep, rtol=2e-2, atol=1e-4, **inputs.reference_kwargs())
