// Which tile a thread block of the KV-cache attention kernel owns (a static grid,
// flattened into blockIdx.x): kBlockM packed-GQA rows of one (batch entry, tile head), and
// one split of the key blocks those rows see. It holds the tile's K/V head; the tile head
// (the same unless a tile is one query head: kvcache_params.h) is decoded again where it
// is needed (held through the key loop, it spilled the W = 256 kernel).
#pragma once

#include "common/attention_mask.h"
#include "common/kvcache_params.h"
#include "common/sequence_info.h"

namespace flashattn {

struct KvcacheBlock {
  int m_begin, kv_head, batch, split;
  int n_block_first, n_block_last;  // none when last < first
  int valid_rows;                   // packed rows of the tile that exist
  CacheSequence seq;
  PackedRowsMask mask;

  // Row blocks x splits x tile heads x batch, row blocks fastest.
  static int64_t grid_blocks(const KvcacheFwdParams& p, int kBlockM) {
    return int64_t((p.packed_rows + kBlockM - 1) / kBlockM) * p.num_splits * p.tile_heads * p.batch;
  }

  __device__ __forceinline__ KvcacheBlock(const KvcacheFwdParams& p, int kBlockM, int kBlockN)
      : seq(p, decode_batch(p, kBlockM)),
        mask{{p.seqlen_q, seq.seqlen_k, p.window_left, p.window_right}, p.group} {
    const int num_m_blocks = (p.packed_rows + kBlockM - 1) / kBlockM;
    int rest = static_cast<int>(blockIdx.x);
    m_begin = (rest % num_m_blocks) * kBlockM;
    rest /= num_m_blocks;
    split = rest % p.num_splits;
    rest /= p.num_splits;
    // (A packed call skips the division: its temporaries spilled the W = 256 kernel.)
    kv_head = p.tile_heads_per_kv_head == 1 ? rest % p.tile_heads : rest % p.tile_heads / p.tile_heads_per_kv_head;
    batch = rest / p.tile_heads;
    valid_rows = p.packed_rows - m_begin;
    const int row_end = min(m_begin + kBlockM, p.packed_rows);
    const int first = mask.key_begin(m_begin) / kBlockN;
    const int last = (mask.key_end(row_end) + kBlockN - 1) / kBlockN - 1;
    // Equal runs of the key blocks, from this sequence's own length (the grid's number of
    // splits comes from the cache's capacity, so short sequences leave late splits empty).
    const int per_split = (last - first + p.num_splits) / p.num_splits;
    n_block_first = first + split * per_split;
    n_block_last = min(last, n_block_first + per_split - 1);
  }
  __device__ __forceinline__ static int decode_batch(const KvcacheFwdParams& p, int kBlockM) {
    const int num_m_blocks = (p.packed_rows + kBlockM - 1) / kBlockM;
    return static_cast<int>(blockIdx.x / num_m_blocks) / p.num_splits / p.tile_heads;
  }
  __device__ __forceinline__ static int tile_head(const KvcacheFwdParams& p, int kBlockM) {
    const int num_m_blocks = (p.packed_rows + kBlockM - 1) / kBlockM;
    return static_cast<int>(blockIdx.x / num_m_blocks) / p.num_splits % p.tile_heads;
  }
  // Offset of this tile's first row in the partial outputs (rows of head_dim floats).
  __device__ __forceinline__ int64_t partial_row(const KvcacheFwdParams& p, int kBlockM) const {
    return ((int64_t(split) * p.batch + batch) * p.tile_heads + tile_head(p, kBlockM)) * p.packed_rows + m_begin;
  }
};

}  // namespace flashattn
