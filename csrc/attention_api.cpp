#include "attention_api.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace flashattn {
namespace {

// Layout named in every shape message, so the user sees which axis is which.
constexpr const char* kLayout = "(batch, seqlen, nheads, head_dim)";

void check_rank4(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "flashattn_ext: ", name, " must have 4 dimensions ", kLayout,
              ", got ", t.dim(), " dimensions with shape ", t.sizes());
}

void check_size(const at::Tensor& t, const char* name, int64_t dim, const char* dim_name,
                int64_t expected, const char* expected_from) {
  TORCH_CHECK(t.size(dim) == expected, "flashattn_ext: ", name, " ", dim_name, " (dim ", dim,
              ") must match ", expected_from, ": got ", t.size(dim), ", expected ", expected);
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), "flashattn_ext: ", name,
              " must be on the same device as q: got ", t.device(), ", expected ", q.device());
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flashattn_ext: ", name,
              " must have the same dtype as q: got ", t.scalar_type(), ", expected ",
              q.scalar_type());
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  // An empty tensor has no element to address, whatever its strides (autograd
  // hands the backward an expanded, stride-0 gradient of an empty output).
  TORCH_CHECK(t.numel() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, "flashattn_ext: ", name,
              " must be contiguous in its last dimension (head_dim): got stride ", t.stride(-1),
              ", expected 1");
}

void check_options(const AttentionOptions& opts, const at::Tensor& q, const at::Tensor& k,
                   const BackendFeatures& backend) {
  TORCH_CHECK(std::isfinite(opts.softmax_scale), "flashattn_ext: softmax_scale must be finite, got ",
              opts.softmax_scale);
  TORCH_CHECK(opts.dropout_p >= 0.0 && opts.dropout_p < 1.0,
              "flashattn_ext: dropout_p must be in [0, 1), got ", opts.dropout_p);
  TORCH_CHECK(std::isfinite(opts.softcap) && opts.softcap >= 0.0,
              "flashattn_ext: softcap must be finite and >= 0 (0 turns it off), got ", opts.softcap);
  TORCH_CHECK_NOT_IMPLEMENTED(opts.dropout_p == 0.0 || backend.dropout,
                              "flashattn_ext: dropout_p > 0 is not implemented on ", backend.name,
                              " yet (got dropout_p=", opts.dropout_p, ")");
  TORCH_CHECK_NOT_IMPLEMENTED(opts.softcap == 0.0 || backend.softcap,
                              "flashattn_ext: softcap is not implemented on ", backend.name,
                              " yet (got softcap=", opts.softcap, ")");
  if (opts.alibi_slopes.has_value()) {
    TORCH_CHECK_NOT_IMPLEMENTED(backend.alibi, "flashattn_ext: alibi_slopes is not implemented on ",
                                backend.name, " yet");
    const at::Tensor& s = *opts.alibi_slopes;
    check_same_device(s, "alibi_slopes", q);
    TORCH_CHECK(s.scalar_type() == at::kFloat, "flashattn_ext: alibi_slopes must be float32, got ",
                s.scalar_type());
    const int64_t b = q.size(0), h = q.size(2);
    const bool per_head = s.dim() == 1 && s.size(0) == h;
    const bool per_batch_head = s.dim() == 2 && s.size(0) == b && s.size(1) == h;
    TORCH_CHECK(per_head || per_batch_head, "flashattn_ext: alibi_slopes must have shape (nheads,) = (",
                h, ",) or (batch, nheads) = (", b, ", ", h, "), got ", s.sizes());
    TORCH_CHECK(s.stride(-1) == 1, "flashattn_ext: alibi_slopes must be contiguous in its last "
                "dimension: got stride ", s.stride(-1), ", expected 1");
  }
  if (opts.dropout_p > 0.0) {
    TORCH_CHECK(opts.rng_state.has_value(), "flashattn_ext: rng_state (int64 [seed, offset]) is "
                "required when dropout_p > 0");
    const at::Tensor& r = *opts.rng_state;
    TORCH_CHECK(r.scalar_type() == at::kLong && r.numel() == 2,
                "flashattn_ext: rng_state must be an int64 tensor of 2 elements [seed, offset], got ",
                r.scalar_type(), " of shape ", r.sizes());
  }
  (void)k;
}

}  // namespace

void check_forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& opts, const BackendFeatures& backend) {
  check_rank4(q, "q");
  check_rank4(k, "k");
  check_rank4(v, "v");
  check_same_device(k, "k", q);
  check_same_device(v, "v", q);
  check_same_dtype(k, "k", q);
  check_same_dtype(v, "v", q);
  TORCH_CHECK(backend.dtype_supported(q.scalar_type()), "flashattn_ext: dtype ", q.scalar_type(),
              " is not supported on ", backend.name, " (q, k and v must share a supported dtype)");

  const int64_t batch = q.size(0), head_dim = q.size(3);
  check_size(k, "k", 0, "batch size", batch, "q");
  check_size(v, "v", 0, "batch size", batch, "q");
  check_size(v, "v", 1, "seqlen", k.size(1), "k");
  check_size(v, "v", 2, "nheads", k.size(2), "k");
  check_size(k, "k", 3, "head_dim", head_dim, "q");
  check_size(v, "v", 3, "head_dim", head_dim, "q");
  TORCH_CHECK(head_dim <= kMaxHeadDim, "flashattn_ext: head_dim (q dim 3) must be at most ",
              kMaxHeadDim, ", got ", head_dim);
  TORCH_CHECK(head_dim % kHeadDimAlignment == 0, "flashattn_ext: head_dim (q dim 3) must be a "
              "multiple of ", kHeadDimAlignment, " (flash_attn_func pads it), got ", head_dim);
  TORCH_CHECK(k.size(2) > 0 || q.size(2) == 0, "flashattn_ext: k nheads (dim 2) must be positive "
              "when q has heads, got 0");
  TORCH_CHECK(k.size(2) == 0 || q.size(2) % k.size(2) == 0,
              "flashattn_ext: q nheads (dim 2) must be a multiple of k nheads (dim 2): got ",
              q.size(2), " and ", k.size(2));
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  check_options(opts, q, k, backend);
}

void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const AttentionOptions& opts, const BackendFeatures& backend) {
  check_forward_inputs(q, k, v, opts, backend);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{dout, "dout"},
                                std::pair<const at::Tensor&, const char*>{out, "out"}}) {
    check_rank4(t, name);
    check_same_device(t, name, q);
    check_same_dtype(t, name, q);
    TORCH_CHECK(t.sizes() == q.sizes(), "flashattn_ext: ", name, " must have the shape of q: got ",
                t.sizes(), ", expected ", q.sizes());
    check_last_dim_contiguous(t, name);
  }
  check_same_device(lse, "lse", q);
  TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()), "flashattn_ext: lse must be ",
              q.scalar_type() == at::kDouble ? "float64" : "float32",
              " (float64 for float64 inputs, else float32), got ", lse.scalar_type());
  const std::vector<int64_t> lse_shape{q.size(0), q.size(2), q.size(1)};
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(lse_shape), "flashattn_ext: lse must have shape "
              "(batch, nheads, seqlen_q) = ", at::IntArrayRef(lse_shape), ", got ", lse.sizes());
}

std::pair<int, int> effective_window(const AttentionOptions& opts, int64_t seqlen_q,
                                     int64_t seqlen_k) {
  // Bounds that reach past every key are the same as no bound; clamping keeps
  // the kernels' int arithmetic far from overflow.
  const int64_t far = seqlen_q + seqlen_k;
  int64_t left = opts.window_left < 0 || opts.window_left >= far ? -1 : opts.window_left;
  int64_t right = opts.causal ? 0 : opts.window_right;
  if (right < 0 || right >= far) right = -1;
  return {static_cast<int>(left), static_cast<int>(right)};
}

std::tuple<at::Tensor, at::Tensor> allocate_forward_outputs(const at::Tensor& q) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(lse_dtype(q.scalar_type())));
  return {out, lse};
}

bool is_empty_problem(const at::Tensor& q, const at::Tensor& k) {
  return q.numel() == 0 || k.size(1) == 0;
}

namespace {
TensorStrides strides_of(const at::Tensor& t) {
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}
}  // namespace

AttentionFwdParams make_forward_params(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out,
                                       const at::Tensor& lse, const AttentionOptions& opts) {
  AttentionFwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_strides = strides_of(q);
  p.k_strides = strides_of(k);
  p.v_strides = strides_of(v);
  p.out_strides = strides_of(out);
  TORCH_CHECK(q.size(1) <= std::numeric_limits<int>::max() &&
                  k.size(1) <= std::numeric_limits<int>::max() &&
                  q.size(0) * q.size(2) <= std::numeric_limits<int>::max(),
              "flashattn_ext: batch * nheads and the seqlens must each fit in int32, got q shape ",
              q.sizes(), " and k shape ", k.sizes());
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.nheads_q = static_cast<int>(q.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.seqlen_k = static_cast<int>(k.size(1));
  p.nheads_kv = static_cast<int>(k.size(2));
  p.softmax_scale = static_cast<float>(opts.softmax_scale);
  p.softmax_scale_log2 = static_cast<float>(opts.softmax_scale * M_LOG2E);
  std::tie(p.window_left, p.window_right) = effective_window(opts, q.size(1), k.size(1));
  p.softcap = static_cast<float>(opts.softcap);
  if (opts.alibi_slopes.has_value()) {
    p.alibi_slopes = opts.alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = opts.alibi_slopes->dim() == 2 ? opts.alibi_slopes->stride(0) : 0;
  }
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
  return p;
}

AttentionBwdParams make_backward_params(const at::Tensor& dout, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& out, const at::Tensor& lse,
                                        const at::Tensor& dq, const at::Tensor& dk,
                                        const at::Tensor& dv, const AttentionOptions& opts) {
  AttentionBwdParams p{};
  static_cast<AttentionFwdParams&>(p) = make_forward_params(q, k, v, out, lse, opts);
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dout_strides = strides_of(dout);
  p.dq_strides = strides_of(dq);
  p.dk_strides = strides_of(dk);
  p.dv_strides = strides_of(dv);
  return p;
}

}  // namespace flashattn
