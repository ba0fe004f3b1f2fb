// The dropout mask, as a pure function of (seed, offset, batch entry, head, query row,
// key column): Philox-4x32-7 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011), a counter-based generator. Any tiling, thread count or backend that asks about
// the same element gets the same bit, and the backward regenerates the forward's mask from
// the saved [seed, offset] instead of storing it.
//
// No torch types: the CUDA kernels include this header too.
#pragma once

#include <cstdint>

#include "common/attention_params.h"  // FLASHATTN_HOST_DEVICE

namespace flashattn {

struct PhiloxWords {
  uint32_t w[4];
};

// a * b as its high and low words. On the GPU one IMAD.WIDE.U32: written as a 64-bit
// product, nvcc kept 64-bit multiplies, shifts and XORs through the rounds (the dropout
// forward ran at half the plain one's speed).
FLASHATTN_HOST_DEVICE void multiply_wide(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  asm("{\n\t.reg .b64 product;\n\tmul.wide.u32 product, %2, %3;\n\tmov.b64 {%1, %0}, product;\n\t}"
      : "=r"(hi), "=r"(lo)
      : "r"(a), "r"(b));
#else
  const uint64_t product = uint64_t{a} * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
#endif
}

// Philox-4x32 with 7 rounds (Random123's philox4x32_7, whose known answers the tests check):
// 128 random bits per counter. Seven rounds are what flash-attn 2's dropout draws; Random123's
// default of ten adds margin at ~6 integer operations a round on the path of every probability.
FLASHATTN_HOST_DEVICE PhiloxWords philox4x32_7(PhiloxWords counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 7; ++round) {
    const uint32_t* c = counter.w;
    uint32_t hi0, lo0, hi1, lo1;
    multiply_wide(kMultiplier0, c[0], hi0, lo0);
    multiply_wide(kMultiplier1, c[2], hi1, lo1);
    const PhiloxWords next{{hi1 ^ c[1] ^ key0, lo1, hi0 ^ c[3] ^ key1, lo0}};
    counter = next;
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// Dropout of one call: rng_state [seed, offset] and dropout_p, on every backend.
//
// Element (query row i, key column j) of head h of batch entry b (i, j within that entry's own
// sequences, so a variable-length batch draws each sequence's mask the same way as a dense one)
// is kept iff its byte is >= threshold, i.e. with probability 1 - threshold / 256: dropout_p
// rounded to a multiple of 1/256, as flash-attn 2's 8-bit thresholds do (the kept ones are
// scaled by 1 / (1 - dropout_p), flash-attn's scale).
//
// One Philox draw (16 bytes) decides the 16 elements of queries {2s, 2s + 1, 2s + 8, 2s + 9} x
// keys {2t, 2t + 1, 2t + 8, 2t + 9} of a 16 x 16 tile (s = (i % 8) / 2, t = (j % 8) / 2). The set
// is its own transpose: lanes l and l ^ 4 of an m16n8k16 accumulator hold it, half each, with
// the queries as rows (the forward) or with the keys as rows (the backward's Sᵀ), so in either
// kernel the two lanes make one draw per tile between them and swap halves with two shuffles
// (cuda/common/dropout_mask.cuh). Element (2s + qa + 8 qb, 2t + ka + 8 kb) takes byte
// 2 kb + ka of word 2 qa + qb. Bytes rather than 16-bit words halve the draws, for a coarser p
// (steps of 1/256 rather than 2^-16).
//
// The draw's counter: (offset + 4 * (j / 16) + t as 64 bits, 4 * (i / 16) + s, b * nheads + h),
// its key the seed. Offsets that differ by at least ceil(seqlen_k / 16) * 4 therefore give
// independent masks under one seed.
struct DropoutGenerator {
  uint64_t seed;
  uint64_t offset;
  uint32_t threshold;  // a byte below it drops its element

  // The draw of queries 16 (row_group / 4) + {2s, 2s + 1, 2s + 8, 2s + 9}, s = row_group % 4,
  // and keys likewise of column_group, of head batch_head.
  FLASHATTN_HOST_DEVICE PhiloxWords draw(uint32_t batch_head, uint32_t row_group, uint64_t column_group) const {
    const uint64_t position = offset + column_group;
    return philox4x32_7(PhiloxWords{{static_cast<uint32_t>(position),
                                     static_cast<uint32_t>(position >> 32), row_group, batch_head}},
                        static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }

  FLASHATTN_HOST_DEVICE static uint32_t row_group(int64_t i) { return static_cast<uint32_t>(4 * (i / 16) + (i % 8) / 2); }
  FLASHATTN_HOST_DEVICE static uint64_t column_group(int64_t j) { return static_cast<uint64_t>(4 * (j / 16) + (j % 8) / 2); }
  // The byte of element (i, j) in its draw: word 2 qa + qb, byte 2 kb + ka.
  FLASHATTN_HOST_DEVICE static uint32_t byte_of(const PhiloxWords& words, int64_t i, int64_t j) {
    const uint32_t word = words.w[2 * (i % 2) + (i % 16) / 8];
    return (word >> (8 * (2 * ((j % 16) / 8) + j % 2))) & 0xFFu;
  }

  FLASHATTN_HOST_DEVICE bool keeps(uint32_t byte) const { return byte >= threshold; }
};

// dropout_p in 1/256 steps, rounded to nearest; at most 255, so a p just below 1 still keeps
// one byte in 256.
FLASHATTN_HOST_DEVICE uint32_t dropout_threshold(double dropout_p) {
  const double steps = dropout_p * 256.0 + 0.5;
  return steps >= 255.0 ? 255u : static_cast<uint32_t>(steps);
}

}  // namespace flashattn
