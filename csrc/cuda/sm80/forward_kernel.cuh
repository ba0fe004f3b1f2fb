// Forward attention kernel for sm_80+ (mma.sync tensor cores), FlashAttention-2 class.
//
// One thread block owns kBlockM query rows of one (batch, head). It streams the
// key/value blocks the mask lets those rows see through shared memory, last
// block first, so the blocks that need the element-wise mask (the sequence tail,
// the causal diagonal) come first and the rest run unmasked. The N x N score
// matrix never leaves the chip: each S = Q K^T block lives in registers, is
// consumed by the online softmax (running max m and sum l per row, the output
// accumulator rescaled by exp2(m_old - m_new)), and feeds P V straight from the
// accumulator registers. O and lse are written once at the end.
//
// Warps split the query rows: each of the kWarps warps owns kBlockM / kWarps rows
// (one or two m16 tiles) across the whole key block and the whole head dimension,
// so the softmax row reductions stay inside a quad of lanes (no shared memory).
//
// Pipeline: K and V blocks rotate through kStages shared-memory stages, so the
// copy of the next block runs under the whole S = Q K^T, softmax, P V of this one.
// Q stays in shared memory and is re-read per block: keeping it in registers
// would cost W/2 registers per m16 tile, which the d >= 128 tiles don't have.
//
// Build: part of the flashattn_ext extension (setup.py / CMakeLists.txt); the
// instantiations live in instantiations/fwd_hdim<W>.cu. Versions:
//   v1  FA2-style mma.sync kernel, padded shared-memory rows, register-resident P,
//       single K/V buffers; a branch per score for the mask.
//   v2  masked and unmasked tiles as separate code; two K/V stages in flight.
//   v3  O rescale skipped when no row's max moved.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "cuda/common/forward_epilogue.cuh"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm80/smem_tile.cuh"

namespace flashattn {

// kScoreKUnroll: how many of the W/16 k-steps of S = Q K^T are unrolled. Full
// unrolling lets the compiler hoist every fragment load; with two m16 tiles per
// warp that can exhaust the 255 registers, and a partly rolled loop costs only
// an address add per step.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kScoreKUnroll_ = kHeadDim_ / 16>
struct ForwardTileShape {
  static constexpr int kScoreKUnroll = kScoreKUnroll_;
  static constexpr int kHeadDim = kHeadDim_;  // compiled width W (>= the problem's head_dim)
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
  static constexpr int kNTiles = kBlockN / 8;        // n8 tiles of S per m16 tile
  static constexpr int kDTiles = kHeadDim / 8;       // n8 tiles of O per m16 tile
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  // K/V blocks in flight: with two, the copy of block j+1 has all of block j's
  // compute to land in, instead of one GEMM as with FlashAttention-2's single buffers.
  static constexpr int kStages = 2;
  static constexpr int kSmemBytes = QTile::kBytes + kStages * 2 * KVTile::kBytes;
  static_assert(kRowsPerWarp % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "mma k-steps are 16 wide");
};

template <typename Element, typename Shape>
__global__ void __launch_bounds__(Shape::kThreads)
    attention_forward_kernel(const __grid_constant__ AttentionFwdParams params) {
  using Mma = MmaElement<Element>;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kHeadDim = Shape::kHeadDim;
  constexpr int kMTiles = Shape::kMTiles, kNTiles = Shape::kNTiles, kDTiles = Shape::kDTiles;
  constexpr int kKsUnroll = Shape::kScoreKUnroll;
  using QTile = typename Shape::QTile;
  using KVTile = typename Shape::KVTile;

  extern __shared__ __align__(128) unsigned char smem[];
  // Shared memory: Q, then kStages x (K, V).
  const uint32_t q_smem = smem_address(smem);
  const auto k_smem = [&](int stage) { return q_smem + QTile::kBytes + stage * 2 * KVTile::kBytes; };
  const auto v_smem = [&](int stage) { return k_smem(stage) + KVTile::kBytes; };

  const ForwardBlock blk(params, ForwardTile::in_plain_order(params, kBlockM, blockIdx.x), kBlockM, kBlockN);
  if (blk.empty) return;
  const int thread = threadIdx.x;
  const int warp = thread / 32, lane = thread % 32;
  const MaskGeometry& mask = blk.mask;
  const int m_begin = blk.m_begin;

  const SequenceInfo& seq = blk.seq;
  const Element* q_ptr = seq.q_row(static_cast<const Element*>(params.q), params.q_strides, blk.batch, blk.head, m_begin);
  const Element* k_ptr = seq.k_row(static_cast<const Element*>(params.k), params.k_strides, blk.batch, blk.kv_head, 0);
  const Element* v_ptr = seq.k_row(static_cast<const Element*>(params.v), params.v_strides, blk.batch, blk.kv_head, 0);
  Element* out_ptr = blk.out_rows<Element>(params);
  float* lse_ptr = blk.lse_rows(params);

  float acc_o[kMTiles][kDTiles][4];
  float row_max[kMTiles][2];  // running max of the log2-domain scores
  float row_sum[kMTiles][2];  // this lane's part of the running sum (quad-reduced at the end)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = -INFINITY;
      row_sum[mt][h] = 0.f;
    }
  }

  const int n_block_first = blk.n_block_first, n_block_last = blk.n_block_last;
  const int valid_q_rows = blk.valid_q_rows;

  if (n_block_last >= n_block_first) {
    QTile::template load_async<Shape::kThreads>(q_smem, q_ptr, params.q_strides.row, valid_q_rows,
                                                params.head_dim, thread);
    const auto load_kv_block = [&](int stage, int n_block) {
      const int n0 = n_block * kBlockN;
      KVTile::template load_async<Shape::kThreads>(k_smem(stage), k_ptr + n0 * params.k_strides.row,
                                                   params.k_strides.row, seq.seqlen_k - n0,
                                                   params.head_dim, thread);
      KVTile::template load_async<Shape::kThreads>(v_smem(stage), v_ptr + n0 * params.v_strides.row,
                                                   params.v_strides.row, seq.seqlen_k - n0,
                                                   params.head_dim, thread);
    };
    // Prologue: the first kStages - 1 blocks in flight, one commit group each
    // (empty groups past the last block keep the wait counts uniform).
    const int num_blocks = n_block_last - n_block_first + 1;
#pragma unroll
    for (int st = 0; st < Shape::kStages - 1; ++st) {
      if (st < num_blocks) load_kv_block(st, n_block_last - st);
      cp_async_commit();
    }

    // ldmatrix lane addressing (see mma_primitives.cuh for the fragment layouts).
    const int a_row = lane % 16, a_col = (lane / 16) * 8;                  // A: Q
    const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // B: K rows
    const int vt_row = (lane % 8) + ((lane / 8) % 2) * 8, vt_col = (lane / 16) * 8;  // B: V^T
    const int warp_row = warp * Shape::kRowsPerWarp;

    for (int it = 0; it < num_blocks; ++it) {
      const int n_block = n_block_last - it;
      const int stage = it % Shape::kStages;
      // Block `it + kStages - 1` goes in flight into the stage every warp
      // finished with in the previous iteration (the barrier below orders it).
      cp_async_wait<Shape::kStages - 2>();
      __syncthreads();  // block `it` (and Q) visible to all; stage (it - 1) free
      {
        const int ahead = it + Shape::kStages - 1;
        if (ahead < num_blocks) load_kv_block(ahead % Shape::kStages, n_block_last - ahead);
        cp_async_commit();
      }
      const uint32_t k_stage = k_smem(stage), v_stage = v_smem(stage);

      float acc_s[kMTiles][kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;

#pragma unroll kKsUnroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
          ldmatrix_x4(a[mt], QTile::address(q_smem, warp_row + mt * 16 + a_row, ks * 16 + a_col));
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, KVTile::address(k_stage, np * 16 + b_row, ks * 16 + b_col));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma::mma(acc_s[mt][2 * np], a[mt], b[0], b[1]);
            Mma::mma(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      const int n_begin = n_block * kBlockN;
      if (mask.tile_fully_visible(m_begin, m_begin + kBlockM, n_begin, n_begin + kBlockN))
        softmax_update<false>(acc_s, acc_o, row_max, row_sum, params.softmax_scale_log2, mask,
                              m_begin + warp_row, n_begin, lane);
      else
        softmax_update<true>(acc_s, acc_o, row_max, row_sum, params.softmax_scale_log2, mask,
                             m_begin + warp_row, n_begin, lane);

      // O += P V, P from the S accumulators (two n8 tiles = one k16 A fragment).
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t p[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          accumulator_as_a<Element>(p[mt], acc_s[mt], kk);
        }
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, KVTile::address(v_stage, kk * 16 + vt_row, dp * 16 + vt_col));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma::mma(acc_o[mt][2 * dp], p[mt], b[0], b[1]);
            Mma::mma(acc_o[mt][2 * dp + 1], p[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  store_forward_rows<Element>(acc_o, row_max, row_sum, out_ptr, params.out_strides.row, lse_ptr,
                              warp * Shape::kRowsPerWarp, valid_q_rows, params.head_dim, lane);
}

}  // namespace flashattn
