#include "attention_api.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "argument_checks.h"
#include "common/philox.h"

namespace flashattn {
namespace {

// Layouts named in every shape message, so the user sees which axis is which.
constexpr const char* kDenseLayout = "(batch, seqlen, nheads, head_dim)";
constexpr const char* kVarlenLayout = "(total, nheads, head_dim)";

// q, k, v, out and dout: 4-d dense, 3-d when that side is variable-length (cu_seqlens given).
void check_rank(const at::Tensor& t, const char* name, bool varlen) {
  const int64_t rank = varlen ? 3 : 4;
  TORCH_CHECK(t.dim() == rank, "flashattn_ext: ", name, " must have ", rank, " dimensions ",
              varlen ? kVarlenLayout : kDenseLayout,
              varlen ? " (cu_seqlens given)" : " (no cu_seqlens given)", ", got ", t.dim(),
              " dimensions with shape ", t.sym_sizes());
}

c10::SymInt batch_of(const at::Tensor& t, const std::optional<at::Tensor>& cu_seqlens) {
  return cu_seqlens.has_value() ? cu_seqlens->sym_size(0) - 1 : t.sym_size(0);
}

void check_sequence_layout(const at::Tensor& q, const at::Tensor& k, const SequenceLayout& layout) {
  for (const auto& [cu, name] : {std::pair{&layout.cu_seqlens_q, "cu_seqlens_q"},
                                 std::pair{&layout.cu_seqlens_k, "cu_seqlens_k"}})
    if (cu->has_value())
      TORCH_CHECK((*cu)->dim() == 1 && holds((*cu)->sym_size(0) >= 1), "flashattn_ext: ", name,
                  " must be 1-d with batch + 1 >= 1 elements, got shape ", (*cu)->sym_sizes());
  const c10::SymInt batch = batch_of(q, layout.cu_seqlens_q);
  if (layout.varlen_q()) {
    check_sequence_tensor(layout.cu_seqlens_q, "cu_seqlens_q", batch + 1, "batch + 1", q);
    TORCH_CHECK(layout.max_seqlen_q >= 0, "flashattn_ext: max_seqlen_q must be given (>= 0) "
                "with cu_seqlens_q, got ", layout.max_seqlen_q);
  } else {
    TORCH_CHECK(layout.max_seqlen_q == -1 || holds(q.sym_size(1) == layout.max_seqlen_q), "flashattn_ext: "
                "max_seqlen_q without cu_seqlens_q must be -1 or q's seqlen (dim 1) = ", q.sym_size(1),
                ", got ", layout.max_seqlen_q);
  }
  if (layout.varlen_k()) {
    check_sequence_tensor(layout.cu_seqlens_k, "cu_seqlens_k", batch + 1,
                          layout.varlen_q() ? "the length of cu_seqlens_q" : "q's batch + 1", q);
    TORCH_CHECK(layout.max_seqlen_k >= 0, "flashattn_ext: max_seqlen_k must be given (>= 0) "
                "with cu_seqlens_k, got ", layout.max_seqlen_k);
  } else {
    TORCH_CHECK(holds(k.sym_size(0) == batch), "flashattn_ext: k batch size (dim 0) must match ",
                layout.varlen_q() ? "cu_seqlens_q's length - 1" : "q", ": got ", k.sym_size(0),
                ", expected ", batch);
    TORCH_CHECK(layout.max_seqlen_k == -1 || holds(k.sym_size(1) == layout.max_seqlen_k), "flashattn_ext: "
                "max_seqlen_k without cu_seqlens_k must be -1 or k's seqlen (dim 1) = ", k.sym_size(1),
                ", got ", layout.max_seqlen_k);
  }
  check_sequence_tensor(layout.seqused_q, "seqused_q", batch, "batch", q);
  check_sequence_tensor(layout.seqused_k, "seqused_k", batch, "batch", q);
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
  TORCH_CHECK_NOT_IMPLEMENTED(!opts.learnable_sink.has_value() || backend.learnable_sink,
                              "flashattn_ext: learnable_sink is not implemented on ", backend.name,
                              " yet");
  TORCH_CHECK_NOT_IMPLEMENTED(opts.softcap == 0.0 || backend.softcap,
                              "flashattn_ext: softcap is not implemented on ", backend.name,
                              " yet (got softcap=", opts.softcap, ")");
  if (opts.alibi_slopes.has_value()) {
    TORCH_CHECK_NOT_IMPLEMENTED(backend.alibi, "flashattn_ext: alibi_slopes is not implemented on ",
                                backend.name, " yet");
    check_alibi_slopes(*opts.alibi_slopes, q, batch_of(q, opts.layout.cu_seqlens_q), q.sym_size(-2));
  }
  if (opts.learnable_sink.has_value()) check_learnable_sink(*opts.learnable_sink, q, q.sym_size(-2));
  if (opts.dropout_p > 0.0) {
    TORCH_CHECK(opts.rng_state.has_value(), "flashattn_ext: rng_state (int64 [seed, offset]) is "
                "required when dropout_p > 0");
    const at::Tensor& r = *opts.rng_state;
    TORCH_CHECK(r.scalar_type() == at::kLong && holds(r.sym_numel() == 2),
                "flashattn_ext: rng_state must be an int64 tensor of 2 elements [seed, offset], got ",
                r.scalar_type(), " of shape ", r.sym_sizes());
    // The CUDA kernels read it where they run (the CPU backend copies it).
    TORCH_CHECK(!q.is_cuda() || (r.device() == q.device() && r.is_contiguous()),
                "flashattn_ext: rng_state must be contiguous and on q's device (", q.device(), "), got ",
                r.is_contiguous() ? "" : "a non-contiguous tensor ", "on ", r.device());
  }
  (void)k;
}

std::vector<c10::SymInt> lse_shape_of(const at::Tensor& q, const SequenceLayout& layout) {
  if (layout.varlen_q()) return {q.sym_size(1), q.sym_size(0)};
  return {q.sym_size(0), q.sym_size(2), q.sym_size(1)};
}

bool same_shape(const at::Tensor& t, c10::SymIntArrayRef shape) {
  if (t.dim() != static_cast<int64_t>(shape.size())) return false;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (!holds(t.sym_size(d) == shape[d])) return false;
  return true;
}

}  // namespace

void check_forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& opts, const BackendFeatures& backend) {
  const SequenceLayout& layout = opts.layout;
  check_rank(q, "q", layout.varlen_q());
  check_rank(k, "k", layout.varlen_k());
  check_rank(v, "v", layout.varlen_k());
  check_same_device(k, "k", q);
  check_same_device(v, "v", q);
  check_same_dtype(k, "k", q);
  check_same_dtype(v, "v", q);
  TORCH_CHECK(backend.dtype_supported(q.scalar_type()), "flashattn_ext: dtype ", q.scalar_type(),
              " is not supported on ", backend.name, " (q, k and v must share a supported dtype)");

  const c10::SymInt head_dim = q.sym_size(-1);
  if (!layout.varlen_k()) check_size(v, "v", 0, "batch size", k.sym_size(0), "k");
  check_size(v, "v", -3, layout.varlen_k() ? "total rows" : "seqlen", k.sym_size(-3), "k");
  check_size(v, "v", -2, "nheads", k.sym_size(-2), "k");
  check_size(k, "k", -1, "head_dim", head_dim, "q");
  check_size(v, "v", -1, "head_dim", head_dim, "q");
  check_heads(q, k, "k", " (flash_attn_func pads it)");
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  check_sequence_layout(q, k, layout);
  check_options(opts, q, k, backend);
}

void check_heads(const at::Tensor& q, const at::Tensor& k, const char* k_name, const char* alignment_note) {
  const c10::SymInt head_dim = q.sym_size(-1);
  TORCH_CHECK(holds(head_dim <= kMaxHeadDim), "flashattn_ext: head_dim (q's last dim) must be at most ",
              kMaxHeadDim, ", got ", head_dim);
  TORCH_CHECK(holds(head_dim % kHeadDimAlignment == 0), "flashattn_ext: head_dim (q's last dim) must be a "
              "multiple of ", kHeadDimAlignment, alignment_note, ", got ", head_dim);
  const c10::SymInt nheads_q = q.sym_size(-2), nheads_kv = k.sym_size(-2);
  TORCH_CHECK(holds(nheads_kv > 0) || holds(nheads_q == 0), "flashattn_ext: ", k_name, " nheads (dim ",
              k.dim() - 2, ") must be positive when q has heads, got 0");
  TORCH_CHECK(holds(nheads_kv == 0) || holds(nheads_q % nheads_kv == 0), "flashattn_ext: q nheads (dim ",
              q.dim() - 2, ") must be a multiple of ", k_name, " nheads (dim ", k.dim() - 2, "): got ",
              nheads_q, " and ", nheads_kv);
}

void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const AttentionOptions& opts, const BackendFeatures& backend) {
  check_forward_inputs(q, k, v, opts, backend);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{dout, "dout"},
                                std::pair<const at::Tensor&, const char*>{out, "out"}}) {
    check_rank(t, name, opts.layout.varlen_q());
    check_same_device(t, name, q);
    check_same_dtype(t, name, q);
    TORCH_CHECK(same_shape(t, q.sym_sizes()), "flashattn_ext: ", name, " must have the shape of q: got ",
                t.sym_sizes(), ", expected ", q.sym_sizes());
    check_last_dim_contiguous(t, name);
  }
  check_lse(lse, q, opts);
}

void check_lse(const at::Tensor& lse, const at::Tensor& q, const AttentionOptions& opts) {
  check_same_device(lse, "lse", q);
  TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()), "flashattn_ext: lse must be ",
              q.scalar_type() == at::kDouble ? "float64" : "float32",
              " (float64 for float64 inputs, else float32), got ", lse.scalar_type());
  const std::vector<c10::SymInt> lse_shape = lse_shape_of(q, opts.layout);
  TORCH_CHECK(same_shape(lse, lse_shape), "flashattn_ext: lse must have shape ",
              opts.layout.varlen_q() ? "(nheads, total_q) = " : "(batch, nheads, seqlen_q) = ",
              c10::SymIntArrayRef(lse_shape), ", got ", lse.sym_sizes());
}

void check_probabilities_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                const AttentionOptions& opts, const BackendFeatures& backend) {
  check_forward_inputs(q, k, k, opts, backend);  // v's checks are k's
  check_lse(lse, q, opts);
}

at::Tensor allocate_probabilities(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts) {
  const SequenceLayout& layout = opts.layout;
  const auto rounded = [](const c10::SymInt& n) { return (n + 127) / 128 * 128; };
  const c10::SymInt seqlen_q = layout.varlen_q() ? c10::SymInt(layout.max_seqlen_q) : q.sym_size(1);
  const c10::SymInt seqlen_k = layout.varlen_k() ? c10::SymInt(layout.max_seqlen_k) : k.sym_size(1);
  return at::zeros_symint({batch_of(q, layout.cu_seqlens_q), q.sym_size(-2), rounded(seqlen_q), rounded(seqlen_k)},
                          q.options());
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

std::tuple<at::Tensor, at::Tensor> allocate_forward_outputs(const at::Tensor& q,
                                                            const AttentionOptions& opts) {
  const at::TensorOptions lse_options = q.options().dtype(lse_dtype(q.scalar_type()));
  if (opts.layout.seqused_q.has_value())
    return {at::zeros_symint(q.sym_sizes(), q.options()),
            at::full_symint(lse_shape_of(q, opts.layout), std::numeric_limits<double>::infinity(), lse_options)};
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(lse_shape_of(q, opts.layout), lse_options)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_backward_outputs(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& opts) {
  const auto make = [](const at::Tensor& t, bool zeroed) {
    return zeroed ? at::zeros_symint(t.sym_sizes(), t.options()) : at::empty_symint(t.sym_sizes(), t.options());
  };
  const bool keys_unused = opts.layout.seqused_k.has_value();
  const c10::SymInt sink_heads = opts.learnable_sink ? q.sym_size(-2) : c10::SymInt(0);
  const at::Tensor dsink = at::zeros_symint({batch_of(q, opts.layout.cu_seqlens_q), sink_heads},
                                            q.options().dtype(at::kFloat));
  return {make(q, opts.layout.seqused_q.has_value()), make(k, keys_unused), make(v, keys_unused), dsink};
}

ProblemSizes problem_sizes(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts) {
  const SequenceLayout& layout = opts.layout;
  ProblemSizes s{};
  s.batch = batch_of(q, layout.cu_seqlens_q).expect_int();
  s.nheads_q = q.size(-2);
  s.nheads_kv = k.size(-2);
  s.head_dim = q.size(-1);
  s.rows_q = q.size(-3);
  s.rows_k = k.size(-3);
  s.seqlen_q = layout.varlen_q() ? layout.max_seqlen_q : s.rows_q;
  s.seqlen_k = layout.varlen_k() ? layout.max_seqlen_k : s.rows_k;
  return s;
}

void check_sequence_values(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts) {
  const SequenceLayout& layout = opts.layout;
  std::vector<at::Tensor> parts;
  for (const auto* t : {&layout.cu_seqlens_q, &layout.cu_seqlens_k, &layout.seqused_q, &layout.seqused_k})
    if (t->has_value()) parts.push_back(**t);
  if (parts.empty()) return;
  // One copy (one synchronisation) for all of them.
  const at::Tensor host = at::cat(parts).to(at::kCPU, at::kLong);
  const int64_t* values = host.data_ptr<int64_t>();
  const ProblemSizes sizes = problem_sizes(q, k, opts);
  const int64_t batch = sizes.batch;

  // Sequence lengths per side: from cu_seqlens (checked here) or the dense seqlen.
  std::vector<int64_t> lengths[2];
  const auto read_cu = [&](const char* name, int64_t rows, int64_t max_seqlen, const char* max_name,
                           const char* tensor, std::vector<int64_t>& len) {
    TORCH_CHECK(values[0] == 0, "flashattn_ext: ", name, "[0] must be 0, got ", values[0]);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t n = values[b + 1] - values[b];
      TORCH_CHECK(n >= 0, "flashattn_ext: ", name, " must be non-decreasing: got ", name, "[", b + 1,
                  "] = ", values[b + 1], " < ", name, "[", b, "] = ", values[b]);
      TORCH_CHECK(n <= max_seqlen, "flashattn_ext: sequence ", b, " of ", name, " has ", n,
                  " rows, more than ", max_name, " = ", max_seqlen);
      len.push_back(n);
    }
    TORCH_CHECK(values[batch] == rows, "flashattn_ext: ", name, "[-1] (the total rows) must equal ",
                tensor, "'s dim 0: got ", values[batch], ", expected ", rows);
    values += batch + 1;
  };
  if (layout.varlen_q())
    read_cu("cu_seqlens_q", sizes.rows_q, layout.max_seqlen_q, "max_seqlen_q", "q", lengths[0]);
  else
    lengths[0].assign(batch, sizes.rows_q);
  if (layout.varlen_k())
    read_cu("cu_seqlens_k", sizes.rows_k, layout.max_seqlen_k, "max_seqlen_k", "k", lengths[1]);
  else
    lengths[1].assign(batch, sizes.rows_k);
  const char* used_names[2] = {"seqused_q", "seqused_k"};
  const bool used[2] = {layout.seqused_q.has_value(), layout.seqused_k.has_value()};
  for (int side = 0; side < 2; ++side) {
    if (!used[side]) continue;
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(values[b] >= 0 && values[b] <= lengths[side][b], "flashattn_ext: ", used_names[side],
                  "[", b, "] must be in [0, ", lengths[side][b], "] (the rows of sequence ", b, "), got ",
                  values[b]);
    values += batch;
  }
}

bool is_empty_problem(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts) {
  return q.numel() == 0 || ((k.size(-3) == 0 || k.size(-2) == 0) && !opts.learnable_sink.has_value());
}

TensorStrides strides_of(const at::Tensor& t) {
  if (t.dim() == 3) return TensorStrides{0, t.stride(0), t.stride(1)};
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

namespace {

const int* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<int>() : nullptr;
}
}  // namespace

void set_alibi_slopes(AttentionFwdParams& p, const std::optional<at::Tensor>& alibi_slopes) {
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.alibi_batch_stride = alibi_slopes.has_value() && alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
}

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
  const ProblemSizes sizes = problem_sizes(q, k, opts);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(sizes.rows_q <= kIntMax && sizes.rows_k <= kIntMax && sizes.batch * sizes.nheads_q <= kIntMax,
              "flashattn_ext: batch * nheads and the rows of q and k must each fit in int32, got q shape ",
              q.sizes(), " and k shape ", k.sizes());
  p.batch = static_cast<int>(sizes.batch);
  p.nheads_q = static_cast<int>(sizes.nheads_q);
  p.nheads_kv = static_cast<int>(sizes.nheads_kv);
  p.head_dim = static_cast<int>(sizes.head_dim);
  p.seqlen_q = static_cast<int>(std::min(sizes.seqlen_q, sizes.rows_q));
  p.seqlen_k = static_cast<int>(std::min(sizes.seqlen_k, sizes.rows_k));
  p.rows_q = static_cast<int>(sizes.rows_q);
  p.rows_k = static_cast<int>(sizes.rows_k);
  p.cu_seqlens_q = data_or_null(opts.layout.cu_seqlens_q);
  p.cu_seqlens_k = data_or_null(opts.layout.cu_seqlens_k);
  p.seqused_q = data_or_null(opts.layout.seqused_q);
  p.seqused_k = data_or_null(opts.layout.seqused_k);
  // lse (batch, nheads, seqlen_q) dense, (nheads, total_q) variable-length.
  p.lse_strides = opts.layout.varlen_q() ? TensorStrides{0, 1, lse.stride(0)}
                                         : TensorStrides{lse.stride(0), 1, lse.stride(1)};
  p.softmax_scale = static_cast<float>(opts.softmax_scale);
  p.softmax_scale_log2 = static_cast<float>(opts.softmax_scale * M_LOG2E);
  std::tie(p.window_left, p.window_right) = effective_window(opts, p.seqlen_q, p.seqlen_k);
  p.softcap = static_cast<float>(opts.softcap);
  set_alibi_slopes(p, opts.alibi_slopes);
  if (opts.learnable_sink.has_value()) p.learnable_sink = opts.learnable_sink->data_ptr<float>();
  if (opts.dropout_p > 0.0) {
    p.rng_state = opts.rng_state->data_ptr<int64_t>();
    p.dropout_threshold = dropout_threshold(opts.dropout_p);
    p.dropout_scale = static_cast<float>(1.0 / (1.0 - opts.dropout_p));
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
