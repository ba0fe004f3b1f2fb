// The checks of single arguments that every op's argument checking shares
// (attention_api.cpp, kvcache_api.cpp), so that an argument fails with the same
// message, "flashattn_ext: <argument> ... got ..., expected ...", whichever op it went to.
//
// Shapes and strides are read as SymInts, so that these checks also run in the Meta
// kernels (csrc/meta/) on the symbolic shapes of torch.compile; there each comparison
// becomes a guard, as a Python `if` on a SymInt would.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

namespace flashattn {

inline bool holds(const c10::SymBool& condition) { return condition.guard_bool(__FILE__, __LINE__); }

inline void check_size(const at::Tensor& t, const char* name, int64_t dim, const char* dim_name,
                       const c10::SymInt& expected, const char* expected_from) {
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  TORCH_CHECK(holds(t.sym_size(d) == expected), "flashattn_ext: ", name, " ", dim_name, " (dim ", d,
              ") must match ", expected_from, ": got ", t.sym_size(d), ", expected ", expected);
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), "flashattn_ext: ", name,
              " must be on the same device as q: got ", t.device(), ", expected ", q.device());
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flashattn_ext: ", name,
              " must have the same dtype as q: got ", t.scalar_type(), ", expected ",
              q.scalar_type());
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  // An empty tensor has no element to address, whatever its strides (autograd
  // hands the backward an expanded, stride-0 gradient of an empty output).
  TORCH_CHECK(holds(t.sym_numel() == 0) || holds(t.sym_size(-1) <= 1) || holds(t.sym_stride(-1) == 1),
              "flashattn_ext: ", name, " must be contiguous in its last dimension (head_dim): got stride ",
              t.sym_stride(-1), ", expected 1");
}

// A per-sequence int32 vector (cu_seqlens: batch + 1; seqused, cache_seqlens, ...: batch),
// 1-d, contiguous, on q's device; absent is fine.
inline void check_sequence_tensor(const std::optional<at::Tensor>& t, const char* name,
                                  const c10::SymInt& expected_len, const char* expected_from, const at::Tensor& q) {
  if (!t.has_value()) return;
  check_same_device(*t, name, q);
  TORCH_CHECK(t->scalar_type() == at::kInt, "flashattn_ext: ", name, " must be int32, got ",
              t->scalar_type());
  TORCH_CHECK(t->dim() == 1, "flashattn_ext: ", name, " must have 1 dimension, got shape ",
              t->sym_sizes());
  TORCH_CHECK(holds(t->sym_size(0) == expected_len), "flashattn_ext: ", name, " must have ", expected_from,
              " = ", expected_len, " elements, got ", t->sym_size(0));
  TORCH_CHECK(holds(t->sym_size(0) <= 1) || holds(t->sym_stride(0) == 1), "flashattn_ext: ", name,
              " must be contiguous: got stride ", t->sym_stride(0), ", expected 1");
}

// alibi_slopes: fp32 (nheads,) or (batch, nheads), on q's device, unit-stride rows.
inline void check_alibi_slopes(const at::Tensor& s, const at::Tensor& q, const c10::SymInt& batch,
                               const c10::SymInt& nheads) {
  check_same_device(s, "alibi_slopes", q);
  TORCH_CHECK(s.scalar_type() == at::kFloat, "flashattn_ext: alibi_slopes must be float32, got ",
              s.scalar_type());
  const bool per_head = s.dim() == 1 && holds(s.sym_size(0) == nheads);
  const bool per_batch_head = s.dim() == 2 && holds(s.sym_size(0) == batch) && holds(s.sym_size(1) == nheads);
  TORCH_CHECK(per_head || per_batch_head, "flashattn_ext: alibi_slopes must have shape (nheads,) = (",
              nheads, ",) or (batch, nheads) = (", batch, ", ", nheads, "), got ", s.sym_sizes());
  TORCH_CHECK(holds(s.sym_stride(-1) == 1), "flashattn_ext: alibi_slopes must be contiguous in its last "
              "dimension: got stride ", s.sym_stride(-1), ", expected 1");
}

// learnable_sink: fp32 (nheads,), contiguous, on q's device.
inline void check_learnable_sink(const at::Tensor& sink, const at::Tensor& q, const c10::SymInt& nheads) {
  check_same_device(sink, "learnable_sink", q);
  TORCH_CHECK(sink.scalar_type() == at::kFloat, "flashattn_ext: learnable_sink must be float32, got ",
              sink.scalar_type());
  TORCH_CHECK(sink.dim() == 1 && holds(sink.sym_size(0) == nheads), "flashattn_ext: learnable_sink must have shape "
              "(nheads,) = (", nheads, ",), got ", sink.sym_sizes());
  TORCH_CHECK(holds(sink.sym_size(0) <= 1) || holds(sink.sym_stride(0) == 1), "flashattn_ext: learnable_sink must be "
              "contiguous: got stride ", sink.sym_stride(0), ", expected 1");
}

}  // namespace flashattn
