// The dropout mask of common/philox.h on the m16n8 accumulator fragments of every attention
// kernel: the forward's (queries as rows) and the backward's (keys as rows, Sᵀ).
//
// One Philox draw decides the eight elements a forward lane holds of a 16 x 16 tile (rows
// g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9), so the forward draws each element once. The
// backward's lane holds the transposed set (keys g, g + 8; queries 2t, 2t + 1, 2t + 8, 2t + 9),
// which two draws decide, half each; lanes l and l ^ 4 (keys g and g ^ 1) need the same two
// draws, so each makes one and they swap halves: two shuffles instead of a second draw.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/philox.h"

namespace flashattn {

struct DropoutMask {
  DropoutGenerator generator;
  uint32_t batch_head;
  uint32_t threshold_high;  // threshold << 16: a word keeps its high half iff it is >= this

  __device__ __forceinline__ DropoutMask(const AttentionFwdParams& p, int batch, int head)
      : generator{static_cast<uint64_t>(__ldg(p.rng_state)), static_cast<uint64_t>(__ldg(p.rng_state + 1)),
                  p.dropout_threshold},
        batch_head(static_cast<uint32_t>(batch * p.nheads_q + head)),
        threshold_high(p.dropout_threshold << 16) {}

  // Whether half `half` (0 low, 1 high) of `word` keeps its element.
  __device__ __forceinline__ bool keeps(uint32_t word, int half) const {
    return (half ? word : word << 16) >= threshold_high;
  }

  // Queries as rows: zeroes the dropped elements of acc, one m16 tile of a lane (element e of
  // n8 tile nt: row 16 * row_tile + g + 8 (e / 2), column col0 + 8 nt + 2t + e % 2), col0 a
  // multiple of 16, rows and columns within the lane's (batch entry, head) sequences. All
  // draws in flight at once: made as bits ahead of the softmax instead, two at a time (the
  // registers' limit while S = Q K^T runs), the Hopper forward ran slower still.
  template <int kNTiles>
  __device__ __forceinline__ void drop_rows(float (&acc)[kNTiles][4], int row_tile, int col0, int lane) const {
    static_assert(kNTiles % 2 == 0, "a draw covers two n8 tiles");
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int c = 0; c < kNTiles / 2; ++c) {
      const PhiloxWords w =
          generator.draw(batch_head, 8 * row_tile + g, static_cast<uint64_t>(4 * (col0 / 16 + c) + t));
#pragma unroll
      for (int tile = 0; tile < 2; ++tile)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& x = acc[2 * c + tile][e];
          x = keeps(w.w[2 * (e >> 1) + tile], e & 1) ? x : 0.f;
        }
    }
  }

  // Keys as rows: bit 4j + e says whether element 4j + e of a lane's Sᵀ fragment (key
  // 16 * key_tile + g + 8 (e / 2), query query0 + 8j + 2t + e % 2; query0 a multiple of 16)
  // is kept, for the kColumns queries of a warp's product (at most 64: 32 bits).
  template <int kColumns>
  __device__ __forceinline__ uint32_t transposed_keep_bits(int key_tile, int query0, int lane) const {
    static_assert(kColumns % 16 == 0 && kColumns <= 64, "whole 16-query draws, one bit each");
    const int g = lane / 4, t = lane % 4, h = g & 1;  // h: the half of each word this lane's keys take
    // This lane draws query rows 2t + h (and + 8), its partner lane ^ 4 rows 2t + 1 - h; each
    // sends the other the other key's halves, packed two words to a register.
    const uint32_t send_order = h ? 0x5410u : 0x7632u;
    const uint32_t even_order = h ? 0x3254u : 0x5410u;  // own word k's half beside the partner's
    const uint32_t odd_order = h ? 0x3276u : 0x7610u;
    uint32_t bits = 0;
    // Two draws at a time: with all four in flight the Hopper backward spilled (W = 128).
#pragma unroll 2
    for (int c = 0; c < kColumns / 16; ++c) {
      const PhiloxWords w = generator.draw(batch_head, 8 * (query0 / 16 + c) + 2 * t + h,
                                           static_cast<uint64_t>(4 * key_tile + g / 2));
      const uint32_t received[2] = {
          __shfl_xor_sync(0xffffffffu, __byte_perm(w.w[0], w.w[1], send_order), 4),
          __shfl_xor_sync(0xffffffffu, __byte_perm(w.w[2], w.w[3], send_order), 4)};
      // Word k: 2 (query % 16 >= 8) + (key % 16 >= 8); its low half for query 2t, high for 2t + 1.
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t mine = __byte_perm(w.w[k], received[k / 2], k % 2 ? odd_order : even_order);
        const int query_half = k >> 1, key_half = k & 1;
#pragma unroll
        for (int odd = 0; odd < 2; ++odd)
          bits |= uint32_t(keeps(mine, odd)) << (8 * c + 4 * query_half + 2 * key_half + odd);
      }
    }
    return bits;
  }
};

}  // namespace flashattn
