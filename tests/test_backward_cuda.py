"""GPU tests of the CUDA backward kernels (skipped without a CUDA device).

Every case compares dq, dk, dv with the fp64 autograd gradients of the reference
(tests/reference.py) under its error rule: kernel error <= 3x the error of the same
PyTorch computation in the low precision, + 1e-5. out and lse come from the CUDA
forward op, as in training. The gradients are allocated from a caching-allocator
pool poisoned with NaN first, so an element the kernels never write, or an
uninitialised workspace, shows up as NaN.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashattn_ext
from cuda_inputs import LOW_PRECISION, poison_allocator, random_inputs
from reference import assert_error_rule, attention_reference_with_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("kernel_family"),
]

HEAD_DIMS = (32, 40, 64, 80, 96, 128, 160, 192, 224, 256)
SEQLEN_PAIRS = ((1, 239), (239, 1), (113, 203), (128, 217), (400, 331), (1023, 1024), (2048, 2048))


def forward(q, k, v, scale, causal, window):
    return torch.ops.flashattn_ext.attention_forward(q, k, v, scale, causal, window[0], window[1], 0.0,
                                                     None, 0.0, None)


def backward(dout, q, k, v, out, lse, scale, causal, window, deterministic=False):
    poison_allocator(q.device)
    grads = torch.ops.flashattn_ext.attention_backward(dout, q, k, v, out, lse, scale, causal, window[0],
                                                       window[1], 0.0, None, 0.0, None, deterministic)
    torch.cuda.synchronize(q.device)
    return grads[:3]  # dq, dk, dv: dsink is empty without a sink


def check_backward(q, k, v, dout, causal=False, window=(-1, -1), deterministic=False, context=""):
    scale = q.size(-1) ** -0.5
    out, lse = forward(q, k, v, scale, causal, window)
    dq, dk, dv = backward(dout, q, k, v, out, lse, scale, causal, window, deterministic)
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype, f"{context} {name}"
    kwargs = dict(softmax_scale=scale, causal=causal, window=window)
    reference = attention_reference_with_grads(q, k, v, dout, **kwargs)[2:]
    low = attention_reference_with_grads(q, k, v, dout, compute_dtype=q.dtype, **kwargs)[2:]
    assert_error_rule(("dq", "dk", "dv"), (dq, dk, dv), reference, low, q.dtype,
                      f"{context} deterministic={deterministic}")
    return dq, dk, dv


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlens", SEQLEN_PAIRS, ids=lambda s: f"q{s[0]}_k{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_backward_head_dims_and_seqlens(head_dim, seqlens, causal, dtype):
    sq, sk = seqlens
    batch, nheads = (1, 2) if sq * sk > 10**6 else (2, 3)
    q, k, v, dout = random_inputs(batch, sq, sk, nheads, nheads, head_dim, dtype, seed=head_dim + sq)
    check_backward(q, k, v, dout, causal=causal, context=f"d={head_dim} sq={sq} sk={sk} causal={causal}")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_backward_tiny_seqlens(head_dim, dtype):
    # The classic NaN cases: blocks that are almost all padding.
    for sq, sk, causal in itertools.product((1, 2, 5, 17), (1, 2, 5, 17), (False, True)):
        q, k, v, dout = random_inputs(2, sq, sk, 2, 1, head_dim, dtype, seed=sq * 31 + sk)
        check_backward(q, k, v, dout, causal=causal, context=f"d={head_dim} sq={sq} sk={sk} causal={causal}")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("gqa_ratio", (1, 2, 8))
@pytest.mark.parametrize("window", ((-1, -1), (32, 8), (0, 0), (100, -1), (-1, 40), (8, 0)),
                         ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_backward_window_gqa_strides(head_dim, window, gqa_ratio, dtype):
    for (sq, sk), causal, layout in itertools.product(((257, 300), (300, 257)), (False, True),
                                                      ("contiguous", "mixed")):
        q, k, v, dout = random_inputs(2, sq, sk, 8, 8 // gqa_ratio, head_dim, dtype, layout=layout, seed=sq)
        check_backward(q, k, v, dout, causal=causal, window=window,
                       context=f"d={head_dim} window={window} gqa={gqa_ratio} sq={sq} sk={sk} "
                               f"causal={causal} {layout}")


@pytest.mark.parametrize("head_dim", (64, 128, 192, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_backward_deterministic_is_correct(head_dim, causal):
    q, k, v, dout = random_inputs(2, 700, 900, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    check_backward(q, k, v, dout, causal=causal, deterministic=True, context=f"d={head_dim}")
    check_backward(q, k, v, dout, causal=causal, window=(200, 30), deterministic=True,
                   context=f"d={head_dim} window")


@pytest.mark.parametrize("head_dim", (128, 256))
@pytest.mark.parametrize("window", ((-1, -1), (-1, 0), (512, 0), (-1, 512), (512, -1)),
                         ids=("full", "causal", "local", "right_bounded", "left_bounded"))
def test_backward_deterministic_with_more_key_blocks_than_run_at_once(window, head_dim):
    """deterministic=True where one head has 300 key blocks of 128 keys (d 128) or 600 of 64 (d 256,
    the Hopper kernel's tile), more than the GPU runs at once: a key block that waited for one not
    yet launched would hang. dq agrees with the non-deterministic result up to rounding (an add
    skipped or repeated would be far off) and repeats bit for bit."""
    q, k, v, dout = random_inputs(1, 38400, 38400, 2, 1, head_dim, torch.bfloat16, seed=11)
    scale = head_dim ** -0.5
    out, lse = forward(q, k, v, scale, False, window)
    free = backward(dout, q, k, v, out, lse, scale, False, window)
    first = backward(dout, q, k, v, out, lse, scale, False, window, deterministic=True)
    again = backward(dout, q, k, v, out, lse, scale, False, window, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, free):
        error = (a.float() - b.float()).abs().max().item()
        assert error <= 0.02 * b.float().abs().max().item(), f"{name} {window}: {error}"
    assert all(torch.equal(a, b) for a, b in zip(first, again)), f"deterministic=True differs between runs {window}"


def test_backward_fully_masked_rows_and_columns_get_zero_gradients():
    # Causal with seqlen_q > seqlen_k: the first 150 queries see no key.
    q, k, v, dout = random_inputs(1, 250, 100, 2, 2, 64, torch.bfloat16)
    dq, dk, dv = check_backward(q, k, v, dout, causal=True)
    assert torch.all(dq[:, :150] == 0)
    for grad in (dq, dk, dv):
        assert not torch.isnan(grad).any()
    # A sliding window over seqlen_k > seqlen_q: keys 0..189 are seen by no query.
    q, k, v, dout = random_inputs(1, 100, 300, 4, 2, 128, torch.float16)
    dq, dk, dv = check_backward(q, k, v, dout, causal=True, window=(10, 0))
    assert torch.all(dk[:, :190] == 0) and torch.all(dv[:, :190] == 0)
    assert not torch.isnan(dq).any()


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_backward_repeated_runs_are_bit_identical(head_dim, causal):
    q, k, v, dout = random_inputs(2, 1000, 1500, 4, 2, head_dim, torch.bfloat16, seed=7)
    scale = head_dim ** -0.5
    out, lse = forward(q, k, v, scale, causal, (-1, -1))
    for deterministic in (False, True):
        first = backward(dout, q, k, v, out, lse, scale, causal, (-1, -1), deterministic)
        for _ in range(50):
            again = backward(dout, q, k, v, out, lse, scale, causal, (-1, -1), deterministic)
            assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2]), "dk/dv differ"
            if deterministic:
                assert torch.equal(first[0], again[0]), "dq differs with deterministic=True"


def test_backward_deterministic_cost():
    """Times the backward at d 128, N 4096 with and without deterministic=True (printed;
    only a gross slowdown fails)."""
    q, k, v, dout = random_inputs(4, 4096, 4096, 16, 16, 128, torch.bfloat16)
    scale = 128 ** -0.5
    results = {}
    for causal in (False, True):
        out, lse = forward(q, k, v, scale, causal, (-1, -1))
        for deterministic in (False, True):
            def run():
                return torch.ops.flashattn_ext.attention_backward(dout, q, k, v, out, lse, scale, causal,
                                                                  -1, -1, 0.0, None, 0.0, None,
                                                                  deterministic)
            for _ in range(3):
                run()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                run()
            stop.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(stop) / 10
            flops = 10 * 4 * 16 * 4096 * 4096 * 128 / (2 if causal else 1)
            results[(causal, deterministic)] = ms
            print(f"causal={causal} deterministic={deterministic}: {ms:.3f} ms, "
                  f"{flops / ms / 1e9:.0f} TFLOP/s")
    for causal in (False, True):
        ratio = results[(causal, True)] / results[(causal, False)]
        print(f"causal={causal}: deterministic costs {100 * (ratio - 1):.1f} %")
        assert ratio < 3.0


def test_backward_batch_times_heads_over_grid_limit():
    # 1100 x 64 = 70400 (batch, head) pairs: more than a grid's y/z dimension holds.
    q, k, v, dout = random_inputs(1100, 3, 5, 64, 64, 32, torch.float16)
    check_backward(q, k, v, dout)


def test_backward_misaligned_views_are_handled():
    # Views at an odd element offset: not 16-byte aligned, so the op copies them first.
    q, k, v, dout = random_inputs(2, 130, 150, 2, 2, 64, torch.bfloat16)
    scale = 64 ** -0.5
    out, lse = forward(q, k, v, scale, False, (-1, -1))

    def shifted(t):
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = storage[1:].view(t.shape)
        view.copy_(t)
        return view

    expected = backward(dout, q, k, v, out, lse, scale, False, (-1, -1), True)
    got = backward(shifted(dout), shifted(q), shifted(k), shifted(v), shifted(out), lse, scale, False,
                   (-1, -1), True)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_backward_empty_problems():
    q, k, v, dout = random_inputs(2, 7, 0, 2, 2, 64, torch.bfloat16)
    out, lse = forward(q, k, v, 0.125, False, (-1, -1))
    dq, dk, dv = backward(dout, q, k, v, out, lse, 0.125, False, (-1, -1))
    assert torch.all(dq == 0) and dk.numel() == 0 and dv.numel() == 0
    q, k, v, dout = random_inputs(2, 0, 9, 2, 2, 64, torch.bfloat16)
    out, lse = forward(q, k, v, 0.125, False, (-1, -1))
    dq, dk, dv = backward(dout, q, k, v, out, lse, 0.125, False, (-1, -1))
    assert dq.numel() == 0 and torch.all(dk == 0) and torch.all(dv == 0)


def test_backward_through_autograd_matches_the_op():
    q, k, v, dout = random_inputs(2, 300, 400, 4, 2, 128, torch.bfloat16, layout="mixed")
    scale = 128 ** -0.5
    out, lse = forward(q, k, v, scale, True, (-1, -1))
    expected = backward(dout, q, k, v, out, lse, scale, True, (-1, -1), True)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    flashattn_ext.flash_attn_func(*leaves, softmax_scale=scale, causal=True, deterministic=True).backward(dout)
    for e, leaf in zip(expected, leaves):
        assert torch.equal(e, leaf.grad)


def test_empty_inputs_backward_from_a_reduction():
    # out.sum() hands the backward an expanded gradient with stride 0 everywhere.
    for shape in ((0, 7, 2, 64), (2, 0, 2, 64), (2, 7, 0, 64)):
        q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(shape[0], 9, shape[2], 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        flashattn_ext.flash_attn_func(q, k, k, causal=True).sum().backward()
        assert q.grad.shape == q.shape and torch.all(q.grad == 0), shape
        assert k.grad.shape == k.shape and torch.all(k.grad == 0), shape


def test_strided_head_dim_is_copied_once():
    q, k, v, dout = random_inputs(2, 300, 400, 4, 2, 64, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    wide = [torch.randn(*t.shape[:-1], 2 * t.shape[-1], device="cuda", dtype=t.dtype) for t in (q, k, v)]
    strided = []
    for w, t in zip(wide, (q, k, v)):
        w[..., ::2] = t.detach()
        strided.append(w[..., ::2].requires_grad_(True))
    for args in (leaves, strided):
        flashattn_ext.flash_attn_func(*args, causal=True, deterministic=True).backward(dout)
    for leaf, view in zip(leaves, strided):
        assert torch.equal(leaf.grad, view.grad)


def test_use_deterministic_algorithms_reaches_the_backward():
    q, k, v, dout = random_inputs(2, 1024, 1024, 8, 2, 128, torch.bfloat16)
    scale = 128 ** -0.5
    out, lse = forward(q, k, v, scale, False, (-1, -1))
    expected = backward(dout, q, k, v, out, lse, scale, False, (-1, -1), True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(5):
            got = backward(dout, q, k, v, out, lse, scale, False, (-1, -1), False)
            for e, g in zip(expected, got):
                assert torch.equal(e, g)
    finally:
        torch.use_deterministic_algorithms(previous)


def test_backward_runs_on_the_current_stream():
    q, k, v, dout = random_inputs(2, 512, 512, 4, 4, 64, torch.bfloat16)
    scale = 0.125
    out, lse = forward(q, k, v, scale, False, (-1, -1))
    expected = backward(dout, q, k, v, out, lse, scale, False, (-1, -1), True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        poison_allocator()
        got = torch.ops.flashattn_ext.attention_backward(dout, q, k, v, out, lse, scale, False, -1, -1,
                                                         0.0, None, 0.0, None, True)
    stream.synchronize()
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    # A CUDA graph captures only work on its own capture stream (workspaces included).
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.flashattn_ext.attention_backward(dout, q, k, v, out, lse, scale, False, -1,
                                                              -1, 0.0, None, 0.0, None, True)
    graph.replay()
    torch.cuda.synchronize()
    for e, g in zip(expected, captured):
        assert torch.equal(e, g)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_backward_on_second_device():
    q, k, v, dout = (t.to("cuda:1") for t in random_inputs(2, 300, 300, 4, 4, 64, torch.bfloat16))
    with torch.cuda.device(0):
        out, lse = forward(q, k, v, 0.125, False, (-1, -1))
        dq, dk, dv, _ = torch.ops.flashattn_ext.attention_backward(dout, q, k, v, out, lse, 0.125, False, -1,
                                                                -1, 0.0, None, 0.0, None, False)
    torch.cuda.synchronize("cuda:1")
    assert dq.device == q.device
    reference = attention_reference_with_grads(q, k, v, dout, softmax_scale=0.125)[2:]
    for got, ref in zip((dq, dk, dv), reference):
        assert (got.double() - ref).abs().max().item() < 5e-2


@pytest.mark.slow
def test_backward_64_bit_offsets():
    # q, dout, dq hold 2^31 + 2^24 elements: every offset past 2^31 needs 64-bit arithmetic.
    # dq of a query row depends only on that row (and k, v), so the last rows are checked alone.
    free, _ = torch.cuda.mem_get_info()
    if free < 60 * 2**30:
        pytest.skip("needs 60 GB of free GPU memory")
    nheads, head_dim, sk = 2, 128, 40
    sq = (2**31 + 2**24) // (nheads * head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.empty(1, sq, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.empty_like(q)
    for t in (q, dout):
        for chunk in t.view(-1, 2**24):
            chunk.copy_(torch.randn(2**24, generator=gen, device="cuda"))
    k, v = (torch.randn(1, sk, nheads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    scale = head_dim ** -0.5
    out, lse = forward(q, k, v, scale, False, (-1, -1))
    dq = backward(dout, q, k, v, out, lse, scale, False, (-1, -1))[0]
    tail = slice(sq - 1000, sq)
    qs, douts = q[:, tail].contiguous(), dout[:, tail].contiguous()
    del q, dout, out, lse
    ref_dq = attention_reference_with_grads(qs, k, v, douts, softmax_scale=scale)[2]
    low_dq = attention_reference_with_grads(qs, k, v, douts, softmax_scale=scale,
                                            compute_dtype=torch.bfloat16)[2]
    assert_error_rule(("dq",), (dq[:, tail],), (ref_dq,), (low_dq,), torch.bfloat16, "64-bit offsets")
