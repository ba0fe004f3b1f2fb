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

// The cp.async copies of one tile: its Q rows and its key blocks' K and V.
template <typename Element, typename Shape>
struct ForwardTileCopies {
  const AttentionFwdParams& params;
  const ForwardBlock& blk;
  const Element* q_ptr;
  const Element* k_ptr;
  const Element* v_ptr;

  __device__ __forceinline__ ForwardTileCopies(const AttentionFwdParams& params, const ForwardBlock& blk)
      : params(params),
        blk(blk),
        q_ptr(blk.seq.q_row(static_cast<const Element*>(params.q), params.q_strides, blk.batch, blk.head, blk.m_begin)),
        k_ptr(blk.seq.k_row(static_cast<const Element*>(params.k), params.k_strides, blk.batch, blk.kv_head, 0)),
        v_ptr(blk.seq.k_row(static_cast<const Element*>(params.v), params.v_strides, blk.batch, blk.kv_head, 0)) {}

  __device__ __forceinline__ void load_q(uint32_t q_smem) const {
    Shape::QTile::template load_async<Shape::kThreads>(q_smem, q_ptr, params.q_strides.row, blk.valid_q_rows,
                                                       params.head_dim, threadIdx.x);
  }
  __device__ __forceinline__ void load_kv_block(uint32_t kv_smem, int n_block) const {
    using KVTile = typename Shape::KVTile;
    const int n0 = n_block * Shape::kBlockN;
    KVTile::template load_async<Shape::kThreads>(kv_smem, k_ptr + n0 * params.k_strides.row, params.k_strides.row,
                                                 blk.seq.seqlen_k - n0, params.head_dim, threadIdx.x);
    KVTile::template load_async<Shape::kThreads>(kv_smem + KVTile::kBytes, v_ptr + n0 * params.v_strides.row,
                                                 params.v_strides.row, blk.seq.seqlen_k - n0, params.head_dim,
                                                 threadIdx.x);
  }
  __device__ __forceinline__ void issue_prologue(ForwardSmem<Shape> smem, KVStages<Shape::kStages> stages) const {
    forward_prologue<Shape>(
        smem, [&](uint32_t q_smem) { load_q(q_smem); },
        [&](uint32_t kv_smem, int n_block) { load_kv_block(kv_smem, n_block); }, blk.n_block_first,
        blk.n_block_last, stages);
  }
};

// One tile: its main loop, then `after_loop()`, then its epilogue (O and lse of its rows, from
// the registers). `issue_prologue`: whether this call issues the tile's first copies, into
// `stages` (a persistent block issued them already). `after_loop` may decode the next tile into
// `blk`: nothing of it is read after that call.
template <typename Element, typename Shape, ScoreMod kMod, typename AfterLoop>
__device__ __forceinline__ void forward_tile(const AttentionFwdParams& params, const ForwardBlock& blk,
                                             ForwardSmem<Shape> smem, KVStages<Shape::kStages> stages,
                                             bool issue_prologue, const AfterLoop& after_loop) {
  const ForwardTileCopies<Element, Shape> copies(params, blk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  Element* out_ptr = blk.out_rows<Element>(params);
  float* lse_ptr = blk.lse_rows(params);
  const int valid_q_rows = blk.valid_q_rows;
  ForwardRowState<Shape> state(!reads_sink(kMod) ? -INFINITY : sink_logit_log2(params, blk.head), lane);
  if (issue_prologue) copies.issue_prologue(smem, stages);
  // ALiBi per score (no linear frame: its second code path spilled the W = 128 kernel).
  forward_mainloop<Element, Shape>(
      smem, [&](uint32_t kv_smem, int n_block) { copies.load_kv_block(kv_smem, n_block); }, blk.mask,
      [&] { return ScoreTransform<kMod>(params, blk.batch, blk.head); },
      [&](auto& acc_s, int warp_row_begin, int n_begin) {
        if constexpr (has_dropout(kMod)) {
          const DropoutMask dropout(params, blk.batch, blk.head);
#pragma unroll
          for (int mt = 0; mt < Shape::kMTiles; ++mt) dropout.drop_rows(acc_s[mt], warp_row_begin / 16 + mt, n_begin, lane);
        }
      },
      blk.m_begin, blk.n_block_first, blk.n_block_last, stages, state);
  after_loop();
  store_forward_rows<Element>(state.acc_o, state.row_max, state.row_sum, out_ptr, params.out_strides.row, lse_ptr,
                              warp * Shape::kRowsPerWarp, valid_q_rows, params.head_dim, lane, INFINITY,
                              has_dropout(kMod) ? params.dropout_scale : 1.f);
}

// One block per tile (ForwardBlock's order), or, kPersistent, as many blocks as the SMs hold,
// each taking its first tile by its index and every next one from params.tile_counter
// (zeroed before the launch), the Hopper forward's scheme without its producer: thread 0
// takes the next number after the tile's last key block, and the barrier that hands it on
// also frees the shared memory, so the next tile's first copies are issued before this
// tile's O is stored, into the K / V stages after its last (the ring carries on).
template <typename Element, typename Shape, ScoreMod kMod, bool kPersistent = false>
__global__ void __launch_bounds__(Shape::kThreads)
    attention_forward_kernel(const __grid_constant__ AttentionFwdParams params) {
  // Every warp starts its rows at the sink: warps that split the keys would count it twice.
  static_assert(Shape::kKeyWarps == 1, "the attention kernel's warps own whole rows");
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  const ForwardSmem<Shape> smem{smem_address(smem_bytes)};
  const TileOrder<Division> order(params, Shape::kBlockM);
  if constexpr (!kPersistent) {
    const ForwardBlock blk(params, order, Shape::kBlockM, Shape::kBlockN, false, blockIdx.x);
    if (!blk.empty) forward_tile<Element, Shape, kMod>(params, blk, smem, {}, true, [] {});
  } else {
    // Tile i's successor goes to slot i % 2: thread 0 writes a slot again two barriers after
    // every thread read it.
    __shared__ unsigned next_tiles[2];
    const unsigned num_tiles = static_cast<unsigned>(ForwardBlock::grid_blocks(params, Shape::kBlockM));
    KVStages<Shape::kStages> stages;
    // Each tile decoded once; a number past the end decodes as the last tile and runs nothing.
    const auto decode = [&](unsigned tile) {
      return ForwardBlock(params, order, Shape::kBlockM, Shape::kBlockN, false, min(tile, num_tiles - 1));
    };
    unsigned tile = blockIdx.x;
    ForwardBlock blk = decode(tile);
    const auto issue_prologue = [&] {
      if (tile < num_tiles && !blk.empty) ForwardTileCopies<Element, Shape>(params, blk).issue_prologue(smem, stages);
    };
    issue_prologue();
    for (int slot = 0; tile < num_tiles; slot ^= 1) {
      const auto next_tile = [&] {
        if (threadIdx.x == 0) next_tiles[slot] = atomicAdd(params.tile_counter, 1) + gridDim.x;
        __syncthreads();  // the next number visible; every warp done with Q and the K / V stages
        tile = next_tiles[slot];
        if (!blk.empty) stages = stages.after(blk.n_block_last - blk.n_block_first + 1);
        blk = decode(tile);
        issue_prologue();
      };
      if (blk.empty)
        next_tile();
      else
        forward_tile<Element, Shape, kMod>(params, blk, smem, stages, false, next_tile);
    }
  }
}

}  // namespace flashattn
