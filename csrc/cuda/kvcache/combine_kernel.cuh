// After the KV-cache attention: each packed row's split-KV partials merged by their
// log-sum-exp, O = sum_s exp(lse_s - lse) O_s with lse = log (sum_s exp(lse_s) + exp(sink))
// (the learnable sink joins here, once, not in each split), and written to its (query
// position, head) of out and lse. A row no split saw a key for gets O = 0 and lse = +inf
// (lse = sink with a sink), as from the other forward kernels. One warp per row.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/kvcache_params.h"
#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

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

template <typename Element>
__global__ void kvcache_combine_kernel(const __grid_constant__ KvcacheFwdParams p) {
  using Mma = MmaElement<Element>;
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t rows = int64_t(p.batch) * p.nheads_kv * p.packed_rows;
  if (row >= rows) return;
  const int r = static_cast<int>(row % p.packed_rows);
  const int kv_head = static_cast<int>(row / p.packed_rows % p.nheads_kv);
  const int b = static_cast<int>(row / p.packed_rows / p.nheads_kv);
  const int position = r / p.group, head = kv_head * p.group + r % p.group;
  const int64_t split_stride = rows;  // partial rows between one split and the next

  const float sink = p.learnable_sink != nullptr ? p.learnable_sink[head] : -INFINITY;
  float max_lse = sink;
  for (int s = lane; s < p.num_splits; s += 32) max_lse = fmaxf(max_lse, p.lse_partial[s * split_stride + row]);
  max_lse = warp_max(max_lse);
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(p.lse_partial[s * split_stride + row] - max_lse);
    if (lane == 0 && sink != -INFINITY) sum += expf(sink - max_lse);
  }
  sum = warp_sum(sum);
  const bool has_keys = max_lse != -INFINITY;
  const float lse = has_keys ? max_lse + logf(sum) : INFINITY;

  Element* out = static_cast<Element*>(p.out) + b * p.out_strides.batch + position * p.out_strides.row +
                 head * p.out_strides.head;
  // Lane j holds the weight of split s0 + j and passes it round: the loads of eight splits are
  // then in flight at once. (One split at a time, its weight recomputed per column pass, took
  // 21 us for 29 splits, beside 155 us for the attention over 128k keys before it.)
  for (int col0 = 0; col0 < p.head_dim; col0 += 64) {
    const int col = col0 + 2 * lane;
    const bool in_row = col < p.head_dim;
    float o0 = 0.f, o1 = 0.f;
    for (int s0 = 0; has_keys && s0 < p.num_splits; s0 += 32) {
      const int s = s0 + lane;
      // 0 for an empty split (lse_s = -inf)
      const float lane_weight = s < p.num_splits ? expf(p.lse_partial[s * split_stride + row] - lse) : 0.f;
      const int count = min(32, p.num_splits - s0);
#pragma unroll 8
      for (int j = 0; j < count; ++j) {
        const float weight = __shfl_sync(0xffffffffu, lane_weight, j);
        if (in_row) {
          const float2 o =
              *reinterpret_cast<const float2*>(p.out_partial + ((s0 + j) * split_stride + row) * p.head_dim + col);
          o0 += weight * o.x;
          o1 += weight * o.y;
        }
      }
    }
    if (in_row) *reinterpret_cast<uint32_t*>(out + col) = Mma::pack(o0, o1);
  }
  if (lane == 0) p.lse[b * p.lse_strides.batch + head * p.lse_strides.head + position] = lse;
}

}  // namespace flashattn
