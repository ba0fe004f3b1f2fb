"""torch.library.opcheck on the ops over the shared sample cases.

opcheck runs test_schema (no aliasing/mutation the schema does not declare),
test_autograd_registration (the forward's autograd is registered through
torch.library, see flashattn_ext/ops.py), test_faketensor (the fake kernels
give exactly the real outputs' sizes, strides and dtypes) and
test_aot_dispatch_dynamic (eager vs AOT autograd with dynamic shapes, forward
and backward). None is skipped: every one applies to these ops. The varlen cases
pass the sequence arguments (cu_seqlens, seqused, max_seqlen) too. For the KV cache op,
which writes its caches, test_schema also checks that nothing else is written, and
test_aot_dispatch_dynamic the functionalized mutation (torch.compile's view of it)."""

import pytest
import torch

import kvcache_inputs
from random_cases import random_attention_cases, random_kvcache_cases, random_varlen_cases
from sample_inputs import CASES_BY_NAME, VARLEN_CASES, VarlenCase, cases_tagged

# Besides the tagged cases, a few of the random ones (random_cases.py, small): combinations
# the fake kernels' shapes and the schema must hold for too.
RANDOM_CASES = ([case for case, _ in random_attention_cases(12, max_len=80, first=500) if case.op_compatible][:6]
                + [case for case, _ in random_varlen_cases(12, max_len=80, first=500) if case.op_compatible][:6])
OPCHECK_CASES = ([case for case in cases_tagged("opcheck") if case.op_compatible]
                 + [case for case in VARLEN_CASES if "opcheck" in case.tags and case.op_compatible] + RANDOM_CASES)
# fp64 is the dtype of gradcheck; a few cases are enough to cover its code path.
FP64_CASES = ["basic", "all_features", "mixed_strides"]

PARAMS = ([pytest.param(case, torch.float32, id=f"{case.name}-float32") for case in OPCHECK_CASES]
          + [pytest.param(CASES_BY_NAME[name], torch.float64, id=f"{name}-float64") for name in FP64_CASES])


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_opcheck_attention_forward(case, dtype):
    inputs = case.make(dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_forward.default, inputs.forward_op_args())


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_opcheck_attention_backward(case, dtype):
    # The backward op has no autograd formula of its own (no double backward), so
    # its inputs do not require grad.
    inputs = case.make(dtype, requires_grad=False)
    out, lse = torch.ops.flashattn_ext.attention_forward(*inputs.forward_op_args())
    torch.library.opcheck(torch.ops.flashattn_ext.attention_backward.default,
                          inputs.backward_op_args(out, lse))


def test_opcheck_forward_without_grad():
    inputs = CASES_BY_NAME["gqa_2"].make(torch.float32, requires_grad=False)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_forward.default, inputs.forward_op_args())


KVCACHE_OPCHECK_CASES = ([kvcache_inputs.CASES_BY_NAME[name] for name in ("decode_gqa4_rotary_gptj", "paged16_leftpad",
                                                                           "cache_only", "batch_idx", "sink")]
                         + [case for case, _ in random_kvcache_cases(4, max_capacity=100, max_seqlen_q=8, first=500)])


@pytest.mark.parametrize("case", KVCACHE_OPCHECK_CASES, ids=str)
def test_opcheck_attention_kvcache_forward(case):
    inputs = kvcache_inputs.make_inputs(case, torch.float32)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_kvcache_forward.default,
                          inputs.op_args(case, num_splits=2))


# return_attn_probs' op, on a dense case and a variable-length one.
@pytest.mark.parametrize("case,dtype", [PARAMS[0], *[p for p in PARAMS if isinstance(p.values[0], VarlenCase)][:1]])
def test_opcheck_attention_probabilities(case, dtype):
    inputs = case.make(dtype, requires_grad=False)
    out, lse = torch.ops.flashattn_ext.attention_forward(*inputs.forward_op_args())
    args = (inputs.q, inputs.k, lse, inputs.resolved_scale(), inputs.causal, inputs.window[0], inputs.window[1],
            inputs.softcap, inputs.alibi_slopes, 0.25, torch.tensor([3, 0])) + tuple(inputs.sequence_args)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_probabilities.default, args)
