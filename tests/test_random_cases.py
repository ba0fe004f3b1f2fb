"""The seeded random cases of random_cases.py through the checks of the named ones:
dense batches through flash_attn_func forward and backward against the fp64 reference
under the error rule (with the backward's D term, reference.backward_d_allowances);
test_varlen's check_case (flash_attn_varlen_func forward and backward against each
sequence alone through flash_attn_func and against the fp64 reference under the error
rule; NaN-poisoned outputs on CUDA) and test_kvcache's check_call (the caches written in
place and nothing else, out and lse against the fp64 reference built from the expected
cache contents). CI runs a few hundred small ones on the CPU; the GPU runs 150-200 of each
kind, larger ones, across the kernels' block boundaries, on both kernel families."""

from __future__ import annotations

import pytest
import torch

from cuda_inputs import poison_allocator
from random_cases import random_attention_cases, random_kvcache_cases, random_varlen_cases
from reference import (BASELINE_DTYPES, FP32_NOISE_RTOL, SINK_GRADIENT, assert_error_rule,
                       attention_reference_with_grads, backward_d_allowances)
from test_attention_cpu import NAMES, run_flash_attn
from test_kvcache import check_call, needs_cuda_kernel, poison_outputs
from test_varlen import check_case

CPU_DENSE = random_attention_cases(100, max_len=300)
GPU_DENSE = random_attention_cases(150, max_len=1100, first=10_000)
CPU_VARLEN = random_varlen_cases(200, max_len=300)
CPU_KVCACHE = random_kvcache_cases(200, max_capacity=300, max_seqlen_q=24)
GPU_VARLEN = random_varlen_cases(150, max_len=1100, first=10_000)
GPU_KVCACHE = random_kvcache_cases(200, max_capacity=3000, max_seqlen_q=200, first=10_000)


def ids(cases):
    return [case.name for case, _ in cases]


def alternate(index: int, dtypes):
    return dtypes[index % len(dtypes)]


def check_dense_case(case, dtype, device: str, deterministic: bool):
    inputs = case.make(dtype, device=device, requires_grad=True)
    if device == "cuda":
        poison_allocator()
    actual = run_flash_attn(inputs, deterministic=deterministic)
    names = NAMES + ((SINK_GRADIENT,) if case.sink else ())
    for name, tensor in zip(names, actual):
        assert not torch.isnan(tensor).any(), f"{case.name}: {name} has NaN"
    kwargs = inputs.reference_kwargs()
    reference = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    low_precision = None
    if dtype in BASELINE_DTYPES:
        low_precision = attention_reference_with_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                                                       compute_dtype=dtype, **kwargs)
    noise_rtol = 2.0 ** -49 if dtype == torch.float64 else FP32_NOISE_RTOL
    dq, dk, dsink = backward_d_allowances(inputs.q, inputs.k, inputs.v, inputs.dout, actual[0],
                                          noise_rtol=noise_rtol, **kwargs)
    assert_error_rule(names, actual, reference, low_precision, dtype, context=case.name,
                      allowances={"dq": dq, "dk": dk, SINK_GRADIENT: dsink})


@pytest.mark.parametrize("index", range(len(CPU_DENSE)), ids=ids(CPU_DENSE))
def test_random_dense_cpu(index):
    case, deterministic = CPU_DENSE[index]
    check_dense_case(case, alternate(index, (torch.bfloat16, torch.float32)), "cpu", deterministic)


@pytest.mark.parametrize("index", range(len(CPU_VARLEN)), ids=ids(CPU_VARLEN))
def test_random_varlen_cpu(index):
    case, page_size = CPU_VARLEN[index]
    check_case(case, alternate(index, (torch.bfloat16, torch.float32)), "cpu", page_size)


@pytest.mark.parametrize("index", range(len(CPU_KVCACHE)), ids=ids(CPU_KVCACHE))
def test_random_kvcache_cpu(index):
    case, num_splits = CPU_KVCACHE[index]
    check_call(case, alternate(index, (torch.bfloat16, torch.float32)), "cpu", num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("kernel_family")
@pytest.mark.parametrize("index", range(len(GPU_VARLEN)), ids=ids(GPU_VARLEN))
def test_random_varlen_cuda(index):
    case, page_size = GPU_VARLEN[index]
    check_case(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("kernel_family")
@pytest.mark.parametrize("index", range(len(GPU_DENSE)), ids=ids(GPU_DENSE))
def test_random_dense_cuda(index):
    case, deterministic = GPU_DENSE[index]
    check_dense_case(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", deterministic)


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("index", range(len(GPU_KVCACHE)), ids=ids(GPU_KVCACHE))
def test_random_kvcache_cuda(index):
    case, num_splits = GPU_KVCACHE[index]
    poison_outputs()
    check_call(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", num_splits)
