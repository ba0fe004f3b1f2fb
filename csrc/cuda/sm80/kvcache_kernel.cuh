// KV-cache attention kernel for sm_80+ (mma.sync tensor cores): one thread block owns
// kBlockM packed-GQA rows of one (batch entry, tile head) (kvcache/kvcache_block.cuh), so K
// and V are read once for every query head that shares them (but in ALiBi calls, whose
// tiles are one query head each: common/kvcache_params.h), runs the forward main loop
// (forward_mainloop.cuh) over its split of the cache's key blocks, contiguous or paged,
// and writes fp32 partial O and lse for the combine kernel to merge and unpack. A decoding
// tile's warps split each key block (key_split_merge.cuh).
#pragma once

#include "common/kvcache_params.h"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/forward_epilogue.cuh"
#include "cuda/kvcache/kvcache_block.cuh"
#include "cuda/sm80/forward_mainloop.cuh"
#include "cuda/sm80/key_split_merge.cuh"

namespace flashattn {

template <typename Element, typename Shape, ScoreMod kMod>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    kvcache_forward_kernel(const __grid_constant__ KvcacheFwdParams params) {
  using QTile = typename Shape::QTile;
  using KVTile = typename Shape::KVTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_address(smem);

  const KvcacheBlock blk(params, Shape::kBlockM, Shape::kBlockN);
  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  const CacheSequence& seq = blk.seq;
  const Element* q_ptr = static_cast<const Element*>(params.q) + blk.batch * params.q_strides.batch +
                         KvcacheBlock::tile_head(params, Shape::kBlockM) * params.q_strides.head +
                         int64_t(blk.m_begin) * params.q_strides.row;
  const Element* k_cache = static_cast<const Element*>(params.k);
  const Element* v_cache = static_cast<const Element*>(params.v);

  const auto load_q = [&](uint32_t smem_q) {
    QTile::template load_async<Shape::kThreads>(smem_q, q_ptr, params.q_strides.row, blk.valid_rows,
                                                params.head_dim, thread);
  };
  // A key block within one run of rows (a contiguous cache, or one page: page >= 0 where
  // the caller has looked it up) copies by the strided loop, one address per thread and
  // pass; only a block across pages looks up each row's page (per-row addressing cost the
  // decoding kernel half its bandwidth).
  const auto load_cache_tile = [&](uint32_t tile_smem, const Element* cache, const TensorStrides& strides, int n0,
                                   int page) {
    const int rows = seq.seqlen_k - n0;
    if (page >= 0 || seq.rows_strided(n0, Shape::kBlockN))
      KVTile::template load_async<Shape::kThreads>(
          tile_smem,
          page >= 0 ? seq.paged_element(cache, strides, blk.kv_head, page, seq.leftpad + n0)
                    : seq.k_row(cache, strides, blk.kv_head, n0),
          strides.row, rows, params.head_dim, thread);
    else
      KVTile::template load_rows_async<Shape::kThreads>(
          tile_smem, [&](int r) { return seq.k_row(cache, strides, blk.kv_head, n0 + r); }, rows, params.head_dim,
          thread);
  };
  // forward_mainloop loads the key blocks one after the other, last first: a paged cache's
  // page for the next one is read while this one's copies are issued, so that the lookup's
  // latency is off the copy's path (read at the copy, it cost a decoding block alone on its
  // SM 30-60 %). The decoding tiles only (16 rows; 32 rows over 16-key blocks at W = 256):
  // the larger ones have no register to spare for it at W = 192 and 256.
  constexpr bool kPageAhead = Shape::kBlockM <= 16 || Shape::kBlockN <= 16;
  const bool page_ahead = kPageAhead && seq.pages != nullptr;
  int next_page = page_ahead && blk.n_block_last >= blk.n_block_first
                      ? seq.page_of(seq.leftpad + blk.n_block_last * Shape::kBlockN)
                      : -1;
  const auto load_kv_block = [&](uint32_t kv_smem, int n_block) {
    const int n0 = n_block * Shape::kBlockN;
    int page = -1;  // block n_block's page where it lies in one
    if (page_ahead) {
      if (seq.rows_strided(n0, Shape::kBlockN)) page = next_page;
      next_page = n_block > blk.n_block_first ? seq.page_of(seq.leftpad + n0 - Shape::kBlockN) : -1;
    }
    load_cache_tile(kv_smem, k_cache, params.k_strides, n0, page);
    load_cache_tile(kv_smem + KVTile::kBytes, v_cache, params.v_strides, n0, page);
  };
  const ForwardSmem<Shape> tile_smem{q_smem};
  forward_prologue<Shape>(tile_smem, load_q, load_kv_block, blk.n_block_first, blk.n_block_last, {});
  ForwardRowState<Shape> state;
  forward_mainloop<Element, Shape>(
      tile_smem, load_kv_block, blk.mask,
      // ALiBi's slope is the tile head's, a query head's (kvcache_params.h).
      [&] { return ScoreTransform<kMod>(params, blk.batch, KvcacheBlock::tile_head(params, Shape::kBlockM)); },
      [](auto&, int, int) {}, blk.m_begin,
      blk.n_block_first, blk.n_block_last, {}, state);
  allow_dependent_launch();  // the combine's blocks may take the SM slots of the finished ones

  static_assert(KeySplitMergeLayout<Shape>::kBytes <= Shape::kStages * 2 * KVTile::kBytes,
                "the merge reuses the K/V stages");
  if (!merge_key_split_warps(state, reinterpret_cast<float*>(smem + QTile::kBytes))) return;
  const int64_t partial_row = blk.partial_row(params, Shape::kBlockM);
  store_forward_rows<float>(state.acc_o, state.row_max, state.row_sum,
                            params.out_partial + partial_row * params.head_dim, params.head_dim,
                            params.lse_partial + partial_row, Shape::warp_row(warp), blk.valid_rows,
                            params.head_dim, lane, -INFINITY);
}

}  // namespace flashattn
