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

// The block index read again after the key loop: a volatile read the compiler cannot merge
// with the one at the kernel's start, so the coordinates decoded from it are recomputed
// there instead of held through the loop in registers it has not got.
__device__ __forceinline__ int block_index_reread() {
  int block;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
  return block;
}

struct KvcacheBlock {
  int m_begin, kv_head, batch;
  int n_block_first, n_block_last;  // none when last < first
  int valid_rows;                   // packed rows of the tile that exist
  CacheSequence seq;
  PackedRowsMask mask;

  // Row blocks x splits x tile heads x batch, row blocks fastest.
  static int64_t grid_blocks(const KvcacheFwdParams& p, int kBlockM) {
    return int64_t(num_m_blocks(p, kBlockM)) * p.num_splits * p.tile_heads * p.batch;
  }

  __device__ __forceinline__ KvcacheBlock(const KvcacheFwdParams& p, int kBlockM, int kBlockN)
      : seq(p, decode_batch(p, kBlockM, blockIdx.x)),
        mask{{p.seqlen_q, seq.seqlen_k, p.window_left, p.window_right}, p.group} {
    const int m_blocks = num_m_blocks(p, kBlockM);
    int rest = static_cast<int>(blockIdx.x);
    m_begin = (rest % m_blocks) * kBlockM;
    rest /= m_blocks;
    const int split = rest % p.num_splits;
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
  __host__ __device__ __forceinline__ static int num_m_blocks(const KvcacheFwdParams& p, int kBlockM) {
    return (p.packed_rows + kBlockM - 1) / kBlockM;
  }
  // Coordinates of the tile of block `block` (blockIdx.x, or block_index_reread()).
  __device__ __forceinline__ static int decode_batch(const KvcacheFwdParams& p, int kBlockM, int block) {
    return block / num_m_blocks(p, kBlockM) / p.num_splits / p.tile_heads;
  }
  __device__ __forceinline__ static int tile_head(const KvcacheFwdParams& p, int kBlockM, int block) {
    return block / num_m_blocks(p, kBlockM) / p.num_splits % p.tile_heads;
  }
  __device__ __forceinline__ static int m_begin_of(const KvcacheFwdParams& p, int kBlockM, int block) {
    return block % num_m_blocks(p, kBlockM) * kBlockM;
  }
  // The tile's index among (batch, tile head, row block), that of its split counter.
  __device__ __forceinline__ static int64_t tile_of(const KvcacheFwdParams& p, int kBlockM, int block) {
    const int m_blocks = num_m_blocks(p, kBlockM);
    return int64_t(block / m_blocks / p.num_splits) * m_blocks + block % m_blocks;
  }
  // Offset of block `block`'s first row in the partial outputs (rows of head_dim floats).
  __device__ __forceinline__ static int64_t partial_row_of(const KvcacheFwdParams& p, int kBlockM, int block) {
    const int split = block / num_m_blocks(p, kBlockM) % p.num_splits;
    return ((int64_t(split) * p.batch + decode_batch(p, kBlockM, block)) * p.tile_heads +
            tile_head(p, kBlockM, block)) * p.packed_rows +
           m_begin_of(p, kBlockM, block);
  }
};

}  // namespace flashattn
