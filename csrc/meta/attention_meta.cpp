// Meta kernels of the ops: the checks of attention_api.cpp / kvcache_api.cpp (the one copy
// of them), then outputs with the shapes, dtypes and strides the real kernels give, without
// data. These are what FakeTensor, torch.compile (dynamic shapes included: the checks read
// SymInts) and torch.export run for the ops, so a bad call fails while tracing, with the
// message the kernels would give. The values of cu_seqlens / seqused (and of the KV cache op's
// cache_seqlens, block_table, ...) are data: only the real backends check them.
#include <torch/library.h>

#include "attention_api.h"
#include "attention_ops.h"
#include "kvcache_api.h"

namespace flashattn {
namespace {

bool any_kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// Which features a device supports is known to its own backend only; tracing allows them all.
constexpr BackendFeatures kMetaBackend{"Meta", /*softcap=*/true, /*alibi=*/true, /*dropout=*/true,
                                       /*learnable_sink=*/true, any_kernel_dtype};

std::tuple<at::Tensor, at::Tensor> attention_forward_meta(FLASHATTN_FORWARD_ARGS) {
  const AttentionOptions opts{softmax_scale, causal,       window_left, window_right,
                              softcap,       alibi_slopes, dropout_p,   rng_state,
                              SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, learnable_sink};
  (void)deterministic;
  check_forward_inputs(q, k, v, opts, kMetaBackend);
  return allocate_forward_outputs(q, opts);
}

BackwardGradients attention_backward_meta(FLASHATTN_BACKWARD_ARGS) {
  const AttentionOptions opts{softmax_scale, causal,       window_left, window_right,
                              softcap,       alibi_slopes, dropout_p,   rng_state,
                              SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, learnable_sink};
  (void)deterministic;
  check_backward_inputs(dout, q, k, v, out, lse, opts, kMetaBackend);
  return allocate_backward_outputs(q, k, v, opts);
}

at::Tensor attention_probabilities_meta(FLASHATTN_PROBABILITIES_ARGS) {
  const AttentionOptions opts{softmax_scale, causal,       window_left, window_right,
                              softcap,       alibi_slopes, dropout_p,   rng_state,
                              SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, std::nullopt};
  check_probabilities_inputs(q, k, lse, opts, kMetaBackend);
  return allocate_probabilities(q, k, opts);
}

// The caches' mutation is declared by the schema (Tensor(a!)); functionalization
// (torch.compile, export) writes it back, so the Meta kernel only checks and allocates.
std::tuple<at::Tensor, at::Tensor> attention_kvcache_forward_meta(FLASHATTN_KVCACHE_FORWARD_ARGS) {
  check_kvcache_inputs(q, k_cache, v_cache, FLASHATTN_KVCACHE_OPTIONS, kMetaBackend);
  return allocate_kvcache_outputs(q);
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, Meta, m) {
  m.impl("attention_forward", TORCH_FN(flashattn::attention_forward_meta));
  m.impl("attention_backward", TORCH_FN(flashattn::attention_backward_meta));
  m.impl("attention_kvcache_forward", TORCH_FN(flashattn::attention_kvcache_forward_meta));
  m.impl("attention_probabilities", TORCH_FN(flashattn::attention_probabilities_meta));
}
