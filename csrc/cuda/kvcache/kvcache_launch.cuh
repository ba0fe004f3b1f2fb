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

// Decoding reads K and V once and computes little. Decode (packed rows <= 32: one query row
// per head of the GQA group, so up to 32 query heads per KV head): 32-row tiles on 2 warps
// and three 64-key stages, two thread blocks per SM. Each warp reads the whole K and V
// block from shared memory, so 4 warps on 64 rows read 4 x the bytes the copy brought in,
// and the third stage hides the block-table lookup in front of each paged copy. Sweeps of
// 2026-12-04 (benchmarks/RESULTS.md), against 64 rows on 4 warps with two stages: W 128
// paged 2.8-3.2 -> 3.5-4.1 TB/s but at the smallest shape, contiguous -2 to +17 %; W 64
// +4-27 % contiguous, +9-47 % paged; 3 stages of 64 rows held one block per SM and read
// 2.5-2.9. W = 192, 256 decode on 32 rows and 2 warps too, with 32 and 16 keys per block
// and two stages (-1 to +23 % contiguous, +17-33 % paged; 32 x 32 spilled at W 256).
// Primary (longer q: chunked prefill) keeps 64-row tiles, which re-read K/V for fewer row
// blocks (W = 192, 256: 32-key blocks, 64 spilled). Fallback: devices whose shared-memory
// opt-in is small (sm_86/89: 99 KB), 32-key blocks (16 at W = 256) on 2 warps.
template <int W>
struct KvcacheTilePlan {
  using Decode = ForwardTileShape<W, 32, 64, 2, W / 16, 3>;
  using Primary = ForwardTileShape<W, 64, 64, 4>;
  using Fallback = ForwardTileShape<W, 32, 32, 2>;
};
template <>
struct KvcacheTilePlan<192> {
  using Primary = ForwardTileShape<192, 64, 32, 4>;
  using Decode = ForwardTileShape<192, 32, 32, 2>;
  using Fallback = ForwardTileShape<192, 32, 32, 2>;
};
template <>
struct KvcacheTilePlan<256> {  // the score loop half unrolled
  using Primary = ForwardTileShape<256, 64, 32, 4, 8>;
  using Decode = ForwardTileShape<256, 32, 16, 2>;
  using Fallback = ForwardTileShape<256, 32, 16, 2>;
};

// softcap at W = 256: 16-key blocks (32 spilled: the tanh's operands on top of the plain
// kernel's 255 registers), 64 rows for decoding too (its 32-row decode tile is not
// measured with softcap). The split count is still chosen from the plain plan's tile.
template <int W, ScoreMod kMod>
struct KvcacheVariantPlan : KvcacheTilePlan<W> {};
template <>
struct KvcacheVariantPlan<256, ScoreMod::kSoftcap> {
  using Primary = ForwardTileShape<256, 64, 16, 4>;
  using Decode = Primary;
  using Fallback = ForwardTileShape<256, 32, 16, 2>;
};

// f(the tile shape) for a call with this many packed rows on this device.
template <typename Plan, typename F>
auto with_kvcache_tile(const DeviceLimits& limits, int packed_rows, const F& f) {
  if (packed_rows <= Plan::Decode::kBlockM && Plan::Decode::kSmemBytes <= limits.max_smem_per_block)
    return f(typename Plan::Decode{});
  if (Plan::Primary::kSmemBytes <= limits.max_smem_per_block) return f(typename Plan::Primary{});
  return f(typename Plan::Fallback{});
}

template <int W>
KvcacheTileInfo kvcache_tile_info(const DeviceLimits& limits, int packed_rows) {
  return with_kvcache_tile<KvcacheTilePlan<W>>(limits, packed_rows, [&](auto shape) {
    using Shape = decltype(shape);
    const auto kernel = kvcache_forward_kernel<__nv_bfloat16, Shape, ScoreMod::kNone>;
    int blocks = 1;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Shape::kThreads, Shape::kSmemBytes) !=
            cudaSuccess)
      blocks = 1;
    return KvcacheTileInfo{Shape::kBlockM, Shape::kBlockN, blocks > 0 ? blocks : 1};
  });
}

template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_kvcache_attention(const KvcacheFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream) {
  return with_kvcache_tile<KvcacheVariantPlan<W, kMod>>(limits, params.packed_rows, [&](auto shape) {
    using Shape = decltype(shape);
    if (Shape::kSmemBytes > limits.max_smem_per_block) return cudaErrorInvalidConfiguration;
    return launch_on_flat_grid(kvcache_forward_kernel<Element, Shape, kMod>,
                               KvcacheBlock::grid_blocks(params, Shape::kBlockM), Shape::kThreads,
                               Shape::kSmemBytes, stream, params);
  });
}

#define FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, MOD)                                                         \
  template cudaError_t launch_kvcache_attention<__nv_bfloat16, W, ScoreMod::MOD>(const KvcacheFwdParams&,      \
                                                                               const DeviceLimits&, cudaStream_t); \
  template cudaError_t launch_kvcache_attention<__half, W, ScoreMod::MOD>(const KvcacheFwdParams&,             \
                                                                        const DeviceLimits&, cudaStream_t);
#define FLASHATTN_INSTANTIATE_KVCACHE(W)                              \
  template KvcacheTileInfo kvcache_tile_info<W>(const DeviceLimits&, int); \
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kNone)                     \
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kSoftcap)

}  // namespace flashattn
