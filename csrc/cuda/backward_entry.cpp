// CUDA backward op: checks, device guard, gradients and fp32 workspaces, then the kernels for
// q's dtype and head-dim tile on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_api.h"
#include "attention_ops.h"
#include "cuda/backward_launch.h"
#include "cuda/cuda_backend.h"
#include "cuda/head_dim_tiles.h"

namespace flashattn {
namespace {

// dsink[b, h] = -sum over the rows i of head h of sequence b of exp(sink_h - lse_i) D_i (the
// sink's probability times dP_sink - D = -D), from the backward's workspaces: lse2 = lse log2(e)
// (+inf on padding rows) and D (0 there). With a variable-length q the rows between two
// sequences' padded blocks belong to neither: zeroed before the preprocess, and the exponent
// clamped to <= 0 (P_sink <= 1) keeps them at 0 * finite. Sums in fp64, a deterministic order.
void sink_gradient_from_workspaces(const AttentionBwdParams& p, const at::Tensor& lse_log2,
                                   const at::Tensor& softmax_d, const at::Tensor& sink,
                                   const std::optional<at::Tensor>& cu_seqlens_q, at::Tensor& dsink) {
  const at::Tensor sink_log2 = sink.mul(M_LOG2E);
  const auto terms_of = [&](const at::Tensor& lse2, const at::Tensor& d, const at::Tensor& sink2) {
    return (sink2 - lse2).clamp_max_(0.f).exp2_().mul_(d).to(at::kDouble);
  };
  if (!cu_seqlens_q.has_value()) {
    const auto rows = [&](const at::Tensor& w) { return w.view({p.batch, p.nheads_q, p.workspace_head_stride}); };
    const at::Tensor terms = terms_of(rows(lse_log2), rows(softmax_d), sink_log2.view({1, -1, 1}));
    dsink.copy_(terms.sum(2).neg_());
    return;
  }
  const auto rows = [&](const at::Tensor& w) { return w.view({p.nheads_q, p.workspace_head_stride}); };
  const at::Tensor terms = terms_of(rows(lse_log2), rows(softmax_d), sink_log2.view({-1, 1}));
  // Sequence b's rows: from backward_workspace_sequence's start to the next sequence's (the
  // last to the head's end), summed as differences of a prefix sum.
  const at::Tensor prefix = at::constant_pad_nd(terms.cumsum(1), {1, 0});
  const at::Tensor first_rows = cu_seqlens_q->narrow(0, 0, p.batch).to(at::kLong);
  const at::Tensor starts =
      (first_rows + at::arange(p.batch, first_rows.options()) * kBackwardQueryRowRounding)
          .div_(kBackwardQueryRowRounding, "floor")
          .mul_(kBackwardQueryRowRounding);
  const at::Tensor ends =
      at::cat({starts.narrow(0, 1, p.batch - 1), at::full({1}, p.workspace_head_stride, starts.options())});
  dsink.copy_((prefix.index_select(1, starts) - prefix.index_select(1, ends)).t());
}

struct BackwardLauncher {
  const AttentionBwdParams& params;  // everything but the workspaces
  at::TensorOptions device_options;
  DeviceLimits limits;
  cudaStream_t stream;
  const AttentionOptions& opts;
  at::Tensor& dsink;

  template <int W>
  cudaError_t launch() const {
    const BackwardWorkspaceGeometry geometry = backward_workspace_geometry(params, W);
    TORCH_CHECK(geometry.seqlen_q_rounded <= std::numeric_limits<int>::max(),
                "flashattn_ext: seqlen_q ", params.seqlen_q, " is too long for the backward "
                "workspaces (rounded up to ", geometry.seqlen_q_rounded, " rows)");
    const auto f32 = device_options.dtype(at::kFloat);
    // Allocated on the current stream, which the kernels run on, so freeing them when this
    // returns is safe with the caching allocator.
    const at::Tensor dq_accum = at::empty({geometry.workspace_rows, geometry.head_dim_rounded}, f32);
    const at::Tensor softmax_d = at::empty({geometry.workspace_rows}, f32);
    const at::Tensor lse_log2 = at::empty({geometry.workspace_rows}, f32);
    const at::Tensor semaphores = at::empty(
        {params.deterministic ? params.batch * int64_t{params.nheads_q} * geometry.semaphores_per_head
                              : 0},
        device_options.dtype(at::kInt));

    if (params.learnable_sink != nullptr && params.cu_seqlens_q != nullptr) {
      softmax_d.zero_();
      lse_log2.zero_();
    }

    AttentionBwdParams p = params;
    p.dq_accum = dq_accum.data_ptr<float>();
    p.softmax_d = softmax_d.data_ptr<float>();
    p.lse_log2 = lse_log2.data_ptr<float>();
    p.dq_semaphore = params.deterministic ? semaphores.data_ptr<int>() : nullptr;
    p.seqlen_q_rounded = static_cast<int>(geometry.seqlen_q_rounded);
    p.head_dim_rounded = static_cast<int>(geometry.head_dim_rounded);
    p.workspace_batch_stride = geometry.batch_stride;
    p.workspace_head_stride = geometry.head_stride;
    p.workspace_rows = geometry.workspace_rows;
    const cudaError_t status = dispatch_score_mod(backward_score_mod(p), [&](auto mod) {
      return p.is_bf16 ? launch_attention_backward<__nv_bfloat16, W, mod()>(p, limits, stream)
                       : launch_attention_backward<__half, W, mod()>(p, limits, stream);
    });
    if (status == cudaSuccess && params.learnable_sink != nullptr)
      sink_gradient_from_workspaces(p, lse_log2, softmax_d, *opts.learnable_sink, opts.layout.cu_seqlens_q, dsink);
    return status;
  }
};

}  // namespace

BackwardGradients attention_backward_cuda(FLASHATTN_BACKWARD_ARGS) {
  const AttentionOptions opts{softmax_scale, causal,       window_left, window_right,
                              softcap,       alibi_slopes, dropout_p,   rng_state,
                              SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, learnable_sink};
  check_backward_inputs(dout, q, k, v, out, lse, opts, cuda_features());
  check_cuda_device(q);
  const c10::cuda::CUDAGuard device_guard(q.device());

  if (host_value_checks_enabled())
    check_sequence_values(q, k, opts);
  auto [dq, dk, dv, dsink] = allocate_backward_outputs(q, k, v, opts);
  if (is_empty_problem(q, k, opts)) {
    // No query, or no key: every gradient is an empty sum.
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dsink};
  }

  // Named, so that any copies outlive the kernels that read them.
  const at::Tensor dout_16 = with_16_byte_rows(dout), q_16 = with_16_byte_rows(q),
                   k_16 = with_16_byte_rows(k), v_16 = with_16_byte_rows(v),
                   out_16 = with_16_byte_rows(out), lse_c = lse.contiguous();
  AttentionBwdParams params =
      make_backward_params(dout_16, q_16, k_16, v_16, out_16, lse_c, dq, dk, dv, opts);
  // torch.use_deterministic_algorithms(True) asks every op for a reproducible result.
  params.deterministic = deterministic || at::globalContext().deterministicAlgorithms();
  const BackwardLauncher launcher{params, q.options(), device_limits(q),
                                  c10::cuda::getCurrentCUDAStream().stream(), opts, dsink};
  // A variable-length k whose sequences are all empty (max_seqlen_k = 0) launches no key
  // block: its gradient rows are zero.
  if (params.seqlen_k == 0) {
    dk.zero_();
    dv.zero_();
  }
  cudaError_t status = cudaSuccess;
  if (!dispatch_head_dim_tile(params.head_dim, launcher, &status))
    fail_head_dim_not_compiled(params.head_dim);
  check_cuda_status(status, "the backward kernel launch");
  return {dq, dk, dv, dsink};
}

}  // namespace flashattn
