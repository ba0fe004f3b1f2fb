// Backward pass of exact attention, FlashAttention-2 style (mma.sync, sm_80+).
//
// Algorithm. Three kernels on one stream (the second and third programmatic dependent
// launches of the one before: common/backward_passes.cuh):
//   1. preprocess: per query row, D = rowsum(dO * O) in fp32 and lse2 = lse * log2(e), into
//      workspaces padded to seqlen_q_rounded rows (padded rows: D = 0, lse2 = +inf, so every
//      P computed for them below is exp2(-inf) = 0 and they contribute nothing), and the
//      row of the dQ workspace zeroed.
//   2. main: one thread block per (key block, kv head, batch), flattened into blockIdx.x. It
//      keeps dK and dV of its BN keys in registers while it walks every query head of its
//      GQA group and, per head, every query block that sees one of its keys (MaskGeometry
//      ranges; invisible blocks are never loaded). Per query block (BM queries):
//        Sᵀ  = K Qᵀ                          (recomputed, never stored)
//        Pᵀ  = exp2(logit(Sᵀ) − lse2)        (element mask only on tiles that straddle it;
//                                              logit: score_transform.cuh)
//        dV += Pᵀ dO
//        dPᵀ = V dOᵀ
//        dSᵀ = Pᵀ ∘ (dPᵀ − D)               (with softcap also ∘ (1 − t²), t the capped score)
//        dK += dSᵀ Q
//        dQ_accum += dS K                    (fp32 red.global into the workspace)
//      At the end dK is scaled by softmax_scale and both are written in the output dtype.
//   3. postprocess: dq = dq_accum * softmax_scale in the output dtype, strided.
//
// Warp layout. A warp owns 16 key rows (the M of m16n8k16) and computes Sᵀ and dPᵀ with the
// keys as rows, so the fp32 accumulators of Pᵀ and dSᵀ are already laid out as the A operand
// of dV += Pᵀ dO and dK += dSᵀ Q (see mma_primitives.cuh): for head-dim tiles up to 128 each
// warp covers all BM queries and those two products take P and dS straight from registers.
// dK + dV of 16 rows cost W fp32 registers per thread, which is too many past W = 128, so for
// W = 192/256 a pair of warps shares 16 key rows: each computes Sᵀ/dPᵀ for half the queries
// and accumulates dK/dV for half the head dimension, and Pᵀ goes through shared memory so both
// see all queries (kWarpsD = 2). dSᵀ is always written to shared memory once, because the
// dQ = dS K product needs it with the queries as rows: its A operand is read back with
// ldmatrix.trans, K (row-major in smem) is its B operand through ldmatrix.trans as well. The
// dQ product uses its own warp grid over (BM, head-dim chunk) so its accumulators stay small.
//
// Pipeline. K and V are loaded once. Q, dO and the per-query lse2/D of the next query block are
// prefetched with cp.async into the other of two stages while the current one is computed
// (one stage for the smallest-smem plan). Per query block there are two block barriers: one
// when the stage has landed (which also frees the other stage and the dS/P tiles of the
// previous block), one after dSᵀ (and Pᵀ) are in shared memory.
//
// Tile sizes (chosen in backward_launch.cuh): registers bound the key rows per warp (16) and
// the head-dim share of the dK/dV accumulators (W / kWarpsD registers per thread); BM = 64
// adds 32 registers of Sᵀ (16 once rounded to Pᵀ) and 32 of dPᵀ, which at W = 128 is all
// that 255 registers hold (ptxas reports 0 spills for every plan). Shared memory (K, V, two
// stages of Q and dO, dSᵀ, Pᵀ, all padded SmemTiles) bounds the rest: d 128 needs 155 KB,
// d 256 217 KB of the 227 KB a Hopper block can opt into. Devices with ~99 KB get a plan with
// smaller blocks.
//
// Precision: products take Element operands and accumulate in fp32 (as the forward). Pᵀ is
// kept rounded to Element, which is what dV's product consumes; dSᵀ = Pᵀ(dPᵀ − D) uses that
// rounded P with fp32 dPᵀ and D, so dS carries about one extra Element rounding before its
// own rounding for the dK and dQ products.
//
// Deterministic dQ: the key blocks of one (batch, query head, query block) add their dS K in
// increasing key-block order, taking turns on a counter in dq_semaphore. Query blocks are
// visited from the last to the first, so under a causal mask every key block starts on the
// bottom query block, which all of them share, and the turns form a pipeline instead of a
// chain of waits down the diagonal. A block only ever waits for blocks with a smaller
// blockIdx.x, which were dispatched before it, so the turns cannot deadlock.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "cuda/backward_launch.h"
#include "cuda/common/backward_passes.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/score_transform.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm80/smem_tile.cuh"

namespace flashattn {
namespace backward {

// One plan: head-dim tile W, BN keys and BM queries per block, kWarpsD warps sharing the key
// rows of a warp (splitting queries for Sᵀ/dPᵀ and head dims for dK/dV), kStages buffers of
// Q/dO, and the dQ product computed in chunks of kDqChunk head dims by a kDqWarpsQ x
// (warps / kDqWarpsQ) warp grid.
template <int kHeadDimTile_, int kBlockN_, int kBlockM_, int kWarpsD_, int kStages_,
          int kDqWarpsQ_, int kDqChunk_>
struct BackwardTile {
  static constexpr int kHeadDimTile = kHeadDimTile_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kWarpsD = kWarpsD_;
  static constexpr int kStages = kStages_;
  static constexpr int kDqWarpsQ = kDqWarpsQ_;
  static constexpr int kDqChunk = kDqChunk_;

  static constexpr int kWarpsN = kBlockN / 16;
  static constexpr int kWarps = kWarpsN * kWarpsD;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kQueriesPerWarp = kBlockM / kWarpsD;  // Sᵀ / dPᵀ columns of one warp
  static constexpr int kDimsPerWarp = kHeadDimTile / kWarpsD;  // dK / dV columns of one warp
  static constexpr int kDqWarpsD = kWarps / kDqWarpsQ;
  static constexpr int kDqRowsPerWarp = kBlockM / kDqWarpsQ;
  static constexpr int kDqColsPerWarp = kDqChunk / kDqWarpsD;

  using KVTile = SmemTile<kBlockN, kHeadDimTile>;
  using QTile = SmemTile<kBlockM, kHeadDimTile>;
  using ScoreTile = SmemTile<kBlockN, kBlockM>;  // Pᵀ / dSᵀ: key rows, query columns

  // Byte offsets into dynamic shared memory.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + KVTile::kBytes;
  static constexpr int kOffQ = kOffV + KVTile::kBytes;
  static constexpr int kOffDO = kOffQ + kStages * QTile::kBytes;
  static constexpr int kOffLse = kOffDO + kStages * QTile::kBytes;
  static constexpr int kOffD = kOffLse + kStages * kBlockM * 4;
  static constexpr int kOffDS = kOffD + kStages * kBlockM * 4;
  static constexpr int kOffP = kOffDS + ScoreTile::kBytes;
  static constexpr int kSmemBytes = kOffP + (kWarpsD > 1 ? ScoreTile::kBytes : 0);

  static_assert(kBlockN % 16 == 0 && kBlockM % 16 == 0, "blocks are whole mma tiles");
  static_assert(kQueriesPerWarp % 16 == 0, "B fragments are loaded two n-tiles at a time");
  static_assert(kDimsPerWarp % 16 == 0, "B fragments are loaded two n-tiles at a time");
  static_assert(kWarps % kDqWarpsQ == 0 && kDqRowsPerWarp % 16 == 0, "dQ warp rows");
  static_assert(kHeadDimTile % kDqChunk == 0 && kDqColsPerWarp % 16 == 0, "dQ warp columns");
  static_assert(kBackwardQueryRowRounding % kBlockM == 0 && kBlockM >= kBackwardMinBlockM, "workspace padding");
  static_assert(kBlockM / 2 <= kThreads, "one cp.async per 4 floats of lse2 and D");
  static_assert(kStages == 1 || kStages == 2, "single or double buffered");
};

// Per-lane byte offset of the row address a lane gives ldmatrix.x4 for a 16x16 block of a
// padded tile, in the two orders of the four 8x8 sub-matrices that the operands need:
//  - column-major order (rows 0-7, 8-15 of columns 0-7, then of columns 8-15): the A operand
//    of a row-major [m][k] tile, and with .trans the B operand (two n-tiles) of a [k][n] tile;
//  - row-major order (columns 0-7, 8-15 of rows 0-7, then of rows 8-15): the B operand (two
//    n-tiles) of an [n][k] tile, and with .trans the A operand of a [k][m] tile.
template <typename Tile>
__device__ __forceinline__ uint32_t ldsm_offset_colmajor(int lane) {
  return static_cast<uint32_t>(((lane & 15) * Tile::kStride + (lane >> 4) * 8) * 2);
}
template <typename Tile>
__device__ __forceinline__ uint32_t ldsm_offset_rowmajor(int lane) {
  return static_cast<uint32_t>((((lane & 7) + (lane >> 4) * 8) * Tile::kStride + (lane & 8)) * 2);
}

template <typename Tile>
__device__ __forceinline__ constexpr uint32_t tile_offset(int row, int col) {
  return static_cast<uint32_t>((row * Tile::kStride + col) * 2);
}

// acc (16 x 8·kNTiles) += A (16 x kK) · Bᵀ with A a row-major tile (lanes at a_addr, from
// ldsm_offset_colmajor) and B stored [n][k] (lanes at b_addr, from ldsm_offset_rowmajor).
// The k loop is unrolled by two only: two k-steps give the scheduler enough independent
// loads and mma, and the full unroll makes ptxas hoist so many fragments next to the dK/dV
// accumulators that it spills (measured at W = 128).
template <typename Element, typename ATile, typename BTile, int kK, int kNTiles>
__device__ __forceinline__ void mma_a_bt(float (&acc)[kNTiles][4], uint32_t a_addr,
                                         uint32_t b_addr) {
#pragma unroll 2
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, a_addr + tile_offset<ATile>(0, ks * 16));
#pragma unroll
    for (int jp = 0; jp < kNTiles / 2; ++jp) {
      uint32_t b[4];
      ldmatrix_x4(b, b_addr + tile_offset<BTile>(jp * 16, ks * 16));
      MmaElement<Element>::mma(acc[2 * jp], a, b[0], b[1]);
      MmaElement<Element>::mma(acc[2 * jp + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x 8·kNTiles) += A (one 16x16 k-step) · B (16 x 8·kNTiles) with B stored [k][n]
// (lanes at b_addr, from ldsm_offset_colmajor, already at the k-step's first row).
template <typename Element, typename BTile, int kNTiles>
__device__ __forceinline__ void mma_step_a_b(float (&acc)[kNTiles][4], const uint32_t (&a)[4],
                                             uint32_t b_addr) {
#pragma unroll
  for (int jp = 0; jp < kNTiles / 2; ++jp) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, b_addr + tile_offset<BTile>(0, jp * 16));
    MmaElement<Element>::mma(acc[2 * jp], a, b[0], b[1]);
    MmaElement<Element>::mma(acc[2 * jp + 1], a, b[2], b[3]);
  }
}

// Writes a warp's 16 x 8·kNTiles fp32 accumulator, rounded to Element, into a padded tile at
// (row0, col0); lane (g, t) owns rows g, g+8 and columns 2t, 2t+1 of each n-tile.
template <typename Element, typename Tile, int kNTiles>
__device__ __forceinline__ void store_accumulator(unsigned char* tile, const float (&c)[kNTiles][4],
                                                  int row0, int col0, int lane, float scale) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
    const int col = col0 + 8 * j + 2 * t;
    *reinterpret_cast<uint32_t*>(tile + tile_offset<Tile>(row0 + g, col)) =
        MmaElement<Element>::pack(c[j][0] * scale, c[j][1] * scale);
    *reinterpret_cast<uint32_t*>(tile + tile_offset<Tile>(row0 + g + 8, col)) =
        MmaElement<Element>::pack(c[j][2] * scale, c[j][3] * scale);
  }
}

// The same for an accumulator already rounded to Element pairs (rows g, g+8 of each n-tile).
template <typename Tile, int kNTiles>
__device__ __forceinline__ void store_packed(unsigned char* tile, const uint32_t (&c)[kNTiles][2],
                                             int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
    const int col = col0 + 8 * j + 2 * t;
    *reinterpret_cast<uint32_t*>(tile + tile_offset<Tile>(row0 + g, col)) = c[j][0];
    *reinterpret_cast<uint32_t*>(tile + tile_offset<Tile>(row0 + g + 8, col)) = c[j][1];
  }
}

template <typename Element>
__device__ __forceinline__ float2 unpack_pair(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack_pair<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack_pair<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// A sequence's rows as the main kernel addresses them (SequenceInfo and the workspace row).
struct BlockSequence {
  int seqlen_q, seqlen_k, q_offset, k_offset;
  int64_t workspace_row;  // of query 0 of head 0 (backward_workspace_sequence)

  __device__ __forceinline__ MaskGeometry mask(const AttentionBwdParams& p) const {
    return MaskGeometry{seqlen_q, seqlen_k, p.window_left, p.window_right};
  }

  template <typename T>
  __device__ __forceinline__ T* q_row(T* base, const TensorStrides& s, int b, int head, int row) const {
    return element_row(base, s, b, head, int64_t{q_offset} + row);
  }
  template <typename T>
  __device__ __forceinline__ T* k_row(T* base, const TensorStrides& s, int b, int head, int row) const {
    return element_row(base, s, b, head, int64_t{k_offset} + row);
  }
};

// ---------------------------------------------------------------------------------------
// 2. The main kernel (see the header comment).
template <typename Element, typename Tile, ScoreMod kMod>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    attention_backward_kernel(const AttentionBwdParams p) {
  constexpr int W = Tile::kHeadDimTile;
  constexpr int BN = Tile::kBlockN;
  constexpr int BM = Tile::kBlockM;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kQTiles = Tile::kQueriesPerWarp / 8;  // n-tiles of Sᵀ / dPᵀ per warp
  constexpr int kDTiles = Tile::kDimsPerWarp / 8;     // n-tiles of dK / dV per warp
  constexpr int kDqMTiles = Tile::kDqRowsPerWarp / 16;
  constexpr int kDqNTiles = Tile::kDqColsPerWarp / 8;
  using KVTile = typename Tile::KVTile;
  using QTile = typename Tile::QTile;
  using ScoreTile = typename Tile::ScoreTile;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = smem_address(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int warp_n = warp % Tile::kWarpsN, warp_d = warp / Tile::kWarpsN;
  const int key_row0 = 16 * warp_n;                          // this warp's key rows in the block
  const int query_col0 = warp_d * Tile::kQueriesPerWarp;     // its Sᵀ columns
  const int dim_col0 = warp_d * Tile::kDimsPerWarp;          // its dK / dV columns
  const int dq_row0 = (warp % Tile::kDqWarpsQ) * Tile::kDqRowsPerWarp;
  const int dq_col0 = (warp / Tile::kDqWarpsQ) * Tile::kDqColsPerWarp;

  // A dependent launch of the preprocess (common/backward_passes.cuh), and the postprocess one
  // of this kernel: every thread waits for the preprocess before anything else.
  allow_dependent_launch();
  wait_for_previous_kernel();
  const BackwardBlock blk(p, BM, BN);
  if (blk.empty) return;
  // The sequence's bounds, read from shared memory where the loop needs them: held in
  // registers through it, they pushed the W = 96 ... 192 tiles into spills.
  __shared__ BlockSequence block_sequence;
  if (tid == 0)
    block_sequence = {blk.seq.seqlen_q, blk.seq.seqlen_k, blk.seq.q_offset, blk.seq.k_offset,
                      backward_workspace_sequence(p, blk.seq.q_offset, blk.b)};
  __syncthreads();
  const BlockSequence& seq = block_sequence;
  const int n0 = blk.n0, h_kv = blk.h_kv, b = blk.b, group = blk.group;
  const int m_first = blk.m_first, num_m = blk.num_m, num_iters = blk.num_iters;
  const int m_last = m_first + num_m - 1;
  int visible_begin[2], visible_end[2];
  lane_visible_queries(blk.mask, n0 + key_row0 + g, visible_begin, visible_end);

  // The iterations walk the query heads of the group in order and, per head, the query blocks
  // from m_last down to m_first.
  auto load_query_block = [&](int h, int m_block, int stage) {
    const int m0 = m_block * BM;
    QTile::template load_async<kThreads>(
        smem_base + Tile::kOffQ + stage * QTile::kBytes,
        seq.q_row(static_cast<const Element*>(p.q), p.q_strides, b, h, m0), p.q_strides.row,
        seq.seqlen_q - m0, p.head_dim, tid);
    QTile::template load_async<kThreads>(
        smem_base + Tile::kOffDO + stage * QTile::kBytes,
        seq.q_row(static_cast<const Element*>(p.dout), p.dout_strides, b, h, m0),
        p.dout_strides.row, seq.seqlen_q - m0, p.head_dim, tid);
    // The workspaces are padded to whole blocks, so these 16-byte copies are always in range.
    const int64_t row = seq.workspace_row + h * p.workspace_head_stride + m0;
    if (tid < BM / 4) {
      cp_async_16(smem_base + Tile::kOffLse + stage * BM * 4 + tid * 16, p.lse_log2 + row + tid * 4,
                  true);
    } else if (tid < BM / 2) {
      const int c = tid - BM / 4;
      cp_async_16(smem_base + Tile::kOffD + stage * BM * 4 + c * 16, p.softmax_d + row + c * 4,
                  true);
    }
  };

  float acc_dk[kDTiles][4] = {};
  float acc_dv[kDTiles][4] = {};

  if (num_iters > 0) {
    KVTile::template load_async<kThreads>(
        smem_base + Tile::kOffK,
        seq.k_row(static_cast<const Element*>(p.k), p.k_strides, b, h_kv, n0), p.k_strides.row,
        seq.seqlen_k - n0, p.head_dim, tid);
    KVTile::template load_async<kThreads>(
        smem_base + Tile::kOffV,
        seq.k_row(static_cast<const Element*>(p.v), p.v_strides, b, h_kv, n0), p.v_strides.row,
        seq.seqlen_k - n0, p.head_dim, tid);
    load_query_block(h_kv * group, m_last, 0);
    cp_async_commit();
  }

  // Lane addresses of every ldmatrix, without the stage and k-step offsets.
  const uint32_t k_as_a = smem_base + Tile::kOffK + ldsm_offset_colmajor<KVTile>(lane) +
                          tile_offset<KVTile>(key_row0, 0);
  const uint32_t v_as_a = smem_base + Tile::kOffV + ldsm_offset_colmajor<KVTile>(lane) +
                          tile_offset<KVTile>(key_row0, 0);
  const uint32_t k_as_b = smem_base + Tile::kOffK + ldsm_offset_colmajor<KVTile>(lane) +
                          tile_offset<KVTile>(0, dq_col0);
  const uint32_t qdo_as_bt = ldsm_offset_rowmajor<QTile>(lane) + tile_offset<QTile>(query_col0, 0);
  const uint32_t qdo_as_b = ldsm_offset_colmajor<QTile>(lane) + tile_offset<QTile>(0, dim_col0);
  const uint32_t ds_as_at = smem_base + Tile::kOffDS + ldsm_offset_rowmajor<ScoreTile>(lane) +
                            tile_offset<ScoreTile>(0, dq_row0);
  const uint32_t scores_as_a =
      ldsm_offset_colmajor<ScoreTile>(lane) + tile_offset<ScoreTile>(key_row0, 0);

  int h = h_kv * group, m_block = m_last;
  for (int it = 0; it < num_iters; ++it) {
    const int stage = Tile::kStages == 2 ? (it & 1) : 0;
    const bool next_in_head = m_block > m_first;
    const int next_h = next_in_head ? h : h + 1;
    const int next_m_block = next_in_head ? m_block - 1 : m_last;
    if (Tile::kStages == 1 && it > 0) {
      __syncthreads();  // every warp is done with the single stage
      load_query_block(h, m_block, 0);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();
    if (Tile::kStages == 2 && it + 1 < num_iters) {
      load_query_block(next_h, next_m_block, stage ^ 1);
      cp_async_commit();
    }

    const int m0 = m_block * BM;
    const uint32_t q_stage = smem_base + Tile::kOffQ + stage * QTile::kBytes;
    const uint32_t do_stage = smem_base + Tile::kOffDO + stage * QTile::kBytes;
    const float* lse2_s = reinterpret_cast<const float*>(smem + Tile::kOffLse + stage * BM * 4);
    const float* d_s = reinterpret_cast<const float*>(smem + Tile::kOffD + stage * BM * 4);

    // Sᵀ = K Qᵀ, then Pᵀ, kept rounded to Element pairs: that is the A operand of dV += Pᵀ dO
    // as it is, and it frees 16 registers while dPᵀ is computed.
    // With softcap, 1 - t^2 of each pair of scores waits for dS in the dS tile, in this lane's
    // own slots (it reads them back before its dS overwrites them; the barrier at the top of
    // the iteration ordered the previous dQ product's reads before): registers are what the
    // tiles lack (W = 96 spilled).
    // With dropout, pt keeps the undropped P that dS takes and dV's operand the dropped one (its
    // 1 / (1 - p) applied to dV at the end); keep_bits says which were kept.
    using Transform = ScoreTransform<kMod>;
    uint32_t pt[kQTiles][2];
    uint32_t keep_bits = 0;
    if constexpr (has_dropout(kMod))
      keep_bits = DropoutMask(p, b, h).transposed_keep_bits<Tile::kQueriesPerWarp>((n0 + key_row0) / 16,
                                                                                 m0 + query_col0, lane);
    const auto kept = [&](int j, int e, float x) { return (keep_bits >> (4 * j + e)) & 1 ? x : 0.f; };
    uint32_t pv[kQTiles][2];  // the dropped Pᵀ, for dV (unused without dropout)
    {
      float s[kQTiles][4] = {};
      mma_a_bt<Element, KVTile, QTile, W, kQTiles>(s, k_as_a, q_stage + qdo_as_bt);
      const bool masked = !seq.mask(p).tile_fully_visible(m0, min(m0 + BM, seq.seqlen_q), n0, n0 + BN);
      const Transform transform(p, b, h);
      // The ALiBi distance of query m0 + query_col0 + 2t from the lane's key of each half.
      float key_distance[2];
      if constexpr (Transform::kUsesDistance) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          key_distance[half] =
              float(seq.mask(p).diagonal_of_row(m0 + query_col0 + 2 * t) - (n0 + key_row0 + g + 8 * half));
      }
#pragma unroll
      for (int j = 0; j < kQTiles; ++j) {
        const int col = query_col0 + 8 * j + 2 * t;
        const float2 lse2 = *reinterpret_cast<const float2*>(lse2_s + col);
        if constexpr (Transform::kSoftcap) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] = transform.capped(s[j][e]);
          *reinterpret_cast<uint32_t*>(smem + Tile::kOffDS + tile_offset<ScoreTile>(key_row0 + g, col)) =
              pack_tanh_derivative(s[j][0], s[j][1]);
          *reinterpret_cast<uint32_t*>(smem + Tile::kOffDS + tile_offset<ScoreTile>(key_row0 + g + 8, col)) =
              pack_tanh_derivative(s[j][2], s[j][3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float distance = Transform::kUsesDistance ? key_distance[e >> 1] + float(8 * j + (e & 1)) : 0.f;
          // lse2 = +inf (a row that sees no key, or padding) gives exp2(-inf) = 0, never NaN.
          const float x = fast_exp2(transform.logit_of(s[j][e], distance, -((e & 1) ? lse2.y : lse2.x)));
          const int query = m0 + col + (e & 1);
          const bool visible = query >= visible_begin[e >> 1] && query < visible_end[e >> 1];
          s[j][e] = masked && !visible ? 0.f : x;
        }
        pt[j][0] = MmaElement<Element>::pack(s[j][0], s[j][1]);
        pt[j][1] = MmaElement<Element>::pack(s[j][2], s[j][3]);
        if constexpr (has_dropout(kMod)) {
          pv[j][0] = MmaElement<Element>::pack(kept(j, 0, s[j][0]), kept(j, 1, s[j][1]));
          pv[j][1] = MmaElement<Element>::pack(kept(j, 2, s[j][2]), kept(j, 3, s[j][3]));
        }
      }
    }
    const uint32_t(&p_for_dv)[kQTiles][2] = has_dropout(kMod) ? pv : pt;

    if constexpr (Tile::kWarpsD == 1) {
      // dV += Pᵀ dO with Pᵀ straight from registers.
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        const uint32_t a[4] = {p_for_dv[2 * kk][0], p_for_dv[2 * kk][1], p_for_dv[2 * kk + 1][0],
                               p_for_dv[2 * kk + 1][1]};
        mma_step_a_b<Element, QTile, kDTiles>(acc_dv, a,
                                              do_stage + qdo_as_b + tile_offset<QTile>(16 * kk, 0));
      }
    } else {
      store_packed<ScoreTile>(smem + Tile::kOffP, p_for_dv, key_row0, query_col0, lane);
    }

    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − D) in place.
    float dp[kQTiles][4] = {};
    mma_a_bt<Element, KVTile, QTile, W, kQTiles>(dp, v_as_a, do_stage + qdo_as_bt);
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      const float2 dsum = *reinterpret_cast<const float2*>(d_s + query_col0 + 8 * j + 2 * t);
      const float2 p_lo = unpack_pair<Element>(pt[j][0]);  // row g
      const float2 p_hi = unpack_pair<Element>(pt[j][1]);  // row g + 8
      if constexpr (has_dropout(kMod)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] = kept(j, e, dp[j][e] * p.dropout_scale);
      }
      dp[j][0] = p_lo.x * (dp[j][0] - dsum.x);
      dp[j][1] = p_lo.y * (dp[j][1] - dsum.y);
      dp[j][2] = p_hi.x * (dp[j][2] - dsum.x);
      dp[j][3] = p_hi.y * (dp[j][3] - dsum.y);
      if constexpr (Transform::kSoftcap) {
        const int col = query_col0 + 8 * j + 2 * t;
        const float2 d_lo = unpack_tanh_derivative(
            *reinterpret_cast<const uint32_t*>(smem + Tile::kOffDS + tile_offset<ScoreTile>(key_row0 + g, col)));
        const float2 d_hi = unpack_tanh_derivative(
            *reinterpret_cast<const uint32_t*>(smem + Tile::kOffDS + tile_offset<ScoreTile>(key_row0 + g + 8, col)));
        dp[j][0] *= d_lo.x;
        dp[j][1] *= d_lo.y;
        dp[j][2] *= d_hi.x;
        dp[j][3] *= d_hi.y;
      }
    }
    store_accumulator<Element, ScoreTile>(smem + Tile::kOffDS, dp, key_row0, query_col0, lane, 1.f);
    if constexpr (Tile::kWarpsD == 1) {
      // dK += dSᵀ Q with dSᵀ straight from the accumulators.
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t a[4];
        accumulator_as_a<Element>(a, dp, kk);
        mma_step_a_b<Element, QTile, kDTiles>(acc_dk, a,
                                              q_stage + qdo_as_b + tile_offset<QTile>(16 * kk, 0));
      }
    }
    __syncthreads();  // dSᵀ (and Pᵀ) of every warp are in shared memory
    if constexpr (Tile::kWarpsD > 1) {
      // Both warps of a key-row pair need Pᵀ and dSᵀ over all BM queries. Each k-step has 2 x
      // 8 independent mma already; unrolling further only lengthens register lifetimes (spills
      // at W = 256).
#pragma unroll 1
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_base + Tile::kOffP + scores_as_a + tile_offset<ScoreTile>(0, 16 * kk));
        mma_step_a_b<Element, QTile, kDTiles>(acc_dv, a,
                                              do_stage + qdo_as_b + tile_offset<QTile>(16 * kk, 0));
        ldmatrix_x4(a, smem_base + Tile::kOffDS + scores_as_a + tile_offset<ScoreTile>(0, 16 * kk));
        mma_step_a_b<Element, QTile, kDTiles>(acc_dk, a,
                                              q_stage + qdo_as_b + tile_offset<QTile>(16 * kk, 0));
      }
    }

    // dQ_accum += dS K, a chunk of head dims at a time.
    int* semaphore = nullptr;
    int turn = 0;
    if (p.deterministic) {
      semaphore = p.dq_semaphore +
                  (static_cast<int64_t>(b) * p.nheads_q + h) * (p.seqlen_q_rounded / kBackwardMinBlockM) +
                  m_block;
      turn = n0 / BN - seq.mask(p).key_begin(m0) / BN;
      if (tid == 0) {
        while (load_acquire(semaphore) != turn) {
        }
      }
      __syncthreads();
    }
    // This lane's first element of the dQ tile; the rest are at compile-time offsets (steps of
    // 8 rows and 8 columns, in which dq_accum_offset is additive).
    float* dq_lane = p.dq_accum +
                     dq_accum_offset(seq.workspace_row + h * p.workspace_head_stride + m0 + dq_row0, dq_col0, W) +
                     dq_accum_offset(g, 2 * t, W);
    const int dq_rows_left = seq.seqlen_q - m0 - dq_row0 - g;
#pragma unroll 1
    for (int chunk = 0; chunk < W; chunk += Tile::kDqChunk) {
      float acc[kDqMTiles][kDqNTiles][4] = {};
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[kDqMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kDqMTiles; ++mi)
          ldmatrix_x4_trans(a[mi], ds_as_at + tile_offset<ScoreTile>(16 * kk, 16 * mi));
#pragma unroll
        for (int jp = 0; jp < kDqNTiles / 2; ++jp) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, k_as_b + tile_offset<KVTile>(16 * kk, chunk + 16 * jp));
#pragma unroll
          for (int mi = 0; mi < kDqMTiles; ++mi) {
            MmaElement<Element>::mma(acc[mi][2 * jp], a[mi], bk[0], bk[1]);
            MmaElement<Element>::mma(acc[mi][2 * jp + 1], a[mi], bk[2], bk[3]);
          }
        }
      }
      // Rows past seqlen_q only ever add zeros (and cost L2 atomics): skip them. Columns past
      // head_dim add zeros to the padding of dq_accum, which nothing reads.
      float* const dq_chunk = dq_lane + dq_accum_offset(0, chunk, W);
#pragma unroll
      for (int mi = 0; mi < kDqMTiles; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (16 * mi + 8 * half < dq_rows_left) {
#pragma unroll
            for (int jd = 0; jd < kDqNTiles; ++jd)
              red_add_pair(dq_chunk + dq_accum_offset(16 * mi + 8 * half, 8 * jd, W),
                           acc[mi][jd][2 * half], acc[mi][jd][2 * half + 1]);
          }
        }
      }
    }
    if (p.deterministic) {
      __syncthreads();  // every thread's adds precede the release below (cumulativity)
      if (tid == 0) {
        __threadfence();
        store_release(semaphore, turn + 1);
      }
    }
    h = next_h;
    m_block = next_m_block;
  }

  // dK·scale and dV through shared memory (K and V are no longer read), then coalesced
  // 16-byte stores of the rows < seqlen_k and columns < head_dim.
  __syncthreads();
  store_accumulator<Element, KVTile>(smem + Tile::kOffK, acc_dk, key_row0, dim_col0, lane,
                                     p.softmax_scale);
  store_accumulator<Element, KVTile>(smem + Tile::kOffV, acc_dv, key_row0, dim_col0, lane,
                                     has_dropout(kMod) ? p.dropout_scale : 1.f);
  __syncthreads();
  Element* dk = seq.k_row(static_cast<Element*>(p.dk), p.dk_strides, b, h_kv, n0);
  Element* dv = seq.k_row(static_cast<Element*>(p.dv), p.dv_strides, b, h_kv, n0);
  const int valid_rows = min(BN, seq.seqlen_k - n0);
  for (int chunk = tid; chunk < BN * KVTile::kChunksPerRow; chunk += kThreads) {
    const int row = chunk / KVTile::kChunksPerRow;
    const int col = (chunk % KVTile::kChunksPerRow) * 8;
    if (row < valid_rows && col < p.head_dim) {
      *reinterpret_cast<uint4*>(dk + row * p.dk_strides.row + col) =
          *reinterpret_cast<const uint4*>(smem + Tile::kOffK + tile_offset<KVTile>(row, col));
      *reinterpret_cast<uint4*>(dv + row * p.dv_strides.row + col) =
          *reinterpret_cast<const uint4*>(smem + Tile::kOffV + tile_offset<KVTile>(row, col));
    }
  }
}

}  // namespace backward
}  // namespace flashattn
