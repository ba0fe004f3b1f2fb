// Which tile a thread block works on, for the kernels of both families: the forward's query
// blocks and the backward's key blocks, with the key / query ranges the mask leaves them.
// Tiles are numbered in one flat order (so that batch x heads past 65535 fits): a static grid
// gives block i tile i; the Hopper forward's persistent grid (persistent_forward_blocks) walks
// the same order with fewer, resident blocks.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "common/sequence_info.h"
#include "cuda/common/fast_divmod.cuh"
#include "cuda/device_limits.h"

namespace flashattn {

// The divisors that decode a forward tile number. The Hopper persistent grid takes FastDivmod's,
// made once per launch on the host: the GPU has no integer divider, and the compiler's divisions
// (each a chain of about 30 instructions, three in a row) ran at every tile's start, where no
// other warp of the block has work to hide them.
template <typename Divisor>
struct TileOrder {
  Divisor query_blocks{1};  // of the longest sequence
  Divisor heads{1};         // query heads
  Divisor group{1};         // query heads per KV head

  TileOrder() = default;
  FLASHATTN_HOST_DEVICE TileOrder(const AttentionFwdParams& p, int kBlockM)
      : query_blocks((p.seqlen_q + kBlockM - 1) / kBlockM),
        heads(p.nheads_q),
        group(p.nheads_kv > 0 ? p.nheads_q / p.nheads_kv : 1) {}
};
using ForwardTileOrder = TileOrder<FastDivmod>;

// What forward tile `tile` is: a block of kBlockM query rows of one (batch, head), and the
// key blocks [n_block_first, n_block_last] the mask lets those rows see (none when last <
// first). The tiles are counted for the longest sequence; a tile past its own sequence's
// end is `empty`.
struct ForwardBlock {
  int m_begin, head, batch, kv_head;
  int n_block_first, n_block_last;
  int valid_q_rows;
  bool empty;
  SequenceInfo seq;
  MaskGeometry mask;

  // The tiles that the constructor decodes: query blocks x heads x batch.
  FLASHATTN_HOST_DEVICE static int64_t grid_blocks(const AttentionFwdParams& params, int kBlockM) {
    return int64_t((params.seqlen_q + kBlockM - 1) / kBlockM) * params.batch * params.nheads_q;
  }

  // Flattened grid (one dimension never overflows for batch * heads > 65535): query blocks
  // vary fastest, heaviest (last) blocks first for causal balance; the sequences of a
  // variable-length batch in params.batch_order, longest first. tile < grid_blocks.
  template <typename Divisor>
  __device__ __forceinline__ ForwardBlock(const AttentionFwdParams& params, const TileOrder<Divisor>& order,
                                          int kBlockM, int kBlockN, bool dense, unsigned tile)
      : ForwardBlock(params, order, kBlockM, kBlockN, dense, order.query_blocks.div(static_cast<int>(tile)),
                     static_cast<int>(tile)) {}

  template <typename Element>
  __device__ __forceinline__ Element* out_rows(const AttentionFwdParams& params) const {
    return seq.q_row(static_cast<Element*>(params.out), params.out_strides, batch, head, m_begin);
  }
  __device__ __forceinline__ float* lse_rows(const AttentionFwdParams& params) const {
    return seq.lse_row(params, batch, head, m_begin);
  }

 private:
  // bh: the tile's (batch slot, head) number, tile / query blocks.
  template <typename Divisor>
  __device__ __forceinline__ ForwardBlock(const AttentionFwdParams& params, const TileOrder<Divisor>& order,
                                          int kBlockM, int kBlockN, bool dense, int bh, int tile)
      : head(order.heads.mod(bh)),
        batch(dense || params.batch_order == nullptr ? order.heads.div(bh) : params.batch_order[order.heads.div(bh)]),
        kv_head(order.group.div(head)),
        seq(params, batch, dense),
        mask{seq.seqlen_q, seq.seqlen_k, params.window_left, params.window_right} {
    // Within a shorter sequence the heaviest block is its own last one, so the
    // order counts down from there and the blocks past its end come last.
    const int seq_m_blocks = (seq.seqlen_q + kBlockM - 1) / kBlockM;
    const int m_block = seq_m_blocks - 1 - (tile - bh * order.query_blocks.divisor);
    empty = m_block < 0;
    m_begin = m_block * kBlockM;
    valid_q_rows = seq.seqlen_q - m_begin;
    n_block_first = mask.key_begin(m_begin) / kBlockN;
    n_block_last = (mask.key_end(min(m_begin + kBlockM, seq.seqlen_q)) + kBlockN - 1) / kBlockN - 1;
  }
};

// The blocks of a persistent forward grid, or 0 for the static grid (one block per tile), for
// tiles of kBlockM x kBlockN and `resident` blocks the SMs hold at once. A persistent block
// loads its next tile's Q and first K / V while it finishes the last, and skips the launch of
// a block per tile: that pays where the key loops are short (measured on the H100, d 128:
// +7 % at N 1024, +14 % causal; nothing at N 8192-16384 without a causal mask, where kAuto
// keeps the static grid). It needs a tile counter and more tiles than resident blocks.
inline int64_t persistent_forward_blocks(const AttentionFwdParams& p, const DeviceLimits& limits, int kBlockM,
                                         int kBlockN, int64_t resident) {
  if (p.tile_counter == nullptr || limits.forward_scheduler == ForwardScheduler::kStatic) return 0;
  if (limits.persistent_grid_cap > 0) resident = std::min<int64_t>(resident, limits.persistent_grid_cap);
  if (ForwardBlock::grid_blocks(p, kBlockM) <= resident) return 0;
  if (limits.forward_scheduler == ForwardScheduler::kAuto) {
    // Keys a query row sees on average: a causal mask halves them, a window bounds them.
    const bool causal = p.window_right == 0 && p.window_left < 0;
    int64_t keys = causal ? p.seqlen_k / 2 : p.seqlen_k;
    if (!causal && (p.window_left >= 0 || p.window_right >= 0))
      keys = std::min<int64_t>(keys, int64_t{p.window_left < 0 ? p.seqlen_k : p.window_left} +
                                         (p.window_right < 0 ? p.seqlen_k : p.window_right) + 1);
    if (keys > 32 * int64_t{kBlockN}) return 0;
  }
  return resident;
}

// What one thread block of the backward main kernels owns: the kBlockN keys from n0 of KV
// head h_kv of batch b (flattened into blockIdx.x, key blocks fastest, so that the blocks
// running together share their head's Q and dO in L2; `last_key_block_first` launches a head's
// key blocks in reverse: see dq_adds_last_key_block_first), and, for each of the
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

  __device__ __forceinline__ BackwardBlock(const AttentionBwdParams& p, int kBlockM, int kBlockN,
                                           bool last_key_block_first = false)
      : seq(p, static_cast<int>(blockIdx.x / ((p.seqlen_k + kBlockN - 1) / kBlockN)) / p.nheads_kv),
        mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right} {
    const int num_n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    const int bh_kv = static_cast<int>(blockIdx.x / num_n_blocks);
    const int index = static_cast<int>(blockIdx.x % num_n_blocks);
    n0 = (last_key_block_first ? num_n_blocks - 1 - index : index) * kBlockN;
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

// Deterministic dQ in the Hopper backward: each query block's dQ takes the adds of the key blocks
// that see it in one fixed order, the order in which they reach it. Where the visible queries
// start later for later keys (causal, or a window bounded on the right), each key block starts
// its loop at its diagonal, so the last key block reaches a query block first: the adds run last
// key block first, and the grid launches a head's key blocks last first too, so that a block only
// waits for blocks launched before it (no deadlock where a head's key blocks do not all fit on
// the GPU at once). Otherwise every key block starts at the first query block and the adds run
// first key block first, a chain that delays the k-th key block of a head by k adds.
FLASHATTN_HOST_DEVICE bool dq_adds_last_key_block_first(const AttentionBwdParams& p) {
  return p.window_right >= 0;
}

// How many key blocks add to query block m_block's dQ before key block nb (which adds to it), in
// the order of dq_adds_last_key_block_first: the value of the query block's semaphore that nb
// waits for. A key block adds to the query blocks BackwardBlock gives it; under a banded mask
// those of one query block are consecutive, and the mask's key range finds them up to a block.
__device__ __forceinline__ int dq_add_turn(const MaskGeometry& mask, int nb, int m_block, int kBlockM,
                                           int kBlockN, bool last_key_block_first) {
  const auto adds = [&](int n) {
    const int n0 = n * kBlockN;
    if (n < 0 || n0 >= mask.seqlen_k) return false;
    const int query_begin = mask.query_begin(n0);
    const int query_end = mask.query_end(min(n0 + kBlockN, mask.seqlen_k));
    return query_end > query_begin && query_begin / kBlockM <= m_block &&
           m_block < (query_end + kBlockM - 1) / kBlockM;
  };
  const int m0 = m_block * kBlockM, m_end = min(m0 + kBlockM, mask.seqlen_q);
  if (last_key_block_first) {
    int last = max(nb, (min(mask.key_end(m_end), mask.seqlen_k) - 1) / kBlockN);
    while (last > nb && !adds(last)) --last;
    while (adds(last + 1)) ++last;
    return last - nb;
  }
  int first = min(nb, mask.key_begin(m0) / kBlockN);
  while (first < nb && !adds(first)) ++first;
  while (adds(first - 1)) --first;
  return nb - first;
}

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
