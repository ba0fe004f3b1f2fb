// CUDA forward op: checks, device guard, outputs, then the kernel for q's dtype
// and head-dim tile on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_api.h"
#include "attention_ops.h"
#include "common/sequence_info.h"
#include "cuda/batch_order.h"
#include "cuda/cuda_backend.h"
#include "cuda/forward_launch.h"

namespace flashattn {
namespace {

struct ForwardLauncher {
  const AttentionFwdParams& params;
  DeviceLimits limits;
  cudaStream_t stream;

  template <int W>
  cudaError_t launch() const {
    return dispatch_score_mod(forward_score_mod(params), [&](auto mod) {
      return params.is_bf16 ? launch_attention_forward<__nv_bfloat16, W, mod()>(params, limits, stream)
                            : launch_attention_forward<__half, W, mod()>(params, limits, stream);
    });
  }
};

}  // namespace

void run_forward_kernel(const AttentionFwdParams& call_params, const DeviceLimits& limits, cudaStream_t stream) {
  AttentionFwdParams params = call_params;
  // The persistent grid's counter, where the forward may run one (a tile has at least 64 query
  // rows; the launch layers decide with the exact tile), zeroed on the stream, so that
  // CUDA-graph replays start from zero too; and after it a variable-length batch's order,
  // written on the stream from cu_seqlens / seqused.
  const int64_t most_tiles = (int64_t{params.seqlen_q} + 63) / 64 * params.batch * params.nheads_q;
  const bool counter = (limits.hopper_kernels ? limits.forward_scheduler != ForwardScheduler::kStatic
                                              : limits.forward_scheduler == ForwardScheduler::kPersistent) &&
                       most_tiles > limits.num_sms;
  const bool order = SequenceInfo::has_sequence_bounds(params) && params.batch > 1 &&
                     params.batch <= kMaxOrderedBatch;
  at::Tensor scheduler_ints;
  if (counter || order) {
    scheduler_ints = at::zeros({1 + (order ? params.batch : 0)},
                               at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::cuda::current_device()));
    if (counter) params.tile_counter = scheduler_ints.data_ptr<int>();
    if (order) {
      int* batch_order = scheduler_ints.data_ptr<int>() + 1;
      params.batch_order = batch_order;
      check_cuda_status(launch_longest_first_batch_order(params, batch_order, stream), "the batch-order kernel launch");
    }
  }
  cudaError_t status = cudaSuccess;
  if (!dispatch_head_dim_tile(params.head_dim, ForwardLauncher{params, limits, stream}, &status))
    fail_head_dim_not_compiled(params.head_dim);
  check_cuda_status(status, "the forward kernel launch");
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(FLASHATTN_FORWARD_ARGS) {
  const AttentionOptions opts{softmax_scale, causal,  window_left, window_right,
                              softcap,       alibi_slopes, dropout_p, rng_state,
                              SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, learnable_sink};
  check_forward_inputs(q, k, v, opts, cuda_features());
  check_cuda_device(q);
  const c10::cuda::CUDAGuard device_guard(q.device());

  if (host_value_checks_enabled())
    check_sequence_values(q, k, opts);
  auto [out, lse] = allocate_forward_outputs(q, opts);
  if (is_empty_problem(q, k, opts)) {
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  // Named, so that any copies outlive the kernel that reads them.
  const at::Tensor q_16 = with_16_byte_rows(q), k_16 = with_16_byte_rows(k), v_16 = with_16_byte_rows(v);
  run_forward_kernel(make_forward_params(q_16, k_16, v_16, out, lse, opts), device_limits(q),
                     c10::cuda::getCurrentCUDAStream().stream());
  return {out, lse};
}

// A testing aid (return_attn_probs=True), so its speed is no object: the CPU backend computes
// it from copies, with the same dropout mask function as the kernels.
at::Tensor attention_probabilities_cuda(FLASHATTN_PROBABILITIES_ARGS) {
  const AttentionOptions opts{softmax_scale, causal,       window_left, window_right,
                              softcap,       alibi_slopes, dropout_p,   rng_state,
                              SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, std::nullopt};
  check_probabilities_inputs(q, k, lse, opts, cuda_features());
  const auto on_cpu = [](const std::optional<at::Tensor>& t) {
    return t.has_value() ? std::optional<at::Tensor>(t->cpu()) : std::nullopt;
  };
  return attention_probabilities_cpu(q.cpu(), k.cpu(), lse.cpu(), softmax_scale, causal, window_left, window_right,
                                     softcap, on_cpu(alibi_slopes), dropout_p, on_cpu(rng_state),
                                     on_cpu(cu_seqlens_q), on_cpu(cu_seqlens_k), on_cpu(seqused_q),
                                     on_cpu(seqused_k), max_seqlen_q, max_seqlen_k)
      .to(q.device());
}

}  // namespace flashattn
