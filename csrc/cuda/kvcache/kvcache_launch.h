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
// (a query row of each query head of a KV head's group), and how many of its thread blocks
// an SM holds at once.
struct KvcacheTileInfo {
  int block_m, block_n, blocks_per_sm;
};
template <int W>
KvcacheTileInfo kvcache_tile_info(const DeviceLimits& limits, int packed_rows);

// The splits of the key blocks for a call whose shapes are these (never its values, so a
// captured CUDA graph stays right when cache_seqlens changes): `requested` > 0 is taken
// (at most one split per key block of the cache's capacity, at most 128); 0 keeps one
// split when the tiles already fill the device, else takes the fewest splits whose grid
// fills the SMs' block slots in whole waves (within 85 % of the best such fill), each
// split at least four key blocks long.
int kvcache_num_splits(int requested, int batch, int nheads_kv, int packed_rows, int cache_rows,
                       const KvcacheTileInfo& tile, int num_sms);

// Rotary embedding and the packed-GQA copy of q; the new rows into the cache.
cudaError_t launch_kvcache_prepare(const KvcacheFwdParams& attn, const KvcachePrepareParams& prepare,
                                   cudaStream_t stream);

// The attention of the packed queries against the cache, into the partial outputs; kMod:
// kNone or kSoftcap (the KV cache takes no ALiBi, and its sink joins in the combine).
template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_kvcache_attention(const KvcacheFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream);

// The partials merged into out and lse.
cudaError_t launch_kvcache_combine(const KvcacheFwdParams& params, cudaStream_t stream);

}  // namespace flashattn
