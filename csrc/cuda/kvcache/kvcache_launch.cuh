// The KV-cache attention launch for one head-dim tile width: its tile plan and grid.
// Included only by the generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common/kernel_launch.cuh"
#include "cuda/kvcache/kvcache_block.cuh"
#include "cuda/kvcache/kvcache_launch.h"
#include "cuda/sm80/kvcache_kernel.cuh"

namespace flashattn {

// Decoding reads K and V once and computes little: 64-row tiles (decoding's packed rows
// are the GQA group, a handful) keep the tensor work per key block well under its copy
// time, and two 64-key stages leave room for two thread blocks per SM (W <= 128), one
// copying while the other computes. (Four stages, one block per SM, read 1.2 TB/s where
// two stages read 1.9: benchmarks/RESULTS.md.) W = 192, 256: 32-key blocks (64 spilled).
// Fallback: devices whose shared-memory opt-in is small (sm_86/89: 99 KB), 32-key blocks
// (16 at W = 256) on 2 warps.
template <int W>
struct KvcacheTilePlan {
  using Primary = ForwardTileShape<W, 64, 64, 4>;
  using Fallback = ForwardTileShape<W, 32, 32, 2>;
};
template <>
struct KvcacheTilePlan<192> {
  using Primary = ForwardTileShape<192, 64, 32, 4>;
  using Fallback = ForwardTileShape<192, 32, 32, 2>;
};
template <>
struct KvcacheTilePlan<256> {  // the score loop half unrolled
  using Primary = ForwardTileShape<256, 64, 32, 4, 8>;
  using Fallback = ForwardTileShape<256, 32, 16, 2>;
};

// softcap at W = 256: 16-key blocks (32 spilled: the tanh's operands on top of the plain
// kernel's 255 registers). The split count is still chosen from the plain plan's tile.
template <int W, ScoreMod kMod>
struct KvcacheVariantPlan : KvcacheTilePlan<W> {};
template <>
struct KvcacheVariantPlan<256, ScoreMod::kSoftcap> {
  using Primary = ForwardTileShape<256, 64, 16, 4>;
  using Fallback = ForwardTileShape<256, 32, 16, 2>;
};

template <int W>
KvcacheTileInfo kvcache_tile_info(const DeviceLimits& limits) {
  const auto info = [&](auto shape) {
    using Shape = decltype(shape);
    const auto kernel = kvcache_forward_kernel<__nv_bfloat16, Shape, ScoreMod::kNone>;
    int blocks = 1;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Shape::kThreads, Shape::kSmemBytes) !=
            cudaSuccess)
      blocks = 1;
    return KvcacheTileInfo{Shape::kBlockM, Shape::kBlockN, blocks > 0 ? blocks : 1};
  };
  using Plan = KvcacheTilePlan<W>;
  if (Plan::Primary::kSmemBytes <= limits.max_smem_per_block) return info(typename Plan::Primary{});
  return info(typename Plan::Fallback{});
}

template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_kvcache_attention(const KvcacheFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream) {
  const auto launch = [&](auto shape) {
    using Shape = decltype(shape);
    return launch_on_flat_grid(kvcache_forward_kernel<Element, Shape, kMod>,
                               KvcacheBlock::grid_blocks(params, Shape::kBlockM), Shape::kThreads,
                               Shape::kSmemBytes, stream, params);
  };
  using Plan = KvcacheVariantPlan<W, kMod>;
  if (Plan::Primary::kSmemBytes <= limits.max_smem_per_block) return launch(typename Plan::Primary{});
  if (Plan::Fallback::kSmemBytes <= limits.max_smem_per_block) return launch(typename Plan::Fallback{});
  return cudaErrorInvalidConfiguration;
}

#define FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, MOD)                                                         \
  template cudaError_t launch_kvcache_attention<__nv_bfloat16, W, ScoreMod::MOD>(const KvcacheFwdParams&,      \
                                                                               const DeviceLimits&, cudaStream_t); \
  template cudaError_t launch_kvcache_attention<__half, W, ScoreMod::MOD>(const KvcacheFwdParams&,             \
                                                                        const DeviceLimits&, cudaStream_t);
#define FLASHATTN_INSTANTIATE_KVCACHE(W)                              \
  template KvcacheTileInfo kvcache_tile_info<W>(const DeviceLimits&); \
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kNone)                     \
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kSoftcap)

}  // namespace flashattn
