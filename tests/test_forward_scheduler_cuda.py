"""The forward's persistent grid against its static grid, for both kernel families: the
Hopper kernel (skipped without an sm_90 GPU and a build with the Hopper kernels) and the
mma.sync one (its persistent grid compiled for plain scores; forced on a Hopper build with
FLASHATTN_DISABLE_HOPPER_KERNELS, and what the tiles without a Hopper plan run).

A tile's output is computed by one thread block from the same inputs in the same order
whichever block takes it, so the persistent grid (resident blocks taking tiles from a
counter) must give the static grid's out and lse bit for bit. FLASHATTN_FORWARD_SCHEDULER
picks the grid per call; `persistent:N` caps the grid at N blocks, so that these small
problems walk several tiles per block and carry the K/V rings, the Q barrier and the tile
hand-over from one tile to the next (empty tiles of short sequences, tiles without keys).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flashattn_ext
from cuda_inputs import hopper_build
from reference import assert_error_rule, attention_reference
from sample_inputs import CASES_BY_NAME, VARLEN_CASES, AttentionCase

forward_op = torch.ops.flashattn_ext.attention_forward


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(params=("hopper", "sm80"))
def family(request, monkeypatch):
    if request.param == "hopper" and not hopper_build():
        pytest.skip("needs an sm_90 GPU and the Hopper kernels")
    if request.param == "sm80" and hopper_build():
        monkeypatch.setenv("FLASHATTN_DISABLE_HOPPER_KERNELS", "1")
    return request.param


def skip_unless_persistent(family, case, head_dim, dropout=False):
    """The mma.sync kernel's persistent grid is compiled for plain scores only, and not for its
    W 128 tile (sm80/forward_launch.cuh): elsewhere both settings run its static grid, and
    comparing them would test nothing."""
    modified = dropout or case.softcap or case.alibi or case.sink
    if family == "sm80" and (modified or head_dim == 128):
        pytest.skip("the mma.sync persistent grid runs plain scores at head-dim tiles other than 128")


def grid_head_dim(family):
    """A head dim whose tile has a persistent grid in the family."""
    return 128 if family == "hopper" else 64


PERSISTENT = ("persistent:1", "persistent:3", "persistent:7", "persistent")
HEAD_DIMS = (32, 64, 96, 128, 256)  # 32 and 96: no Hopper plan, the mma.sync kernel runs
DENSE_CASES = [
    AttentionCase("many_tiles_causal", batch=3, seqlen_q=700, seqlen_k=700, nheads=5, nheads_kv=5, causal=True),
    AttentionCase("many_tiles_gqa_q_lt_k", batch=2, seqlen_q=333, seqlen_k=1000, nheads=6, nheads_kv=2),
    CASES_BY_NAME["q203_k113_causal"],       # rows that see no key
    CASES_BY_NAME["window_masks_rows"],      # tiles without keys
    CASES_BY_NAME["mixed_strides_causal"],
    CASES_BY_NAME["sink_all_features"],      # softcap + ALiBi + sink + window
    CASES_BY_NAME["alibi_per_batch_head"],
]
# Dropout (p, rng_state [seed, offset]), on the first two cases.
DROPOUT = (0.3, (1234, 77))


def run_forward(inputs, scheduler, monkeypatch, dropout=None):
    monkeypatch.setenv("FLASHATTN_FORWARD_SCHEDULER", scheduler)
    args = list(inputs.forward_op_args())
    if dropout is not None:
        args[9] = dropout[0]
        args[10] = torch.tensor(dropout[1], dtype=torch.int64, device="cuda")
    out, lse = forward_op(*args)
    torch.cuda.synchronize()
    return out, lse


def assert_same_bits(static, persistent, context):
    for name, a, b in zip(("out", "lse"), static, persistent):
        assert a.shape == b.shape, f"{context}: {name} shape"
        same = (a == b) | (a.isnan() & b.isnan())
        assert bool(same.all()), (f"{context}: {name} differs at {int((~same).sum())} of {a.numel()} elements "
                                  f"(max |diff| {float((a.float() - b.float()).abs().nan_to_num(0).max()):.3g})")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case,dropout", [(c, False) for c in DENSE_CASES] + [(c, True) for c in DENSE_CASES[:2]],
                         ids=lambda x: str(x) if isinstance(x, AttentionCase) else ("dropout" if x else "plain"))
def test_persistent_grid_matches_static_grid(case, dropout, head_dim, family, monkeypatch):
    skip_unless_persistent(family, case, head_dim, dropout)
    inputs = dataclasses.replace(case, head_dim=head_dim).make(torch.bfloat16, "cuda", seed=head_dim)
    drop = DROPOUT if dropout else None
    static = run_forward(inputs, "static", monkeypatch, drop)
    for scheduler in PERSISTENT:
        assert_same_bits(static, run_forward(inputs, scheduler, monkeypatch, drop), f"{case} d{head_dim} {scheduler}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", [c for c in VARLEN_CASES if c.op_compatible], ids=str)
def test_persistent_grid_matches_static_grid_varlen(case, head_dim, family, monkeypatch):
    skip_unless_persistent(family, case, head_dim)
    inputs = dataclasses.replace(case, head_dim=head_dim).make(torch.float16, "cuda", seed=head_dim)
    static = run_forward(inputs, "static", monkeypatch)
    for scheduler in PERSISTENT:
        assert_same_bits(static, run_forward(inputs, scheduler, monkeypatch), f"{case} d{head_dim} {scheduler}")


def test_persistent_grid_against_the_reference(family, monkeypatch):
    case = DENSE_CASES[0]
    inputs = dataclasses.replace(case, head_dim=grid_head_dim(family)).make(torch.bfloat16, "cuda", seed=5)
    out, lse = run_forward(inputs, "persistent:5", monkeypatch)
    kwargs = dict(softmax_scale=inputs.resolved_scale(), causal=True)
    ref = attention_reference(inputs.q, inputs.k, inputs.v, **kwargs)
    low = attention_reference(inputs.q, inputs.k, inputs.v, compute_dtype=torch.bfloat16, **kwargs)
    assert_error_rule(("out", "lse"), (out, lse), ref, (low[0], low[1].float()), torch.bfloat16, "persistent:5")


def test_cuda_graph_replays_restart_the_tile_counter(family, monkeypatch):
    """The counter is zeroed on the stream by each call, so a captured call's replays walk every
    tile again (a counter left at its end would leave out a replay's tiles but the first ones)."""
    case = dataclasses.replace(DENSE_CASES[0], head_dim=grid_head_dim(family))
    inputs = case.make(torch.bfloat16, "cuda", seed=11)
    monkeypatch.setenv("FLASHATTN_FORWARD_SCHEDULER", "persistent:3")
    args = inputs.forward_op_args()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        forward_op(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_op(*args)
    for seed in (12, 13):
        fresh = case.make(torch.bfloat16, "cuda", seed=seed)
        for name in ("q", "k", "v"):
            getattr(inputs, name).copy_(getattr(fresh, name))
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(run_forward(inputs, "static", monkeypatch), captured, f"replay with inputs of seed {seed}")


def forward_kernel_names(inputs, scheduler, monkeypatch):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_forward(inputs, scheduler, monkeypatch)
    return {e.name for e in prof.events() if "attention_forward" in e.name and "kernel" in e.name}


def test_the_setting_picks_the_grid(family, monkeypatch):
    """The comparisons above would pass if the setting were ignored: the two grids must run
    different kernels (the persistent one's last template argument is true) of the family."""
    inputs = dataclasses.replace(DENSE_CASES[0], head_dim=grid_head_dim(family)).make(torch.bfloat16, "cuda")
    static = forward_kernel_names(inputs, "static", monkeypatch)
    persistent = forward_kernel_names(inputs, "persistent:3", monkeypatch)
    assert len(static) == 1 and len(persistent) == 1 and static != persistent, (static, persistent)
    assert all(("sm90" in name) == (family == "hopper") for name in static | persistent), (static, persistent)


def test_bad_setting_is_refused(monkeypatch):
    inputs = CASES_BY_NAME["basic"].make(torch.bfloat16, "cuda")
    for bad in ("dynamic", "persistent:0", "persistent:", "persistent:x"):
        with pytest.raises(RuntimeError, match=f"FLASHATTN_FORWARD_SCHEDULER must be .* got '{bad}'"):
            run_forward(inputs, bad, monkeypatch)
