// Launch layer of the mma.sync forward kernel: its tile plan, the shared-memory opt-in,
// the grid.
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"
#include "cuda/common/kernel_launch.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn {

// The tile plan: block shape per head-dim tile width W, the one place these are chosen.
// What bounds them:
//  - registers: each thread holds its rows' O accumulator (rows_per_warp * W / 32
//    floats) and S block (rows_per_warp * kBlockN / 32 floats) within 255, without
//    spills (checked with -Xptxas -v for every shape below);
//  - shared-memory bandwidth: a warp reads all of K and V per block, so a warp
//    owning 32 rows (two m16 tiles) halves those reads per FLOP against 16 rows;
//    that is kept wherever the registers allow (W = 64, 128: 32 rows per warp ran
//    1.2-1.5x faster than 16 on the H200, benchmarks/RESULTS.md);
//  - shared memory: Q (kBlockM x W) + 2 stages x (K + V) (kBlockN x W each), padded
//    rows, must fit the device's opt-in limit: 227 KB on sm_90, 163 KB on sm_80,
//    99 KB on sm_86/89, where the large widths fall back to a smaller tile.
template <int W>
struct ForwardTilePlan;
template <>
struct ForwardTilePlan<32> {
  using Primary = ForwardTileShape<32, 128, 128, 8>;
  using Fallback = Primary;
};
template <>
struct ForwardTilePlan<64> {
  using Primary = ForwardTileShape<64, 128, 64, 4>;
  using Fallback = Primary;
};
template <>
struct ForwardTilePlan<96> {
  using Primary = ForwardTileShape<96, 128, 64, 8>;
  using Fallback = Primary;
};
template <>
struct ForwardTilePlan<128> {
  using Primary = ForwardTileShape<128, 128, 64, 4>;
  using Fallback = Primary;
};
template <>
struct ForwardTilePlan<192> {
  using Primary = ForwardTileShape<192, 128, 32, 8>;
  using Fallback = ForwardTileShape<192, 64, 32, 4>;
};
template <>
struct ForwardTilePlan<256> {
  using Primary = ForwardTileShape<256, 128, 64, 8>;
  using Fallback = ForwardTileShape<256, 64, 32, 4>;
};

// The plans of a score-mod variant: dropout's draws tip the W = 128 plan (at 255 registers)
// into spills (4-16 bytes; still 4 with smaller key blocks or a partly rolled S = Q K^T
// loop, depending on the variant and the flags), so it runs 16 rows per warp (168-195).
template <int W, ScoreMod kMod, bool = W == 128 && has_dropout(kMod)>
struct ForwardVariantPlan : ForwardTilePlan<W> {};
template <int W, ScoreMod kMod>
struct ForwardVariantPlan<W, kMod, true> {
  using Primary = ForwardTileShape<128, 64, 64, 4>;
  using Fallback = Primary;
};

template <typename Element, typename Shape, ScoreMod kMod>
cudaError_t launch_forward_with_shape(const AttentionFwdParams& params, cudaStream_t stream) {
  return launch_on_flat_grid(attention_forward_kernel<Element, Shape, kMod>,
                             ForwardBlock::grid_blocks(params, Shape::kBlockM), Shape::kThreads,
                             Shape::kSmemBytes, stream, params);
}

}  // namespace flashattn
