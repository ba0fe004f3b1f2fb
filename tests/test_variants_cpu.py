"""Dropout and learnable sinks on the CPU backend (issue 14), beyond the shared cases
of sample_inputs.py (whose sink cases test_attention_cpu, test_varlen, opcheck and
compile run against the fp64 reference).

Dropout is checked through the mask the output reveals: with v[j] = e_j (head_dim >=
seqlen_k), out[i, j] = P[i, j] * mask[i, j] / (1 - p), so out != 0 is the mask. The
same seed with random v must then match the fp64 reference run with that mask, forward
and backward, which holds only if the backward regenerates the forward's mask. The revealed
mask is also held bit for bit to the definition's (tests/dropout_reference.py: Philox-4x32-7,
one byte per element, checked against Random123's known answers), which the CUDA kernels share
(tests/test_dropout_cuda.py)."""

import dataclasses
import math
import shutil
import subprocess

import pytest
import torch

from flashattn_ext import flash_attn_func, flash_attn_varlen_func

import dropout_reference
from dropout_reference import identity_values, revealed_columns
from conftest import REPO_ROOT
from reference import (BASELINE_DTYPES, SINK_GRADIENT, assert_error_rule, assert_s_dmask,
                       attention_reference_with_grads, visibility_mask)
from sample_inputs import CASES_BY_NAME, AttentionCase, VarlenCase

forward_op = torch.ops.flashattn_ext.attention_forward
NAMES = ("out", "lse", "dq", "dk", "dv")


def names_of(inputs):
    return NAMES + ((SINK_GRADIENT,) if inputs.learnable_sink is not None else ())


def attention_with_seed(seed, q, k, v, **kwargs):
    """flash_attn_func with torch's generator seeded: the same seed, the same mask."""
    torch.manual_seed(seed)
    return flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)


def revealed_mask(seed, inputs, dropout_p):
    """(batch, nheads, seqlen_q, seqlen_k) bool: the mask of the call seeded with `seed`."""
    with torch.no_grad():
        out, _, _ = attention_with_seed(seed, inputs.q, inputs.k, identity_values(inputs.v),
                                        dropout_p=dropout_p, **inputs.func_kwargs())
    return (out[..., :inputs.k.size(1)] != 0).permute(0, 2, 1, 3)


DROPOUT_CASES = [
    AttentionCase("dropout", batch=2, seqlen_q=33, seqlen_k=40, nheads=2, head_dim=40),
    # Two key blocks and two query blocks of the CPU kernel; GQA.
    AttentionCase("dropout_causal_gqa_blocks", batch=1, seqlen_q=140, seqlen_k=136, nheads=4, nheads_kv=2,
                  head_dim=136, causal=True),
    AttentionCase("dropout_window", batch=1, seqlen_q=50, seqlen_k=64, head_dim=64, window=(10, 3)),
    # Every modifier at once: softcap, ALiBi, sink, causal, window, GQA.
    AttentionCase("dropout_all_features", batch=2, seqlen_q=60, seqlen_k=48, nheads=4, nheads_kv=2,
                  head_dim=48, causal=True, window=(20, -1), softcap=2.0, alibi="batch_nheads",
                  softmax_scale=0.3, sink=True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=str)
def test_dropout_matches_reference_with_the_revealed_mask(case, dtype):
    dropout_p, seed = 0.25, 7
    inputs = case.make(dtype, requires_grad=True)
    mask = revealed_mask(seed, inputs, dropout_p)
    out, lse, _ = attention_with_seed(seed, inputs.q, inputs.k, inputs.v, dropout_p=dropout_p,
                                      **inputs.func_kwargs())
    actual = (out, lse, *torch.autograd.grad(out, inputs.differentiable(), inputs.dout))

    kwargs = dict(inputs.reference_kwargs(), dropout_mask=mask, dropout_p=dropout_p)
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    low_precision = None
    if dtype in BASELINE_DTYPES:
        low_precision = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                                                       compute_dtype=dtype, **kwargs)
    assert_error_rule(names_of(inputs), actual, reference, low_precision, dtype, context=case.name)


@pytest.mark.parametrize("dropout_p", [0.1, 0.17, 0.5, 0.9])
def test_dropout_keeps_one_minus_p(dropout_p):
    """The kept fraction of the visible probabilities is within 5 sigma of the keep rate of
    p's byte threshold, itself within 1/512 of 1 - p."""
    case = AttentionCase("fraction", batch=1, seqlen_q=256, seqlen_k=200, nheads=4, head_dim=200, causal=True)
    inputs = case.make(torch.float32)
    mask = revealed_mask(3, inputs, dropout_p)
    visible = visibility_mask(case.seqlen_q, case.seqlen_k, True, (-1, -1))
    trials = visible.sum().item() * case.batch * case.nheads
    kept = (mask & visible).sum().item()
    assert not (mask & ~visible).any()
    keep = dropout_reference.keep_probability(dropout_p)
    assert abs(keep - (1 - dropout_p)) <= 1 / 512
    sigma = math.sqrt(keep * (1 - keep) / trials)
    assert abs(kept / trials - keep) <= 5 * sigma, (kept / trials, keep, sigma)


def gradients_with_seed(seed, inputs, **kwargs):
    out, lse, _ = attention_with_seed(seed, inputs.q, inputs.k, inputs.v, **inputs.func_kwargs(), **kwargs)
    return (out, lse, *torch.autograd.grad(out, inputs.differentiable(), inputs.dout))


def test_dropout_is_reproducible_and_fresh_per_call():
    inputs = DROPOUT_CASES[-1].make(torch.float32, requires_grad=True)
    first = gradients_with_seed(11, inputs, dropout_p=0.3)
    again = gradients_with_seed(11, inputs, dropout_p=0.3)
    for name, a, b in zip(names_of(inputs), first, again):
        assert torch.equal(a, b), f"{name}: the same seed must give the same bits"
    # Without reseeding, the next call draws a new seed: another mask.
    next_out = flash_attn_func(inputs.q, inputs.k, inputs.v, dropout_p=0.3, **inputs.func_kwargs())
    assert not torch.equal(next_out, again[0])
    # lse is that of the undropped probabilities: the same as without dropout.
    _, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True, **inputs.func_kwargs())
    assert torch.equal(lse, first[1])


def test_dropout_mask_does_not_depend_on_the_thread_count():
    inputs = DROPOUT_CASES[1].make(torch.float32, requires_grad=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = revealed_mask(5, inputs, 0.4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(revealed_mask(5, inputs, 0.4), one_thread)


def test_dropout_varlen_draws_each_sequence_by_its_position():
    """flash_attn_varlen_func: the mask revealed per sequence, and each sequence against the
    reference with its own part of it (rows and columns within the sequence)."""
    case = VarlenCase("dropout_varlen", seqlens_q=(20, 0, 35), seqlens_k=(25, 3, 40), nheads=2, head_dim=40,
                      causal=True, sink=True)
    dropout_p, seed = 0.3, 2
    inputs = case.make(torch.float64, requires_grad=True)
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args

    def run(v):
        torch.manual_seed(seed)
        return flash_attn_varlen_func(inputs.q, inputs.k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                      return_attn_probs=True, **inputs.func_kwargs())

    key_starts = cu_k[:-1].repeat_interleave(cu_k.diff())
    out_identity = run(identity_values(inputs.v.detach(), torch.arange(inputs.v.size(0)) - key_starts))[0]
    out, lse, _ = run(inputs.v)
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    dsink_sum = torch.zeros_like(inputs.learnable_sink, dtype=torch.float64)
    for b in range(case.batch):
        rows_q = slice(cu_q[b].item(), cu_q[b + 1].item())
        rows_k = slice(cu_k[b].item(), cu_k[b + 1].item())
        seqlen_k = rows_k.stop - rows_k.start
        mask = (out_identity[rows_q, :, :seqlen_k] != 0).permute(1, 0, 2)[None]
        sequence = [t[rows][None].detach() for t, rows in ((inputs.q, rows_q), (inputs.k, rows_k),
                                                           (inputs.v, rows_k), (inputs.dout, rows_q))]
        reference = attention_reference_with_grads(*sequence, **inputs.reference_kwargs(), dropout_mask=mask,
                                                   dropout_p=dropout_p)
        actual = (out[rows_q][None], lse[:, rows_q][None], grads[0][rows_q][None], grads[1][rows_k][None],
                  grads[2][rows_k][None])
        assert_error_rule(NAMES, actual, reference[:5], None, torch.float64, context=f"sequence {b}")
        dsink_sum += reference[5]
    assert_error_rule((SINK_GRADIENT,), grads[3:], (dsink_sum,), None, torch.float64)


# ---- The mask against its definition (tests/dropout_reference.py) --------------------------

def test_reference_philox_known_answers():
    """Both Philox-4x32-7s of dropout_reference.py against Random123's kat_vectors."""
    for counter, key, expected in dropout_reference.KNOWN_ANSWERS:
        assert dropout_reference.philox4x32_7_scalar(counter, key) == expected
        words = dropout_reference.philox4x32_7([torch.tensor(c) for c in counter], key)
        assert tuple(int(w) for w in words) == expected


def test_reference_thresholds():
    assert [dropout_reference.threshold_of(p) for p in (0.0, 0.1, 0.17, 0.5, 0.9, 1 - 2**-20)] == [
        0, 26, 44, 128, 230, 255]


def test_reference_mask_is_the_definition_element_by_element():
    """The vectorised mask (its draw grid, word and half selection) against the definition
    applied to each element alone; a seed with its high word set and an offset whose column
    groups carry into the counter's second word; sizes not multiples of 16."""
    seed, offset, dropout_p = 2**62 - 12345, 2**32 - 3, 0.3
    batch_heads = [[0, 5], [9, 2**20 + 1]]
    mask = dropout_reference.keep_mask(seed, offset, dropout_p, batch_heads, 37, 41)
    assert mask.shape == (2, 2, 37, 41)
    for a, row in enumerate(batch_heads):
        for c, batch_head in enumerate(row):
            expected = torch.tensor([[dropout_reference.element_keeps(seed, offset, dropout_p, batch_head, i, j)
                                      for j in range(41)] for i in range(37)])
            assert torch.equal(mask[a, c], expected), batch_head


MASK_CASES = [
    AttentionCase("mask_dense", batch=2, seqlen_q=37, seqlen_k=40, nheads=3, nheads_kv=3, head_dim=40),
    # Two query and key blocks of the CPU kernel; seqlen_k > head_dim: revealed in chunks.
    AttentionCase("mask_gqa_causal_blocks", batch=1, seqlen_q=140, seqlen_k=136, nheads=4, nheads_kv=2,
                  head_dim=64, causal=True),
    AttentionCase("mask_mqa_window_q70_k300", batch=2, seqlen_q=70, seqlen_k=300, nheads=3, nheads_kv=1,
                  head_dim=64, window=(100, 20)),
    AttentionCase("mask_q1_k239", batch=2, seqlen_q=1, seqlen_k=239, nheads=2, head_dim=128),
    AttentionCase("mask_all_features", batch=2, seqlen_q=60, seqlen_k=50, nheads=4, nheads_kv=2, head_dim=48,
                  causal=True, window=(20, -1), softcap=2.0, alibi="batch_nheads", softmax_scale=0.3, sink=True),
]


@pytest.mark.parametrize("dropout_p", [0.1, 0.17, 0.5])
@pytest.mark.parametrize("case", MASK_CASES, ids=str)
def test_dropout_mask_is_the_reference_mask(case, dropout_p):
    """The mask flash_attn_func applies is the definition's bit for bit, for the seed it
    draws (every visible element; the others are dropped by the attention mask anyway)."""
    inputs = case.make(torch.float32)
    seed = dropout_reference.seed_after_manual_seed(21, "cpu")

    def run(v):
        torch.manual_seed(21)
        return flash_attn_func(inputs.q, inputs.k, v, dropout_p=dropout_p, **inputs.func_kwargs())

    revealed = revealed_columns(run, inputs.v, case.seqlen_k).permute(0, 2, 1, 3)
    expected = dropout_reference.dropout_keep_mask(seed, 0, dropout_p, case.batch, case.nheads, case.seqlen_q,
                                                   case.seqlen_k)
    visible = visibility_mask(case.seqlen_q, case.seqlen_k, case.causal, case.window)
    assert visible.any()
    mismatches = (revealed != (expected & visible)).sum().item()
    assert mismatches == 0, f"{mismatches} of {revealed.numel()} elements differ from the reference mask"


@pytest.mark.parametrize("dropout_p", [0.1, 0.17])
def test_dropout_varlen_mask_is_the_reference_mask(dropout_p):
    """flash_attn_varlen_func: sequence b's mask is the definition's with batch index b and
    positions within the sequence (sequences with no query, no key, lengths not multiples
    of 16, seqlen_k > head_dim)."""
    case = VarlenCase("mask_varlen", seqlens_q=(20, 0, 35, 1, 70, 17, 9), seqlens_k=(25, 3, 40, 130, 0, 17, 64),
                      nheads=4, nheads_kv=2, head_dim=48)
    inputs = case.make(torch.float32)
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args
    seed = dropout_reference.seed_after_manual_seed(4, "cpu")

    def run(v):
        torch.manual_seed(4)
        return flash_attn_varlen_func(inputs.q, inputs.k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                      **inputs.func_kwargs())

    key_positions = torch.arange(inputs.v.size(0)) - cu_k[:-1].repeat_interleave(cu_k.diff())
    revealed = revealed_columns(run, inputs.v, max(case.seqlens_k), key_positions)
    expected = dropout_reference.varlen_dropout_keep_masks(seed, 0, dropout_p, case.nheads, case.seqlens_q,
                                                           case.seqlens_k)
    for b, (seqlen_q, seqlen_k) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
        rows = slice(cu_q[b].item(), cu_q[b + 1].item())
        sequence = revealed[rows, :, :seqlen_k].permute(1, 0, 2)[None]
        assert torch.equal(sequence, expected[b]), f"sequence {b}"
        # Past the sequence's own keys nothing is revealed (v = 0 there, or another sequence's keys).
        assert not revealed[rows, :, seqlen_k:].any()


@pytest.mark.parametrize("rng", [(123456789, 0), (2**62 - 7, 2**32 - 5)], ids=("offset0", "high_seed_offset_carry"))
def test_op_forward_and_backward_masks_are_the_reference_mask(rng):
    """The op with an explicit rng_state [seed, offset] (an offset whose column groups carry
    into the counter's second word): the forward's mask (out, v = identity) and the backward's
    (dv = (P * mask / (1 - p))^T dout with dout = identity over query rows) are the reference's."""
    dropout_p = 0.17
    case = AttentionCase("op_masks", batch=2, seqlen_q=50, seqlen_k=90, nheads=3, nheads_kv=3, head_dim=32,
                         causal=True)
    inputs = case.make(torch.float32)
    rng_state = torch.tensor(rng, dtype=torch.int64)
    args = (inputs.resolved_scale(), True, -1, -1, 0.0, None, dropout_p, rng_state)
    visible = visibility_mask(case.seqlen_q, case.seqlen_k, True, (-1, -1))
    expected = dropout_reference.dropout_keep_mask(*rng, dropout_p, case.batch, case.nheads, case.seqlen_q,
                                                   case.seqlen_k) & visible
    forward = revealed_columns(lambda v: forward_op(inputs.q, inputs.k, v, *args)[0], inputs.v, case.seqlen_k)
    assert torch.equal(forward.permute(0, 2, 1, 3), expected)
    out, lse = forward_op(inputs.q, inputs.k, inputs.v, *args)
    chunks = []
    for first in range(0, case.seqlen_q, case.head_dim):
        dv = torch.ops.flashattn_ext.attention_backward(identity_values(inputs.dout, None, first), inputs.q,
                                                        inputs.k, inputs.v, out, lse, *args, False)[2]
        chunks.append((dv[..., :min(case.head_dim, case.seqlen_q - first)] != 0).permute(0, 2, 3, 1))
    assert torch.equal(torch.cat(chunks, dim=2), expected)


def test_sink_rows_without_keys_get_zero_out_and_lse_sink():
    inputs = CASES_BY_NAME["sink_causal_q_gt_k"].make(torch.float32, requires_grad=True)
    out, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True, **inputs.func_kwargs())
    dq, dsink = torch.autograd.grad(out, (inputs.q, inputs.learnable_sink), inputs.dout)
    blind = inputs.q.size(1) - inputs.k.size(1)
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    torch.testing.assert_close(lse[:, :, :blind], inputs.learnable_sink.detach()[None, :, None].expand(1, -1, blind))
    assert torch.equal(dq[:, :blind], torch.zeros_like(dq[:, :blind]))
    assert torch.isfinite(dsink).all()


def test_sink_without_any_key():
    """No key at all: every row is the sink alone (lse = sink, out 0, zero gradients)."""
    case = dataclasses.replace(CASES_BY_NAME["sink"], seqlen_k=0)
    inputs = case.make(torch.float32, requires_grad=True)
    out, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True, **inputs.func_kwargs())
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, inputs.learnable_sink.detach()[None, :, None].expand_as(lse))
    for grad in torch.autograd.grad(out, inputs.differentiable(), inputs.dout):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_sink_gradcheck():
    case = AttentionCase("gc_sink", batch=1, seqlen_q=5, seqlen_k=4, nheads=2, head_dim=8, causal=True,
                         window=(2, -1), softcap=1.5, alibi="nheads")
    inputs = case.make(torch.float64, requires_grad=True)
    kwargs = inputs.func_kwargs()
    del kwargs["learnable_sink"]

    def attention(q, k, v, sink):
        # The sink is fp32 (the op's requirement): gradcheck perturbs an fp64 copy by
        # steps large against its rounding.
        return flash_attn_func(q, k, v, learnable_sink=sink.float(), **kwargs)

    sink = torch.tensor([0.3, -0.5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attention, (inputs.q, inputs.k, inputs.v, sink), eps=1e-3, atol=1e-4,
                                    rtol=1e-3)


def test_vmap_with_an_unbatched_sink_gives_per_entry_sink_gradients():
    """The ops' vmap rules fold the vmapped dimension into the batch; dsink, per batch
    entry, unfolds into one gradient per vmapped entry."""
    inputs = CASES_BY_NAME["sink"].make(torch.float32)
    args = inputs.forward_op_args()
    queries, douts = torch.stack([inputs.q, 2 * inputs.q]), torch.stack([inputs.dout, -inputs.dout])

    def forward_backward(q, dout):
        out, lse = forward_op(q, *args[1:])
        return torch.ops.flashattn_ext.attention_backward(dout, q, *args[1:3], out, lse, *args[3:])

    per_entry = torch.vmap(forward_backward)(queries, douts)
    expected = [torch.stack(grads) for grads in zip(*map(forward_backward, queries, douts))]
    for name, a, e in zip(("dq", "dk", "dv", SINK_GRADIENT), per_entry, expected):
        torch.testing.assert_close(a, e, msg=name)


def test_vmap_refuses_a_batched_sink():
    inputs = CASES_BY_NAME["sink"].make(torch.float32)
    sinks = torch.zeros(3, inputs.q.size(2))
    with pytest.raises(RuntimeError, match=r"learnable_sink cannot be vmapped over"):
        torch.vmap(lambda s: flash_attn_func(inputs.q, inputs.k, inputs.v, learnable_sink=s))(sinks)


def test_opcheck_dropout():
    inputs = DROPOUT_CASES[-1].make(torch.float32, requires_grad=True)
    args = list(inputs.forward_op_args())
    args[9:11] = [0.2, torch.tensor([1234, 0], dtype=torch.int64)]  # dropout_p, rng_state
    torch.library.opcheck(forward_op.default, tuple(args))


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_philox_known_answers(tmp_path):
    """csrc/common/philox.h against Random123's known-answer vectors of philox4x32_7."""
    source = tmp_path / "philox_kat.cpp"
    source.write_text("""
        #include <cstdio>
        #include "common/philox.h"
        int main() {
          using flashattn::PhiloxWords;
          const PhiloxWords counters[3] = {{{0, 0, 0, 0}}, {{~0u, ~0u, ~0u, ~0u}},
                                           {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}};
          const unsigned keys[3][2] = {{0, 0}, {~0u, ~0u}, {0xa4093822u, 0x299f31d0u}};
          for (int i = 0; i < 3; ++i) {
            const PhiloxWords r = flashattn::philox4x32_7(counters[i], keys[i][0], keys[i][1]);
            std::printf("%08x %08x %08x %08x\\n", r.w[0], r.w[1], r.w[2], r.w[3]);
          }
        }
    """)
    binary = tmp_path / "philox_kat"
    subprocess.run(["c++", "-std=c++17", f"-I{REPO_ROOT / 'csrc'}", str(source), "-o", str(binary)], check=True)
    assert subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split("\n")[:3] == [
        " ".join(f"{word:08x}" for word in expected) for _, _, expected in dropout_reference.KNOWN_ANSWERS]


# ---- return_attn_probs: flash-attn's S_dmask ----------------------------------------------------

S_DMASK_CASES = [
    AttentionCase("s_dmask_every_modifier", batch=2, seqlen_q=33, seqlen_k=140, nheads=4, nheads_kv=2,
                  head_dim=40, causal=True, window=(50, -1), softcap=2.0, alibi="batch_nheads",
                  softmax_scale=0.3, sink=True),
    # seqlen_q past one 128-row block, seqlen_k below one.
    AttentionCase("s_dmask_rows_past_a_block", batch=1, seqlen_q=130, seqlen_k=20, nheads=2, head_dim=16),
]


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", S_DMASK_CASES, ids=str)
def test_return_attn_probs_is_flash_attn_s_dmask(case, dtype, dropout_p):
    inputs = case.make(dtype)
    s_dmask, keep = dropout_reference.s_dmask_and_keep_mask(flash_attn_func, case, inputs, 5, dropout_p, "cpu")
    if dropout_p == 0:
        assert s_dmask is None, "flash-attn 2 forms S_dmask only with dropout"
        return
    tolerance = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    assert_s_dmask(s_dmask, inputs.q, inputs.k, keep, **tolerance, **inputs.reference_kwargs())


def test_return_attn_probs_varlen_puts_each_sequence_at_its_batch_entry():
    gen = torch.Generator().manual_seed(8)
    seqlens = (20, 0, 150)
    cu = torch.tensor([0, 20, 20, 170], dtype=torch.int32)
    q, k, v = (torch.randn(170, 2, 32, generator=gen) for _ in range(3))
    seed = dropout_reference.seed_after_manual_seed(6, "cpu")
    _, _, s_dmask = flash_attn_varlen_func(q, k, v, cu, cu, 150, 150, dropout_p=0.2, causal=True,
                                           return_attn_probs=True)
    assert s_dmask.shape == (3, 2, 256, 256)
    masks = dropout_reference.varlen_dropout_keep_masks(seed, 0, 0.2, 2, seqlens, seqlens)
    for b, n in enumerate(seqlens):
        assert not s_dmask[b, :, n:].any() and not s_dmask[b, :, :, n:].any()
        if n == 0:
            continue
        rows, rounded = slice(int(cu[b]), int(cu[b + 1])), (n + 127) // 128 * 128
        assert_s_dmask(s_dmask[b:b + 1, :, :rounded, :rounded], q[rows].unsqueeze(0), k[rows].unsqueeze(0),
                       masks[b], rtol=1e-5, atol=1e-7, causal=True)
