// Forward attention kernel for sm_80+ (mma.sync tensor cores): a thread block owns
// kBlockM query rows of one (batch, head) of a dense or variable-length batch at a time
// (tile_scheduler.cuh's ForwardBlock), runs the main loop over the key blocks its rows
// see (forward_mainloop.cuh), and writes O and lse once at the end.
#pragma once

#include "common/attention_params.h"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/forward_epilogue.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm80/forward_mainloop.cuh"

namespace flashattn {

// One tile: its rows' main loop and epilogue, Q, K and V staged at q_smem.
template <typename Element, typename Shape, ScoreMod kMod>
__device__ __forceinline__ void forward_tile(const AttentionFwdParams& params, const ForwardBlock& blk,
                                             uint32_t q_smem) {
  using QTile = typename Shape::QTile;
  using KVTile = typename Shape::KVTile;
  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  const SequenceInfo& seq = blk.seq;
  const Element* q_ptr = seq.q_row(static_cast<const Element*>(params.q), params.q_strides, blk.batch, blk.head, blk.m_begin);
  const Element* k_ptr = seq.k_row(static_cast<const Element*>(params.k), params.k_strides, blk.batch, blk.kv_head, 0);
  const Element* v_ptr = seq.k_row(static_cast<const Element*>(params.v), params.v_strides, blk.batch, blk.kv_head, 0);
  Element* out_ptr = blk.out_rows<Element>(params);
  float* lse_ptr = blk.lse_rows(params);

  const auto load_q = [&](uint32_t q_smem) {
    QTile::template load_async<Shape::kThreads>(q_smem, q_ptr, params.q_strides.row, blk.valid_q_rows,
                                                params.head_dim, thread);
  };
  const auto load_kv_block = [&](uint32_t kv_smem, int n_block) {
    const int n0 = n_block * Shape::kBlockN;
    KVTile::template load_async<Shape::kThreads>(kv_smem, k_ptr + n0 * params.k_strides.row, params.k_strides.row,
                                                 seq.seqlen_k - n0, params.head_dim, thread);
    KVTile::template load_async<Shape::kThreads>(kv_smem + KVTile::kBytes, v_ptr + n0 * params.v_strides.row, params.v_strides.row,
                                                 seq.seqlen_k - n0, params.head_dim, thread);
  };
  ForwardRowState<Shape> state(!reads_sink(kMod) ? -INFINITY : sink_logit_log2(params, blk.head), lane);
  // ALiBi per score (no linear frame: its second code path spilled the W = 128 kernel).
  forward_mainloop<Element, Shape>(
      q_smem, load_q, load_kv_block, blk.mask, [&] { return ScoreTransform<kMod>(params, blk.batch, blk.head); },
      [&](auto& acc_s, int warp_row_begin, int n_begin) {
        if constexpr (has_dropout(kMod)) {
          const DropoutMask dropout(params, blk.batch, blk.head);
#pragma unroll
          for (int mt = 0; mt < Shape::kMTiles; ++mt) dropout.drop_rows(acc_s[mt], warp_row_begin / 16 + mt, n_begin, lane);
        }
      },
      blk.m_begin, blk.n_block_first, blk.n_block_last, state);

  store_forward_rows<Element>(state.acc_o, state.row_max, state.row_sum, out_ptr,
                              params.out_strides.row, lse_ptr, warp * Shape::kRowsPerWarp,
                              blk.valid_q_rows, params.head_dim, lane, INFINITY,
                              has_dropout(kMod) ? params.dropout_scale : 1.f);
}

// One block per tile (ForwardBlock's order), or, kPersistent, as many blocks as the SMs hold,
// each taking its first tile by its index and every next one from params.tile_counter
// (zeroed before the launch), the Hopper forward's scheme without its producer: thread 0
// takes the number, and the barrier that hands it on also frees the shared memory.
template <typename Element, typename Shape, ScoreMod kMod, bool kPersistent = false>
__global__ void __launch_bounds__(Shape::kThreads)
    attention_forward_kernel(const __grid_constant__ AttentionFwdParams params) {
  // Every warp starts its rows at the sink: warps that split the keys would count it twice.
  static_assert(Shape::kKeyWarps == 1, "the attention kernel's warps own whole rows");
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_address(smem);
  if constexpr (!kPersistent) {
    const ForwardBlock blk(params, Shape::kBlockM, Shape::kBlockN, false, blockIdx.x);
    if (!blk.empty) forward_tile<Element, Shape, kMod>(params, blk, q_smem);
  } else {
    __shared__ unsigned next_tile;
    const unsigned num_tiles = static_cast<unsigned>(ForwardBlock::grid_blocks(params, Shape::kBlockM));
    for (unsigned tile = blockIdx.x; tile < num_tiles;) {
      const ForwardBlock blk(params, Shape::kBlockM, Shape::kBlockN, false, tile);
      if (!blk.empty) forward_tile<Element, Shape, kMod>(params, blk, q_smem);
      if (threadIdx.x == 0) next_tile = atomicAdd(params.tile_counter, 1) + gridDim.x;
      __syncthreads();
      tile = next_tile;
      __syncthreads();  // every thread has read next_tile before thread 0 writes the one after
    }
  }
}

}  // namespace flashattn
