// The one place where the arguments of attention_kvcache_forward (flash_attn_with_kvcache)
// are checked. Every backend calls these before doing any work, and the Meta kernel
// runs check_kvcache_inputs on symbolic shapes, so a bad call fails the same way, with
// the same message, on every device and while tracing.
//
// What the op computes (ops_schema.cpp has the contract, csrc/cpu/kvcache_cpu.cpp is the
// executable specification): batch entry b's sequence is rows
// [leftpad[b], cache_seqlens[b] + seqlen_new) of its cache row (cache_batch_idx[b], or b;
// through block_table[b] when paged); k_new / v_new (rotated) are written at rows
// cache_seqlens[b] .. + seqlen_new first, and q attends to the whole sequence,
// bottom-right aligned.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "attention_api.h"

namespace flashattn {

// Every argument of attention_kvcache_forward but q, k_cache and v_cache (schema order).
struct KvcacheOptions {
  std::optional<at::Tensor> k_new, v_new;            // (batch, seqlen_new, nheads_kv, head_dim), both or neither
  std::optional<at::Tensor> rotary_cos, rotary_sin;  // (seqlen_ro, rotary_dim / 2), both or neither; need k_new
  std::optional<at::Tensor> cache_seqlens;           // int32 (batch,); absent: whole cache rows, no k_new
  std::optional<at::Tensor> cache_batch_idx;         // int32 (batch,); not with block_table
  std::optional<at::Tensor> cache_leftpad;           // int32 (batch,); the sequence's first row
  std::optional<at::Tensor> block_table;             // int32 (batch, max_blocks_per_seq): paged caches
  double softmax_scale;
  bool causal;
  int64_t window_left;   // < 0: unbounded
  int64_t window_right;  // < 0: unbounded; 0 when causal
  double softcap;
  bool rotary_interleaved;  // GPT-J pairs (0, 1), (2, 3), ...; else GPT-NeoX halves
  std::optional<at::Tensor> alibi_slopes;
  int64_t num_splits;  // 0: the backend's heuristic, 1: no split, n > 1: n splits of the keys
  std::optional<at::Tensor> learnable_sink;

  bool paged() const { return block_table.has_value(); }
  bool appends() const { return k_new.has_value(); }
};

// The sizes of a checked call.
struct KvcacheSizes {
  int64_t batch, seqlen_q, nheads_q, nheads_kv, head_dim;
  int64_t seqlen_new;   // rows of k_new / v_new (0 without)
  int64_t capacity;     // rows one sequence can hold: seqlen_cache, or max_blocks_per_seq * page_size
  int64_t page_size;    // paged: rows per block (k_cache dim 1); else 0
  int64_t cache_rows;   // k_cache dim 0: batch_cache, or num_blocks when paged
  int64_t rotary_dim;   // 2 * rotary_cos.size(1); 0 without rotary
};

// Shapes, dtypes, devices and strides of the arguments; throws on the first problem,
// naming the argument. Features the backend lacks (alibi_slopes, learnable_sink,
// softcap per `backend`) raise NotImplementedError.
void check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const KvcacheOptions& opts, const BackendFeatures& backend);

KvcacheSizes kvcache_sizes(const at::Tensor& q, const at::Tensor& k_cache, const KvcacheOptions& opts);

// Whether q's rotary positions advance with its rows (cache_seqlens[b] + i) or all sit at
// cache_seqlens[b]: flash-attn rotates q row by row only when the attention is causal or
// local, local meaning a window bound below the cache's capacity.
bool rotary_q_positions_advance(const KvcacheOptions& opts, int64_t capacity);

// The values of cache_seqlens, cache_leftpad, cache_batch_idx and block_table against the
// sizes: 0 <= cache_seqlens[b] and cache_seqlens[b] + seqlen_new <= capacity;
// 0 <= leftpad[b] <= cache_seqlens[b]; cache_batch_idx[b] in [0, batch_cache); the
// block_table entries the sequence uses in [0, num_blocks); rotary_cos long enough for
// the positions rotated. Reads them on the host: a device synchronisation when they live
// on a GPU, so the CUDA backend skips it while a CUDA graph is being captured, as it does
// check_sequence_values.
void check_kvcache_values(const at::Tensor& q, const at::Tensor& k_cache, const KvcacheOptions& opts);

// Fresh outputs: out like q and lse (batch, nheads, seqlen_q) in lse_dtype (fp32; fp64 for
// fp64 inputs).
std::tuple<at::Tensor, at::Tensor> allocate_kvcache_outputs(const at::Tensor& q);

}  // namespace flashattn
