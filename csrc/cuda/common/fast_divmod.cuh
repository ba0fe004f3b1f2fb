#pragma once

#include <cstdint>

namespace flashattn {

// Division by a divisor that stays fixed while a kernel loops (a block's count of query blocks):
// a multiply-high, an add and a shift (Granlund and Montgomery's round-up method). The GPU has
// no integer divider; the compiler's division (a float reciprocal and corrections, about 30
// instructions) was not hoisted out of the backward's loop, whose consumers divided twice per
// iteration on the path to their first wgmma.
struct FastDivmod {
  int divisor;
  uint32_t multiplier, shift;

  // divisor >= 1; a block with no work passes 0 and never divides.
  __host__ __device__ __forceinline__ explicit FastDivmod(int d) : divisor(d > 1 ? d : 1) {
    shift = 0;
    while ((1u << shift) < static_cast<uint32_t>(divisor)) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }

  // 0 <= n < 2^31.
  __host__ __device__ __forceinline__ int div(int n) const {
#ifdef __CUDA_ARCH__
    const uint32_t high = __umulhi(static_cast<uint32_t>(n), multiplier);
#else
    const uint32_t high = static_cast<uint32_t>((uint64_t{static_cast<uint32_t>(n)} * multiplier) >> 32);
#endif
    return static_cast<int>((high + static_cast<uint32_t>(n)) >> shift);
  }
  __host__ __device__ __forceinline__ int mod(int n) const { return n - div(n) * divisor; }
};

// The compiler's division behind FastDivmod's interface, for a kernel that makes its divisors
// itself (making a FastDivmod costs a 64-bit division) and decodes one tile a block, or hides a
// division's latency behind other resident blocks (the mma.sync forward, whose tightest tiles
// spilled 36 bytes with FastDivmod's registers).
struct Division {
  int divisor;

  __host__ __device__ __forceinline__ explicit Division(int d) : divisor(d > 1 ? d : 1) {}
  __host__ __device__ __forceinline__ int div(int n) const { return n / divisor; }
  __host__ __device__ __forceinline__ int mod(int n) const { return n - div(n) * divisor; }
};

}  // namespace flashattn
