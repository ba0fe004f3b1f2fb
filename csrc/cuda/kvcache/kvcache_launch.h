// The launches of a flash_attn_with_kvcache call, as the torch-side code sees them: the
// prepare kernel, the attention kernel of one head-dim tile width, the combine kernel,
// and the choice of the number of splits. Template definitions: kvcache_launch.cuh,
// compiled only in the generated instantiations; the rest in kvcache_kernels.cu.
#pragma once

#include <cuda_runtime.h>

#include "common/kvcache_params.h"
#include "cuda/device_limits.h"
#include "cuda/score_mod.h"

namespace flashattn {

// The tile the attention kernel of width W runs on this device for this many packed rows
// (a query row of each query head of a KV head's group), how many of its thread blocks
// an SM holds at once, and how many bytes of K and V one of them has in flight while it
// computes (the stages past the one it reads).
struct KvcacheTileInfo {
  int block_m, block_n, blocks_per_sm, bytes_in_flight;
};
template <int W>
KvcacheTileInfo kvcache_tile_info(const DeviceLimits& limits, int packed_rows);

// The splits of the key blocks for a call whose shapes are these (never its values, so a
// captured CUDA graph stays right when cache_seqlens changes): `requested` > 0 is taken
// (at most one split per key block of the cache's capacity, at most 128); 0 keeps one
// split when the tiles already fill the device, else takes the fewest splits (each at
// least two key blocks long) within 5 % of the least modelled time. The model: a call
// lasts as long as its busiest SM, which reads its thread blocks' key blocks (plus 2 for
// a block's start and end) in waves of as many as it holds, at a rate that grows with the
// bytes the wave's blocks have in flight up to the SM's share of DRAM. That share is
// reached at the bytes the SM's share of the peak bandwidth delivers in one DRAM latency
// (Little's law), about 2 us: 73-75 KB on the H200 (2026-12-04: one d 128 block with 70 KB in
// flight read 7 % slower than two; d 256 blocks with 17 KB each needed four), 52 KB on
// the H100 (2026-12-07: d 64 blocks with 32 KB each read fastest two per SM, not three).
// A block of a paged cache counts a fifth less in flight: alone on its SM it read 15-18 %
// slower than on a contiguous cache (its page lookups, 31 % more instructions), two per SM
// as fast (2026-12-04). Short splits are the exception the model does not see: a split of
// at most 4 key blocks is bound by the latency of its loads' few rounds (the decoding tiles
// keep two key blocks in flight), which more blocks on each SM overlap. Where filling every
// block slot of the device leaves each split 2-4 key blocks, that count is taken over a
// smaller one of the model's (H100, fixed counts, 2026-12-07: d 128, batch 1, 8 KV heads,
// 4k keys: 32 splits read 5.6-7.2 % more than the model's 16; d 64, 32 KV heads: 16 read
// 6.5-7.3 % more than its 8; no other of 24 shapes from 4k to 128k keys had such a count).
int kvcache_num_splits(int requested, int batch, int tile_heads, int packed_rows, int cache_rows, bool paged,
                       const KvcacheTileInfo& tile, const DeviceLimits& limits);

// Rotary embedding and the packed-GQA copy of q; the new rows into the cache.
cudaError_t launch_kvcache_prepare(const KvcacheFwdParams& attn, const KvcachePrepareParams& prepare,
                                   cudaStream_t stream);

// The attention of the packed queries against the cache, into the partial outputs; kMod:
// kNone, kSoftcap, kBias or kSoftcapBias (ALiBi; the sink joins in the combine).
template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_kvcache_attention(const KvcacheFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream);

// The partials merged into out and lse.
cudaError_t launch_kvcache_combine(const KvcacheFwdParams& params, cudaStream_t stream);

}  // namespace flashattn
