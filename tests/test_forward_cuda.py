"""GPU tests of the CUDA forward kernel (skipped without a CUDA device).

Every case compares out and lse with the fp64 reference under the error rule of
tests/reference.py (kernel error <= 2x the error of the same PyTorch computation
in the low precision). Outputs come from a caching allocator pool poisoned with
NaN first, so an element the kernel never writes shows up as NaN.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashattn_ext
from cuda_inputs import LOW_PRECISION, poison_allocator, random_inputs
from reference import assert_error_rule, attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("kernel_family"),
]

HEAD_DIMS = (32, 40, 59, 64, 80, 96, 128, 160, 192, 224, 256)
SEQLEN_PAIRS = ((1, 239), (239, 1), (113, 203), (1023, 1024), (2048, 2048), (3, 799))


def check_forward(q, k, v, causal=False, window=(-1, -1), context="", scale=None):
    scale = q.size(-1) ** -0.5 if scale is None else scale
    ref_out, ref_lse = attention_reference(q, k, v, softmax_scale=scale, causal=causal, window=window)
    low_out, low_lse = attention_reference(q, k, v, softmax_scale=scale, causal=causal, window=window,
                                           compute_dtype=q.dtype)
    poison_allocator()
    out, lse = flashattn_ext.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                             window_size=window, return_attn_probs=True)[:2]
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_error_rule(("out", "lse"), (out, lse), (ref_out, ref_lse), (low_out, low_lse.float()), q.dtype,
                      context)
    return out, lse


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlens", SEQLEN_PAIRS, ids=lambda s: f"q{s[0]}_k{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_head_dims_and_seqlens(head_dim, seqlens, causal, dtype):
    sq, sk = seqlens
    batch, nheads = (1, 2) if sq * sk > 10**6 else (2, 3)
    q, k, v, _ = random_inputs(batch, sq, sk, nheads, nheads, head_dim, dtype, seed=head_dim + sq)
    check_forward(q, k, v, causal=causal, context=f"d={head_dim} sq={sq} sk={sk} causal={causal}")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("scale", (-0.3, 0.0), ids=("negative_scale", "zero_scale"))
@pytest.mark.parametrize("head_dim", (64, 96, 128, 256))
def test_forward_negative_and_zero_scale(head_dim, scale, causal, dtype):
    """Blocks no boundary cuts take the max of the raw scores and scale it once per row: with a
    negative scale the min (flash-attn's softmax_scale is any finite float). 300 x 700 leaves
    such blocks beside cut ones in both families, causal or not."""
    q, k, v, _ = random_inputs(2, 300, 700, 3, 3, head_dim, dtype, seed=head_dim + 7)
    check_forward(q, k, v, causal=causal, scale=scale,
                  context=f"d={head_dim} scale={scale} causal={causal}")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("gqa_ratio", (1, 2, 8))
@pytest.mark.parametrize("window", ((-1, -1), (32, 8), (0, 0), (100, -1), (-1, 40), (8, 0)),
                         ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("head_dim", (64, 128))
def test_forward_window_gqa_strides(head_dim, window, gqa_ratio, dtype):
    for (sq, sk), causal, layout in itertools.product(((257, 300), (300, 257)), (False, True),
                                                      ("contiguous", "mixed")):
        q, k, v, _ = random_inputs(2, sq, sk, 8, 8 // gqa_ratio, head_dim, dtype, layout=layout, seed=sq)
        check_forward(q, k, v, causal=causal, window=window,
                      context=f"window={window} gqa={gqa_ratio} sq={sq} sk={sk} causal={causal} {layout}")


def test_forward_fully_masked_rows_are_zero_with_infinite_lse():
    # seqlen_q > seqlen_k, causal (bottom-right): the first 150 rows see no key.
    q, k, v, _ = random_inputs(1, 250, 100, 2, 2, 64, torch.bfloat16)
    out, lse = check_forward(q, k, v, causal=True)
    assert torch.all(out[:, :150] == 0) and torch.all(torch.isposinf(lse[:, :, :150]))
    assert not torch.isnan(out).any()


def test_forward_repeated_runs_are_bit_identical():
    q, k, v, _ = random_inputs(2, 1000, 1500, 4, 2, 128, torch.bfloat16)
    first = torch.ops.flashattn_ext.attention_forward(q, k, v, 0.1, True, -1, -1, 0.0, None, 0.0, None)
    for _ in range(10):
        again = torch.ops.flashattn_ext.attention_forward(q, k, v, 0.1, True, -1, -1, 0.0, None, 0.0, None)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_forward_batch_times_heads_over_grid_limit():
    # 1100 x 64 = 70400 (batch, head) pairs: more than a grid's y/z dimension holds.
    q, k, v, _ = random_inputs(1100, 3, 5, 64, 64, 32, torch.float16)
    check_forward(q, k, v, causal=False)


def test_forward_runs_on_the_current_stream():
    q, k, v, _ = random_inputs(2, 512, 512, 4, 4, 64, torch.bfloat16)
    expected = flashattn_ext.flash_attn_func(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        poison_allocator()
        out = flashattn_ext.flash_attn_func(q, k, v)
    stream.synchronize()
    assert torch.equal(out, expected)
    # A CUDA graph captures only work on its own capture stream.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashattn_ext.flash_attn_func(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_forward_on_second_device():
    q, k, v = (t.to("cuda:1") for t in random_inputs(2, 300, 300, 4, 4, 64, torch.bfloat16)[:3])
    with torch.cuda.device(0):
        out, lse = torch.ops.flashattn_ext.attention_forward(q, k, v, 0.125, False, -1, -1, 0.0, None,
                                                             0.0, None)
    assert out.device == q.device
    ref_out, _ = attention_reference(q, k, v, softmax_scale=0.125)
    assert (out.double() - ref_out).abs().max().item() < 2e-2


def test_forward_refuses_float32_by_name():
    # CUDA's one refusal by dtype (dropout runs on CUDA: test_dropout_cuda.py).
    q, k, v, _ = random_inputs(1, 16, 16, 2, 2, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype Float is not supported on CUDA"):
        torch.ops.flashattn_ext.attention_forward(q.float(), k.float(), v.float(), 0.1, False, -1, -1,
                                                  0.0, None, 0.0, None)
