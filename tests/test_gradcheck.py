"""torch.autograd.gradcheck in float64 through the real CPU op.

The CPU kernel computes fp64 inputs in fp64 (and recomputes lse in fp64 in the
backward), so the analytic gradients of the kernel's backward are checked
against finite differences of the kernel's own forward."""

import pytest
import torch

from flashattn_ext import flash_attn_func

from sample_inputs import GRADCHECK_CASES


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=str)
def test_gradcheck_flash_attn_func(case):
    inputs = case.make(torch.float64, requires_grad=True)
    kwargs = inputs.func_kwargs()

    def attention(q, k, v):
        return flash_attn_func(q, k, v, **kwargs)

    assert torch.autograd.gradcheck(attention, (inputs.q, inputs.k, inputs.v), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)


def test_gradcheck_op_autograd_formula():
    """The op's own register_autograd formula (used by callers of torch.ops directly)."""
    inputs = GRADCHECK_CASES[1].make(torch.float64, requires_grad=True)
    _, _, scale, causal, left, right, softcap, alibi, dropout_p, rng_state = (
        inputs.forward_op_args()[1:])

    def attention(q, k, v):
        out, _ = torch.ops.flashattn_ext.attention_forward(q, k, v, scale, causal, left, right, softcap,
                                                           alibi, dropout_p, rng_state)
        return out

    assert torch.autograd.gradcheck(attention, (inputs.q, inputs.k, inputs.v), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)
