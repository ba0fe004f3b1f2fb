"""The seeded random cases of random_cases.py through the checks of the named ones:
test_varlen's check_case (flash_attn_varlen_func forward and backward against each
sequence alone through flash_attn_func and against the fp64 reference under the error
rule; NaN-poisoned outputs on CUDA) and test_kvcache's check_call (the caches written in
place and nothing else, out and lse against the fp64 reference built from the expected
cache contents). CI runs 200 small ones of each on the CPU; the GPU runs 300 of each,
larger ones, across the kernels' block boundaries, on both kernel families."""

from __future__ import annotations

import pytest
import torch

from random_cases import random_kvcache_cases, random_varlen_cases
from test_kvcache import check_call, needs_cuda_kernel, poison_outputs
from test_varlen import check_case

CPU_VARLEN = random_varlen_cases(200, max_len=300)
CPU_KVCACHE = random_kvcache_cases(200, max_capacity=300, max_seqlen_q=24)
GPU_VARLEN = random_varlen_cases(300, max_len=1100, first=10_000)
GPU_KVCACHE = random_kvcache_cases(300, max_capacity=3000, max_seqlen_q=200, first=10_000)


def ids(cases):
    return [case.name for case, _ in cases]


def alternate(index: int, dtypes):
    return dtypes[index % len(dtypes)]


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
@needs_cuda_kernel
@pytest.mark.parametrize("index", range(len(GPU_KVCACHE)), ids=ids(GPU_KVCACHE))
def test_random_kvcache_cuda(index):
    case, num_splits = GPU_KVCACHE[index]
    poison_outputs()
    check_call(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", num_splits)
