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

// Decoding reads K and V once and computes little; the tile's job is to keep the copy
// going. Decode (packed rows <= 16: a query row per head of the GQA group): one m16 tile
// of rows on 4 warps that split each key block (16 keys each at W <= 192), three 64-key
// stages (two at W = 192), two blocks per SM (W = 256 keeps the ShortQuery tile: 16 rows
// on 2 warps splitting 32 keys spilled). Split over keys, no warp reads another's K and V
// from shared memory or computes rows another one also computes, as in cuDNN's decoding
// kernel (16 rows, 128 keys, 4 warps); against the 32-row, 2-warp tile it read 1-3 % more
// at d 128 (one build, A/B, 2026-12-04; W = 64 and 192 were timed only together with that
// day's other decoding changes, RESULTS.md). 128-key blocks (cuDNN's) were slower at W = 128
// (196 KB of stages, one block per SM: 0.82-0.996 x on the H200) and mixed at W = 64 (H200
// -2 to +3 % past 32k keys, -6 to -9 % at 4k; H100 not better; 2026-12-07).
// ShortQuery (packed rows <= 32: a few queries per head, or 32 query heads per KV head)
// keeps that 32-row tile on 2 warps with three 64-key stages. Primary (longer q: chunked
// prefill) keeps 64-row tiles, which re-read K/V for fewer row blocks (W = 192, 256:
// 32-key blocks, 64 spilled). Fallback: devices whose shared-memory opt-in is small
// (sm_86/89: 99 KB), 32-key blocks (16 at W = 256) on 2 warps. The Decode tiles of W = 64
// and 128 keep their K / V stages swizzled (smem_tile.cuh), so that the L2 serves each line
// of the cache as one request; the others stay padded (swizzled, the ShortQuery tiles' softcap
// and ALiBi variants at W = 128 and 192 and the W = 192 Decode tile's ALiBi one spilled 4-16
// bytes: the swizzle's address arithmetic in every ldmatrix; W = 32 and 96 rows are not whole
// 128-byte segments).
template <int W>
struct KvcacheTilePlan {
  using Decode = ForwardTileShape<W, 16, 64, 4, W / 16, 3, 4, W % 64 == 0>;
  using ShortQuery = ForwardTileShape<W, 32, 64, 2, W / 16, 3>;
  using Primary = ForwardTileShape<W, 64, 64, 4>;
  using Fallback = ForwardTileShape<W, 32, 32, 2>;
};
template <>
struct KvcacheTilePlan<192> {
  using Decode = ForwardTileShape<192, 16, 64, 4, 12, 2, 4>;
  using ShortQuery = ForwardTileShape<192, 32, 32, 2>;
  using Primary = ForwardTileShape<192, 64, 32, 4>;
  using Fallback = ForwardTileShape<192, 32, 32, 2>;
};
template <>
struct KvcacheTilePlan<256> {  // the score loop half unrolled
  using Decode = ForwardTileShape<256, 32, 16, 2>;
  using ShortQuery = Decode;
  using Primary = ForwardTileShape<256, 64, 32, 4, 8>;
  using Fallback = ForwardTileShape<256, 32, 16, 2>;
};

// A score modifier (softcap, ALiBi) at W = 256: 16-key blocks (32 spilled with softcap: the
// tanh's operands on top of the plain kernel's 255 registers), 64 rows for decoding too (its
// 32-row decode tile is not measured with a modifier). The split count is still chosen from
// the plain plan's tile.
template <int W, bool kModified>
struct KvcacheVariantPlan : KvcacheTilePlan<W> {};
template <>
struct KvcacheVariantPlan<256, true> {
  using Primary = ForwardTileShape<256, 64, 16, 4>;
  using Decode = Primary;
  using ShortQuery = Primary;
  using Fallback = ForwardTileShape<256, 32, 16, 2>;
};

// f(the tile shape) for a call with this many packed rows on this device.
template <typename Plan, typename F>
auto with_kvcache_tile(const DeviceLimits& limits, int packed_rows, const F& f) {
  if (packed_rows <= Plan::Decode::kBlockM && Plan::Decode::kSmemBytes <= limits.max_smem_per_block)
    return f(typename Plan::Decode{});
  if (packed_rows <= Plan::ShortQuery::kBlockM && Plan::ShortQuery::kSmemBytes <= limits.max_smem_per_block)
    return f(typename Plan::ShortQuery{});
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
    return KvcacheTileInfo{Shape::kBlockM, Shape::kBlockN, blocks > 0 ? blocks : 1,
                           (Shape::kStages - 1) * 2 * Shape::KVTile::kBytes};
  });
}

template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_kvcache_attention(const KvcacheFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream) {
  return with_kvcache_tile<KvcacheVariantPlan<W, kMod != ScoreMod::kNone>>(limits, params.packed_rows, [&](auto shape) {
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
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kSoftcap)                  \
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kBias)                     \
  FLASHATTN_INSTANTIATE_KVCACHE_VARIANT(W, kSoftcapBias)

}  // namespace flashattn
