// CPU backend of attention_kvcache_forward (flash_attn_with_kvcache), and the executable
// specification of what a CUDA implementation must compute:
//   1. append: k_new (rotated) and v_new are written into each sequence's cache rows
//      cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (through block_table when
//      paged), and nothing else of the caches is written;
//   2. q is rotated (rotary positions are cache rows: see rotary_q_positions_advance);
//   3. each batch entry's keys, rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1
//      of its cache row, are cut into num_splits parts; each part's attention (out
//      normalised over the part's keys, and lse) is the CPU forward on the part,
//      the mask and the ALiBi distances shifted so that they are the whole sequence's
//      (split_problem); the parts are merged by log-sum-exp (merge_splits), the learnable
//      sink joining there. This is the split-KV decomposition a CUDA kernel runs for decode,
//      and merge_splits is what its combine step must compute.
// Partial results are kept in the accumulation dtype (fp32; fp64 for fp64 inputs), as the
// CUDA kernels keep theirs in fp32, and out is rounded to q's dtype once, after the merge.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "attention_ops.h"
#include "cpu/attention_cpu.h"
#include "cpu/cpu_dtypes.h"
#include "kvcache_api.h"

namespace flashattn {
namespace {

constexpr BackendFeatures kCpuKvcacheBackend{"CPU", /*softcap=*/true, /*alibi=*/true, /*dropout=*/false,
                                             /*learnable_sink=*/true, cpu_dtype_supported};

// num_splits = 0: the CPU parallelises over heads and query blocks within each part, and
// more parts only add merge work, so its heuristic is no split.
constexpr int64_t kCpuDefaultSplits = 1;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Where batch entry b's sequence lives: a row of a dense cache, or the blocks a row of
// block_table names.
struct SequenceInCache {
  int64_t cache_row;   // dense: k_cache index (cache_batch_idx[b] or b)
  const int* blocks;   // paged: block_table[b]; nullptr when dense
  int64_t page_size;
  int64_t seqlen_before;  // cache_seqlens[b] (the whole row without cache_seqlens)
  int64_t first_row;      // cache_leftpad[b] (0 without)
};

// Calls visit(rows, offset) for each run of the sequence's rows [first, first + count) that
// is contiguous in `cache`: one run for a dense cache, one per block touched when paged;
// rows is a (n, nheads_kv, head_dim) view of the cache, offset its first row minus first.
template <typename Visit>
void for_each_cache_run(const at::Tensor& cache, const SequenceInCache& seq, int64_t first, int64_t count,
                        const Visit& visit) {
  if (seq.blocks == nullptr) {
    visit(cache.select(0, seq.cache_row).narrow(0, first, count), 0);
    return;
  }
  for (int64_t done = 0; done < count;) {
    const int64_t row = first + done, offset = row % seq.page_size;
    const int64_t n = std::min(count - done, seq.page_size - offset);
    visit(cache.select(0, seq.blocks[row / seq.page_size]).narrow(0, offset, n), done);
    done += n;
  }
}

// A copy of the sequence's rows [first, first + count) in `dtype`.
at::Tensor gather_rows(const at::Tensor& cache, const SequenceInCache& seq, int64_t first, int64_t count,
                       at::ScalarType dtype) {
  at::Tensor rows = at::empty({count, cache.size(2), cache.size(3)}, cache.options().dtype(dtype));
  for_each_cache_run(cache, seq, first, count,
                     [&](const at::Tensor& run, int64_t offset) { rows.narrow(0, offset, run.size(0)).copy_(run); });
  return rows;
}

// A (batch,) int32 argument on the host, or `fallback` for every entry when absent.
std::vector<int64_t> host_values(const std::optional<at::Tensor>& t, int64_t batch, int64_t fallback) {
  if (!t.has_value()) return std::vector<int64_t>(batch, fallback);
  const at::Tensor values = t->to(at::kLong).contiguous();
  return std::vector<int64_t>(values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + batch);
}

std::vector<SequenceInCache> sequences_in_cache(const at::Tensor& k_cache, const KvcacheOptions& opts,
                                                const KvcacheSizes& s) {
  const std::vector<int64_t> seqlens = host_values(opts.cache_seqlens, s.batch, s.capacity);
  const std::vector<int64_t> leftpad = host_values(opts.cache_leftpad, s.batch, 0);
  std::vector<int64_t> cache_rows(s.batch);
  for (int64_t b = 0; b < s.batch; ++b) cache_rows[b] = b;
  if (opts.cache_batch_idx) cache_rows = host_values(opts.cache_batch_idx, s.batch, 0);
  std::vector<SequenceInCache> sequences(s.batch);
  for (int64_t b = 0; b < s.batch; ++b)
    sequences[b] = {cache_rows[b], opts.paged() ? opts.block_table->select(0, b).data_ptr<int>() : nullptr,
                    s.page_size, seqlens[b], leftpad[b]};
  return sequences;
}

// Rotates the first rotary_dim columns of x (rows, nheads, head_dim), in place, row r by
// the angle of cos/sin row r (cos, sin: (rows, rotary_dim / 2)). Interleaved (GPT-J)
// pairs columns (2i, 2i + 1); otherwise (GPT-NeoX) columns (i, i + rotary_dim / 2).
void rotate(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t half = cos.size(1);
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  at::Tensor x1 = interleaved ? x.narrow(2, 0, 2 * half).slice(2, 0, 2 * half, 2) : x.narrow(2, 0, half);
  at::Tensor x2 = interleaved ? x.narrow(2, 0, 2 * half).slice(2, 1, 2 * half, 2) : x.narrow(2, half, half);
  const at::Tensor rotated1 = x1 * c - x2 * s;
  const at::Tensor rotated2 = x1 * s + x2 * c;
  x1.copy_(rotated1);
  x2.copy_(rotated2);
}

// The rotary rows of `count` positions from `first`, in `dtype`: consecutive positions, or
// `first` repeated when the positions do not advance.
std::pair<at::Tensor, at::Tensor> rotary_rows(const KvcacheOptions& opts, int64_t first, int64_t count,
                                              bool advance, at::ScalarType dtype) {
  const auto rows = [&](const at::Tensor& table) {
    const at::Tensor picked = advance ? table.narrow(0, first, count) : table.narrow(0, first, 1).expand({count, -1});
    return picked.to(dtype);
  };
  return {rows(*opts.rotary_cos), rows(*opts.rotary_sin)};
}

// Step 1: k_new (rotated) and v_new into each sequence's rows from cache_seqlens[b].
void append_new_keys(const at::Tensor& k_cache, const at::Tensor& v_cache, const KvcacheOptions& opts,
                     const std::vector<SequenceInCache>& sequences, at::ScalarType acc_dtype) {
  for (size_t b = 0; b < sequences.size(); ++b) {
    const SequenceInCache& seq = sequences[b];
    at::Tensor k_rows = opts.k_new->select(0, b);
    const at::Tensor v_rows = opts.v_new->select(0, b);
    const int64_t count = k_rows.size(0);
    if (opts.rotary_cos) {
      k_rows = k_rows.to(acc_dtype, /*non_blocking=*/false, /*copy=*/true);
      const auto [cos, sin] = rotary_rows(opts, seq.seqlen_before, count, /*advance=*/true, acc_dtype);
      rotate(k_rows, cos, sin, opts.rotary_interleaved);
    }
    for_each_cache_run(k_cache, seq, seq.seqlen_before, count, [&](at::Tensor run, int64_t offset) {
      run.copy_(k_rows.narrow(0, offset, run.size(0)));
    });
    for_each_cache_run(v_cache, seq, seq.seqlen_before, count, [&](at::Tensor run, int64_t offset) {
      run.copy_(v_rows.narrow(0, offset, run.size(0)));
    });
  }
}

// Keys [key_begin, key_end) of a sequence of seqlen_k keys, and the queries that see any
// of them, as a dense attention problem whose own bottom-right mask is the sequence's mask
// restricted to those keys: queries [0, rows), keys [key_begin, key_end), window
// (window_left, window_right), and ALiBi distances from diagonal + diagonal_shift (the
// sequence's diagonal in the part's key numbering). Queries past `rows` see none of the
// part's keys.
struct SplitProblem {
  int64_t rows, key_end, window_left, window_right, diagonal_shift;
  bool empty(int64_t key_begin) const { return rows == 0 || key_end <= key_begin; }
};

// Query i of seqlen_q sees keys [i + c - left, i + c + right] of the sequence (c = seqlen_k -
// seqlen_q; a negative bound is unbounded). Keeping queries [0, rows) and keys [begin, end)
// moves the diagonal of query i to i + (end - begin) - rows, so the bounds shift by
// shift = (seqlen_k - end) - (seqlen_q - rows); rows and end are the last query that sees a
// key below part_end and the last key it sees, which keeps both shifted bounds >= 0.
SplitProblem split_problem(int64_t seqlen_q, int64_t seqlen_k, int64_t left, int64_t right, int64_t part_end) {
  const int64_t c = seqlen_k - seqlen_q;
  SplitProblem p{};
  p.rows = left < 0 ? seqlen_q : std::clamp<int64_t>(part_end - c + left, 0, seqlen_q);
  p.key_end = right < 0 ? part_end : std::min(part_end, p.rows + c + right);
  const int64_t shift = (seqlen_k - p.key_end) - (seqlen_q - p.rows);
  p.window_left = left < 0 ? -1 : left - shift;
  p.window_right = right < 0 ? -1 : right + shift;
  p.diagonal_shift = shift;
  return p;
}

// The merge of attention over disjoint parts of the keys: part s has its out_parts[s]
// (sq, nheads, head_dim), normalised over its own keys, and lse_parts[s] (nheads, sq), -inf
// where the row saw none of its keys. The whole's lse is the log-sum-exp of the parts' (and
// of the sink's logit), and its out the sum of the parts' outs weighted by exp(lse_s - lse).
// A row that saw no key and has no sink gets out 0 and lse +inf.
void merge_splits(const at::Tensor& out_parts, at::Tensor lse_parts, const std::optional<at::Tensor>& sink,
                  at::Tensor out, at::Tensor lse) {
  const int64_t num_parts = lse_parts.size(0);
  if (sink) lse_parts = at::cat({lse_parts, sink->to(lse_parts.scalar_type()).view({1, -1, 1}).expand({1, -1, lse_parts.size(2)})});
  const at::Tensor max = std::get<0>(lse_parts.max(0));
  // Rows with no term at all are shifted by 0, so that their weights are exp(-inf) = 0, not NaN.
  const at::Tensor shift = max.masked_fill(max == -kInf, 0.0);
  const at::Tensor weights = (lse_parts - shift).exp_();
  const at::Tensor total = weights.sum(0);
  lse.copy_((total.log() + shift).masked_fill_(total == 0, kInf));
  // exp(lse_s - lse) = weight_s / total; 0 for rows with no term.
  const at::Tensor scales = (weights.narrow(0, 0, num_parts) / total).nan_to_num_(0.0);
  out.copy_((out_parts * scales.permute({0, 2, 1}).unsqueeze(-1)).sum(0));
}

// Steps 2 and 3 for batch entry b: out[b] and lse[b].
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const KvcacheOptions& opts,
            const KvcacheSizes& s, const SequenceInCache& seq, int64_t b, at::ScalarType acc_dtype,
            at::Tensor& out, at::Tensor& lse) {
  const int64_t seqlen_q = s.seqlen_q, first = seq.first_row;
  const int64_t seqlen_k = seq.seqlen_before + s.seqlen_new - first;
  const at::Tensor keys = gather_rows(k_cache, seq, first, seqlen_k, acc_dtype);
  const at::Tensor values = gather_rows(v_cache, seq, first, seqlen_k, acc_dtype);
  at::Tensor q_rows = q.select(0, b).to(acc_dtype, /*non_blocking=*/false, /*copy=*/true);
  if (opts.rotary_cos) {
    const auto [cos, sin] = rotary_rows(opts, seq.seqlen_before, seqlen_q,
                                        rotary_q_positions_advance(opts, s.capacity), acc_dtype);
    rotate(q_rows, cos, sin, opts.rotary_interleaved);
  }

  const int64_t num_splits = opts.num_splits == 0 ? kCpuDefaultSplits : opts.num_splits;
  const int64_t part_size = (seqlen_k + num_splits - 1) / num_splits;
  const at::TensorOptions acc = q_rows.options();
  at::Tensor out_parts = at::zeros({num_splits, seqlen_q, s.nheads_q, s.head_dim}, acc);
  at::Tensor lse_parts = at::full({num_splits, s.nheads_q, seqlen_q}, -kInf, acc);
  const int64_t left = opts.window_left < 0 ? -1 : opts.window_left;
  const int64_t right = opts.causal ? 0 : (opts.window_right < 0 ? -1 : opts.window_right);
  // (batch, nheads) slopes: this entry's row, as a batch of one.
  std::optional<at::Tensor> slopes = opts.alibi_slopes;
  if (slopes && slopes->dim() == 2) slopes = slopes->narrow(0, b, 1);
  for (int64_t part = 0; part < num_splits; ++part) {
    const int64_t begin = std::min(seqlen_k, part * part_size), end = std::min(seqlen_k, begin + part_size);
    const SplitProblem p = split_problem(seqlen_q, seqlen_k, left, right, end);
    if (p.empty(begin)) continue;
    AttentionOptions part_opts{opts.softmax_scale, /*causal=*/false, p.window_left, p.window_right, opts.softcap,
                               slopes, /*dropout_p=*/0.0, /*rng_state=*/std::nullopt, SequenceLayout{},
                               /*learnable_sink=*/std::nullopt};
    part_opts.alibi_diagonal_shift = p.diagonal_shift;
    const auto [part_out, part_lse] =
        attention_forward_cpu_with_options(q_rows.narrow(0, 0, p.rows).unsqueeze(0),
                                           keys.narrow(0, begin, p.key_end - begin).unsqueeze(0),
                                           values.narrow(0, begin, p.key_end - begin).unsqueeze(0), part_opts);
    out_parts[part].narrow(0, 0, p.rows).copy_(part_out[0]);
    // attention_forward marks a row without keys with lse +inf; in a merge it weighs nothing.
    lse_parts[part].narrow(1, 0, p.rows).copy_(part_lse[0].masked_fill(part_lse[0] == kInf, -kInf));
  }
  merge_splits(out_parts, lse_parts, opts.learnable_sink, out.select(0, b), lse.select(0, b));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_kvcache_forward_cpu(FLASHATTN_KVCACHE_FORWARD_ARGS) {
  const KvcacheOptions opts = FLASHATTN_KVCACHE_OPTIONS;
  check_kvcache_inputs(q, k_cache, v_cache, opts, kCpuKvcacheBackend);
  // The cache addresses below come from these values: they must be sound.
  check_kvcache_values(q, k_cache, opts);
  // The steps are ATen calls on the op's tensors, none of which autograd may record.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const KvcacheSizes s = kvcache_sizes(q, k_cache, opts);
  const at::ScalarType acc_dtype = lse_dtype(q.scalar_type());
  const std::vector<SequenceInCache> sequences = sequences_in_cache(k_cache, opts, s);
  if (opts.appends()) append_new_keys(k_cache, v_cache, opts, sequences, acc_dtype);
  auto [out, lse] = allocate_kvcache_outputs(q);
  if (q.numel() == 0) {
    lse.fill_(kInf);  // an empty head dim included: nothing is attended
    return {out, lse};
  }
  for (int64_t b = 0; b < s.batch; ++b) attend(q, k_cache, v_cache, opts, s, sequences[b], b, acc_dtype, out, lse);
  return {out, lse};
}

}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("attention_kvcache_forward", TORCH_FN(flashattn::attention_kvcache_forward_cpu));
}
