"""The seeded random cases of random_cases.py on the GPU, through test_random_cases.py's
checks: larger ones than CI's (lengths to 1100, caches to 3000 rows, chunks to 200 query
rows), across the kernels' block boundaries; dense and variable-length calls on both kernel
families."""

from __future__ import annotations

import pytest
import torch

from random_cases import random_attention_cases, random_kvcache_cases, random_varlen_cases
from test_kvcache import check_call, needs_cuda_kernel, poison_outputs
from test_random_cases import alternate, check_dense_case, ids
from test_varlen import check_case

GPU_DENSE = random_attention_cases(100, max_len=1100, first=10_000)
GPU_VARLEN = random_varlen_cases(100, max_len=1100, first=10_000)
GPU_KVCACHE = random_kvcache_cases(150, max_capacity=3000, max_seqlen_q=200, first=10_000)


def on_both_kernel_families(test):
    """A GPU test run with the kernels the build picks and with the mma.sync ones forced."""
    for mark in (pytest.mark.usefixtures("kernel_family"),
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.gpu):
        test = mark(test)
    return test


@on_both_kernel_families
@pytest.mark.parametrize("index", range(len(GPU_DENSE)), ids=ids(GPU_DENSE))
def test_random_dense_cuda(index):
    case, call = GPU_DENSE[index]
    check_dense_case(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", manual_seed=index, **call)


@on_both_kernel_families
@pytest.mark.parametrize("index", range(len(GPU_VARLEN)), ids=ids(GPU_VARLEN))
def test_random_varlen_cuda(index):
    case, call = GPU_VARLEN[index]
    check_case(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", **call)


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("index", range(len(GPU_KVCACHE)), ids=ids(GPU_KVCACHE))
def test_random_kvcache_cuda(index):
    case, num_splits = GPU_KVCACHE[index]
    poison_outputs()
    check_call(case, alternate(index, (torch.bfloat16, torch.float16)), "cuda", num_splits)
