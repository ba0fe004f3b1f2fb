"""Context parallelism: exact attention over a sequence sharded across the ranks
of a torch.distributed process group (ring attention).

Each rank holds the queries, keys and values of its part of the sequence. The
K/V blocks travel around the ring of ranks with point-to-point operations; at
each of the P steps a rank attends its queries to the block it holds while the
next block is in flight, and folds the block's (out, lse) into its running
result by log-sum-exp in fp32 (merge_attention_outputs). The backward sends
the K/V blocks around again together with fp32 dK/dV accumulators, which end
the P-th hop back on their owner; dQ stays local. Every block's backward
recomputes P = exp(S - lse) from the merged (global) out and lse, so each block
gives exactly its share of the gradients.

Two layouts of the global sequence, for world size P (the group's size):

* ring: rank r holds the r-th of P equal contiguous parts
  (ring_shard / ring_gather);
* zigzag: the sequence in 2P equal chunks, rank r holding chunks r and
  2P - 1 - r, so that under a causal mask every rank has the same amount of
  work at every step (zigzag_shard / zigzag_gather).

Masks are those of flash_attn_func on the global tensors (seqlen_q = seqlen_k,
so causal and the sliding window are the ordinary diagonal ones). The op's mask
is relative to the bottom-right corner of the q and k it is given, so each
block's part of the global mask is rebuilt by trimming the block to the rows
and keys that see one another (_band_call): causal and any sliding window are
exact. softcap acts on each score alone, so every block applies it. A learnable
sink joins each row's denominator once: folded into the merged (out, lse) after
the last step, its gradient -sum(exp(sink - lse) * rowsum(dout * out)) over this
rank's rows (the ranks' shares add up like those of any replicated parameter).
ALiBi is not exact (its bias needs a per-block distance offset the op lacks),
nor is dropout (its mask is keyed by the row and column within the op's call, so
the blocks would need global offsets too); both raise NotImplementedError.

Works on any backend the kernels run on: CUDA tensors with NCCL, CPU tensors
with gloo. Every rank must pass shards of the same shape.
"""

from __future__ import annotations

import itertools
import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import checks
from . import ops
from .interface import _kernel_operands, _softmax_scale

RING = "ring"
ZIGZAG = "zigzag"

# (global position of its first token, length): the contiguous runs of the
# global sequence that one rank's shard holds, in the shard's order.
Segment = Tuple[int, int]
# (q_start, q_end, k_start, k_end, window_left, window_right): one op call on
# rows q_start:q_end of the local queries and keys k_start:k_end of a held block.
BlockCall = Tuple[int, int, int, int, int, int]


def _segments(layout: str, rank: int, world_size: int, local_len: int) -> List[Segment]:
    if layout == RING:
        return [(rank * local_len, local_len)]
    chunk = local_len // 2
    return [(rank * chunk, chunk), ((2 * world_size - 1 - rank) * chunk, chunk)]


def _band_call(q_start: int, q_len: int, k_start: int, k_len: int, lo, hi) -> Optional[BlockCall]:
    """The op call for global query positions [q_start, q_start + q_len) against
    keys [k_start, k_start + k_len) under the mask lo <= key - query <= hi
    (lo may be -inf, hi +inf); None when no query sees a key.

    The op aligns its mask to the bottom-right corner of what it is given, so the
    block is trimmed to the rows that see a key and the keys some row sees. The
    last trimmed row and key then lie on the band (their offset ``corner`` is in
    [lo, hi]), and the op's window is the band measured from that corner. Rows
    inside the trimmed range that see nothing get lse = +inf from the op.
    """
    row_first = max(q_start, k_start - hi)
    row_last = min(q_start + q_len - 1, k_start + k_len - 1 - lo)
    key_first = max(k_start, q_start + lo)
    key_last = min(k_start + k_len - 1, q_start + q_len - 1 + hi)
    if row_first > row_last or key_first > key_last:
        return None
    corner = key_last - row_last
    rows, keys = row_last + 1 - row_first, key_last + 1 - key_first
    # A bound that reaches past the trimmed block is none (-1), which marks an
    # unmasked call: _coalesce_full joins those, and the kernels skip the mask.
    left = -1 if lo == -math.inf or corner - lo >= keys - 1 else corner - lo
    right = -1 if hi == math.inf or hi - corner >= rows - 1 else hi - corner
    return (row_first - q_start, row_last + 1 - q_start, key_first - k_start, key_last + 1 - k_start,
            int(left), int(right))


def _join_full(x: BlockCall, y: BlockCall) -> Optional[BlockCall]:
    """x and y as one call, when both are unmasked and side by side (same rows and
    adjacent keys, or same keys and adjacent rows); else None."""
    if x[4:] != (-1, -1) or y[4:] != (-1, -1):
        return None
    if x[:2] == y[:2] and x[3] == y[2]:
        return (x[0], x[1], x[2], y[3], -1, -1)
    if x[2:4] == y[2:4] and x[1] == y[0]:
        return (x[0], y[1], x[2], x[3], -1, -1)
    return None


def _coalesce_full(calls: List[BlockCall]) -> List[BlockCall]:
    """calls with unmasked neighbours joined: fewer, larger kernel launches and
    merges (zigzag: one call per causal step instead of two)."""
    while True:
        for a, b in itertools.permutations(range(len(calls)), 2):
            joined = _join_full(calls[a], calls[b])
            if joined is not None:
                calls = [c for i, c in enumerate(calls) if i not in (a, b)] + [joined]
                break
        else:
            return calls


def _block_calls(q_segments: Sequence[Segment], k_segments: Sequence[Segment], lo, hi) -> List[BlockCall]:
    """The op calls that compute, exactly, the attention of the local queries
    (laid out as q_segments) over a held K/V block (laid out as k_segments)."""
    if list(q_segments) == list(k_segments) and lo in (0, -math.inf) and hi in (0, math.inf):
        # Same positions on both sides, increasing along the shard: the order of
        # local indices is that of global positions, so a mask made only of order
        # comparisons (causal, full) is the op's own on the whole shard.
        return [(0, sum(n for _, n in q_segments), 0, sum(n for _, n in k_segments),
                 -1 if lo == -math.inf else 0, -1 if hi == math.inf else 0)]
    calls = []
    q_offset = 0
    for q_start, q_len in q_segments:
        k_offset = 0
        for k_start, k_len in k_segments:
            call = _band_call(q_start, q_len, k_start, k_len, lo, hi)
            if call is not None:
                qs, qe, ks, ke, left, right = call
                calls.append((q_offset + qs, q_offset + qe, k_offset + ks, k_offset + ke, left, right))
            k_offset += k_len
        q_offset += q_len
    return _coalesce_full(calls)


def merge_attention_outputs(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over the union of two disjoint key sets, from each
    set's (out, lse) in the op's layout: out (batch, seqlen, nheads, head_dim),
    lse (batch, nheads, seqlen), fp32 (fp64 for fp64 inputs).

    Computed in fp32 (fp64 for fp64 outputs) with the larger lse subtracted, so
    no exponential overflows. A row with lse = +inf (it saw no key in that set,
    the ops' convention) contributes nothing; a row empty in both stays empty:
    out 0, lse +inf.
    """
    dtype = torch.promote_types(out_a.dtype, torch.float32)
    # +inf marks an empty row; as a log-sum-exp an empty sum is -inf.
    la = lse_a.masked_fill(lse_a == math.inf, -math.inf)
    lb = lse_b.masked_fill(lse_b == math.inf, -math.inf)
    top = torch.maximum(la, lb)
    empty = top == -math.inf
    top = top.masked_fill(empty, 0.0)
    wa, wb = torch.exp(la - top), torch.exp(lb - top)
    total = wa + wb
    lse = (top + torch.log(total)).masked_fill(empty, math.inf)
    # (batch, nheads, seqlen) weights of rows of (batch, seqlen, nheads, head_dim).
    wa, wb = ((w / total.masked_fill(empty, 1.0)).transpose(1, 2).unsqueeze(-1).to(dtype)
              for w in (wa, wb))
    out = out_a.to(dtype) * wa + out_b.to(dtype) * wb
    return out, lse


class _Ring:
    """Point-to-point hops from each rank of ``group`` to the next one."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def pass_on(self, tensor: torch.Tensor) -> "_InFlight":
        """Starts sending tensor to the next rank and receiving the previous
        rank's into a new buffer; the transfer overlaps whatever runs until
        wait(). One rank is its own neighbour: nothing moves."""
        if self.size == 1:
            return _InFlight(tensor, [])
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, received, group=self.group,
                       group_peer=(self.rank - 1) % self.size),
        ])
        return _InFlight(received, requests)


class _InFlight:
    def __init__(self, tensor, requests):
        self._tensor, self._requests = tensor, requests

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        return self._tensor


def _held_block_calls(layout, ring: _Ring, step: int, local_len: int, lo, hi) -> List[BlockCall]:
    """The op calls of ``step``, at which this rank holds the K/V of rank rank - step."""
    source = (ring.rank - step) % ring.size
    return _block_calls(_segments(layout, ring.rank, ring.size, local_len),
                        _segments(layout, source, ring.size, local_len), lo, hi)


def _ring_forward(q, kv, layout, softmax_scale, softcap, lo, hi, ring: _Ring):
    """(out in fp32 (fp64 for fp64 inputs), lse) merged over every held block."""
    local_len = q.size(1)
    out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    lse = torch.full((q.size(0), q.size(2), local_len), math.inf, dtype=checks.lse_dtype(q.dtype),
                     device=q.device)
    for step in range(ring.size):
        incoming = ring.pass_on(kv) if step + 1 < ring.size else None
        for qs, qe, ks, ke, left, right in _held_block_calls(layout, ring, step, local_len, lo, hi):
            block_out, block_lse = ops.attention_forward(
                q[:, qs:qe], kv[0, :, ks:ke], kv[1, :, ks:ke], softmax_scale, False, left, right,
                softcap, None, 0.0, None, False)
            out[:, qs:qe], lse[:, :, qs:qe] = merge_attention_outputs(
                out[:, qs:qe], lse[:, :, qs:qe], block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def _fold_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with the sink's logit joining each row's denominator: lse' =
    logaddexp(lse, sink), out scaled by exp(lse - lse'); a row without keys gets out 0,
    lse = sink."""
    keys = lse.masked_fill(lse == math.inf, -math.inf)
    folded = torch.logaddexp(keys, sink.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(keys - folded).transpose(1, 2).unsqueeze(-1).to(out.dtype), folded


def _sink_gradient(dout, out, lse, sink) -> torch.Tensor:
    """d loss / d sink over this rank's rows: -sum exp(sink - lse) rowsum(dout * out)."""
    wide = lse.dtype
    delta = (dout.to(wide) * out.to(wide)).sum(-1).transpose(1, 2)  # (batch, nheads, rows)
    share = torch.exp(sink.to(wide).view(1, -1, 1) - lse)
    return -(share * delta).sum(dim=(0, 2)).to(sink.dtype)


def _ring_backward(dout, q, kv, out, lse, layout, softmax_scale, softcap, lo, hi, deterministic, ring: _Ring):
    local_len = q.size(1)
    wide = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dkv_in_flight = None
    for step in range(ring.size):
        incoming = ring.pass_on(kv) if step + 1 < ring.size else None
        dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)
        for qs, qe, ks, ke, left, right in _held_block_calls(layout, ring, step, local_len, lo, hi):
            q_rows, k_rows, v_rows = q[:, qs:qe], kv[0, :, ks:ke], kv[1, :, ks:ke]
            block_dq, block_dk, block_dv, _ = ops.run_backward(
                dout[:, qs:qe], q_rows, k_rows, v_rows, out[:, qs:qe], lse[:, :, qs:qe], softmax_scale,
                False, left, right, softcap, None, 0.0, None, deterministic)
            dq[:, qs:qe] += block_dq
            dkv[0, :, ks:ke] += block_dk
            dkv[1, :, ks:ke] += block_dv
        if dkv_in_flight is not None:
            # The accumulator of the same block, from the ranks that held it before.
            dkv += dkv_in_flight.wait()
        # After the last step this hop takes every accumulator home.
        dkv_in_flight = ring.pass_on(dkv)
        if incoming is not None:
            kv = incoming.wait()
    return dq, dkv_in_flight.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, layout, softmax_scale, softcap, lo, hi, deterministic, ring):
        # One tensor, so one message per hop.
        kv = torch.stack([k, v])
        out, lse = _ring_forward(q, kv, layout, softmax_scale, softcap, lo, hi, ring)
        if sink is not None:
            out, lse = _fold_sink(out, lse, sink)
        # Every block's backward recomputes P from this out and lse: the sink's share included.
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse, sink)
        ctx.args = (layout, softmax_scale, softcap, lo, hi, deterministic, ring)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        del dlse  # lse has no gradient, as in flash_attn_func
        q, kv, out, lse, sink = ctx.saved_tensors
        dout = ops.unit_stride_last_dim(dout)
        dq, dkv = _ring_backward(dout, q, kv, out, lse, *ctx.args)
        dsink = _sink_gradient(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        return (dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), dsink,
                None, None, None, None, None, None, None)


def _process_group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "flashattn_ext: ring attention needs an initialised torch.distributed process group "
            "(call torch.distributed.init_process_group first); got none")
    return dist.group.WORLD if group is None else group


def _mask_bounds(causal: bool, window_size) -> Tuple[float, float]:
    """The mask as lo <= key - query <= hi (a negative window bound is unbounded;
    causal sets the right bound to 0, as in flash_attn_func)."""
    left, right = checks.check_window_size(window_size)
    lo = -math.inf if left < 0 else -left
    hi = 0 if causal else (math.inf if right < 0 else right)
    return lo, hi


def _check_shard_lengths(q, k, layout: str, world_size: int) -> None:
    if q.size(1) != k.size(1):
        raise RuntimeError(
            "flashattn_ext: ring attention needs equal shards of one sequence: q and k must have "
            f"the same local seqlen (dim 1): got {q.size(1)} and {k.size(1)}")
    if layout == ZIGZAG and q.size(1) % 2 != 0:
        raise RuntimeError(
            "flashattn_ext: zigzag ring attention needs an even local seqlen (q dim 1: chunks r and "
            f"2P - 1 - r of the global sequence, so a global seqlen divisible by 2P = "
            f"{2 * world_size}): got {q.size(1)}")


def _check_local_shard(q, k, v, softmax_scale, dropout_p, softcap, learnable_sink) -> None:
    """The op's own checks (its Meta kernel: shapes, dtypes, strides, the scalars, the sink)
    on this rank's shards, before any rank sends: every rank fails alike, none waits on a peer."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        checks.check_is_tensor(t, name)
    if learnable_sink is not None:
        checks.check_is_tensor(learnable_sink, "learnable_sink")
    on_meta = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
               for t in (q, k, v, learnable_sink)]
    shards, sink = on_meta[:3], on_meta[3]
    head_dim = q.size(-1) if q.dim() > 0 else 0
    # A valid dropout_p > 0 is refused by ring attention itself (after this); an invalid
    # one (negative, NaN, >= 1) goes to the op's check.
    checked_dropout_p = 0.0 if 0.0 < dropout_p < 1.0 else dropout_p
    ops.attention_forward(*_kernel_operands(*shards), _softmax_scale(softmax_scale, head_dim), False, -1,
                          -1, float(softcap), None, checked_dropout_p, None, learnable_sink=sink)


def _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, learnable_sink, group, layout):
    ring = _Ring(_process_group(group))
    dropout_p = float(dropout_p)
    _check_local_shard(q, k, v, softmax_scale, dropout_p, softcap, learnable_sink)
    _check_shard_lengths(q, k, layout, ring.size)
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"flashattn_ext: dropout_p > 0 is not implemented by ring attention yet, got {dropout_p}")
    if alibi_slopes is not None:
        raise NotImplementedError(
            "flashattn_ext: alibi_slopes is not supported by ring attention: the op measures the "
            "ALiBi distance from each block's own corner, and a block of the ring would need an "
            "offset added to it; got a tensor, expected None")
    lo, hi = _mask_bounds(causal, window_size)
    head_dim = q.size(-1)
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    out, lse = _RingAttention.apply(*_kernel_operands(q, k, v), learnable_sink, layout, softmax_scale,
                                    float(softcap), lo, hi, bool(deterministic), ring)
    out = out[..., :head_dim]
    if return_attn_probs:
        return out, lse, None
    return out


_FUNC_DOC = """
    Arguments are those of flash_attn_func, plus ``group``: the process group
    whose ranks hold the shards (default: the world); learnable_sink (keyword
    only) is the same tensor on every rank, and its gradient on a rank is that
    rank's rows' share (sum it over the group, as for any replicated parameter).
    q (batch, local_seqlen, nheads, head_dim), k and v (batch, local_seqlen,
    nheads_kv, head_dim): this rank's shard, the same shape on every rank.
    causal and window_size refer to positions in the global sequence.
    dropout_p > 0 and alibi_slopes raise NotImplementedError.

    Returns this rank's shard of the output, or with return_attn_probs
    (out, softmax_lse (batch, nheads, local_seqlen) in fp32 (fp64 for fp64
    inputs), None). Differentiable with respect to q, k and v; every rank of the
    group must call the backward.
"""


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                         return_attn_probs=False, group=None, *, learnable_sink=None):
    return _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink, group, RING)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, learnable_sink=None):
    return _ring_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink, group, ZIGZAG)


ring_flash_attn_func.__doc__ = """Attention over a sequence split in P contiguous
    shards, rank r of ``group`` holding the r-th (see ring_shard).
""" + _FUNC_DOC
zigzag_ring_flash_attn_func.__doc__ = """Attention over a sequence split in 2P chunks,
    rank r of ``group`` holding chunks r and 2P - 1 - r (see zigzag_shard): the
    causal work is the same on every rank.
""" + _FUNC_DOC


def _shard(x: torch.Tensor, layout: str, rank: int, world_size: int, dim: int) -> torch.Tensor:
    parts = world_size if layout == RING else 2 * world_size
    if x.size(dim) % parts != 0:
        raise RuntimeError(
            f"flashattn_ext: the {layout} layout splits x dim {dim} (seqlen) into {parts} equal "
            f"parts for world size {world_size}: got length {x.size(dim)}, expected a multiple of "
            f"{parts}")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"flashattn_ext: rank must be in [0, {world_size}), got {rank}")
    local_len = x.size(dim) // world_size
    return torch.cat([x.narrow(dim, start, length)
                      for start, length in _segments(layout, rank, world_size, local_len)], dim)


def _gather(local: torch.Tensor, layout: str, group, dim: int) -> torch.Tensor:
    ring = _Ring(_process_group(group))
    if layout == ZIGZAG and local.size(dim) % 2 != 0:
        raise RuntimeError(
            f"flashattn_ext: a zigzag shard holds two equal chunks: local dim {dim} must be even, "
            f"got {local.size(dim)}")
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(ring.size)]
    dist.all_gather(shards, local, group=ring.group)
    pieces = []
    for rank, shard in enumerate(shards):
        offset = 0
        for start, length in _segments(layout, rank, ring.size, local.size(dim)):
            pieces.append((start, shard.narrow(dim, offset, length)))
            offset += length
    pieces.sort(key=lambda piece: piece[0])
    return torch.cat([piece for _, piece in pieces], dim)


def ring_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor x in the ring layout: the rank-th
    of world_size equal parts of dim ``dim`` (a copy)."""
    return _shard(x, RING, rank, world_size, dim)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor x in the zigzag layout: chunks rank
    and 2 world_size - 1 - rank of 2 world_size equal chunks of dim ``dim``,
    concatenated (a copy)."""
    return _shard(x, ZIGZAG, rank, world_size, dim)


def ring_gather(local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's ring shard (all_gather; not differentiable).
    For a softmax_lse shard (batch, nheads, seqlen), pass dim=2."""
    return _gather(local, RING, group, dim)


def zigzag_gather(local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's zigzag shard, chunks back in sequence
    order (all_gather; not differentiable). For a softmax_lse shard, pass dim=2."""
    return _gather(local, ZIGZAG, group, dim)


__all__ = [
    "merge_attention_outputs",
    "ring_flash_attn_func",
    "ring_gather",
    "ring_shard",
    "zigzag_gather",
    "zigzag_ring_flash_attn_func",
    "zigzag_shard",
]
