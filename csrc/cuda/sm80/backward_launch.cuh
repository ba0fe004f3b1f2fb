// Launch layer of the mma.sync backward main kernel: its tile plans (the one place they
// are chosen), the shared-memory opt-in, the grid, and the passes around it.
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"
#include "cuda/common/backward_passes.cuh"
#include "cuda/common/kernel_launch.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm80/backward_kernel.cuh"

namespace flashattn {
namespace backward {

// The tile plan, per head-dim tile W: BackwardTile<W, BN, BM, kWarpsD, kStages, kDqWarpsQ,
// kDqChunk>. What bounds it:
//  - registers: a warp owns 16 key rows; its dK + dV accumulators cost W / kWarpsD fp32
//    registers per thread and the Sᵀ/dPᵀ accumulators BM / kWarpsD / 2 more, so W <= 128 runs
//    kWarpsD = 1 with BM = 64 (128 + 64 at W = 128), W = 192/256 split the head dimension over
//    a warp pair (kWarpsD = 2). The dQ chunk keeps its accumulators at 16-48 registers (W = 128
//    takes 64 columns at a time over 4 row groups: with the per-sequence bounds of varlen
//    batches, 128 columns over 2 spilled 4-16 bytes).
//  - shared memory: K, V (BN rows), kStages x (Q, dO) (BM rows), dSᵀ (+ Pᵀ when kWarpsD = 2),
//    all padded by 16 bytes a row. Large plans (8 warps, BN = 128 for W <= 128, 64 above) need
//    59 / 91 / 123 / 155 / 169 / 217 KB for W = 32 ... 256: d 256 fits the 227 KB a Hopper
//    block may opt into, A100's 163 KB takes the large plan up to W = 128. The small plans
//    (4 warps) fit the ~99 KB of sm_86/89/120: 88 KB (W 96), 73.5 KB (128), 80.5 KB (192),
//    71 KB (256, single-buffered); W <= 64 fits everywhere with the large plan.
template <int W>
struct BackwardPlans;
template <>
struct BackwardPlans<32> {
  using Large = BackwardTile<32, 128, 64, 1, 2, 4, 32>;
  using Small = Large;
};
template <>
struct BackwardPlans<64> {
  using Large = BackwardTile<64, 128, 64, 1, 2, 2, 64>;
  using Small = Large;
};
template <>
struct BackwardPlans<96> {
  using Large = BackwardTile<96, 128, 64, 1, 2, 4, 96>;
  using Small = BackwardTile<96, 64, 64, 1, 2, 2, 96>;
};
template <>
struct BackwardPlans<128> {
  using Large = BackwardTile<128, 128, 64, 1, 2, 4, 64>;
  using Small = BackwardTile<128, 64, 32, 1, 2, 1, 128>;
};
template <>
struct BackwardPlans<192> {
  using Large = BackwardTile<192, 64, 64, 2, 2, 2, 192>;
  using Small = BackwardTile<192, 32, 32, 2, 2, 1, 192>;
};
template <>
struct BackwardPlans<256> {
  using Large = BackwardTile<256, 64, 64, 2, 2, 2, 128>;
  using Small = BackwardTile<256, 32, 32, 2, 1, 1, 128>;
};

// The plans of a score-mod variant: softcap with ALiBi, and dropout, tip the W = 128 large
// plan (at 246-255 registers) into spills (4-40 bytes in its sm_90a image), so they run the
// small one.
template <int W, ScoreMod kMod, bool = W == 128 && (kMod == ScoreMod::kSoftcapBias || has_dropout(kMod))>
struct BackwardVariantPlans : BackwardPlans<W> {};
template <int W, ScoreMod kMod>
struct BackwardVariantPlans<W, kMod, true> {
  using Large = BackwardPlans<128>::Small;
  using Small = Large;
};

template <typename Element, typename Tile, ScoreMod kMod>
cudaError_t launch_main_kernel(const AttentionBwdParams& p, cudaStream_t stream) {
  return launch_on_flat_grid(attention_backward_kernel<Element, Tile, kMod>, BackwardBlock::grid_blocks(p, Tile::kBlockN),
                             Tile::kThreads, Tile::kSmemBytes, stream, p, LaunchOrder::kDependent);
}

template <typename Element, typename Tile, ScoreMod kMod>
cudaError_t launch_with_tile(const AttentionBwdParams& p, cudaStream_t stream) {
  return run_backward_passes<Element>(p, stream, DqAccumTiles::kRowMajor,
                                      [&] { return launch_main_kernel<Element, Tile, kMod>(p, stream); });
}

}  // namespace backward

}  // namespace flashattn
