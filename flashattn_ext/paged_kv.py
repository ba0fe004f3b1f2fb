"""Paged keys and values for flash_attn_varlen_func (its block_table argument).

flash-attn 2.x's layout: k and v (num_blocks, page_size, nheads_kv, head_dim) and
block_table int32 (batch, max_blocks_per_seq); key row r of sequence b lives in block
block_table[b][r // page_size], at row r % page_size; sequence b has seqused_k[b] keys, or
cu_seqlens_k[b + 1] - cu_seqlens_k[b] (only those differences count: where the pages
are is the block table's business). Entries past a sequence's last page are never used.

A decoding call (one query row per sequence, no gradient, no dropout) runs on
flash_attn_with_kvcache's op, which reads the pages in place (split-KV, packed GQA).

Any other call: the attention ops take dense or packed keys, so the rows a call can read
are gathered first into one (batch, width, nheads_kv, head_dim) tensor per cache, width =
min(max_seqlen_k, max_blocks_per_seq * page_size), sequence b's keys its first rows (the
op's seqused_k). That copy costs memory and traffic of its size; it needs no host
synchronisation (entries are clamped into range before indexing, so the gather never
reads outside the cache: CUDA-graph capture and torch.compile work), and it is
differentiable, so gradients reach the pages (flash-attn's paged path has no backward).

Checked here, since the ops never see these arguments as given: block_table's dtype,
device and shape, k and v's paged shape, cu_seqlens_k's; and, in eager calls where the
ops check values too (not while compiling or capturing a CUDA graph, nor with
FLASHATTN_SKIP_VALUE_CHECKS=1 on CUDA), the values: one synchronisation.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch

from . import checks
from . import ops

_PAGED_LAYOUT = "(num_blocks, page_size, nheads_kv, head_dim) (block_table given)"


def _check_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, seqused_k, block_table) -> None:
    checks.check_is_tensor(block_table, "block_table")
    if max_seqlen_k < 0:
        raise RuntimeError(f"flashattn_ext: max_seqlen_k must be given (>= 0) with cu_seqlens_k, got {max_seqlen_k}")
    for t, name in ((k, "k"), (v, "v")):
        checks.check_rank(t, name, 4, _PAGED_LAYOUT)
    if k.shape != v.shape:
        raise RuntimeError(f"flashattn_ext: k and v must have the same shape {_PAGED_LAYOUT}: "
                           f"got k {list(k.shape)}, v {list(v.shape)}")
    if k.size(1) < 1:
        raise RuntimeError(f"flashattn_ext: k page_size (dim 1, block_table given) must be positive, got {k.size(1)}")
    sequence_tensors = [(block_table, "block_table", "(batch, max_blocks_per_seq)"),
                        (cu_seqlens_k, "cu_seqlens_k", "(batch + 1,)")]
    if seqused_k is not None:
        sequence_tensors.append((seqused_k, "seqused_k", "(batch,)"))
    for t, name, layout in sequence_tensors:
        if t.dtype != torch.int32:
            raise RuntimeError(f"flashattn_ext: {name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"flashattn_ext: {name} must be on the same device as q: got {t.device}, "
                               f"expected {q.device}")
        checks.check_rank(t, name, 2 if t is block_table else 1, layout)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.size(0) < 1:
        raise RuntimeError(f"flashattn_ext: cu_seqlens_q must be 1-d with batch + 1 >= 1 elements, got shape "
                           f"{list(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.size(0) - 1
    if seqused_k is not None and seqused_k.size(0) != batch:
        raise RuntimeError(f"flashattn_ext: seqused_k must have batch = {batch} elements, got {seqused_k.size(0)}")
    if cu_seqlens_k.size(0) != cu_seqlens_q.size(0):
        raise RuntimeError(f"flashattn_ext: cu_seqlens_k must have the length of cu_seqlens_q = "
                           f"{cu_seqlens_q.size(0)} elements, got {cu_seqlens_k.size(0)}")
    if block_table.size(0) != batch:
        raise RuntimeError(f"flashattn_ext: block_table must have batch = {batch} rows (one per sequence), "
                           f"got {block_table.size(0)}")


def _host_value_checks_enabled(device: torch.device) -> bool:
    """As the ops decide (csrc/cuda/cuda_backend.h): always on the CPU, on CUDA unless a
    graph is being captured or FLASHATTN_SKIP_VALUE_CHECKS=1; never while compiling."""
    if torch.compiler.is_compiling():
        return False
    if device.type != "cuda":
        return True
    return os.environ.get("FLASHATTN_SKIP_VALUE_CHECKS") != "1" and not torch.cuda.is_current_stream_capturing()


def _check_values(lengths, cu_seqlens_k, block_table, num_blocks: int, page_size: int, width: int,
                  max_seqlen_k: int, from_seqused: bool) -> None:
    capacity = block_table.size(1) * page_size
    pages = torch.arange(block_table.size(1), device=block_table.device)
    used = pages < (lengths.long().clamp(min=0) + page_size - 1).div(page_size, rounding_mode="floor")[:, None]
    bad_entries = used & ((block_table < 0) | (block_table >= num_blocks))
    bad_lengths = (lengths < 0) | (lengths > width)
    if not any(torch.stack([bad_lengths.any(), bad_entries.any()]).tolist()):
        return
    if bad_lengths.any():
        b = int(bad_lengths.nonzero()[0, 0])
        length = int(lengths[b])
        if length < 0 and from_seqused:
            raise RuntimeError(f"flashattn_ext: seqused_k[{b}] must be >= 0, got {length}")
        if length < 0:
            raise RuntimeError(f"flashattn_ext: cu_seqlens_k must be non-decreasing: got cu_seqlens_k[{b + 1}] = "
                               f"{int(cu_seqlens_k[b + 1])} < cu_seqlens_k[{b}] = {int(cu_seqlens_k[b])}")
        source = "seqused_k" if from_seqused else "cu_seqlens_k"
        if length > capacity:
            raise RuntimeError(f"flashattn_ext: sequence {b} of {source} has {length} rows, more than the "
                               f"max_blocks_per_seq * page_size = {block_table.size(1)} * {page_size} = {capacity} "
                               f"rows of its block_table row")
        raise RuntimeError(f"flashattn_ext: sequence {b} of {source} has {length} rows, more than max_seqlen_k = "
                           f"{max_seqlen_k}")
    b, page = (int(i) for i in bad_entries.nonzero()[0])
    raise RuntimeError(f"flashattn_ext: block_table[{b}][{page}] must be in [0, num_blocks = {num_blocks}) "
                       f"(a block of sequence {b}'s keys), got {int(block_table[b, page])}")


def _gather(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache's rows `rows` (indices into its (num_blocks * page_size) rows), shaped like rows."""
    if cache.size(0) == 0:  # no page to read: every sequence is empty (checked where values are)
        return cache.new_zeros(*rows.shape, *cache.shape[2:])
    return cache.flatten(0, 1)[rows]


def checked_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, seqused_k,
                    block_table) -> torch.Tensor:
    """Each sequence's number of keys, int32 (batch,) (the op's seqused_k), the arguments
    checked."""
    _check_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, seqused_k, block_table)
    lengths = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if _host_value_checks_enabled(q.device):
        _check_values(lengths, cu_seqlens_k, block_table, k.size(0), k.size(1), _width(k, max_seqlen_k, block_table),
                      max_seqlen_k, seqused_k is not None)
    return lengths


def _width(k, max_seqlen_k: int, block_table) -> int:
    return min(max_seqlen_k, block_table.size(1) * k.size(1))


def _rows_16_byte_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def decodes_in_place(q, k, v, cu_seqlens_q, max_seqlen_q: int, seqused_q, dropout_p: float,
                     learnable_sink) -> bool:
    """Whether the call is a decoding step flash_attn_with_kvcache's op computes the same, on
    the pages in place: one query row per sequence (max_seqlen_q = 1 and as many rows as
    sequences: no synchronisation to know it), no gradient, no dropout (that op has neither),
    and caches it reads as they are (a head dim multiple of 8, pages of a multiple of 16
    rows, rows at 16-byte multiples). Where values
    are checked, cu_seqlens_q must also be 0, 1, ..., batch: a call that only claims one
    row per sequence goes the other way, whose op names what is wrong."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    batch = cu_seqlens_q.size(0) - 1
    if not (max_seqlen_q == 1 and q.dim() == 3 and q.size(0) == batch and seqused_q is None and dropout_p == 0.0
            and not needs_grad and q.size(-1) % 8 == 0 and k.size(1) % 16 == 0
            and k.stride(-1) == 1 and v.stride(-1) == 1 and _rows_16_byte_aligned(k) and _rows_16_byte_aligned(v)):
        return False
    if _host_value_checks_enabled(q.device):
        one_row_each = torch.arange(batch + 1, dtype=cu_seqlens_q.dtype, device=cu_seqlens_q.device)
        return bool(torch.equal(cu_seqlens_q, one_row_each))
    return True


def decode(q, k, v, lengths, block_table, softmax_scale: float, causal: bool, window_left: int, window_right: int,
           softcap: float, alibi_slopes, learnable_sink) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, nheads, head_dim), lse (nheads, batch)) of a decodes_in_place call."""
    out, lse = ops.attention_kvcache_forward(
        ops.unit_stride_last_dim(q).unsqueeze(1), k, v, None, None, None, None, lengths.contiguous(), None, None,
        block_table, softmax_scale, causal, window_left, window_right, softcap, True, alibi_slopes, 0,
        learnable_sink)
    return out.squeeze(1), lse.squeeze(2).t().contiguous()


def gather_pages(k, v, lengths, max_seqlen_k: int, block_table) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k_rows, v_rows): each sequence's keys and values (the first lengths[b] rows of
    its pages) as the first rows of a (batch, width, nheads_kv, head_dim) tensor."""
    num_blocks, page_size = k.size(0), k.size(1)
    width = _width(k, max_seqlen_k, block_table)
    positions = torch.arange(width, device=block_table.device)
    blocks = block_table[:, positions // page_size].long().clamp(0, max(num_blocks - 1, 0))
    rows = blocks * page_size + positions % page_size
    return _gather(k, rows), _gather(v, rows)
