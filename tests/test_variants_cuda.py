"""GPU tests of softcap, ALiBi and learnable sinks in the CUDA kernels, forward and backward
(skipped without a CUDA device; on a Hopper GPU each test runs for both kernel families).

Every case runs flash_attn_func and its backward (autograd, the backward op) and holds out,
lse, dq, dk, dv, and dsink with a sink, to the error rule of tests/reference.py against its
fp64 reference: kernel error <= 2x (out, lse) or 3x (gradients) the error of the same
reference computed in the low precision. Outputs and gradients come from an allocator pool
poisoned with NaN, so an element no kernel writes shows up. Dropout, alone and with these
modifiers: test_dropout_cuda.py.

VARIANT_CASES runs each modifier alone at head dims 64, 128 and 256 (the Hopper kernels'
tile widths; ALiBi with slopes (nheads,) and (batch, nheads)), softcap + ALiBi and all three
together at each of them, the sink with softcap and with ALiBi (each set of modifiers is its
own kernel instantiation), and head dims 96 and 80 (the 96-wide tile, which only the mma.sync
kernels run) with each instantiation. Around the modifiers: causal and not, sliding windows,
GQA and MQA, ragged lengths (q 113 / k 203, 203 / 113, 239 / 1, 1 / 239, 128 / 239, 257 /
300, 300 / 257), one case past 1024 keys (several key blocks, the diagonal's masked tiles and
unmasked ones). Softcap 2, 30 and 50 (Gemma 2's): 30 and 50 with softmax scales that make the
scores about half the cap, where tanh bends them (on unit-size scores a cap of 30 is nearly
the identity, and a kernel that skipped it would pass).
"""

from __future__ import annotations

import pytest
import torch

from flashattn_ext import flash_attn_func
from cuda_inputs import LOW_PRECISION, poison_allocator
from reference import SINK_GRADIENT, assert_error_rule, attention_reference_with_grads
from sample_inputs import AttentionCase

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("kernel_family"),
]

NAMES = ("out", "lse", "dq", "dk", "dv")

VARIANT_CASES = [
    # Each modifier alone.
    AttentionCase("softcap_2_d64_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                  head_dim=64, softcap=2.0),
    # Causal with seqlen_q > seqlen_k: rows 0..42 see no key (out 0, lse +inf).
    AttentionCase("softcap_30_d128_causal_q300_k257", batch=2, seqlen_q=300, seqlen_k=257, nheads=4,
                  nheads_kv=4, head_dim=128, causal=True, softcap=30.0, softmax_scale=1.3),
    # A negative scale: tanh's argument carries the sign, the capped score's max stays a max.
    AttentionCase("softcap_5_d128_negative_scale_q300_k700", batch=1, seqlen_q=300, seqlen_k=700, nheads=4,
                  nheads_kv=4, head_dim=128, softcap=5.0, softmax_scale=-0.4),
    AttentionCase("softcap_50_d256_causal_gqa_q257_k300", batch=1, seqlen_q=257, seqlen_k=300, nheads=4,
                  nheads_kv=2, head_dim=256, causal=True, softcap=50.0, softmax_scale=1.5),
    AttentionCase("alibi_heads_d64_causal_q257_k300", batch=2, seqlen_q=257, seqlen_k=300, nheads=4,
                  nheads_kv=4, head_dim=64, causal=True, alibi="nheads"),
    AttentionCase("alibi_batch_heads_d128_mqa_q1_k239", batch=2, seqlen_q=1, seqlen_k=239, nheads=8,
                  nheads_kv=1, head_dim=128, alibi="batch_nheads"),
    AttentionCase("alibi_heads_d256_window_gqa_q300_k257", batch=1, seqlen_q=300, seqlen_k=257, nheads=4,
                  nheads_kv=2, head_dim=256, window=(64, 16), alibi="nheads"),
    AttentionCase("sink_d64_q239_k1", batch=2, seqlen_q=239, seqlen_k=1, nheads=4, nheads_kv=4, head_dim=64,
                  sink=True),
    AttentionCase("sink_d128_causal_window_gqa_q257_k300", batch=1, seqlen_q=257, seqlen_k=300, nheads=8,
                  nheads_kv=2, head_dim=128, causal=True, window=(100, -1), sink=True),
    AttentionCase("sink_d256_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                  head_dim=256, sink=True),
    # softcap + ALiBi.
    AttentionCase("softcap_alibi_batch_heads_d64_q128_k239", batch=2, seqlen_q=128, seqlen_k=239, nheads=4,
                  nheads_kv=2, head_dim=64, softcap=30.0, alibi="batch_nheads", softmax_scale=2.0),
    AttentionCase("softcap_alibi_heads_d128_causal_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4,
                  nheads_kv=4, head_dim=128, causal=True, softcap=2.0, alibi="nheads"),
    # One key at a different distance from each row: ALiBi shows in lse only.
    AttentionCase("softcap_alibi_batch_heads_d256_q239_k1", batch=2, seqlen_q=239, seqlen_k=1, nheads=4,
                  nheads_kv=4, head_dim=256, softcap=2.0, alibi="batch_nheads", softmax_scale=0.1),
    # The sink with one other modifier (each modifier set is its own kernel instantiation).
    # Causal with seqlen_q > seqlen_k: rows 0..89 see only the sink.
    AttentionCase("softcap_sink_d128_causal_gqa_q203_k113", batch=2, seqlen_q=203, seqlen_k=113, nheads=4,
                  nheads_kv=2, head_dim=128, causal=True, softcap=2.0, sink=True),
    AttentionCase("alibi_batch_heads_sink_d256_mqa_q1_k239", batch=2, seqlen_q=1, seqlen_k=239, nheads=4,
                  nheads_kv=1, head_dim=256, alibi="batch_nheads", sink=True),
    # softcap + ALiBi + sink; every tensor in a different non-contiguous layout.
    AttentionCase("all_d64_mqa_causal_window_mixed_strides_q300_k257", batch=1, seqlen_q=300,
                  seqlen_k=257, nheads=8, nheads_kv=1, head_dim=64, causal=True, window=(32, -1), softcap=2.0,
                  alibi="nheads", softmax_scale=0.15, sink=True, layout="mixed_strides"),
    # Past 1024 keys: several key blocks, the diagonal's masked tiles and unmasked ones; with
    # 8 heads the smallest standard ALiBi slopes (2^-7, 2^-8) leave the far keys their weight.
    # Scores of unit size with the sinks (logits around 1): large ones would leave a sink no mass.
    AttentionCase("all_d128_causal_gqa_q1100_k1300", batch=1, seqlen_q=1100, seqlen_k=1300, nheads=8,
                  nheads_kv=2, head_dim=128, causal=True, softcap=2.0, alibi="nheads", sink=True),
    AttentionCase("all_d256_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                  head_dim=256, softcap=2.0, alibi="batch_nheads", softmax_scale=0.15, sink=True),
    # Head dims without a Hopper kernel: the mma.sync kernels in both families.
    AttentionCase("all_d96_causal_gqa_q113_k203", batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                  head_dim=96, causal=True, softcap=2.0, alibi="batch_nheads", sink=True),
    AttentionCase("softcap_alibi_heads_d80_window_q300_k257", batch=1, seqlen_q=300, seqlen_k=257, nheads=4,
                  nheads_kv=4, head_dim=80, window=(48, 48), softcap=30.0, alibi="nheads",
                  softmax_scale=1.5),
    AttentionCase("softcap_sink_d96_q257_k300", batch=2, seqlen_q=257, seqlen_k=300, nheads=4, nheads_kv=4,
                  head_dim=96, softcap=2.0, sink=True),
    AttentionCase("alibi_heads_sink_d80_causal_mqa_q300_k257", batch=1, seqlen_q=300, seqlen_k=257, nheads=4,
                  nheads_kv=1, head_dim=80, causal=True, alibi="nheads", sink=True),
]

VARIANT_CASES_BY_NAME = {case.name: case for case in VARIANT_CASES}
assert len(VARIANT_CASES_BY_NAME) == len(VARIANT_CASES), "case names must be unique"


def run_attention(inputs, deterministic=False):
    """(out, lse, dq, dk, dv[, dsink]): flash_attn_func and its backward, each allocated
    from a pool poisoned with NaN."""
    poison_allocator(inputs.q.device)
    out, lse, _ = flash_attn_func(inputs.q, inputs.k, inputs.v, deterministic=deterministic,
                                  return_attn_probs=True, **inputs.func_kwargs())
    poison_allocator(inputs.q.device)
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    torch.cuda.synchronize(inputs.q.device)
    return (out, lse, *grads)


def check_case(case: AttentionCase, dtype, deterministic=False):
    """The case's inputs on the GPU and its outputs, held to the error rule."""
    inputs = case.make(dtype, device="cuda", requires_grad=True)
    actual = run_attention(inputs, deterministic)
    names = NAMES + ((SINK_GRADIENT,) if inputs.learnable_sink is not None else ())
    dtypes = (dtype, torch.float32, dtype, dtype, dtype, torch.float32)
    assert [t.dtype for t in actual] == list(dtypes[:len(names)]), case.name
    kwargs = inputs.reference_kwargs()
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    low_precision = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                                                   compute_dtype=dtype, **kwargs)
    assert_error_rule(names, actual, reference, low_precision, dtype,
                      context=f"{case.name} deterministic={deterministic}")
    return inputs, actual


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=str)
def test_variants_match_reference(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("case", [VARIANT_CASES_BY_NAME[name] for name in (
    "softcap_30_d128_causal_q300_k257", "alibi_batch_heads_d128_mqa_q1_k239", "sink_d256_gqa_q113_k203",
    "all_d64_mqa_causal_window_mixed_strides_q300_k257")], ids=str)
def test_deterministic_backward_with_modifiers_matches_reference(case):
    check_case(case, torch.bfloat16, deterministic=True)


@pytest.mark.parametrize("head_dim", (64, 96, 128, 256))
def test_sink_rows_without_keys_get_zero_out_lse_sink_and_zero_dq(head_dim):
    # Causal with seqlen_q > seqlen_k: queries 0..199 see no key, only the sink.
    case = AttentionCase("sink_rows_without_keys", batch=2, seqlen_q=300, seqlen_k=100, nheads=4, nheads_kv=2,
                         head_dim=head_dim, causal=True, sink=True)
    inputs, (out, lse, dq, _, _, dsink) = check_case(case, torch.bfloat16)
    blind = case.seqlen_q - case.seqlen_k
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    sink = inputs.learnable_sink.detach()[None, :, None].expand(case.batch, -1, blind)
    torch.testing.assert_close(lse[:, :, :blind], sink)
    assert torch.equal(dq[:, :blind], torch.zeros_like(dq[:, :blind]))
    assert torch.isfinite(dsink).all()


def test_sink_without_any_key():
    """No key at all (the kernels launch no key block): every row is the sink alone, lse =
    sink, out 0, and every gradient 0 (dsink too: D = rowsum(dout * out) = 0)."""
    case = AttentionCase("sink_without_keys", batch=2, seqlen_q=70, seqlen_k=0, nheads=4, nheads_kv=2, head_dim=64,
                         sink=True)
    inputs = case.make(torch.bfloat16, device="cuda", requires_grad=True)
    out, lse, dq, dk, dv, dsink = run_attention(inputs)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, inputs.learnable_sink.detach()[None, :, None].expand_as(lse))
    for grad in (dq, dk, dv, dsink):
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_repeated_runs_with_all_modifiers_are_bit_identical(head_dim):
    case = AttentionCase("all_modifiers_repeated", batch=2, seqlen_q=1000, seqlen_k=1500, nheads=4, nheads_kv=2,
                         head_dim=head_dim, causal=True, softcap=30.0, alibi="nheads", sink=True)
    names = NAMES + (SINK_GRADIENT,)
    for deterministic in (False, True):
        inputs, first = check_case(case, torch.bfloat16, deterministic)
        # Without deterministic=True, dq (and dsink) may sum their blocks' shares in any order.
        compared = names if deterministic else ("out", "lse", "dk", "dv")
        for _ in range(5):
            again = run_attention(inputs, deterministic)
            for name, a, b in zip(names, first, again):
                if name in compared:
                    assert torch.equal(a, b), f"{name} differs between runs, deterministic={deterministic}"
