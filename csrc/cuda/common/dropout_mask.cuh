// The dropout mask of common/philox.h on the m16n8 accumulator fragments of every attention
// kernel: the forward's (queries as rows) and the backward's (keys as rows, Sᵀ).
//
// One Philox draw decides 16 elements of a 16 x 16 tile, which lanes l and l ^ 4 hold half each
// in either orientation: of a pair of tiles, each lane draws one and sends its partner the
// partner's half (two shuffles), so every element is drawn once. A lone last tile (80 keys, or
// 16 queries) is drawn by both lanes.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/philox.h"

namespace flashattn {

struct DropoutMask {
  DropoutGenerator generator;
  uint32_t batch_head;
  uint32_t threshold_low_bits;   // the threshold's low seven bits, in every byte
  uint32_t threshold_below_128;  // 0x80808080 where the threshold's bit 7 is clear, else 0

  __device__ __forceinline__ DropoutMask(const AttentionFwdParams& p, int batch, int head)
      : generator{static_cast<uint64_t>(__ldg(p.rng_state)), static_cast<uint64_t>(__ldg(p.rng_state + 1)),
                  p.dropout_threshold},
        batch_head(static_cast<uint32_t>(batch * p.nheads_q + head)),
        threshold_low_bits((p.dropout_threshold & 0x7Fu) * 0x01010101u),
        threshold_below_128(p.dropout_threshold & 0x80u ? 0u : 0x80808080u) {}

  // Bit 7 of each byte of the result says whether that byte of `word` is >= the threshold (the
  // other bits are noise): per byte, (a | 0x80) - (threshold & 0x7F) borrows nothing from its
  // neighbour and has bit 7 set iff a's low seven bits are >= the threshold's, and with the two
  // bits 7 that makes a >= threshold the majority of (a, that difference, ~threshold).
  __device__ __forceinline__ uint32_t keep_flags(uint32_t word) const {
    const uint32_t low_bits_ge = (word | 0x80808080u) - threshold_low_bits;
    return (word & low_bits_ge) | ((word | low_bits_ge) & threshold_below_128);
  }

  // Byte n of the result all ones where the byte of `flags` (keep_flags) that nibble n of
  // `selector` names (0x8 | byte) keeps its element, else 0: prmt's sign mode replicates bit 7.
  __device__ __forceinline__ static uint32_t spread_flags(uint32_t flags, uint32_t selector) {
    uint32_t mask;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(mask) : "r"(flags), "r"(selector));
    return mask;
  }

  // 0xFFFFFFFF where byte `byte` of `flags` keeps its element, else 0.
  __device__ __forceinline__ static uint32_t element_mask(uint32_t flags, int byte) {
    return spread_flags(flags, (0x8u | byte) * 0x1111u);
  }

  // Bits 0..3: bit 7 of flags' bytes 0..3.
  __device__ __forceinline__ static uint32_t flag_bits(uint32_t flags) {
    return ((flags & 0x80808080u) * 0x00204081u) >> 28;
  }

  // Queries as rows: flags[tile][qb] (keep_flags) of the elements of 16-column tile `tile` in
  // row 16 * row_tile + g + 8 qb, byte 2 kb + ka that of column col0 + 16 tile + 8 kb + 2t + ka;
  // col0 a multiple of 16, rows and columns within the lane's (batch entry, head) sequences.
  template <int kTiles>
  __device__ __forceinline__ void row_keep_flags(uint32_t (&flags)[kTiles][2], int row_tile, int col0,
                                                 int lane) const {
    const int g = lane / 4, t = lane % 4;
    const bool odd_row = g & 1;  // the lane's rows take words 2 odd_row + {0, 1} of a draw
    const uint32_t row_group = 4 * row_tile + g / 2;
    const auto column_group = [&](int tile) { return static_cast<uint64_t>(4 * (col0 / 16 + tile) + t); };
#pragma unroll
    for (int pair = 0; pair < kTiles / 2; ++pair) {
      const PhiloxWords w = generator.draw(batch_head, row_group, column_group(2 * pair + odd_row));
      const uint32_t own[2] = {odd_row ? w.w[2] : w.w[0], odd_row ? w.w[3] : w.w[1]};
      const uint32_t got[2] = {__shfl_xor_sync(0xffffffffu, odd_row ? w.w[0] : w.w[2], 4),
                               __shfl_xor_sync(0xffffffffu, odd_row ? w.w[1] : w.w[3], 4)};
#pragma unroll
      for (int qb = 0; qb < 2; ++qb) {
        flags[2 * pair][qb] = keep_flags(odd_row ? got[qb] : own[qb]);
        flags[2 * pair + 1][qb] = keep_flags(odd_row ? own[qb] : got[qb]);
      }
    }
    if constexpr (kTiles % 2) {
      const PhiloxWords w = generator.draw(batch_head, row_group, column_group(kTiles - 1));
      flags[kTiles - 1][0] = keep_flags(odd_row ? w.w[2] : w.w[0]);
      flags[kTiles - 1][1] = keep_flags(odd_row ? w.w[3] : w.w[1]);
    }
  }

  // Queries as rows: zeroes the dropped elements of acc, one m16 tile of a lane (element e of
  // n8 tile nt: row 16 * row_tile + g + 8 (e / 2), column col0 + 8 nt + 2t + e % 2).
  template <int kNTiles>
  __device__ __forceinline__ void drop_rows(float (&acc)[kNTiles][4], int row_tile, int col0, int lane) const {
    static_assert(kNTiles % 2 == 0, "whole 16-column tiles");
    uint32_t flags[kNTiles / 2][2];
    row_keep_flags(flags, row_tile, col0, lane);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[nt][e] = __uint_as_float(__float_as_uint(acc[nt][e]) &
                                     element_mask(flags[nt / 2][e >> 1], 2 * (nt % 2) + (e & 1)));
  }

  // The same on P packed into m16n8k16 A fragments (accumulator_as_a): register r of fragment
  // kk holds the pair of row g + 8 (r % 2), columns 16 kk + 8 (r / 2) + 2t + {0, 1}.
  template <int kTiles>
  __device__ __forceinline__ static void drop_packed(uint32_t (&p)[kTiles][4], const uint32_t (&flags)[kTiles][2]) {
#pragma unroll
    for (int kk = 0; kk < kTiles; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) p[kk][r] &= spread_flags(flags[kk][r % 2], r / 2 ? 0xBBAAu : 0x9988u);
  }

  // Keys as rows: bit 4j + e says whether element 4j + e of a lane's Sᵀ fragment (key
  // 16 * key_tile + g + 8 (e / 2), query query0 + 8j + 2t + e % 2; query0 a multiple of 16)
  // is kept, for the kColumns queries of a warp's product (at most 64: 32 bits).
  template <int kColumns>
  __device__ __forceinline__ uint32_t transposed_keep_bits(int key_tile, int query0, int lane) const {
    static_assert(kColumns % 16 == 0 && kColumns <= 64, "whole 16-query draws, one bit each");
    constexpr int kTiles = kColumns / 16;
    const int g = lane / 4, t = lane % 4, odd_key = g & 1;
    // Of words qb and 2 + qb, this lane's keys' bytes (its odd_key) in the order of its bits
    // (byte 2 kb + qa of the result: key half kb, query qa), and its partner's.
    const uint32_t own_order = 0x6240u + 0x1111u * odd_key, partner_order = 0x6240u + 0x1111u * (odd_key ^ 1);
    const uint64_t column_group = 4 * key_tile + g / 2;
    const auto row_group = [&](int tile) { return static_cast<uint32_t>(4 * (query0 / 16 + tile) + t); };
    // Bits 8 tile + 4 qb + 2 kb + qa from the two registers of a tile's bytes (qb = 0, 1).
    const auto tile_bits = [&](const uint32_t (&bytes)[2], int tile) {
      return (flag_bits(keep_flags(bytes[0])) | flag_bits(keep_flags(bytes[1])) << 4) << (8 * tile);
    };
    uint32_t bits = 0;
#pragma unroll
    for (int pair = 0; pair < kTiles / 2; ++pair) {
      const PhiloxWords w = generator.draw(batch_head, row_group(2 * pair + odd_key), column_group);
      const uint32_t own[2] = {__byte_perm(w.w[0], w.w[2], own_order), __byte_perm(w.w[1], w.w[3], own_order)};
      const uint32_t got[2] = {
          __shfl_xor_sync(0xffffffffu, __byte_perm(w.w[0], w.w[2], partner_order), 4),
          __shfl_xor_sync(0xffffffffu, __byte_perm(w.w[1], w.w[3], partner_order), 4)};
      bits |= tile_bits(own, 2 * pair + odd_key) | tile_bits(got, 2 * pair + (odd_key ^ 1));
    }
    if constexpr (kTiles % 2) {
      const PhiloxWords w = generator.draw(batch_head, row_group(kTiles - 1), column_group);
      const uint32_t own[2] = {__byte_perm(w.w[0], w.w[2], own_order), __byte_perm(w.w[1], w.w[3], own_order)};
      bits |= tile_bits(own, kTiles - 1);
    }
    return bits;
  }
};

}  // namespace flashattn
