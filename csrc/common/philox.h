// The dropout mask, as a pure function of (seed, offset, batch entry, head, query row,
// key column): Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011), a counter-based generator. Any tiling, thread count or backend
// that asks about the same element gets the same bit, and the backward regenerates
// the forward's mask from the saved [seed, offset] instead of storing it.
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

// Philox-4x32 with 10 rounds (Random123's philox4x32_10): 128 random bits per counter.
FLASHATTN_HOST_DEVICE PhiloxWords philox4x32_10(PhiloxWords counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
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
// Element (row i, column j) of head h of batch entry b (i, j within that entry's own
// sequences, so a variable-length batch draws each sequence's mask the same way as a dense
// one) is kept iff its 16-bit word is >= threshold, i.e. with probability
// 1 - threshold / 2^16, dropout_p rounded to a multiple of 2^-16.
//
// One Philox draw (128 bits) decides eight elements: in the 16 x 16 tile (i / 16, j / 16),
// the rows {r, r + 8} and the columns {2c, 2c + 1, 2c + 8, 2c + 9}, r = i % 8, c = (j % 8) / 2.
// That is what one lane of an m16n8k16 accumulator holds of two n8 tiles, so a forward
// kernel (queries as rows) draws each of its elements once; a backward kernel (keys as rows)
// needs two draws per lane, and lanes l and l ^ 4 split them (cuda/common/dropout_mask.cuh).
// Word 2 * ((i % 16) / 8) + (j % 16) / 8 of the draw decides the element, its low half for
// an even j, its high half for an odd one. 16-bit words rather than 32 halve the draws
// (Philox-4x32-10 is about 50 integer operations); 8-bit ones would halve them again but
// could keep only multiples of 1/256.
//
// The draw's counter: (offset + 4 * (j / 16) + c as 64 bits, 8 * (i / 16) + r, b * nheads + h),
// its key the seed. Offsets that differ by at least ceil(seqlen_k / 16) * 4 therefore give
// independent masks under one seed.
struct DropoutGenerator {
  uint64_t seed;
  uint64_t offset;
  uint32_t threshold;  // a 16-bit word below it drops its element

  // The draw of rows {8 * (i / 16) + r, ... + 8} (row_group = 8 * (i / 16) + r) and column
  // group column_group = 4 * (j / 16) + c of head batch_head.
  FLASHATTN_HOST_DEVICE PhiloxWords draw(uint32_t batch_head, uint32_t row_group, uint64_t column_group) const {
    const uint64_t position = offset + column_group;
    return philox4x32_10(PhiloxWords{{static_cast<uint32_t>(position),
                                      static_cast<uint32_t>(position >> 32), row_group, batch_head}},
                         static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }

  FLASHATTN_HOST_DEVICE static uint32_t row_group(int64_t i) { return static_cast<uint32_t>(8 * (i / 16) + i % 8); }
  FLASHATTN_HOST_DEVICE static uint64_t column_group(int64_t j) { return static_cast<uint64_t>(4 * (j / 16) + (j % 8) / 2); }
  FLASHATTN_HOST_DEVICE static int word_of(int64_t i, int64_t j) { return static_cast<int>(2 * ((i % 16) / 8) + (j % 16) / 8); }
  // The 16-bit word of column j in its draw's word.
  FLASHATTN_HOST_DEVICE static uint32_t half_of(uint32_t word, int64_t j) { return j % 2 ? word >> 16 : word & 0xFFFFu; }

  FLASHATTN_HOST_DEVICE bool keeps(uint32_t half_word) const { return half_word >= threshold; }
};

// dropout_p in 1/2^16 steps, rounded to nearest; at most 65535, so a p just below 1 still
// keeps one word in 2^16.
FLASHATTN_HOST_DEVICE uint32_t dropout_threshold(double dropout_p) {
  const double steps = dropout_p * 65536.0 + 0.5;
  return steps >= 65535.0 ? 65535u : static_cast<uint32_t>(steps);
}

}  // namespace flashattn
