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

// Philox-4x32 with 10 rounds (Random123's philox4x32_10): 128 random bits per counter.
FLASHATTN_HOST_DEVICE PhiloxWords philox4x32_10(PhiloxWords counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
  for (int round = 0; round < 10; ++round) {
    const uint32_t* c = counter.w;
    const uint64_t product0 = uint64_t{kMultiplier0} * c[0];
    const uint64_t product1 = uint64_t{kMultiplier1} * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32), lo0 = static_cast<uint32_t>(product0);
    const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32), lo1 = static_cast<uint32_t>(product1);
    const PhiloxWords next{{hi1 ^ c[1] ^ key0, lo1, hi0 ^ c[3] ^ key1, lo0}};
    counter = next;
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// Dropout of one call: rng_state [seed, offset] and dropout_p. Element (row i, column j)
// of head h of batch entry b (i, j within that entry's own sequences, so a
// variable-length batch draws each sequence's mask the same way as a dense one) is kept
// iff its 32-bit word is >= drop_threshold, i.e. with probability
// 1 - drop_threshold / 2^32 (1 - p to within 2^-32).
//
// Words: the seed is the key; the counter is (offset + j / 4 as 64 bits, i, b * nheads + h),
// and word j % 4 of its output decides column j. Offsets that differ by at least
// ceil(seqlen_k / 4) therefore give independent masks under one seed, as the CUDA
// generator's philox offset advances; the CPU path draws a fresh seed per call instead.
struct DropoutGenerator {
  uint64_t seed;
  uint64_t offset;
  uint32_t drop_threshold;

  // The four words of columns 4 * column_quad .. 4 * column_quad + 3 of row i of (b, h).
  FLASHATTN_HOST_DEVICE PhiloxWords column_quad_words(uint32_t batch_head, uint32_t row,
                                                      uint64_t column_quad) const {
    const uint64_t position = offset + column_quad;
    return philox4x32_10(PhiloxWords{{static_cast<uint32_t>(position),
                                      static_cast<uint32_t>(position >> 32), row, batch_head}},
                         static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }

  FLASHATTN_HOST_DEVICE bool keeps(uint32_t word) const { return word >= drop_threshold; }
};

// floor(p * 2^32): p in [0, 1) gives at most 2^32 - 1, so the cast never overflows.
FLASHATTN_HOST_DEVICE uint32_t dropout_threshold(double dropout_p) {
  return static_cast<uint32_t>(dropout_p * 4294967296.0);
}

}  // namespace flashattn
