// Forward attention kernel for sm_80+ (mma.sync tensor cores): one thread block owns
// kBlockM query rows of one (batch, head) of a dense or variable-length batch
// (tile_scheduler.cuh's ForwardBlock), runs the main loop over the key blocks its rows
// see (forward_mainloop.cuh), and writes O and lse once at the end.
#pragma once

#include "common/attention_params.h"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/forward_epilogue.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm80/forward_mainloop.cuh"

namespace flashattn {

template <typename Element, typename Shape, ScoreMod kMod>
__global__ void __launch_bounds__(Shape::kThreads)
    attention_forward_kernel(const __grid_constant__ AttentionFwdParams params) {
  using QTile = typename Shape::QTile;
  using KVTile = typename Shape::KVTile;
  // Every warp starts its rows at the sink: warps that split the keys would count it twice.
  static_assert(Shape::kKeyWarps == 1, "the attention kernel's warps own whole rows");
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_address(smem);

  const ForwardBlock blk(params, Shape::kBlockM, Shape::kBlockN, false, blockIdx.x);
  if (blk.empty) return;
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

}  // namespace flashattn
