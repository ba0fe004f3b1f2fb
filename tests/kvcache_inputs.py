"""The flash_attn_with_kvcache cases shared by test_kvcache.py and test_opcheck.py, and
their inputs: random caches (dense, or paged with blocks in random order and blocks no
sequence uses), random cache_seqlens / cache_leftpad / cache_batch_idx, rotary tables of
random angles. Sizes are small: the CPU tests run every case in three dtypes and four
num_splits on 2 cores.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sample_inputs import make_alibi_slopes


@dataclass(frozen=True)
class KvcacheCase:
    name: str
    batch: int = 2
    seqlen_q: int = 1
    seqlen_new: int = 1      # 0: no k, v (attention over the cache as it is)
    capacity: int = 48       # rows of a cache row (dense) or of a sequence's blocks (paged)
    nheads: int = 4
    nheads_kv: int = 1
    head_dim: int = 32
    causal: bool = True
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    rotary_dim: int = 0
    rotary_interleaved: bool = True
    leftpad: bool = False
    batch_idx: bool = False   # cache rows picked by cache_batch_idx from a larger cache
    page_size: Optional[int] = None
    sink: bool = False
    # None, "nheads" (shape (nheads,)) or "batch_nheads" (one row per batch entry).
    alibi: Optional[str] = None
    seqlens: str = "random"   # "random", "zero" (an empty cache), "none" (cache_seqlens=None)
    seqlens_as_int: bool = False

    def __str__(self) -> str:
        return self.name


CASES = [
    KvcacheCase("decode_mqa", nheads=8, nheads_kv=1, head_dim=64),
    KvcacheCase("decode_gqa4_rotary_gptj", nheads=8, nheads_kv=2, head_dim=64, rotary_dim=32),
    KvcacheCase("decode_mha_rotary_neox_full", nheads=2, nheads_kv=2, rotary_dim=32, rotary_interleaved=False),
    KvcacheCase("decode_not_causal", causal=False, rotary_dim=16),
    KvcacheCase("chunk_causal_rotary", seqlen_q=5, seqlen_new=5, nheads=4, nheads_kv=2, rotary_dim=16,
                rotary_interleaved=False),
    KvcacheCase("chunk_not_causal_rotary", seqlen_q=3, seqlen_new=3, causal=False, rotary_dim=32),
    KvcacheCase("prefill_empty_cache", seqlen_q=17, seqlen_new=17, seqlens="zero", rotary_dim=16),
    KvcacheCase("more_queries_than_keys", seqlen_q=4, seqlen_new=1, seqlens="zero"),
    KvcacheCase("cache_only", seqlen_q=2, seqlen_new=0),
    KvcacheCase("cache_only_int_seqlens", seqlen_q=1, seqlen_new=0, seqlens_as_int=True),
    KvcacheCase("whole_cache_rows", seqlen_q=3, seqlen_new=0, seqlens="none", causal=False),
    KvcacheCase("int_seqlens", seqlen_new=2, seqlen_q=2, seqlens_as_int=True, rotary_dim=16),
    KvcacheCase("leftpad_rotary", seqlen_q=2, seqlen_new=2, leftpad=True, rotary_dim=16),
    KvcacheCase("batch_idx", batch=3, seqlen_q=2, seqlen_new=2, batch_idx=True, rotary_dim=16),
    KvcacheCase("window_local", seqlen_q=4, seqlen_new=4, causal=False, window=(6, 0), rotary_dim=16),
    KvcacheCase("window_both_sides", seqlen_q=3, seqlen_new=3, causal=False, window=(5, 1)),
    KvcacheCase("window_causal", seqlen_q=3, seqlen_new=3, window=(4, -1)),
    KvcacheCase("softcap", seqlen_q=2, seqlen_new=1, softcap=3.0),
    KvcacheCase("sink", seqlen_q=2, seqlen_new=2, sink=True),
    KvcacheCase("gqa8_d128", nheads=8, nheads_kv=1, head_dim=128, seqlen_q=2, seqlen_new=2, rotary_dim=64),
    KvcacheCase("d256", nheads=2, nheads_kv=2, head_dim=256, capacity=24, rotary_dim=128),
    KvcacheCase("paged16", seqlen_q=2, seqlen_new=2, page_size=16, rotary_dim=16),
    KvcacheCase("paged16_leftpad", seqlen_q=3, seqlen_new=3, page_size=16, leftpad=True),
    KvcacheCase("paged64_chunk", seqlen_q=9, seqlen_new=9, capacity=192, page_size=64, nheads_kv=2,
                rotary_dim=32),
    KvcacheCase("paged256", seqlen_q=1, seqlen_new=1, capacity=512, page_size=256, nheads=8, nheads_kv=2),
    # ALiBi measures from each query's diagonal in the whole sequence, whatever part of the
    # keys a split holds: chunks whose queries see keys on both sides of it, leftpad, pages.
    KvcacheCase("alibi_decode_gqa4", nheads=8, nheads_kv=2, alibi="nheads", rotary_dim=16),
    KvcacheCase("alibi_chunk_not_causal_per_batch", seqlen_q=5, seqlen_new=3, causal=False, alibi="batch_nheads"),
    KvcacheCase("alibi_window_leftpad_paged16_softcap", seqlen_q=4, seqlen_new=4, causal=False, window=(9, 2),
                leftpad=True, page_size=16, softcap=4.0, alibi="nheads", nheads=4, nheads_kv=2),
]
CASES_BY_NAME = {case.name: case for case in CASES}


@dataclass
class KvcacheInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary_cos: Optional[torch.Tensor]
    rotary_sin: Optional[torch.Tensor]
    cache_seqlens: object                      # int32 (batch,), an int, or None
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    learnable_sink: Optional[torch.Tensor]
    alibi_slopes: Optional[torch.Tensor]

    def func_kwargs(self, case: KvcacheCase) -> dict:
        return dict(k=self.k, v=self.v, rotary_cos=self.rotary_cos, rotary_sin=self.rotary_sin,
                    cache_seqlens=self.cache_seqlens, cache_batch_idx=self.cache_batch_idx,
                    cache_leftpad=self.cache_leftpad, block_table=self.block_table, causal=case.causal,
                    window_size=case.window, softcap=case.softcap,
                    rotary_interleaved=case.rotary_interleaved, alibi_slopes=self.alibi_slopes,
                    learnable_sink=self.learnable_sink)

    def op_args(self, case: KvcacheCase, num_splits: int = 1) -> tuple:
        """Positional arguments of the op (cache_seqlens as a tensor)."""
        seqlens = self.cache_seqlens
        if isinstance(seqlens, int):
            seqlens = torch.full((self.q.size(0),), seqlens, dtype=torch.int32, device=self.q.device)
        return (self.q, self.k_cache, self.v_cache, self.k, self.v, self.rotary_cos, self.rotary_sin,
                seqlens, self.cache_batch_idx, self.cache_leftpad, self.block_table,
                self.q.size(-1) ** -0.5, case.causal, case.window[0], case.window[1], case.softcap,
                case.rotary_interleaved, self.alibi_slopes, num_splits, self.learnable_sink)

    def clone_caches(self) -> "KvcacheInputs":
        return dataclasses.replace(self, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone())


def seqlens_values(case: KvcacheCase, gen: torch.Generator) -> torch.Tensor:
    """Each sequence's length before the call (int64, CPU); capacity for "none"."""
    if case.seqlens == "none":
        return torch.full((case.batch,), case.capacity, dtype=torch.int64)
    if case.seqlens == "zero":
        return torch.zeros(case.batch, dtype=torch.int64)
    if case.seqlens_as_int:
        return torch.full((case.batch,), case.capacity // 2, dtype=torch.int64)
    return torch.randint(0, case.capacity - case.seqlen_new + 1, (case.batch,), generator=gen)


def make_inputs(case: KvcacheCase, dtype: torch.dtype, device="cpu", seed: int = 0) -> KvcacheInputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, d, hk = case.batch, case.head_dim, case.nheads_kv
    seqlens = seqlens_values(case, gen)
    if case.page_size is None:
        rows = b + 2 if case.batch_idx else b
        k_cache, v_cache = randn(rows, case.capacity, hk, d), randn(rows, case.capacity, hk, d)
        block_table = None
    else:
        blocks_per_seq = case.capacity // case.page_size
        num_blocks = b * blocks_per_seq + 3  # blocks no sequence uses: they must stay untouched
        k_cache, v_cache = randn(num_blocks, case.page_size, hk, d), randn(num_blocks, case.page_size, hk, d)
        table = torch.randperm(num_blocks, generator=gen)[:b * blocks_per_seq].view(b, blocks_per_seq)
        block_table = table.to(device=device, dtype=torch.int32)
    batch_idx = (torch.randperm(b + 2, generator=gen)[:b].to(device=device, dtype=torch.int32)
                 if case.batch_idx else None)
    leftpad = None
    if case.leftpad:
        leftpad = torch.stack([torch.randint(0, int(n) + 1, (1,), generator=gen)[0] for n in seqlens])
        leftpad = leftpad.to(device=device, dtype=torch.int32)
    rotary_cos = rotary_sin = None
    if case.rotary_dim:
        angles = torch.rand(case.capacity + case.seqlen_q, case.rotary_dim // 2, generator=gen,
                            dtype=torch.float64) * 2 * math.pi
        rotary_cos, rotary_sin = (f(angles).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
    if case.seqlens == "none":
        cache_seqlens = None
    elif case.seqlens_as_int:
        cache_seqlens = int(seqlens[0])
    else:
        cache_seqlens = seqlens.to(device=device, dtype=torch.int32)
    k = v = None
    if case.seqlen_new:
        k, v = randn(b, case.seqlen_new, hk, d), randn(b, case.seqlen_new, hk, d)
    sink = (torch.randn(case.nheads, generator=gen) + 1.0).to(device) if case.sink else None
    alibi_slopes = make_alibi_slopes(case.alibi, b, case.nheads, gen, device)
    return KvcacheInputs(randn(b, case.seqlen_q, case.nheads, d), k_cache, v_cache, k, v, rotary_cos,
                         rotary_sin, cache_seqlens, batch_idx, leftpad, block_table, sink, alibi_slopes)
