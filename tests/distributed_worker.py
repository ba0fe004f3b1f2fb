"""The ranks of tests/test_distributed.py: cases, inputs, and the body each
spawned process runs.

Every rank builds the same global tensors from a fixed seed, takes its shard,
runs ring or zigzag attention forward and backward, and gathers the output,
lse and gradients; rank 0 saves them for the parent process to compare with
the single-process result. All cases run in one process group, because
starting the processes (importing torch) costs seconds each.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

from flashattn_ext import distributed as fd


@dataclass(frozen=True)
class RingCase:
    name: str
    layout: str  # "ring" or "zigzag"
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    seqlen: int = 48  # global; a multiple of 2 x 4 so that world sizes 2 and 4 shard it both ways
    batch: int = 2
    nheads: int = 4
    nheads_kv: int = 4
    head_dim: int = 16
    softcap: float = 0.0
    sink: bool = False  # a learnable_sink, the same on every rank; its gradient summed over them

    def __str__(self) -> str:
        return self.name

    @property
    def outputs(self) -> Tuple[str, ...]:
        return OUTPUTS + (("dsink",) if self.sink else ())

    def learnable_sink(self, device="cpu"):
        """fp32 (nheads,) sink logits around the scores' size, or None."""
        if not self.sink:
            return None
        return torch.linspace(-1.0, 2.0, self.nheads, device=device)

    def global_inputs(self, dtype: torch.dtype, device="cpu"):
        """(q, k, v, dout) of the whole sequence, the same on every rank and in the parent."""
        gen = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        shapes = [(self.batch, self.seqlen, h, self.head_dim)
                  for h in (self.nheads, self.nheads_kv, self.nheads_kv, self.nheads)]
        return [torch.randn(*s, generator=gen).to(device=device, dtype=dtype) for s in shapes]

    def kwargs(self) -> dict:
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)


CASES = [
    RingCase("ring_causal", "ring", causal=True, head_dim=32),
    RingCase("ring_full_gqa2", "ring", nheads_kv=2, seqlen=40),
    RingCase("ring_causal_window_mqa", "ring", causal=True, window=(5, -1), nheads_kv=1),
    RingCase("ring_window_right_head_dim_20", "ring", window=(-1, 4), head_dim=20, nheads_kv=2),
    RingCase("zigzag_causal_mqa", "zigzag", causal=True, nheads_kv=1),
    RingCase("zigzag_full_gqa2", "zigzag", nheads_kv=2, seqlen=32, head_dim=32),
    RingCase("zigzag_window_7_3", "zigzag", window=(7, 3), seqlen=64),
    RingCase("zigzag_causal_window_gqa2", "zigzag", causal=True, window=(9, -1), nheads_kv=2,
             head_dim=32),
    RingCase("ring_causal_softcap_sink_gqa2", "ring", causal=True, nheads_kv=2, softcap=1.5, sink=True),
    RingCase("zigzag_window_sink", "zigzag", window=(6, 2), sink=True),
]

FUNCS = {"ring": fd.ring_flash_attn_func, "zigzag": fd.zigzag_ring_flash_attn_func}
SHARD = {"ring": fd.ring_shard, "zigzag": fd.zigzag_shard}
GATHER = {"ring": fd.ring_gather, "zigzag": fd.zigzag_gather}
OUTPUTS = ("out", "lse", "dq", "dk", "dv")


def run_case(case: RingCase, dtype: torch.dtype, device) -> dict:
    """This rank's part of one case; returns the gathered global results."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard, gather = SHARD[case.layout], GATHER[case.layout]
    q, k, v, dout = (shard(t, rank, world_size) for t in case.global_inputs(dtype, device))
    for t in (q, k, v):
        t.requires_grad_(True)
    sink = case.learnable_sink(device)
    if sink is not None:
        sink.requires_grad_(True)
    out, lse, _ = FUNCS[case.layout](q, k, v, return_attn_probs=True, learnable_sink=sink, **case.kwargs())
    out.backward(dout)
    results = dict(out=gather(out.detach()), lse=gather(lse, dim=2), dq=gather(q.grad),
                   dk=gather(k.grad), dv=gather(v.grad))
    if sink is not None:
        dist.all_reduce(sink.grad)  # each rank's rows' share
        results["dsink"] = sink.grad
    return results


def run(rank: int, world_size: int, init_method: str, backend: str, dtypes, result_path: str):
    """Entry point of one spawned rank (torch.multiprocessing passes ``rank`` first)."""
    # The ranks share the machine's cores: one intra-op thread each.
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        results = {}
        for case in CASES:
            for dtype in dtypes:
                gathered = run_case(case, dtype, device)
                results[(case.name, str(dtype))] = {n: t.cpu() for n, t in gathered.items()}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()
