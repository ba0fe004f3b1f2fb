// The end of a tile whose warps split each key block (ForwardTileShape::kKeyWarps > 1):
// every warp of a group holds the online-softmax state of the same rows over its own keys.
// They are merged in shared memory into the group's first warp, which then writes the rows.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/common/online_softmax.cuh"
#include "cuda/sm80/forward_mainloop.cuh"

namespace flashattn {

// The merge's shared memory (from the start of `scratch`), per warp and lane: its row
// maxes, then its O accumulator and row sums.
template <typename Shape>
struct KeySplitMergeLayout {
  static constexpr int kMaxes = Shape::kMTiles * 2;
  static constexpr int kPartials = Shape::kMTiles * Shape::kDTiles * 4 + Shape::kMTiles * 2;
  static constexpr int kBytes =
      Shape::kKeyWarps == 1 ? 0 : Shape::kWarps * (kMaxes + kPartials) * 32 * int(sizeof(float));
};

// After forward_mainloop (all of whose copies have landed): rescales every warp's state to
// the group's common row max and adds the group into its first warp. Returns whether this
// warp holds merged rows (the one to write them). `scratch`: KeySplitMergeLayout::kBytes
// of shared memory no warp reads any more (the K/V stages). Lanes meet lanes of the same
// index in the other warps: the accumulator fragments are laid out alike in every warp.
template <typename Shape>
__device__ __forceinline__ bool merge_key_split_warps(ForwardRowState<Shape>& state, float* scratch) {
  constexpr int kKeyWarps = Shape::kKeyWarps, kMTiles = Shape::kMTiles, kDTiles = Shape::kDTiles;
  if constexpr (kKeyWarps == 1) {
    return true;
  } else {
    constexpr int kMaxes = KeySplitMergeLayout<Shape>::kMaxes, kPartials = KeySplitMergeLayout<Shape>::kPartials;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first = warp - warp % kKeyWarps;
    float* maxes = scratch;                                      // [warp][mt, h][lane]
    float* partials = scratch + Shape::kWarps * kMaxes * 32;     // [warp][value][lane]
    __syncthreads();  // every warp past its last key block: the stages are free
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) maxes[(warp * kMaxes + mt * 2 + h) * 32 + lane] = state.row_max[mt][h];
    __syncthreads();
    float scales[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mine = state.row_max[mt][h];
        float group_max = mine;
#pragma unroll
        for (int w = 0; w < kKeyWarps; ++w)
          group_max = fmaxf(group_max, maxes[((first + w) * kMaxes + mt * 2 + h) * 32 + lane]);
        // A warp that saw no key of the row holds zeros: scale 0, never exp2(-inf - -inf).
        scales[mt][h] = mine == -INFINITY ? 0.f : exp2f(mine - group_max);
        state.row_max[mt][h] = group_max;
        state.row_sum[mt][h] *= scales[mt][h];
      }
    rescale_output(state.acc_o, scales);
    const auto value = [&](int w, int i) -> float& { return partials[(w * kPartials + i) * 32 + lane]; };
    if (warp != first) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) value(warp, (mt * kDTiles + dt) * 4 + e) = state.acc_o[mt][dt][e];
#pragma unroll
        for (int h = 0; h < 2; ++h) value(warp, kMTiles * kDTiles * 4 + mt * 2 + h) = state.row_sum[mt][h];
      }
    }
    __syncthreads();
    if (warp != first) return false;
#pragma unroll
    for (int w = 1; w < kKeyWarps; ++w)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) state.acc_o[mt][dt][e] += value(first + w, (mt * kDTiles + dt) * 4 + e);
#pragma unroll
        for (int h = 0; h < 2; ++h) state.row_sum[mt][h] += value(first + w, kMTiles * kDTiles * 4 + mt * 2 + h);
      }
    return true;
  }
}

}  // namespace flashattn
