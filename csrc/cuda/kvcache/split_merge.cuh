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

// One 4-column piece of a row, merged online over terms (a split's lse and piece, or the
// sink): the largest logit so far, the sum of exp(logit - max) and the pieces so weighted.
struct MergedPiece {
  float max = -INFINITY, sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

  // Terms at logit x, of total weight `weight` relative to exp(x), whose pieces so weighted
  // sum to `o` (a split: 1 and its piece; another lane's state: its sum and acc); nothing
  // where x is -inf (a split without keys, a state without terms).
  __device__ __forceinline__ void add(float x, float weight, const float4& o) {
    if (x == -INFINITY) return;
    if (x > max) {
      const float scale = expf(max - x);  // 0 from -inf
      sum *= scale;
      acc = make_float4(acc.x * scale, acc.y * scale, acc.z * scale, acc.w * scale);
      max = x;
    }
    const float w = expf(x - max);
    sum += w * weight;
    acc = make_float4(acc.x + w * o.x, acc.y + w * o.y, acc.z + w * o.z, acc.w + w * o.w);
  }
  // The state of lane (this lane ^ offset) added (every lane of the warp calls it).
  __device__ __forceinline__ void add_lane(int offset) {
    const float x = __shfl_xor_sync(0xffffffffu, max, offset), weight = __shfl_xor_sync(0xffffffffu, sum, offset);
    const float4 o = make_float4(
        __shfl_xor_sync(0xffffffffu, acc.x, offset), __shfl_xor_sync(0xffffffffu, acc.y, offset),
        __shfl_xor_sync(0xffffffffu, acc.z, offset), __shfl_xor_sync(0xffffffffu, acc.w, offset));
    add(x, weight, o);
  }
};

// Merges the partial rows [m_begin, m_begin + rows) of (batch, tile_head) over the splits
// into out and lse. A 4-column piece of a row is `lanes` neighbouring lanes' (up to 16, as
// many as the splits want and the block's threads cover in one round): each reads every
// lanes-th run of kSplitsInFlight splits' lse and piece from L2, a run's loads issued
// together, and the lanes' states add by shuffles. A round of pieces costs one L2 round trip
// per 8 x lanes splits. (16 splits in flight took the W = 64 decoding tile from 128 to 134
// registers, which would leave it 3 blocks per SM instead of 4.)
template <typename Element, int kThreads>
__device__ __forceinline__ void merge_tile_splits(const KvcacheFwdParams& p, int batch, int tile_head, int m_begin,
                                                  int rows) {
  constexpr int kSplitsInFlight = 8;
  static_assert(kThreads % 32 == 0, "whole warps: the lanes of a piece shuffle");
  using Mma = MmaElement<Element>;
  const int64_t split_stride = int64_t(p.batch) * p.tile_heads * p.packed_rows;  // partial rows per split
  const int64_t first_row = (int64_t(batch) * p.tile_heads + tile_head) * p.packed_rows + m_begin;
  const int pieces = p.head_dim / 4;  // head_dim is a multiple of 8
  const int items = rows * pieces;
  int lanes = 1;
  while (lanes < 16 && lanes * kSplitsInFlight < p.num_splits && 2 * lanes * items <= kThreads) lanes *= 2;
  // Every thread runs every round (the shuffles need the whole warp); a round's threads
  // past the last piece merge nothing.
  for (int start = 0; start < items * lanes; start += kThreads) {
    const int index = start + threadIdx.x, item = index / lanes, part = index % lanes;
    const bool active = item < items;
    const int r = item / pieces, piece = item % pieces;
    const int64_t row = first_row + r;
    MergedPiece merged;
    for (int s0 = part * kSplitsInFlight; active && s0 < p.num_splits; s0 += lanes * kSplitsInFlight) {
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
      for (int j = 0; j < kSplitsInFlight; ++j) merged.add(lse[j], 1.f, o[j]);
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) merged.add_lane(offset);
    if (!active || part != 0) continue;
    const int packed = m_begin + r, position = packed / p.group, head = tile_head * p.group + packed % p.group;
    // The sink: probability mass, no value.
    if (p.learnable_sink != nullptr) merged.add(p.learnable_sink[head], 1.f, make_float4(0.f, 0.f, 0.f, 0.f));
    const bool has_mass = merged.sum > 0.f;
    const float inv_sum = has_mass ? 1.f / merged.sum : 0.f;
    const float4 acc = merged.acc;
    Element* out = static_cast<Element*>(p.out) + batch * p.out_strides.batch + position * p.out_strides.row +
                   head * p.out_strides.head + 4 * piece;
    *reinterpret_cast<uint2*>(out) =
        make_uint2(Mma::pack(acc.x * inv_sum, acc.y * inv_sum), Mma::pack(acc.z * inv_sum, acc.w * inv_sum));
    if (piece == 0)
      p.lse[batch * p.lse_strides.batch + head * p.lse_strides.head + position] =
          has_mass ? merged.max + logf(merged.sum) : INFINITY;
  }
}

}  // namespace flashattn
