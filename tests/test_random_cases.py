"""The seeded random cases of random_cases.py through the checks of the named ones:
dense batches through flash_attn_func forward and backward against the fp64 reference
under the error rule (with the backward's D term, reference.backward_d_allowances);
test_varlen's check_case (flash_attn_varlen_func forward and backward against each
sequence alone through flash_attn_func and against the fp64 reference under the error
rule; NaN-poisoned outputs on CUDA) and test_kvcache's check_call (the caches written in
place and nothing else, out and lse against the fp64 reference built from the expected
cache contents). Here a few hundred small ones on the CPU, in CI; larger ones on the GPU in
test_random_cases_cuda.py."""

from __future__ import annotations

import pytest
import torch

from cuda_inputs import poison_allocator
from dropout_reference import dropout_keep_mask, seed_after_manual_seed
from flashattn_ext import flash_attn_func
from random_cases import random_attention_cases, random_kvcache_cases, random_varlen_cases
from reference import (BASELINE_DTYPES, SINK_GRADIENT, assert_error_rule, attention_reference_with_grads,
                       backward_d_allowances)
from test_attention_cpu import NAMES, run_flash_attn
from test_kvcache import check_call
from test_varlen import check_case

CPU_DENSE = random_attention_cases(100, max_len=300)
CPU_VARLEN = random_varlen_cases(200, max_len=300)
CPU_KVCACHE = random_kvcache_cases(200, max_capacity=300, max_seqlen_q=24)


def ids(cases):
    return [case.name for case, _ in cases]


def alternate(index: int, dtypes):
    return dtypes[index % len(dtypes)]


def check_dense_case(case, dtype, device: str, deterministic: bool, dropout_p: float, manual_seed: int = 0):
    """flash_attn_func forward and backward against the reference; with dropout, the mask of
    the definition (dropout_reference.py) for the seed the call draws after
    torch.manual_seed(manual_seed), and out and the gradients only (S_dmask, the way to lse
    with dropout, forms the N x N matrix on the CPU)."""
    inputs = case.make(dtype, device=device, requires_grad=True)
    if device == "cuda":
        poison_allocator()
    names = NAMES + ((SINK_GRADIENT,) if case.sink else ())
    kwargs = inputs.reference_kwargs()
    if dropout_p == 0.0:
        actual = run_flash_attn(inputs, deterministic=deterministic)
    else:
        seed = seed_after_manual_seed(manual_seed, device)
        out = flash_attn_func(inputs.q, inputs.k, inputs.v, dropout_p=dropout_p, deterministic=deterministic,
                              **inputs.func_kwargs())
        actual = (out, None, *torch.autograd.grad(out, inputs.differentiable(), inputs.dout))
        kwargs.update(dropout_p=dropout_p, dropout_mask=dropout_keep_mask(
            seed, 0, dropout_p, case.batch, case.nheads, case.seqlen_q, case.seqlen_k, device))
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    low_precision = None
    if dtype in BASELINE_DTYPES:
        low_precision = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                                                       compute_dtype=dtype, **kwargs)
    checked = [i for i, tensor in enumerate(actual) if tensor is not None]
    for i in checked:
        assert not torch.isnan(actual[i]).any(), f"{case.name}: {names[i]} has NaN"
    dq, dk, dsink = backward_d_allowances(inputs.q, inputs.k, inputs.v, inputs.dout, actual[0], **kwargs)
    assert_error_rule([names[i] for i in checked], [actual[i] for i in checked], [reference[i] for i in checked],
                      None if low_precision is None else [low_precision[i] for i in checked], dtype,
                      context=case.name, allowances={"dq": dq, "dk": dk, SINK_GRADIENT: dsink})


@pytest.mark.parametrize("index", range(len(CPU_DENSE)), ids=ids(CPU_DENSE))
def test_random_dense_cpu(index):
    case, call = CPU_DENSE[index]
    check_dense_case(case, alternate(index, (torch.bfloat16, torch.float32)), "cpu", manual_seed=index, **call)


@pytest.mark.parametrize("index", range(len(CPU_VARLEN)), ids=ids(CPU_VARLEN))
def test_random_varlen_cpu(index):
    case, call = CPU_VARLEN[index]
    check_case(case, alternate(index, (torch.bfloat16, torch.float32)), "cpu", **call)


@pytest.mark.parametrize("index", range(len(CPU_KVCACHE)), ids=ids(CPU_KVCACHE))
def test_random_kvcache_cpu(index):
    case, num_splits = CPU_KVCACHE[index]
    check_call(case, alternate(index, (torch.bfloat16, torch.float32)), "cpu", num_splits)
