// The element-type dispatch of the prepare and combine kernels, and the split heuristic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "cuda/common/kernel_launch.cuh"
#include "cuda/kvcache/combine_kernel.cuh"
#include "cuda/kvcache/kvcache_launch.h"
#include "cuda/kvcache/prepare_kernel.cuh"

namespace flashattn {
namespace {

constexpr int kRowsPerBlock = 4;  // the prepare kernel: one warp per row

int64_t blocks_for_rows(int64_t rows) { return (rows + kRowsPerBlock - 1) / kRowsPerBlock; }

}  // namespace

int kvcache_num_splits(int requested, int batch, int tile_heads, int packed_rows, int cache_rows, bool paged,
                       const KvcacheTileInfo& tile, const DeviceLimits& limits) {
  const int key_blocks = std::max(1, (cache_rows + tile.block_n - 1) / tile.block_n);
  if (requested > 0) return std::min({requested, key_blocks, kMaxSplits});
  const int num_sms = limits.num_sms;
  const int64_t tiles = int64_t(batch) * tile_heads * ((packed_rows + tile.block_m - 1) / tile.block_m);
  const int64_t slots = int64_t(num_sms) * tile.blocks_per_sm;
  const int max_splits = std::min(kMaxSplits, key_blocks / 2);
  if (tiles == 0 || tiles * 5 >= slots * 4 || max_splits <= 1) return 1;
  // The latency fitted on the H200's 75 KB at its data sheet's 4.9 TB/s over 132 SMs (it
  // reports 4.8 TB/s, a 6016-bit bus: 73 KB); a device that does not report its bandwidth is
  // taken as one.
  constexpr double kBlockStartEnd = 2.0, kDramLatencySeconds = 2.06e-6, kUnreportedSaturatingBytes = 75.0 * 1024,
                   kPagedInFlightShare = 0.8;
  const double sm_saturating_bytes = limits.dram_bytes_per_s > 0
                                         ? kDramLatencySeconds * limits.dram_bytes_per_s / num_sms
                                         : kUnreportedSaturatingBytes;
  const double block_in_flight = tile.bytes_in_flight * (paged ? kPagedInFlightShare : 1.0);
  const auto sm_rate = [&](int64_t resident) {
    return std::min(1.0, double(resident) * block_in_flight / sm_saturating_bytes);
  };
  // The SM's blocks in waves of blocks_per_sm, a wave of k taking k blocks' reads at rate(k).
  const auto modelled_time = [&](int splits) {
    const int64_t blocks_on_sm = (tiles * splits + num_sms - 1) / num_sms;
    const int64_t full_waves = blocks_on_sm / tile.blocks_per_sm, last = blocks_on_sm % tile.blocks_per_sm;
    const double block_reads = full_waves * tile.blocks_per_sm / sm_rate(tile.blocks_per_sm) +
                               (last > 0 ? last / sm_rate(last) : 0.0);
    return block_reads * ((key_blocks + splits - 1) / splits + kBlockStartEnd);
  };
  double best = modelled_time(1);
  for (int splits = 2; splits <= max_splits; ++splits) best = std::min(best, modelled_time(splits));
  int modelled = 1;
  while (modelled < max_splits && modelled_time(modelled) > 1.05 * best) ++modelled;
  // Short splits, bound by their latency rounds (kvcache_launch.h): as many as fill the slots.
  constexpr int kLatencyBoundKeyBlocks = 4;
  const int64_t slots_per_tile = slots / tiles;  // >= 1: tiles < slots here
  const int per_split = static_cast<int>((key_blocks + slots_per_tile - 1) / slots_per_tile);
  const int filling = (key_blocks + per_split - 1) / per_split;
  if (per_split >= 2 && per_split <= kLatencyBoundKeyBlocks && filling <= max_splits) return std::max(modelled, filling);
  return modelled;
}

cudaError_t launch_kvcache_prepare(const KvcacheFwdParams& attn, const KvcachePrepareParams& prepare,
                                   cudaStream_t stream) {
  const int64_t rows = (prepare.q_packed != nullptr ? int64_t(attn.batch) * attn.seqlen_q * attn.nheads_q : 0) +
                       (prepare.cache_seqlens != nullptr ? int64_t(attn.batch) * prepare.seqlen_new * attn.nheads_kv : 0);
  const int64_t blocks = blocks_for_rows(rows);
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  if (attn.is_bf16)
    kvcache_prepare_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), 32 * kRowsPerBlock, 0, stream>>>(attn, prepare);
  else
    kvcache_prepare_kernel<__half><<<static_cast<unsigned>(blocks), 32 * kRowsPerBlock, 0, stream>>>(attn, prepare);
  return cudaGetLastError();
}

cudaError_t launch_kvcache_combine(const KvcacheFwdParams& params, cudaStream_t stream) {
  const int64_t rows = int64_t(params.batch) * params.tile_heads * params.packed_rows;
  if (rows == 0) return cudaSuccess;
  if (params.num_splits > kMaxSplits || params.head_dim > kCombineMaxHeadDim || rows > INT_MAX)
    return cudaErrorInvalidValue;
  const auto launch = [&](auto element) {
    using Element = decltype(element);
    const auto kernel = params.head_dim <= 64    ? kvcache_combine_kernel<Element, 1>
                        : params.head_dim <= 128 ? kvcache_combine_kernel<Element, 2>
                                                 : kvcache_combine_kernel<Element, 4>;
    return launch_on_flat_grid(kernel, rows, 32 * kCombineWarps, 0, stream, params, LaunchOrder::kDependent);
  };
  return params.is_bf16 ? launch(__nv_bfloat16{}) : launch(__half{});
}

}  // namespace flashattn
