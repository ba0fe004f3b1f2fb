#include "kvcache_api.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "argument_checks.h"

namespace flashattn {
namespace {

// Rows of a paged cache's blocks must be a multiple of this (flash-attn's rule: the
// CUDA kernels load key tiles of 16 rows that never straddle two blocks).
constexpr int64_t kPageSizeAlignment = 16;

constexpr const char* kQueryLayout = "(batch, seqlen_q, nheads, head_dim)";
constexpr const char* kDenseCacheLayout = "(batch_cache, seqlen_cache, nheads_kv, head_dim)";
constexpr const char* kPagedCacheLayout = "(num_blocks, page_size, nheads_kv, head_dim) (block_table given)";
constexpr const char* kNewLayout = "(batch, seqlen_new, nheads_kv, head_dim)";

void check_rank4(const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == 4, "flashattn_ext: ", name, " must have 4 dimensions ", layout, ", got ",
              t.dim(), " dimensions with shape ", t.sym_sizes());
}

void check_new_keys(const at::Tensor& q, const at::Tensor& k_cache, const KvcacheOptions& opts) {
  TORCH_CHECK(opts.k_new.has_value() == opts.v_new.has_value(),
              "flashattn_ext: k_new and v_new (flash_attn_with_kvcache's k and v) must be given together: got ",
              opts.k_new ? "k_new" : "v_new", " alone");
  if (!opts.appends()) return;
  TORCH_CHECK(opts.cache_seqlens.has_value(), "flashattn_ext: k_new and v_new need cache_seqlens "
              "(where in each cache row the new rows go), got cache_seqlens=None");
  const at::Tensor& k_new = *opts.k_new;
  const at::Tensor& v_new = *opts.v_new;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_new, "k_new"},
                                std::pair<const at::Tensor&, const char*>{v_new, "v_new"}}) {
    check_rank4(t, name, kNewLayout);
    check_same_device(t, name, q);
    check_same_dtype(t, name, q);
    check_size(t, name, 0, "batch size", q.sym_size(0), "q");
    check_size(t, name, 2, "nheads", k_cache.sym_size(2), "k_cache");
    check_size(t, name, 3, "head_dim", q.sym_size(3), "q");
    check_last_dim_contiguous(t, name);
  }
  check_size(v_new, "v_new", 1, "seqlen_new", k_new.sym_size(1), "k_new");
}

void check_cache_layout(const at::Tensor& q, const at::Tensor& k_cache, const KvcacheOptions& opts) {
  const c10::SymInt batch = q.sym_size(0);
  check_sequence_tensor(opts.cache_seqlens, "cache_seqlens", batch, "batch", q);
  check_sequence_tensor(opts.cache_batch_idx, "cache_batch_idx", batch, "batch", q);
  check_sequence_tensor(opts.cache_leftpad, "cache_leftpad", batch, "batch", q);
  if (opts.paged()) {
    TORCH_CHECK(!opts.cache_batch_idx.has_value(), "flashattn_ext: cache_batch_idx cannot be combined with "
                "block_table (block_table[b] already names the blocks of sequence b), got both");
    const at::Tensor& table = *opts.block_table;
    check_same_device(table, "block_table", q);
    TORCH_CHECK(table.scalar_type() == at::kInt, "flashattn_ext: block_table must be int32, got ",
                table.scalar_type());
    TORCH_CHECK(table.dim() == 2 && holds(table.sym_size(0) == batch), "flashattn_ext: block_table must have "
                "shape (batch, max_blocks_per_seq) with batch = ", batch, ", got ", table.sym_sizes());
    TORCH_CHECK(holds(table.sym_size(1) <= 1) || holds(table.sym_stride(1) == 1), "flashattn_ext: block_table "
                "must be contiguous in its last dimension: got stride ", table.sym_stride(1), ", expected 1");
    const c10::SymInt page_size = k_cache.sym_size(1);
    TORCH_CHECK(holds(page_size > 0) && holds(page_size % kPageSizeAlignment == 0), "flashattn_ext: "
                "k_cache page_size (dim 1, block_table given) must be a positive multiple of ",
                kPageSizeAlignment, ", got ", page_size);
  } else if (!opts.cache_batch_idx.has_value()) {
    TORCH_CHECK(holds(k_cache.sym_size(0) == batch), "flashattn_ext: k_cache batch size (dim 0) must match "
                "q's when no cache_batch_idx is given: got ", k_cache.sym_size(0), ", expected ", batch);
  }
  const c10::SymInt capacity =
      opts.paged() ? opts.block_table->sym_size(1) * k_cache.sym_size(1) : k_cache.sym_size(1);
  if (opts.appends())
    TORCH_CHECK(holds(opts.k_new->sym_size(1) <= capacity), "flashattn_ext: the cache is too short for k_new: "
                "k_new has seqlen_new = ", opts.k_new->sym_size(1), " rows, more than the ", capacity,
                opts.paged() ? " rows of a sequence (max_blocks_per_seq * page_size)"
                             : " rows of a cache row (k_cache dim 1)");
}

void check_rotary(const at::Tensor& q, const KvcacheOptions& opts) {
  TORCH_CHECK(opts.rotary_cos.has_value() == opts.rotary_sin.has_value(),
              "flashattn_ext: rotary_cos and rotary_sin must be given together: got ",
              opts.rotary_cos ? "rotary_cos" : "rotary_sin", " alone");
  if (!opts.rotary_cos.has_value()) return;
  TORCH_CHECK(opts.appends(), "flashattn_ext: rotary_cos and rotary_sin need k_new and v_new (the rotary "
              "embedding is applied to the new keys as they are written and to q), got k_new=None");
  const at::Tensor& cos = *opts.rotary_cos;
  const at::Tensor& sin = *opts.rotary_sin;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "rotary_cos"},
                                std::pair<const at::Tensor&, const char*>{sin, "rotary_sin"}}) {
    check_same_device(t, name, q);
    check_same_dtype(t, name, q);
    TORCH_CHECK(t.dim() == 2, "flashattn_ext: ", name, " must have 2 dimensions (seqlen_ro, rotary_dim / 2), "
                "got shape ", t.sym_sizes());
    TORCH_CHECK(holds(t.sym_is_contiguous()), "flashattn_ext: ", name, " must be contiguous, got strides ", t.sym_strides());
  }
  check_size(sin, "rotary_sin", 0, "seqlen_ro", cos.sym_size(0), "rotary_cos");
  check_size(sin, "rotary_sin", 1, "rotary_dim / 2", cos.sym_size(1), "rotary_cos");
  TORCH_CHECK(holds(2 * cos.sym_size(1) <= q.sym_size(3)), "flashattn_ext: rotary_dim (2 * rotary_cos dim 1) "
              "must be at most head_dim: got ", 2 * cos.sym_size(1), ", expected <= ", q.sym_size(3));
}

void check_kvcache_options(const at::Tensor& q, const KvcacheOptions& opts, const BackendFeatures& backend) {
  TORCH_CHECK(std::isfinite(opts.softmax_scale), "flashattn_ext: softmax_scale must be finite, got ",
              opts.softmax_scale);
  TORCH_CHECK(std::isfinite(opts.softcap) && opts.softcap >= 0.0,
              "flashattn_ext: softcap must be finite and >= 0 (0 turns it off), got ", opts.softcap);
  TORCH_CHECK(opts.num_splits >= 0, "flashattn_ext: num_splits must be >= 0 (0: chosen by the backend), got ",
              opts.num_splits);
  TORCH_CHECK_NOT_IMPLEMENTED(opts.softcap == 0.0 || backend.softcap,
                              "flashattn_ext: softcap is not implemented in flash_attn_with_kvcache on ",
                              backend.name, " yet (got softcap=", opts.softcap, ")");
  TORCH_CHECK_NOT_IMPLEMENTED(!opts.alibi_slopes.has_value() || backend.alibi,
                              "flashattn_ext: alibi_slopes is not implemented in flash_attn_with_kvcache on ",
                              backend.name, " yet");
  TORCH_CHECK_NOT_IMPLEMENTED(!opts.learnable_sink.has_value() || backend.learnable_sink,
                              "flashattn_ext: learnable_sink is not implemented in flash_attn_with_kvcache on ",
                              backend.name, " yet");
  if (opts.alibi_slopes.has_value()) check_alibi_slopes(*opts.alibi_slopes, q, q.sym_size(0), q.sym_size(2));
  if (opts.learnable_sink.has_value()) check_learnable_sink(*opts.learnable_sink, q, q.sym_size(2));
}

}  // namespace

void check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const KvcacheOptions& opts, const BackendFeatures& backend) {
  const char* cache_layout = opts.paged() ? kPagedCacheLayout : kDenseCacheLayout;
  check_rank4(q, "q", kQueryLayout);
  check_rank4(k_cache, "k_cache", cache_layout);
  check_rank4(v_cache, "v_cache", cache_layout);
  check_same_device(k_cache, "k_cache", q);
  check_same_device(v_cache, "v_cache", q);
  check_same_dtype(k_cache, "k_cache", q);
  check_same_dtype(v_cache, "v_cache", q);
  TORCH_CHECK(backend.dtype_supported(q.scalar_type()), "flashattn_ext: dtype ", q.scalar_type(),
              " is not supported on ", backend.name, " (q and the caches must share a supported dtype)");
  const char* cache_dims[] = {opts.paged() ? "num_blocks" : "batch_cache",
                              opts.paged() ? "page_size" : "seqlen_cache", "nheads", "head_dim"};
  for (int64_t d = 0; d < 4; ++d) check_size(v_cache, "v_cache", d, cache_dims[d], k_cache.sym_size(d), "k_cache");
  check_size(k_cache, "k_cache", 3, "head_dim", q.sym_size(3), "q");
  check_heads(q, k_cache, "k_cache", " (flash_attn_with_kvcache cannot pad it: the caches are written in place)");
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k_cache, "k_cache");
  check_last_dim_contiguous(v_cache, "v_cache");
  check_new_keys(q, k_cache, opts);
  check_cache_layout(q, k_cache, opts);
  check_rotary(q, opts);
  check_kvcache_options(q, opts, backend);
}

KvcacheSizes kvcache_sizes(const at::Tensor& q, const at::Tensor& k_cache, const KvcacheOptions& opts) {
  KvcacheSizes s{};
  s.batch = q.size(0);
  s.seqlen_q = q.size(1);
  s.nheads_q = q.size(2);
  s.nheads_kv = k_cache.size(2);
  s.head_dim = q.size(3);
  s.seqlen_new = opts.appends() ? opts.k_new->size(1) : 0;
  s.page_size = opts.paged() ? k_cache.size(1) : 0;
  s.capacity = opts.paged() ? opts.block_table->size(1) * s.page_size : k_cache.size(1);
  s.cache_rows = k_cache.size(0);
  s.rotary_dim = opts.rotary_cos ? 2 * opts.rotary_cos->size(1) : 0;
  return s;
}

bool rotary_q_positions_advance(const KvcacheOptions& opts, int64_t capacity) {
  const auto bounded = [capacity](int64_t bound) { return bound >= 0 && bound < capacity; };
  return opts.causal || bounded(opts.window_left) || bounded(opts.window_right);
}

void check_kvcache_values(const at::Tensor& q, const at::Tensor& k_cache, const KvcacheOptions& opts) {
  const KvcacheSizes s = kvcache_sizes(q, k_cache, opts);
  std::vector<at::Tensor> parts;
  for (const auto* t : {&opts.cache_seqlens, &opts.cache_leftpad, &opts.cache_batch_idx})
    if (t->has_value()) parts.push_back(**t);
  if (opts.paged()) parts.push_back(opts.block_table->reshape(-1));
  if (parts.empty()) return;
  // One copy (one synchronisation) for all of them.
  const at::Tensor host = at::cat(parts).to(at::kCPU, at::kLong);
  const int64_t* values = host.data_ptr<int64_t>();
  const auto next = [&](bool present) {
    const int64_t* first = present ? values : nullptr;
    if (present) values += s.batch;
    return first;
  };
  const int64_t* seqlens = next(opts.cache_seqlens.has_value());
  const int64_t* leftpad = next(opts.cache_leftpad.has_value());
  const int64_t* batch_idx = next(opts.cache_batch_idx.has_value());
  const int64_t* table = values;
  const int64_t max_blocks = opts.paged() ? opts.block_table->size(1) : 0;
  // Positions the rotary embedding reads, past cache_seqlens[b]: the new keys', and q's rows.
  const int64_t rotary_extent = std::max(
      s.seqlen_new, rotary_q_positions_advance(opts, s.capacity) ? s.seqlen_q : std::min<int64_t>(s.seqlen_q, 1));

  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t start = seqlens ? seqlens[b] : s.capacity;
    TORCH_CHECK(start >= 0, "flashattn_ext: cache_seqlens[", b, "] must be >= 0, got ", start);
    TORCH_CHECK(start + s.seqlen_new <= s.capacity, "flashattn_ext: the cache is too short for k_new: "
                "cache_seqlens[", b, "] + seqlen_new = ", start, " + ", s.seqlen_new, " = ", start + s.seqlen_new,
                " rows, more than the ", s.capacity, opts.paged() ? " rows of a sequence (max_blocks_per_seq * page_size)"
                                                                    : " rows of a cache row (k_cache dim 1)");
    if (leftpad)
      TORCH_CHECK(leftpad[b] >= 0 && leftpad[b] <= start, "flashattn_ext: cache_leftpad[", b, "] must be in [0, ",
                  "cache_seqlens[", b, "] = ", start, "], got ", leftpad[b]);
    if (batch_idx)
      TORCH_CHECK(batch_idx[b] >= 0 && batch_idx[b] < s.cache_rows, "flashattn_ext: cache_batch_idx[", b,
                  "] must be in [0, batch_cache = ", s.cache_rows, "), got ", batch_idx[b]);
    if (opts.paged()) {
      // Only the blocks holding the sequence's rows are read or written.
      const int64_t used_blocks = (start + s.seqlen_new + s.page_size - 1) / s.page_size;
      for (int64_t block = 0; block < used_blocks; ++block) {
        const int64_t entry = table[b * max_blocks + block];
        TORCH_CHECK(entry >= 0 && entry < s.cache_rows, "flashattn_ext: block_table[", b, "][", block,
                    "] must be in [0, num_blocks = ", s.cache_rows, "), got ", entry);
      }
    }
    if (opts.rotary_cos)
      TORCH_CHECK(start + rotary_extent <= opts.rotary_cos->size(0), "flashattn_ext: rotary_cos and rotary_sin "
                  "must have a row for every rotated position: batch entry ", b, " needs positions up to ",
                  start + rotary_extent - 1, ", got seqlen_ro = ", opts.rotary_cos->size(0));
  }
}

std::tuple<at::Tensor, at::Tensor> allocate_kvcache_outputs(const at::Tensor& q) {
  return {at::empty_symint(q.sym_sizes(), q.options()),
          at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1)},
                           q.options().dtype(lse_dtype(q.scalar_type())))};
}

}  // namespace flashattn
