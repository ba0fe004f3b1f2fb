// Launch layer of the mma.sync forward kernel: its tile plan, the shared-memory opt-in,
// the grid.
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"
#include "cuda/common/kernel_launch.cuh"
#include "cuda/device_limits.h"
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

// The persistent grid (plain scores only, which keeps the instantiations few) runs where
// FLASHATTN_FORWARD_SCHEDULER=persistent asks for it; by default this family keeps the static
// grid, whose two or more blocks per SM already overlap one another's starts and ends. Its
// loop costs registers: the W = 128 tile of 32 rows per warp (255 registers) spills 36-56
// bytes in it, so that tile keeps the static grid.
template <typename Shape>
constexpr bool kPersistentGridFits = !(Shape::kHeadDim == 128 && Shape::kRowsPerWarp == 32);

template <typename Element, typename Shape, ScoreMod kMod>
cudaError_t launch_forward_with_shape(const AttentionFwdParams& params, const DeviceLimits& limits,
                                      cudaStream_t stream) {
  if constexpr (kMod == ScoreMod::kNone && kPersistentGridFits<Shape>) {
    if (limits.forward_scheduler == ForwardScheduler::kPersistent) {
      const auto kernel = attention_forward_kernel<Element, Shape, kMod, true>;
      cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
      int blocks_per_sm = 0;
      if (status == cudaSuccess)
        status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, Shape::kThreads,
                                                               Shape::kSmemBytes);
      if (status != cudaSuccess) return status;
      const int64_t blocks = persistent_forward_blocks(params, limits, Shape::kBlockM, Shape::kBlockN,
                                                       int64_t{limits.num_sms} * blocks_per_sm);
      if (blocks > 0)
        return launch_on_flat_grid(kernel, blocks, Shape::kThreads, Shape::kSmemBytes, stream, params);
    }
  }
  return launch_on_flat_grid(attention_forward_kernel<Element, Shape, kMod>,
                             ForwardBlock::grid_blocks(params, Shape::kBlockM), Shape::kThreads,
                             Shape::kSmemBytes, stream, params);
}

}  // namespace flashattn
