// C++ signatures of the ops, one per backend, matching ops_schema.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace flashattn {

#define FLASHATTN_FORWARD_ARGS                                                            \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, double softmax_scale,   \
      bool causal, int64_t window_left, int64_t window_right, double softcap,           \
      const std::optional<at::Tensor>&alibi_slopes, double dropout_p,                    \
      const std::optional<at::Tensor>&rng_state, bool deterministic

#define FLASHATTN_BACKWARD_ARGS                                                           \
  const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, \
      const at::Tensor &out, const at::Tensor &lse, double softmax_scale, bool causal,   \
      int64_t window_left, int64_t window_right, double softcap,                         \
      const std::optional<at::Tensor>&alibi_slopes, double dropout_p,                    \
      const std::optional<at::Tensor>&rng_state, bool deterministic

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(FLASHATTN_FORWARD_ARGS);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(FLASHATTN_BACKWARD_ARGS);

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(FLASHATTN_FORWARD_ARGS);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(FLASHATTN_BACKWARD_ARGS);

}  // namespace flashattn
