// One call of flash_attn_with_kvcache as the CUDA kernels see it: the attention params of
// the packed queries against a KV cache, plus where the cache's rows are and where the
// split-KV partial results go. Torch-free, like attention_params.h.
#pragma once

#include "common/attention_params.h"

namespace flashattn {

struct KvcacheFwdParams : AttentionFwdParams {
  // The cache: k / v (and their strides) are k_cache / v_cache. Batch entry b's keys are
  // the rows [cache_leftpad[b], seqused_k[b] + seqlen_new) of cache row cache_batch_idx[b]
  // (b when null), or, paged, of the pages block_table[b][.] (k / v then (num_pages,
  // page_size, nheads_kv, head_dim): their batch stride steps one page). seqused_k is
  // cache_seqlens, the rows before this call's seqlen_new appended ones (added here rather
  // than by a pass of its own). seqlen_k is the rows a cache row can hold, the bound every
  // lookup is clamped to.
  const int* block_table;  // (batch, pages_per_row) or nullptr
  int64_t block_table_batch_stride;
  int pages_per_row;
  int page_size;  // rows per page, a multiple of 16
  int num_pages;  // of k / v when paged: a block_table entry is clamped below it
  const int* cache_batch_idx;
  const int* cache_leftpad;
  int seqlen_new;

  // Packed GQA: the `group` query heads of one tile head are rows of one tile, row r of
  // tile head h being query position r / group of head h * group + r % group. A tile head
  // is a KV head (group = nheads_q / nheads_kv), or, where the scores of a tile must share
  // one query head (ALiBi's slope), a query head (group = 1), whose K/V head is
  // h / tile_heads_per_kv_head. q_strides step batch entries, packed rows and tile heads:
  // those of a packed copy (batch, tile_heads, seqlen_q * group, head_dim) written by the
  // prepare kernel, or of q itself where its packed rows lie at one stride.
  int group;
  int tile_heads;              // nheads_q / group
  int tile_heads_per_kv_head;  // tile_heads / nheads_kv
  int packed_rows;             // seqlen_q * group

  // Split-KV: split s of a tile takes the s-th of num_splits equal runs of the key
  // blocks the tile sees; it writes O normalised by its own row sums and its lse
  // (-inf where it saw no key), which the combine kernel merges by log-sum-exp.
  int num_splits;
  float* out_partial;  // (num_splits, batch, tile_heads, packed_rows, head_dim)
  float* lse_partial;  // (num_splits, batch, tile_heads, packed_rows)
};

// The new rows of a call and the rotary embedding, for the prepare kernel.
struct KvcachePrepareParams {
  const void* q;  // (batch, seqlen_q, nheads, head_dim) with q_strides
  TensorStrides q_strides;
  void* q_packed;  // KvcacheFwdParams::q, or nullptr where the attention kernel reads q itself
  const void* k_new;  // (batch, seqlen_new, nheads_kv, head_dim), or nullptr
  const void* v_new;
  TensorStrides k_new_strides, v_new_strides;
  int seqlen_new;
  const void* rotary_cos;  // (rotary_rows, rotary_dim / 2), or nullptr
  const void* rotary_sin;
  int rotary_rows;
  int rotary_dim;
  bool rotary_interleaved;  // pairs (2i, 2i + 1) (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX)
  bool rotate_q_per_position;  // causal / windowed: query i at cache_seqlens + i; else all at cache_seqlens
  const int* cache_seqlens;  // rows already in the cache, or nullptr (then no new rows)
};

}  // namespace flashattn
