// The one place where the ops' arguments are checked and turned into params.
// Every backend (cpu/, cuda/) calls these before doing any work, so a bad
// argument fails the same way, with the same message, on every device.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "attention_params.h"

namespace flashattn {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kHeadDimAlignment = 8;

// The scalar arguments shared by the forward and backward schemas.
struct AttentionOptions {
  double softmax_scale;
  bool causal;
  int64_t window_left;   // < 0: unbounded
  int64_t window_right;  // < 0: unbounded; forced to 0 when causal
  double softcap;
  std::optional<at::Tensor> alibi_slopes;
  double dropout_p;
  std::optional<at::Tensor> rng_state;
};

// Which optional features a backend implements; the rest are refused with
// NotImplementedError naming the feature and the device.
struct BackendFeatures {
  const char* name;
  bool softcap;
  bool alibi;
  bool dropout;
  bool (*dtype_supported)(at::ScalarType);
};

// Shapes, dtypes, devices and strides of the forward inputs; throws on the first problem.
void check_forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& opts, const BackendFeatures& backend);

// The forward checks, plus dout/out/lse against q.
void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const AttentionOptions& opts, const BackendFeatures& backend);

// The window the kernels see: causal folded in, bounds past the sequence clamped to unbounded.
std::pair<int, int> effective_window(const AttentionOptions& opts, int64_t seqlen_q,
                                     int64_t seqlen_k);

// The dtype of lse: fp64 for fp64 inputs (the backward's probabilities come from
// it, so it carries the inputs' precision), fp32 for every other dtype.
inline at::ScalarType lse_dtype(at::ScalarType q_dtype) {
  return q_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// Fresh outputs of the forward: out like q (batch, seqlen_q, nheads, head_dim) and
// lse (batch, nheads, seqlen_q) fp32.
std::tuple<at::Tensor, at::Tensor> allocate_forward_outputs(const at::Tensor& q);

// True when the call has nothing to compute (a zero-sized dimension). The outputs
// are then already final: out = 0 and lse = +inf (no key visible) or empty.
bool is_empty_problem(const at::Tensor& q, const at::Tensor& k);

AttentionFwdParams make_forward_params(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out,
                                       const at::Tensor& lse, const AttentionOptions& opts);

// Pointers and strides of dout/dq/dk/dv; the workspace pointers are left null
// for the backend's launch layer to fill.
AttentionBwdParams make_backward_params(const at::Tensor& dout, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& out, const at::Tensor& lse,
                                        const at::Tensor& dq, const at::Tensor& dk,
                                        const at::Tensor& dv, const AttentionOptions& opts);

}  // namespace flashattn
