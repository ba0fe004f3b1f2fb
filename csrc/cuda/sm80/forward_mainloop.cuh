// The main loop of the mma.sync forward kernels (sm_80+), FlashAttention-2 class, shared by
// the attention kernel (forward_kernel.cuh) and the KV-cache kernel (kvcache_kernel.cuh),
// which differ only in where their rows come from and where the results go.
//
// A thread block owns kBlockM query rows. It streams the key/value blocks the mask lets
// those rows see through shared memory, last block first, so the blocks that need the
// element-wise mask (the sequence tail, the causal diagonal) come first and the rest run
// unmasked. The N x N score matrix never leaves the chip: each S = Q K^T block lives in
// registers, is consumed by the online softmax (running max m and sum l per row, the
// output accumulator rescaled by exp2(m_old - m_new)), and feeds P V straight from the
// accumulator registers.
//
// Warps split the query rows: each of the kWarps warps owns kBlockM / kWarps rows (one or
// two m16 tiles) across the whole key block and the whole head dimension, so the softmax
// row reductions stay inside a quad of lanes (no shared memory). A decoding tile has one
// m16 tile of rows, mostly empty, and is bound by the copy: there kKeyWarps warps split
// each key block instead (all rows, kBlockN / kKeyWarps keys each), so no warp reads
// another's K and V from shared memory, and their row states are merged once at the end
// (key_split_merge.cuh).
//
// Pipeline: K and V blocks rotate through kStages shared-memory stages, so the copy of
// the next block runs under the whole S = Q K^T, softmax, P V of this one. Q stays in
// shared memory and is re-read per block: keeping it in registers would cost W/2
// registers per m16 tile, which the d >= 128 tiles don't have.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/sm80/smem_tile.cuh"

namespace flashattn {

// kScoreKUnroll: how many of the W/16 k-steps of S = Q K^T are unrolled. Full
// unrolling lets the compiler hoist every fragment load; with two m16 tiles per
// warp that can exhaust the 255 registers, and a partly rolled loop costs only
// an address add per step. kSwizzledKV: the K / V stages in the swizzled layout of
// smem_tile.cuh (the KV cache's tiles, which the copy bounds), else padded.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kScoreKUnroll_ = kHeadDim_ / 16,
          int kStages_ = 2, int kKeyWarps_ = 1, bool kSwizzledKV_ = false>
struct ForwardTileShape {
  static constexpr int kScoreKUnroll = kScoreKUnroll_;
  static constexpr int kHeadDim = kHeadDim_;  // compiled width W (>= the problem's head_dim)
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeyWarps = kKeyWarps_;  // warps sharing rows, each with its own keys of a block
  static constexpr int kRowsPerWarp = kBlockM / (kWarps / kKeyWarps);
  static constexpr int kWarpKeys = kBlockN / kKeyWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
  static constexpr int kNTiles = kWarpKeys / 8;      // n8 tiles of S per m16 tile
  static constexpr int kDTiles = kHeadDim / 8;       // n8 tiles of O per m16 tile
  // A warp's first row in the tile, and its first key in each key block.
  __device__ __forceinline__ static int warp_row(int warp) { return warp / kKeyWarps * kRowsPerWarp; }
  __device__ __forceinline__ static int warp_key(int warp) { return warp % kKeyWarps * kWarpKeys; }
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim, kSwizzledKV_>;
  // K/V stages: with two, the copy of block j+1 has all of block j's compute to land in,
  // instead of one GEMM as with FlashAttention-2's single buffers; more keep more bytes in
  // flight, which a kernel bound by the copy (decoding) needs.
  static constexpr int kStages = kStages_;
  static constexpr int kSmemBytes = QTile::kBytes + kStages * 2 * KVTile::kBytes;
  static_assert(kRowsPerWarp % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
  static_assert(kWarps % kKeyWarps == 0, "key-splitting warps come in whole groups");
  static_assert(kWarpKeys % 16 == 0 && kHeadDim % 16 == 0, "mma k-steps are 16 wide");
  static_assert(kStages >= 2, "the loop issues a block's copy while it computes the one before");
};

// A warp's rows: the O accumulator and the running max (log2 domain) and sum (this
// lane's part, quad-reduced by the epilogue).
template <typename Shape>
struct ForwardRowState {
  float acc_o[Shape::kMTiles][Shape::kDTiles][4];
  float row_max[Shape::kMTiles][2];
  float row_sum[Shape::kMTiles][2];

  // sink_log2: the learnable sink's logit (score_transform.cuh), -inf without one.
  __device__ __forceinline__ explicit ForwardRowState(float sink_log2 = -INFINITY, int lane = 0) {
#pragma unroll
    for (int mt = 0; mt < Shape::kMTiles; ++mt) {
#pragma unroll
      for (int dt = 0; dt < Shape::kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    }
    start_rows_at_sink(row_max, row_sum, sink_log2, lane);
  }
};

// Shared memory from q_smem: Q, then kStages x (K, V).
template <typename Shape>
struct ForwardSmem {
  uint32_t q;
  __device__ __forceinline__ uint32_t k(int stage) const {
    return q + Shape::QTile::kBytes + stage * 2 * Shape::KVTile::kBytes;
  }
  __device__ __forceinline__ uint32_t v(int stage) const { return k(stage) + Shape::KVTile::kBytes; }
};

// Where a tile's key blocks go in the ring of K / V stages: its it-th block in stage
// (first + it) % kStages. A block that runs one tile starts at 0; a persistent block carries
// the ring on from tile to tile (`after`), so that the next tile's first blocks can be copied
// into the stages this tile is done with.
template <int kStages>
struct KVStages {
  int first = 0;
  __device__ __forceinline__ int of(int it) const { return (first + it) % kStages; }
  __device__ __forceinline__ KVStages after(int num_blocks) const { return {num_blocks > 0 ? of(num_blocks) : first}; }
};

// Issues the copies a tile's main loop waits for first: Q and its first kStages - 1 key blocks
// (n_block_last down), one commit group each (Q joins the first; empty groups past the last
// block keep forward_mainloop's wait counts uniform). `load_q(q_smem)` and
// `load_kv_block(kv_smem, n_block)` issue the cp.async copies of the Q tile and of one key
// block's K and V tiles (V's at kv_smem + KVTile::kBytes), zero-filling rows past the sequence.
template <typename Shape, typename LoadQ, typename LoadKVBlock>
__device__ __forceinline__ void forward_prologue(ForwardSmem<Shape> smem, const LoadQ& load_q,
                                                 const LoadKVBlock& load_kv_block, int n_block_first,
                                                 int n_block_last, KVStages<Shape::kStages> stages) {
  // With no key block Q's copy is still issued, and waited for at the main loop's end. (Any
  // branch around it, or around the whole loop, cost the W = 128 kernel spills.)
  const int num_blocks = n_block_last - n_block_first + 1;
  load_q(smem.q);
#pragma unroll
  for (int st = 0; st < Shape::kStages - 1; ++st) {
    if (st < num_blocks) load_kv_block(smem.k(stages.of(st)), n_block_last - st);
    cp_async_commit();
  }
}

// Rows [m_begin, m_begin + kBlockM) against key blocks n_block_last down to n_block_first
// (nothing when last < first), into `state`, after forward_prologue issued the same tile's
// first copies into `stages`. `load_kv_block` issues the later blocks' copies; `mask` answers
// which (row, key) pairs are visible (MaskGeometry, PackedRowsMask); `score_transform()`
// gives the ScoreTransform (score_transform.cuh) that turns a block's scores into logits;
// `drop_probabilities(acc_s, warp_row_begin, n_begin)` applies dropout to a block's
// probabilities (after the softmax counted them, before P V). Returns with every copy landed;
// other warps may still read Q and the last stage, so a caller reusing them syncs first.
template <typename Element, typename Shape, typename Mask, typename MakeTransform, typename DropProbabilities,
          typename LoadKVBlock>
__device__ __forceinline__ void forward_mainloop(ForwardSmem<Shape> smem, const LoadKVBlock& load_kv_block,
                                                 const Mask& mask, const MakeTransform& score_transform,
                                                 const DropProbabilities& drop_probabilities, int m_begin,
                                                 int n_block_first, int n_block_last,
                                                 KVStages<Shape::kStages> stages, ForwardRowState<Shape>& state) {
  using Mma = MmaElement<Element>;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kHeadDim = Shape::kHeadDim;
  constexpr int kMTiles = Shape::kMTiles, kNTiles = Shape::kNTiles, kDTiles = Shape::kDTiles;
  constexpr int kKsUnroll = Shape::kScoreKUnroll;
  using QTile = typename Shape::QTile;
  using KVTile = typename Shape::KVTile;
  const uint32_t q_smem = smem.q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto& acc_o = state.acc_o;
  auto& row_max = state.row_max;
  auto& row_sum = state.row_sum;
  const int num_blocks = n_block_last - n_block_first + 1;

  // ldmatrix lane addressing (see mma_primitives.cuh for the fragment layouts).
  const int a_row = lane % 16, a_col = (lane / 16) * 8;                          // A: Q
  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // B: K rows
  const int vt_row = (lane % 8) + ((lane / 8) % 2) * 8, vt_col = (lane / 16) * 8;  // B: V^T
  const int warp_row = Shape::warp_row(warp), warp_key = Shape::warp_key(warp);

  for (int it = 0; it < num_blocks; ++it) {
    const int n_block = n_block_last - it;
    const int stage = stages.of(it);
    // Block `it + kStages - 1` goes in flight into the stage every warp
    // finished with in the previous iteration (the barrier below orders it).
    cp_async_wait<Shape::kStages - 2>();
    __syncthreads();  // block `it` (and Q) visible to all; stage (it - 1) free
    {
      const int ahead = it + Shape::kStages - 1;
      if (ahead < num_blocks) load_kv_block(smem.k(stages.of(ahead)), n_block_last - ahead);
      cp_async_commit();
    }
    const uint32_t k_stage = smem.k(stage), v_stage = smem.v(stage);

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
        ldmatrix_x4(b, KVTile::address(k_stage, warp_key + np * 16 + b_row, ks * 16 + b_col));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mma::mma(acc_s[mt][2 * np], a[mt], b[0], b[1]);
          Mma::mma(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    const int n_begin = n_block * kBlockN + warp_key;
    if (mask.tile_fully_visible(m_begin, m_begin + kBlockM, n_begin, n_begin + Shape::kWarpKeys))
      softmax_update<false>(acc_s, acc_o, row_max, row_sum, score_transform(), mask, m_begin + warp_row, n_begin,
                            lane);
    else
      softmax_update<true>(acc_s, acc_o, row_max, row_sum, score_transform(), mask, m_begin + warp_row, n_begin,
                           lane);
    drop_probabilities(acc_s, m_begin + warp_row, n_begin);

    // O += P V, P from the S accumulators (two n8 tiles = one k16 A fragment).
#pragma unroll
    for (int kk = 0; kk < Shape::kWarpKeys / 16; ++kk) {
      uint32_t p[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) accumulator_as_a<Element>(p[mt], acc_s[mt], kk);
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, KVTile::address(v_stage, warp_key + kk * 16 + vt_row, dp * 16 + vt_col));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mma::mma(acc_o[mt][2 * dp], p[mt], b[0], b[1]);
          Mma::mma(acc_o[mt][2 * dp + 1], p[mt], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
}

}  // namespace flashattn
