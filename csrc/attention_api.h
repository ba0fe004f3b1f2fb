// The one place where the ops' arguments are checked and turned into params.
// Every backend (cpu/, cuda/) calls these before doing any work, so a bad
// argument fails the same way, with the same message, on every device.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/attention_params.h"

namespace flashattn {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kHeadDimAlignment = 8;

// Where each batch entry's rows are: the ops' sequence arguments (ops_schema.cpp).
// A side without cu_seqlens is dense, (batch, seqlen, nheads, head_dim).
struct SequenceLayout {
  std::optional<at::Tensor> cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k;
  int64_t max_seqlen_q = -1, max_seqlen_k = -1;

  bool varlen_q() const { return cu_seqlens_q.has_value(); }
  bool varlen_k() const { return cu_seqlens_k.has_value(); }
};

// The sizes of a checked call, whatever its layout.
struct ProblemSizes {
  int64_t batch, nheads_q, nheads_kv, head_dim;
  int64_t seqlen_q, seqlen_k;  // the longest sequence (dense: the sequence length)
  int64_t rows_q, rows_k;      // rows of q / k per head and batch entry of the tensor (varlen: total)
};

// The arguments shared by the forward and backward schemas.
struct AttentionOptions {
  double softmax_scale;
  bool causal;
  int64_t window_left;   // < 0: unbounded
  int64_t window_right;  // < 0: unbounded; forced to 0 when causal
  double softcap;
  std::optional<at::Tensor> alibi_slopes;
  double dropout_p;
  std::optional<at::Tensor> rng_state;  // int64 [seed, offset]; read when dropout_p > 0
  SequenceLayout layout;
  std::optional<at::Tensor> learnable_sink;  // fp32 (nheads,); absent: no sink
  // ALiBi distances count from key diagonal(i) + alibi_diagonal_shift instead of the
  // bottom-right diagonal: 0 for every op call; the CPU KV-cache path's parts of a longer
  // sequence (cpu/kvcache_cpu.cpp) set it, their own diagonal not being the sequence's.
  int64_t alibi_diagonal_shift = 0;
};

// Which optional features a backend implements; the rest are refused with
// NotImplementedError naming the feature and the device.
struct BackendFeatures {
  const char* name;
  bool softcap;
  bool alibi;
  bool dropout;
  bool learnable_sink;
  bool (*dtype_supported)(at::ScalarType);
};

// Shapes, dtypes, devices and strides of the forward inputs; throws on the first problem.
void check_forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& opts, const BackendFeatures& backend);

// head_dim (q's last dim) within the kernels' limits (alignment_note: what the Python
// function does about a misaligned one), and q's nheads (dim -2) a multiple of k's (MQA/GQA);
// k_name names k in the messages. Part of check_forward_inputs, shared by the KV cache op.
void check_heads(const at::Tensor& q, const at::Tensor& k, const char* k_name, const char* alignment_note);

// The forward checks, plus dout/out/lse against q.
void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const AttentionOptions& opts, const BackendFeatures& backend);

// lse (the forward's, of q) against q: dtype, device, shape.
void check_lse(const at::Tensor& lse, const at::Tensor& q, const AttentionOptions& opts);

// attention_probabilities: the forward's checks on q and k, and lse's.
void check_probabilities_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                const AttentionOptions& opts, const BackendFeatures& backend);

// attention_probabilities' output, zeroed: (batch, nheads, seqlen_q, seqlen_k), each seqlen the
// longest sequence rounded up to a multiple of 128 (flash-attn's S_dmask), in q's dtype.
at::Tensor allocate_probabilities(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts);

// The sizes of inputs that passed check_forward_inputs.
ProblemSizes problem_sizes(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts);

// The values of cu_seqlens / seqused against each other and the tensors (cu_seqlens
// starts at 0, never decreases and ends at the rows of q / k; no sequence is longer
// than max_seqlen; seqused within its sequence). Reads them on the host: a device
// synchronisation when they live on a GPU, so the CUDA backend skips it while a
// CUDA graph is being captured (its kernels never read outside the tensors).
void check_sequence_values(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts);

// The window the kernels see: causal folded in, bounds past the sequence clamped to unbounded.
std::pair<int, int> effective_window(const AttentionOptions& opts, int64_t seqlen_q,
                                     int64_t seqlen_k);

// The dtype of lse: fp64 for fp64 inputs (the backward's probabilities come from
// it, so it carries the inputs' precision), fp32 for every other dtype.
inline at::ScalarType lse_dtype(at::ScalarType q_dtype) {
  return q_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// Fresh outputs of the forward: out like q and lse (batch, nheads, seqlen_q), or
// (nheads, total_q) for a variable-length q. With seqused_q the rows no kernel
// writes are set already (out = 0, lse = +inf).
std::tuple<at::Tensor, at::Tensor> allocate_forward_outputs(const at::Tensor& q,
                                                            const AttentionOptions& opts);

// Fresh dq, dk, dv like q, k, v, zero where seqused leaves rows no kernel writes, and
// dsink: fp32 zeros (batch, nheads) with a sink, (batch, 0) without.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_backward_outputs(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& opts);

// True when the call has nothing to compute (a zero-sized dimension). The outputs
// are then already final: out = 0 and lse = +inf (no key visible) or empty. A call
// with queries, a sink and no key is not empty: its rows get lse = sink.
bool is_empty_problem(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts);

// The (batch, row, head) strides of a (batch, seqlen, nheads, head_dim) tensor; a
// variable-length one, (total, nheads, head_dim), is one batch entry whose rows every
// sequence indexes from its cu_seqlens offset: batch stride 0.
TensorStrides strides_of(const at::Tensor& t);

AttentionFwdParams make_forward_params(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out,
                                       const at::Tensor& lse, const AttentionOptions& opts);

// ALiBi's slopes (checked) as the params carry them: per (batch, head), batch stride 0 when
// the batch shares them; absent, a null pointer.
void set_alibi_slopes(AttentionFwdParams& p, const std::optional<at::Tensor>& alibi_slopes);

// Pointers and strides of dout/dq/dk/dv; the workspace pointers are left null
// for the backend's launch layer to fill.
AttentionBwdParams make_backward_params(const at::Tensor& dout, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& out, const at::Tensor& lse,
                                        const at::Tensor& dq, const at::Tensor& dk,
                                        const at::Tensor& dv, const AttentionOptions& opts);

}  // namespace flashattn
