// C++ signatures of the ops, one per backend, matching ops_schema.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace flashattn {

// Variable-length batches (flash-attn's varlen arguments); all absent: dense.
#define FLASHATTN_SEQUENCE_ARGS                                                           \
  const std::optional<at::Tensor>&cu_seqlens_q, const std::optional<at::Tensor>&cu_seqlens_k, \
      const std::optional<at::Tensor>&seqused_q, const std::optional<at::Tensor>&seqused_k,   \
      int64_t max_seqlen_q, int64_t max_seqlen_k

// One sink logit per query head (ops_schema.cpp); absent: no sink.
#define FLASHATTN_SINK_ARGS const std::optional<at::Tensor>&learnable_sink

#define FLASHATTN_FORWARD_ARGS                                                            \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, double softmax_scale,   \
      bool causal, int64_t window_left, int64_t window_right, double softcap,           \
      const std::optional<at::Tensor>&alibi_slopes, double dropout_p,                    \
      const std::optional<at::Tensor>&rng_state, bool deterministic, FLASHATTN_SEQUENCE_ARGS, \
      FLASHATTN_SINK_ARGS

#define FLASHATTN_BACKWARD_ARGS                                                           \
  const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, \
      const at::Tensor &out, const at::Tensor &lse, double softmax_scale, bool causal,   \
      int64_t window_left, int64_t window_right, double softcap,                         \
      const std::optional<at::Tensor>&alibi_slopes, double dropout_p,                    \
      const std::optional<at::Tensor>&rng_state, bool deterministic, FLASHATTN_SEQUENCE_ARGS, \
      FLASHATTN_SINK_ARGS

#define FLASHATTN_PROBABILITIES_ARGS                                                      \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &lse, double softmax_scale, \
      bool causal, int64_t window_left, int64_t window_right, double softcap,           \
      const std::optional<at::Tensor>&alibi_slopes, double dropout_p,                    \
      const std::optional<at::Tensor>&rng_state, FLASHATTN_SEQUENCE_ARGS

// The names of the sequence arguments, in schema order (for forwarding calls).
#define FLASHATTN_SEQUENCE_ARG_NAMES \
  cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k

// attention_kvcache_forward (flash_attn_with_kvcache); kvcache_api.h has the options struct.
#define FLASHATTN_KVCACHE_FORWARD_ARGS                                                        \
  const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,                   \
      const std::optional<at::Tensor>&k_new, const std::optional<at::Tensor>&v_new,           \
      const std::optional<at::Tensor>&rotary_cos, const std::optional<at::Tensor>&rotary_sin, \
      const std::optional<at::Tensor>&cache_seqlens,                                          \
      const std::optional<at::Tensor>&cache_batch_idx,                                        \
      const std::optional<at::Tensor>&cache_leftpad, const std::optional<at::Tensor>&block_table, \
      double softmax_scale, bool causal, int64_t window_left, int64_t window_right,           \
      double softcap, bool rotary_interleaved, const std::optional<at::Tensor>&alibi_slopes,  \
      int64_t num_splits, FLASHATTN_SINK_ARGS

// The arguments of FLASHATTN_KVCACHE_FORWARD_ARGS after the three tensors, as a
// KvcacheOptions initialiser.
#define FLASHATTN_KVCACHE_OPTIONS                                                             \
  KvcacheOptions {                                                                            \
    k_new, v_new, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,      \
        block_table, softmax_scale, causal, window_left, window_right, softcap,               \
        rotary_interleaved, alibi_slopes, num_splits, learnable_sink                          \
  }

// (dq, dk, dv, dsink).
using BackwardGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(FLASHATTN_FORWARD_ARGS);
BackwardGradients attention_backward_cpu(FLASHATTN_BACKWARD_ARGS);
std::tuple<at::Tensor, at::Tensor> attention_kvcache_forward_cpu(FLASHATTN_KVCACHE_FORWARD_ARGS);
at::Tensor attention_probabilities_cpu(FLASHATTN_PROBABILITIES_ARGS);

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(FLASHATTN_FORWARD_ARGS);
BackwardGradients attention_backward_cuda(FLASHATTN_BACKWARD_ARGS);
std::tuple<at::Tensor, at::Tensor> attention_kvcache_forward_cuda(FLASHATTN_KVCACHE_FORWARD_ARGS);
at::Tensor attention_probabilities_cuda(FLASHATTN_PROBABILITIES_ARGS);

}  // namespace flashattn
