// Which tile a thread block works on, for the kernels of both families: the forward's query
// blocks and the backward's key blocks, with the key / query ranges the mask leaves them.
// A static grid is flattened into blockIdx.x (so that batch x heads past 65535 fits); the
// Hopper forward can also run persistent, a grid of resident blocks that walk the tiles
// in a ForwardTileOrder.
#pragma once

#include <cstdint>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "common/sequence_info.h"

namespace flashattn {

// A forward tile: one block of query rows of one (batch, head) pair bh = batch * nheads_q +
// head. `rank` counts the sequence's query blocks from its last one (rank 0: the block that
// sees the most keys under a causal mask), so that a shorter sequence's blocks past its end
// (rank >= its own block count) are the ones that come last.
struct ForwardTile {
  int rank, bh;

  // Tile `index` of the plain order (the static grid's): query blocks fastest, heaviest first,
  // so the blocks of one head run together and share its K/V in L2.
  FLASHATTN_HOST_DEVICE static ForwardTile in_plain_order(const AttentionFwdParams& params, int kBlockM,
                                                          int index) {
    const int num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
    return {index % num_m_blocks, index / num_m_blocks};
  }
};

// The order in which a persistent grid walks the forward's tiles, built on the host.
// Plain (heads_per_section == 0): as ForwardTile::in_plain_order. Longest first (causal,
// windows, varlen, where tiles differ in cost): the (batch, head) pairs are cut into sections
// of heads_per_section pairs whose K/V fit in L2 together; within a section the tiles go rank
// by rank (all pairs' heaviest blocks first), pairs inner, as FlashAttention-3's LPT
// scheduler does. Sections alone keep the L2 reuse of the plain order: a strict global rank
// order would stream every head's K/V once per rank.
struct ForwardTileOrder {
  int num_m_blocks;       // query blocks per (batch, head): the longest sequence's
  int num_tiles;          // num_m_blocks * batch * nheads_q
  int bh_pairs;           // batch * nheads_q
  int heads_per_section;  // 0: plain order

  // How many bytes of K and V a section may take: FlashAttention-3 takes 32 MB of the
  // H100's 50 MB L2 (the H200's is 50 MB too), leaving the rest to Q, O and the other traffic.
  static constexpr int64_t kL2SectionBytes = int64_t(32) << 20;

  static ForwardTileOrder plain(const AttentionFwdParams& params, int kBlockM) {
    const int num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
    const int bh_pairs = params.batch * params.nheads_q;
    return {num_m_blocks, static_cast<int>(int64_t(num_m_blocks) * bh_pairs), bh_pairs, 0};
  }
  static ForwardTileOrder longest_first(const AttentionFwdParams& params, int kBlockM) {
    ForwardTileOrder order = plain(params, kBlockM);
    // K and V of one query head's share of its KV head (GQA: consecutive query heads share one).
    const int group = params.nheads_q / params.nheads_kv;
    const int64_t kv_bytes = int64_t(params.seqlen_k) * params.head_dim * 2 * 2 / group;
    const int64_t heads = kv_bytes > 0 ? kL2SectionBytes / kv_bytes : order.bh_pairs;
    order.heads_per_section = static_cast<int>(heads < 1 ? 1 : (heads > order.bh_pairs ? order.bh_pairs : heads));
    return order;
  }

  FLASHATTN_HOST_DEVICE ForwardTile tile(int index) const {
    if (heads_per_section == 0) return {index % num_m_blocks, index / num_m_blocks};
    const int section_tiles = heads_per_section * num_m_blocks;
    const int section = index / section_tiles;
    const int within = index - section * section_tiles;
    const int first_bh = section * heads_per_section;
    const int left = bh_pairs - first_bh;
    const int pairs = heads_per_section < left ? heads_per_section : left;  // the last section may be short
    return {within / pairs, first_bh + within % pairs};
  }
};

// The tile indices one block of the grid walks (a static stride, no atomics): round r takes
// index r * gridDim.x + blockIdx.x on even rounds and its mirror r * gridDim.x + gridDim.x -
// 1 - blockIdx.x on odd ones (a snake), so that in a longest-first order the block that took
// one round's heaviest tile takes the next round's lightest. The last round's index may be
// past the tiles (skip it). A static grid (gridDim.x = the tile count) walks one round: its
// own tile blockIdx.x. The launch keeps num_tiles + gridDim.x within int.
struct TileWalk {
  int round_start = 0;
  bool mirrored = false;

  __device__ __forceinline__ bool more(int num_tiles) const { return round_start < num_tiles; }
  __device__ __forceinline__ int index() const {
    return round_start + static_cast<int>(mirrored ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  }
  __device__ __forceinline__ void advance() {
    round_start += static_cast<int>(gridDim.x);
    mirrored = !mirrored;
  }
};

// What one thread block of the forward owns for one tile: a block of kBlockM query rows of
// one (batch, head), and the key blocks [n_block_first, n_block_last] the mask lets those
// rows see (none when last < first). The tiles are sized by the longest sequence; a tile
// past its own sequence's end owns nothing (`empty`).
struct ForwardBlock {
  int m_begin, head, batch, kv_head;
  int n_block_first, n_block_last;
  int valid_q_rows;
  bool empty;
  SequenceInfo seq;
  MaskGeometry mask;

  // The static grid, one block per tile: query blocks x heads x batch.
  static int64_t grid_blocks(const AttentionFwdParams& params, int kBlockM) {
    return int64_t((params.seqlen_q + kBlockM - 1) / kBlockM) * params.batch * params.nheads_q;
  }

  __device__ __forceinline__ ForwardBlock(const AttentionFwdParams& params, ForwardTile tile, int kBlockM,
                                          int kBlockN, bool dense = false)
      : seq(params, tile.bh / params.nheads_q, dense),
        mask{seq.seqlen_q, seq.seqlen_k, params.window_left, params.window_right} {
    head = tile.bh % params.nheads_q;
    batch = tile.bh / params.nheads_q;
    kv_head = head / (params.nheads_q / params.nheads_kv);
    // Within a shorter sequence the heaviest block is its own last one, so the
    // rank counts down from there and the blocks past its end come last.
    const int seq_m_blocks = (seq.seqlen_q + kBlockM - 1) / kBlockM;
    const int m_block = seq_m_blocks - 1 - tile.rank;
    empty = m_block < 0;
    m_begin = m_block * kBlockM;
    valid_q_rows = seq.seqlen_q - m_begin;
    n_block_first = mask.key_begin(m_begin) / kBlockN;
    n_block_last = (mask.key_end(min(m_begin + kBlockM, seq.seqlen_q)) + kBlockN - 1) / kBlockN - 1;
  }
  template <typename Element>
  __device__ __forceinline__ Element* out_rows(const AttentionFwdParams& params) const {
    return seq.q_row(static_cast<Element*>(params.out), params.out_strides, batch, head, m_begin);
  }
  __device__ __forceinline__ float* lse_rows(const AttentionFwdParams& params) const {
    return seq.lse_row(params, batch, head, m_begin);
  }
};

// What one thread block of the backward main kernels owns: the kBlockN keys from n0 of KV
// head h_kv of batch b (flattened into blockIdx.x, key blocks fastest), and, for each of the
// `group` query heads sharing that KV head, the num_m query blocks from m_first that see one
// of those keys: num_iters = group * num_m (query head, query block) pairs.
struct BackwardBlock {
  int n0, h_kv, b, group;
  int m_first, num_m, num_iters;
  bool empty;  // the block starts past its sequence's last key (the grid fits the longest)
  SequenceInfo seq;
  MaskGeometry mask;

  // The grid that the constructor decodes: key blocks x KV heads x batch.
  static int64_t grid_blocks(const AttentionBwdParams& p, int kBlockN) {
    return int64_t((p.seqlen_k + kBlockN - 1) / kBlockN) * p.batch * p.nheads_kv;
  }

  __device__ __forceinline__ BackwardBlock(const AttentionBwdParams& p, int kBlockM, int kBlockN)
      : seq(p, static_cast<int>(blockIdx.x / ((p.seqlen_k + kBlockN - 1) / kBlockN)) / p.nheads_kv),
        mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right} {
    const int num_n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    const int bh_kv = static_cast<int>(blockIdx.x / num_n_blocks);
    n0 = static_cast<int>(blockIdx.x % num_n_blocks) * kBlockN;
    h_kv = bh_kv % p.nheads_kv;
    b = bh_kv / p.nheads_kv;
    group = p.nheads_q / p.nheads_kv;
    empty = n0 >= seq.seqlen_k;
    const int query_begin = mask.query_begin(n0);
    const int query_end = mask.query_end(min(n0 + kBlockN, seq.seqlen_k));
    m_first = query_begin / kBlockM;
    num_m = query_end > query_begin ? (query_end + kBlockM - 1) / kBlockM - m_first : 0;
    num_iters = group * num_m;
  }
};

// The queries [begin, end) that see each of a lane's two key rows, key and key + 8 (rows g and
// g + 8 of a warp's 16 in the m16n8 accumulator layout): the element mask of a straddling tile
// is then two compares per score. A key past seqlen_k gets an empty range.
__device__ __forceinline__ void lane_visible_queries(const MaskGeometry& mask, int key, int (&begin)[2],
                                                     int (&end)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int k = key + 8 * half;
    begin[half] = mask.query_begin(k);
    end[half] = k < mask.seqlen_k ? mask.query_end(k + 1) : 0;
  }
}

}  // namespace flashattn
