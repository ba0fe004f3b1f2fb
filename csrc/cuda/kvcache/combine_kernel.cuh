// After the KV-cache attention: each packed row's split-KV partials merged by their
// log-sum-exp, O = sum_s exp(lse_s - lse) O_s with lse = log (sum_s exp(lse_s) + exp(sink))
// (the learnable sink joins here, once, not in each split), and written to its (query
// position, head) of out and lse. A row no split saw a key for gets O = 0 and lse = +inf
// (lse = sink with a sink), as from the other forward kernels.
//
// One block per row, launched as a dependent of the attention kernel (its blocks start
// while the attention's last blocks finish). Every warp loads its first kPrefetchSplits
// splits' partial rows while warp 0 reads the splits' lse, so the two reads are in flight
// together; warp 0 turns the lse into weights in shared memory, the warps weigh their
// partials (and load any further splits, every kCombineWarps-th), and add their sums in
// shared memory. (One warp per row, a split at a time, took 21 us for 29 splits, beside
// 155 us for the attention over 128k keys before it: a chain of dependent L2 loads.)
#pragma once

#include <cmath>
#include <cstdint>

#include "common/kvcache_params.h"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

constexpr int kCombineWarps = 4;
constexpr int kMaxSplits = 128;
constexpr int kCombineMaxHeadDim = 256;
constexpr int kPrefetchSplits = 8;  // per warp: 32 splits' partials in flight with the lse

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// kPairs: the float2 column pairs of a lane (columns 2 lane + 64 i), head_dim <= 64 kPairs.
template <typename Element, int kPairs>
__global__ void __launch_bounds__(32 * kCombineWarps) kvcache_combine_kernel(const __grid_constant__ KvcacheFwdParams p) {
  using Mma = MmaElement<Element>;
  __shared__ float weights[kMaxSplits];
  __shared__ float2 sums[kCombineWarps][32 * kPairs];
  __shared__ float row_lse;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x;
  const int64_t rows = int64_t(p.batch) * p.tile_heads * p.packed_rows;
  const int r = static_cast<int>(row % p.packed_rows);
  const int tile_head = static_cast<int>(row / p.packed_rows % p.tile_heads);
  const int b = static_cast<int>(row / p.packed_rows / p.tile_heads);
  const int position = r / p.group, head = tile_head * p.group + r % p.group;
  const int64_t split_stride = rows;  // partial rows between one split and the next
  // A column past head_dim (a multiple of 8) is never read.
  const auto load_partial = [&](int s, float2 (&o)[kPairs]) {
    const float* partial = p.out_partial + (s * split_stride + row) * p.head_dim;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int col = 2 * lane + 64 * i;
      o[i] = col < p.head_dim ? *reinterpret_cast<const float2*>(partial + col) : make_float2(0.f, 0.f);
    }
  };

  wait_for_previous_kernel();
  float2 prefetched[kPrefetchSplits][kPairs];
#pragma unroll
  for (int j = 0; j < kPrefetchSplits; ++j) {
    const int s = warp + kCombineWarps * j;
    if (s < p.num_splits) load_partial(s, prefetched[j]);
  }
  if (warp == 0) {
    const float sink = p.learnable_sink != nullptr ? p.learnable_sink[head] : -INFINITY;
    float split_lse[kMaxSplits / 32];
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int s = lane + 32 * i;
      split_lse[i] = s < p.num_splits ? p.lse_partial[s * split_stride + row] : -INFINITY;
    }
    float max_lse = sink;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) max_lse = fmaxf(max_lse, split_lse[i]);
    max_lse = warp_max(max_lse);
    float sum = 0.f;
    if (max_lse != -INFINITY) {
#pragma unroll
      for (int i = 0; i < kMaxSplits / 32; ++i) sum += expf(split_lse[i] - max_lse);  // 0 for an empty split
      if (lane == 0 && sink != -INFINITY) sum += expf(sink - max_lse);
    }
    sum = warp_sum(sum);
    const bool has_keys = max_lse != -INFINITY;
    const float lse = has_keys ? max_lse + logf(sum) : INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) weights[lane + 32 * i] = has_keys ? expf(split_lse[i] - lse) : 0.f;
    if (lane == 0) {
      row_lse = lse;
      p.lse[b * p.lse_strides.batch + head * p.lse_strides.head + position] = lse;
    }
  }
  __syncthreads();

  float2 acc[kPairs];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) acc[i] = make_float2(0.f, 0.f);
  const auto accumulate = [&](int s, const float2 (&o)[kPairs]) {
    const float weight = weights[s];
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      acc[i].x += weight * o[i].x;
      acc[i].y += weight * o[i].y;
    }
  };
  if (row_lse != INFINITY) {
#pragma unroll
    for (int j = 0; j < kPrefetchSplits; ++j) {
      const int s = warp + kCombineWarps * j;
      if (s < p.num_splits) accumulate(s, prefetched[j]);
    }
#pragma unroll 4
    for (int s = warp + kCombineWarps * kPrefetchSplits; s < p.num_splits; s += kCombineWarps) {
      float2 o[kPairs];
      load_partial(s, o);
      accumulate(s, o);
    }
  }
#pragma unroll
  for (int i = 0; i < kPairs; ++i) sums[warp][lane + 32 * i] = acc[i];
  __syncthreads();

  Element* out = static_cast<Element*>(p.out) + b * p.out_strides.batch + position * p.out_strides.row +
                 head * p.out_strides.head;
  for (int pair = threadIdx.x; 2 * pair < p.head_dim; pair += 32 * kCombineWarps) {
    float2 o = sums[0][pair];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      o.x += sums[w][pair].x;
      o.y += sums[w][pair].y;
    }
    *reinterpret_cast<uint32_t*>(out + 2 * pair) = Mma::pack(o.x, o.y);
  }
}

}  // namespace flashattn
