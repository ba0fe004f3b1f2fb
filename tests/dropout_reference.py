"""The dropout mask, written from its definition independently of the library (it shares
no code with csrc/common/philox.h or the kernels), for the tests and benchmarks/bench_variants.py.

Definition. Element (query row i, key column j) of head h of batch entry b (i, j within that
entry's own sequences; in a variable-length batch, positions within each sequence and b its
index) is kept iff its byte is >= threshold = min(floor(p * 256 + 0.5), 255); the kept
probabilities are scaled by exactly 1 / (1 - p). One Philox-4x32-7 draw decides 16 elements:

* counter = [lo32(pos), hi32(pos), row_group, batch_head], key = [lo32(seed), hi32(seed)],
  pos = offset + column_group (64 bits), row_group = 4 * (i // 16) + (i % 8) // 2,
  column_group = 4 * (j // 16) + (j % 8) // 2, batch_head = b * nheads_q + h;
* the element reads byte 2 * ((j % 16) // 8) + j % 2 (bits 8 * byte ..) of word
  2 * (i % 2) + (i % 16) // 8 of the draw.

rng_state = [seed, offset] is what flash_attn_func draws per call (offset 0).

Philox-4x32-7 (Salmon et al., SC 2011; Random123's philox4x32_7): 7 rounds of
(hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2, c = [hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0],
then the key bumped by the Weyl constants. Two implementations here: one on Python ints
(exact by construction; the known-answer tests and the element-by-element check use it) and
one vectorised on torch int64 tensors, whose 32 x 32 -> 64-bit products are formed exactly
from 16-bit halves (every intermediate stays below 2^49), on any device.

Below them, identity_values and revealed_columns read the mask a kernel applied from its
output: with v[j] = e_j, out[i, j] = P[i, j] * keep[i, j] / (1 - p), nonzero exactly where
element (i, j) is visible and kept (keys beyond head_dim: one call per chunk of head_dim keys).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 7
MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1

# Random123's kat_vectors, the three "philox4x32 7" lines: counter (4 words), key (2 words),
# expected output (4 words).
KNOWN_ANSWERS = (
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a)),
)


def threshold_of(dropout_p: float) -> int:
    """The bytes below it drop their element: min(floor(p * 256 + 0.5), 255)."""
    steps = int(dropout_p * 256.0 + 0.5)  # non-negative: int() is floor
    return min(steps, 255)


def keep_probability(dropout_p: float) -> float:
    """The exact keep rate the quantised threshold gives: 1 - threshold / 256, within 1/512 of
    1 - p."""
    return 1.0 - threshold_of(dropout_p) / 256.0


# ---- Python ints ----------------------------------------------------------------------------

def philox4x32_7_scalar(counter: Sequence[int], key: Sequence[int]) -> Tuple[int, int, int, int]:
    """One Philox-4x32-7 block on Python ints: counter 4 words, key 2 words."""
    c0, c1, c2, c3 = (int(c) & MASK32 for c in counter)
    k0, k1 = (int(k) & MASK32 for k in key)
    for _ in range(ROUNDS):
        p0 = MULTIPLIERS[0] * c0
        p1 = MULTIPLIERS[1] * c2
        hi0, lo0 = p0 >> 32, p0 & MASK32
        hi1, lo1 = p1 >> 32, p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + WEYL[0]) & MASK32
        k1 = (k1 + WEYL[1]) & MASK32
    return c0, c1, c2, c3


def element_keeps(seed: int, offset: int, dropout_p: float, batch_head: int, i: int, j: int) -> bool:
    """Whether element (i, j) of batch_head is kept, straight from the definition, one draw."""
    seed, offset = int(seed) & MASK64, int(offset) & MASK64
    row_group = 4 * (i // 16) + (i % 8) // 2
    column_group = 4 * (j // 16) + (j % 8) // 2
    pos = (offset + column_group) & MASK64
    words = philox4x32_7_scalar((pos & MASK32, pos >> 32, row_group, batch_head), (seed & MASK32, seed >> 32))
    word = words[2 * (i % 2) + (i % 16) // 8]
    byte = (word >> (8 * (2 * ((j % 16) // 8) + j % 2))) & 0xFF
    return byte >= threshold_of(dropout_p)


# ---- torch int64, vectorised ----------------------------------------------------------------

def _mul_hi_lo(a: torch.Tensor, multiplier: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(hi32, lo32) of multiplier * a exactly, a int64 in [0, 2^32), multiplier < 2^32:
    multiplier * a = p_low + p_high * 2^16 with p_low, p_high < 2^48."""
    m_low, m_high = multiplier & 0xFFFF, multiplier >> 16
    p_low = a * m_low
    p_high = a * m_high
    low_sum = p_low + ((p_high & 0xFFFF) << 16)  # < 2^49
    lo = low_sum & MASK32
    hi = (p_high >> 16) + (low_sum >> 32)        # the exact product is < 2^64: hi < 2^32
    return hi, lo


def philox4x32_7(counter: Sequence[torch.Tensor], key: Sequence[int]) -> List[torch.Tensor]:
    """Philox-4x32-7 on int64 tensors holding 32-bit words (broadcast together); key two
    Python ints. Returns the 4 output words as int64 tensors in [0, 2^32)."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64) & MASK32 for c in counter))
    k0, k1 = (int(k) & MASK32 for k in key)
    for _ in range(ROUNDS):
        hi0, lo0 = _mul_hi_lo(c0, MULTIPLIERS[0])
        hi1, lo1 = _mul_hi_lo(c2, MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + WEYL[0]) & MASK32
        k1 = (k1 + WEYL[1]) & MASK32
    return [c0, c1, c2, c3]


def keep_mask(seed: int, offset: int, dropout_p: float, batch_heads, seqlen_q: int, seqlen_k: int,
              device=None) -> torch.Tensor:
    """bool (*batch_heads.shape, seqlen_q, seqlen_k): the kept elements of each batch_head
    value (b * nheads_q + h) in batch_heads, rows and columns at positions 0.. within the entry.

    All draws of a 16 x 16 tile grid are made at once: row groups 0 .. 4 * ceil(seqlen_q / 16),
    column groups 0 .. 4 * ceil(seqlen_k / 16); then each element picks its draw, word and byte."""
    seed, offset = int(seed) & MASK64, int(offset) & MASK64
    batch_heads = torch.as_tensor(batch_heads, dtype=torch.int64, device=device)
    device = batch_heads.device
    lead = batch_heads.shape
    tiles_q, tiles_k = -(-seqlen_q // 16), -(-seqlen_k // 16)
    if batch_heads.numel() == 0 or tiles_q == 0 or tiles_k == 0:
        return torch.zeros(*lead, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    row_groups = torch.arange(4 * tiles_q, dtype=torch.int64, device=device)
    column_groups = torch.arange(4 * tiles_k, dtype=torch.int64, device=device)
    # pos = offset + column_group as 64 bits, split into its two words (Python ints for the
    # offset: no int64 overflow even for offsets >= 2^63).
    offset_lo, offset_hi = offset & MASK32, offset >> 32
    pos_lo_sum = column_groups + offset_lo                     # < 2^33
    pos_lo = pos_lo_sum & MASK32
    pos_hi = ((pos_lo_sum >> 32) + offset_hi) & MASK32
    bh = batch_heads.reshape(-1, 1, 1)
    words = philox4x32_7((pos_lo.view(1, 1, -1), pos_hi.view(1, 1, -1), row_groups.view(1, -1, 1), bh),
                         (seed & MASK32, seed >> 32))
    threshold = threshold_of(dropout_p)
    # keeps[bh, row_group, column_group, word, byte]
    keeps = torch.stack([torch.stack([((w >> (8 * k)) & 0xFF) >= threshold for k in range(4)], dim=-1)
                         for w in words], dim=-2)
    # The word depends on the row only and the byte on the column only: lay out
    # [bh, row_group, word, column_group, byte].
    keeps = keeps.permute(0, 1, 3, 2, 4).reshape(bh.size(0), 4 * tiles_q * 4, 4 * tiles_k * 4)
    i = torch.arange(seqlen_q, dtype=torch.int64, device=device)
    j = torch.arange(seqlen_k, dtype=torch.int64, device=device)
    rows = (4 * (i // 16) + (i % 8) // 2) * 4 + 2 * (i % 2) + (i % 16) // 8
    columns = (4 * (j // 16) + (j % 8) // 2) * 4 + 2 * ((j % 16) // 8) + j % 2
    mask = keeps.index_select(1, rows).index_select(2, columns)
    return mask.view(*lead, seqlen_q, seqlen_k)


def dropout_keep_mask(seed: int, offset: int, dropout_p: float, batch: int, nheads: int, seqlen_q: int,
                      seqlen_k: int, device=None) -> torch.Tensor:
    """bool (batch, nheads, seqlen_q, seqlen_k): the mask of a dense call (nheads: of q)."""
    batch_heads = (torch.arange(batch).view(-1, 1) * nheads + torch.arange(nheads).view(1, -1))
    return keep_mask(seed, offset, dropout_p, batch_heads.to(device), seqlen_q, seqlen_k, device)


def varlen_dropout_keep_masks(seed: int, offset: int, dropout_p: float, nheads: int, seqlens_q: Sequence[int],
                              seqlens_k: Sequence[int], device=None) -> List[torch.Tensor]:
    """Per sequence b: bool (1, nheads, seqlens_q[b], seqlens_k[b]), its mask with batch index b
    and positions within the sequence (what a dense call of that one sequence at entry b draws)."""
    masks = []
    for b, (seqlen_q, seqlen_k) in enumerate(zip(seqlens_q, seqlens_k)):
        batch_heads = (b * nheads + torch.arange(nheads)).view(1, -1)
        masks.append(keep_mask(seed, offset, dropout_p, batch_heads.to(device), int(seqlen_q), int(seqlen_k),
                               device))
    return masks


def seed_after_manual_seed(manual_seed: int, device) -> int:
    """The seed flash_attn_func draws on `device` right after torch.manual_seed(manual_seed):
    its first torch.randint(0, 2**62) of that device's generator (flashattn_ext/interface.py).
    Leaves torch's generators seeded with manual_seed."""
    torch.manual_seed(manual_seed)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device).item()
    torch.manual_seed(manual_seed)
    return seed


def s_dmask_and_keep_mask(func, case, inputs, manual_seed: int, dropout_p: float, device):
    """(S_dmask, the reference keep mask or None without dropout) of func (flash_attn_func)
    called on a dense case's inputs with return_attn_probs=True after torch.manual_seed."""
    seed = seed_after_manual_seed(manual_seed, device)
    _, _, s_dmask = func(inputs.q, inputs.k, inputs.v, dropout_p=dropout_p, return_attn_probs=True,
                         **inputs.func_kwargs())
    if dropout_p == 0:
        return s_dmask, None
    return s_dmask, dropout_keep_mask(seed, 0, dropout_p, case.batch, case.nheads, case.seqlen_q, case.seqlen_k)


# ---- Reading a kernel's mask from its output ---------------------------------------------------

def identity_values(v: torch.Tensor, key_positions=None, first_column=None) -> torch.Tensor:
    """v's shape with v[..., j, :, :] = e_(p - first_column), p = key_positions[j] the key's
    position in its sequence (default: its row), and 0 for a key outside first_column ..
    first_column + head_dim: out then holds each query's weight of key p in column
    p - first_column. Without first_column, every key must have its column."""
    key_positions = torch.arange(v.size(-3)) if key_positions is None else key_positions.cpu()
    if first_column is None:
        assert v.size(-1) > key_positions.max(), "the mask is read from out's first seqlen_k columns"
        first_column = 0
    columns = key_positions - first_column
    inside = (columns >= 0) & (columns < v.size(-1))
    rows = torch.nn.functional.one_hot(columns.clamp(0, v.size(-1) - 1), v.size(-1)) * inside[:, None]
    return rows.to(device=v.device, dtype=v.dtype).unsqueeze(-2).expand(v.shape).contiguous()


def revealed_columns(run, v, seqlen_k, key_positions=None):
    """out != 0 of run(v with identity values), key columns 0 .. seqlen_k in chunks of
    head_dim (one call per chunk, the keys outside it with v = 0): out's shape with its last
    dim seqlen_k. run must apply the same mask on every call: reseed torch's generator, or
    pass the op the same rng_state."""
    head_dim = v.size(-1)
    chunks = []
    with torch.no_grad():
        for first in range(0, seqlen_k, head_dim):
            out = run(identity_values(v, key_positions, first))
            chunks.append(out[..., :min(head_dim, seqlen_k - first)] != 0)
    return torch.cat(chunks, dim=-1)
