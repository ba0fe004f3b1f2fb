// The end of the KV-cache attention kernel: the last of a tile's splits to finish merges every
// split's partial rows by their log-sum-exp, O = sum_s exp(lse_s - lse) O_s with
// lse = log (sum_s exp(lse_s) + exp(sink)) (the learnable sink joins here, once, not in each
// split), and writes each row to its (query position, head) of out and lse. A row no split
// saw a key for gets O = 0 and lse = +inf (lse = sink with a sink), as from the other forward
// kernels.
//
// Every split stores its partial rows (fp32 O normalised by its own row sums, and its lse,
// -inf where it saw no key), fences them and counts itself on the tile's counter (zeroed by
// the prepare kernel); the block that counts last reads the others' rows from L2. This is
// the merge a separate combine kernel did after the attention kernel: in the kernel, no
// launch and no wait for the whole grid stand between a tile's last split and its output.
// (With one split the block merges its own rows: a second epilogue beside the partial one,
// written from the accumulators, spilled the W = 256 and W = 128 short-query kernels.)
#pragma once

#include <cmath>
#include <cstdint>

#include "common/kvcache_params.h"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

constexpr int kMaxSplits = 128;

// Whether this block is the last of its tile's splits to count itself, after every thread
// of it stored its partial rows (all threads call it). After the barrier, one thread's fence
// before the count makes the block's rows visible device-wide before any block can see the
// count (a fence is cumulative: it orders what the barrier ordered before it, as in a
// cooperative grid's sync); the last block's loads of the others' rows go to L2
// (merge_tile_splits), past any stale L1 line. One split is its own last: the barrier
// alone makes its warps' rows visible to each other.
__device__ __forceinline__ bool last_split_of_tile(const KvcacheFwdParams& p, int64_t tile) {
  __shared__ int is_last;
  __syncthreads();
  if (p.num_splits == 1) return true;
  if (threadIdx.x == 0) {
    wait_for_previous_kernel();  // the prepare kernel zeroed the counters
    __threadfence();
    is_last = atomicAdd(p.split_counters + tile, 1) == p.num_splits - 1;
    if (is_last) __threadfence();
  }
  __syncthreads();
  return is_last;
}

// Merges the partial rows [m_begin, m_begin + rows) of (batch, tile_head) over the splits
// into out and lse. Each thread takes whole 4-column pieces of a row and reads every split's
// lse and piece, kSplitsInFlight splits' loads issued together, merging them online
// (running max, sum and weighted piece), so a piece costs one L2 round trip per
// kSplitsInFlight splits.
template <typename Element, int kThreads>
__device__ __forceinline__ void merge_tile_splits(const KvcacheFwdParams& p, int batch, int tile_head, int m_begin,
                                                  int rows) {
  constexpr int kSplitsInFlight = 8;
  using Mma = MmaElement<Element>;
  const int64_t split_stride = int64_t(p.batch) * p.tile_heads * p.packed_rows;  // partial rows per split
  const int64_t first_row = (int64_t(batch) * p.tile_heads + tile_head) * p.packed_rows + m_begin;
  const int pieces = p.head_dim / 4;  // head_dim is a multiple of 8
  for (int item = threadIdx.x; item < rows * pieces; item += kThreads) {
    const int r = item / pieces, piece = item % pieces;
    const int64_t row = first_row + r;
    float max = -INFINITY, sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    // Another term of the sum at logit x: the running max raised to it first where it is larger.
    const auto add = [&](float x, const float4& o) {
      if (x > max) {
        const float scale = expf(max - x);  // 0 from -inf
        sum *= scale;
        acc = make_float4(acc.x * scale, acc.y * scale, acc.z * scale, acc.w * scale);
        max = x;
      }
      const float weight = expf(x - max);
      sum += weight;
      acc = make_float4(acc.x + weight * o.x, acc.y + weight * o.y, acc.z + weight * o.z, acc.w + weight * o.w);
    };
    for (int s0 = 0; s0 < p.num_splits; s0 += kSplitsInFlight) {
      float lse[kSplitsInFlight];
      float4 o[kSplitsInFlight];
#pragma unroll
      for (int j = 0; j < kSplitsInFlight; ++j) {
        const int64_t partial_row = (s0 + j) * split_stride + row;
        const bool split = s0 + j < p.num_splits;
        lse[j] = split ? __ldcg(p.lse_partial + partial_row) : -INFINITY;
        o[j] = split ? __ldcg(reinterpret_cast<const float4*>(p.out_partial + partial_row * p.head_dim) + piece)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kSplitsInFlight; ++j)
        if (lse[j] != -INFINITY) add(lse[j], o[j]);  // a split without keys weighs nothing
    }
    const int packed = m_begin + r, position = packed / p.group, head = tile_head * p.group + packed % p.group;
    // The sink: probability mass, no value (a sink of -inf adds nothing).
    if (p.learnable_sink != nullptr && p.learnable_sink[head] != -INFINITY)
      add(p.learnable_sink[head], make_float4(0.f, 0.f, 0.f, 0.f));
    const bool has_mass = sum > 0.f;
    const float inv_sum = has_mass ? 1.f / sum : 0.f;
    Element* out = static_cast<Element*>(p.out) + batch * p.out_strides.batch + position * p.out_strides.row +
                   head * p.out_strides.head + 4 * piece;
    *reinterpret_cast<uint2*>(out) =
        make_uint2(Mma::pack(acc.x * inv_sum, acc.y * inv_sum), Mma::pack(acc.z * inv_sum, acc.w * inv_sum));
    if (piece == 0)
      p.lse[batch * p.lse_strides.batch + head * p.lse_strides.head + position] =
          has_mass ? max + logf(sum) : INFINITY;
  }
}

}  // namespace flashattn
