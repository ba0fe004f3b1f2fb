"""Which Hopper forward tile runs a call, and that each is right (skipped without an sm_90 GPU
and a build with the Hopper kernels).

Head dims up to 64 have two Hopper shapes (Sm90ForwardPlan): one consumer warpgroup of 64
query rows, and, for dense calls of at least 2048 queries and keys without a mask (8192 with a
causal one), three warpgroups of 192 rows. The cases straddle that rule so both run, against the
fp64 reference, on both grids.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flashattn_ext
from cuda_inputs import hopper_build
from reference import assert_error_rule, attention_reference
from sample_inputs import AttentionCase

forward_op = torch.ops.flashattn_ext.attention_forward


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hopper_build(), reason="needs an sm_90 GPU and the Hopper kernels"),
]

LONG_SEQUENCE_SHAPE = re.compile(r"Sm90ForwardShape<64, ?128, ?3,")
# (case, whether the 192-row shape runs it)
CASES = [
    (AttentionCase("full_2100x2300", batch=2, seqlen_q=2100, seqlen_k=2300, nheads=3, nheads_kv=3), True),
    (AttentionCase("full_gqa_2048", batch=1, seqlen_q=2048, seqlen_k=2053, nheads=4, nheads_kv=2), True),
    (AttentionCase("short_keys_2100x2047", batch=1, seqlen_q=2100, seqlen_k=2047, nheads=2, nheads_kv=2), False),
    (AttentionCase("causal_2100", batch=1, seqlen_q=2100, seqlen_k=2100, nheads=2, nheads_kv=2, causal=True), False),
    (AttentionCase("causal_8200", batch=1, seqlen_q=8200, seqlen_k=8200, nheads=1, nheads_kv=1, causal=True), True),
    (AttentionCase("causal_8192x8333", batch=1, seqlen_q=8192, seqlen_k=8333, nheads=2, nheads_kv=1, causal=True),
     True),
    (AttentionCase("causal_8191", batch=1, seqlen_q=8191, seqlen_k=8191, nheads=1, nheads_kv=1, causal=True), False),
    (AttentionCase("window_2100", batch=1, seqlen_q=2100, seqlen_k=2100, nheads=2, nheads_kv=2,
                   window=(3000, 3000)), False),
]


def forward_with_kernels(inputs, scheduler, monkeypatch):
    monkeypatch.setenv("FLASHATTN_FORWARD_SCHEDULER", scheduler)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out, lse = forward_op(*inputs.forward_op_args())
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if "attention_forward_sm90_kernel" in e.name}
    return out, lse, names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("case,long_sequence_shape", CASES, ids=lambda x: str(x) if isinstance(x, AttentionCase) else "")
@pytest.mark.parametrize("scheduler", ["static", "persistent:5"])
def test_forward_shape_against_reference(case, long_sequence_shape, head_dim, dtype, scheduler, monkeypatch):
    case = AttentionCase(**{**case.__dict__, "head_dim": head_dim})
    inputs = case.make(dtype, "cuda", seed=head_dim)
    out, lse, names = forward_with_kernels(inputs, scheduler, monkeypatch)
    assert len(names) == 1, names
    assert bool(LONG_SEQUENCE_SHAPE.search(next(iter(names)))) == long_sequence_shape, names
    kwargs = dict(softmax_scale=inputs.resolved_scale(), causal=case.causal, window=case.window)
    ref = attention_reference(inputs.q, inputs.k, inputs.v, **kwargs)
    low = attention_reference(inputs.q, inputs.k, inputs.v, compute_dtype=dtype, **kwargs)
    assert_error_rule(("out", "lse"), (out, lse), ref, (low[0], low[1].float()), dtype,
                      f"{case} d{head_dim} {scheduler}")
