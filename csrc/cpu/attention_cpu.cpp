// CPU backend of flashattn_ext: exact FlashAttention forward and backward,
// registered for the CPU dispatch key.
//
// Algorithm (FlashAttention-2, tiled so that no seqlen_q x seqlen_k matrix ever
// exists; extra memory is a few block x block and block x head_dim buffers per
// thread, plus two fp32/fp64 values per query row in the backward):
//   forward   One task per (batch, head, query block). It walks only the key
//             blocks that hold a visible key, computes S = Q K^T with BLAS,
//             keeps a running row max m and row sum l (online softmax),
//             rescales its accumulator and adds P V; out = acc / l and
//             lse = m + log l. The element mask is applied only to blocks that
//             straddle a window boundary.
//   backward  Recomputes P = exp(S - lse) block by block. Each task owns the output
//             rows it writes, so there are no races and no atomics, and one of two
//             ways runs it (the comment before dq_pass): where there are enough
//             (batch, kv head) pairs to keep the threads busy, one pass per pair:
//             per key block, dK and dV summed over the kv head's query-head group
//             (GQA) and its query blocks, and each query block's dQ term added to
//             the pair's dQ rows (5 block matmuls per block pair); else two passes
//             of smaller tasks:
//               1. per (batch, head, query block): D = rowsum(dout * out), dQ;
//               2. per (batch, kv head, key block): dK and dV,
//             the second recomputing S and dP (7 block matmuls per pair). Both add
//             the same terms in the same order: the same result.
// Tasks go to at::parallel_for workers through a shared counter, one at a
// time, so the uneven tasks of causal and windowed masks balance.
//
// Variable-length batches (cu_seqlens) and seqused run each sequence as a dense
// problem of batch 1 on views of the tensors (make_parts), with the tasks of all
// sequences in one pool.
//
// Dropout multiplies each block of probabilities by its mask scaled by 1 / (1 - p)
// just before P V (forward) and regenerates the same block in the backward: the mask is
// a function of the element's (batch entry, head, row, column) and rng_state
// (csrc/common/philox.h), so it does not depend on the blocks or the threads. A learnable sink
// starts each row's online softmax at max = sink, sum = 1; its gradient comes from the
// backward's per-row lse and D = rowsum(dout * out) (sink_gradient).
//
// Precision: fp32, bf16 and fp16 compute in fp32, fp64 in fp64, and lse has the
// accumulator's dtype, so the backward recomputes P from the lse it is given
// (ring attention hands it a merged one) at full precision. dk and dv, long
// sums over query rows, add up their per-query-block products in fp64 (see
// dkdv_pass).
//
// Scores are kept in log2 units (log2(e) * score, as FlashAttention does) so
// that the softmax runs on exp2, which ATen's vectorised kernels compute about
// 3x faster than exp. Every step of a block pair is an ATen call (BLAS
// matmuls, vectorised exp2 and tanh) with a fixed dispatch cost of a few
// microseconds, so blocks must be large enough for the O(block^2 * head_dim)
// work to dominate, and small enough for the working set to stay in L2; see
// kBlockQ/kBlockK.
#include <ATen/ATen.h>
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_api.h"
#include "attention_ops.h"
#include "common/philox.h"
#include "cpu/attention_cpu.h"
#include "cpu/cpu_dtypes.h"

// at::parallel_for is a header template: with an OpenMP ATen it only runs in
// parallel when this file itself is compiled with OpenMP, and runs serially
// (still correct) otherwise. Said at build time rather than found in a profile.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#pragma message("flashattn_ext: csrc/cpu/attention_cpu.cpp is built without OpenMP (-fopenmp): the CPU kernels will run on one thread")
#endif

namespace flashattn {
namespace {

// 128 x 128 score blocks: each block pair costs ~10 ATen calls of fixed
// overhead, which 128 x 128 x head_dim matmuls amortise (64 x 64 blocks took
// ~1.5x the CPU time at seqlen 4096, d 64), while S, P and dP (64 KiB each in
// fp32) and the 128 x head_dim row blocks stay in a core's L2. 128 x 256,
// 256 x 128 and 256 x 256 measured within noise (+-10%) of 128 x 128, with 2-4x
// the working set and fewer tasks to spread over the threads on short sequences.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 128;
// A dropout draw decides columns of one 16-column tile (csrc/common/philox.h): key blocks
// that start on a whole tile draw each once per row.
static_assert(kBlockK % 16 == 0, "key blocks start at a multiple of 16 columns");

constexpr BackendFeatures kCpuBackend{"CPU", /*softcap=*/true, /*alibi=*/true, /*dropout=*/true,
                                      /*learnable_sink=*/true, cpu_dtype_supported};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One call's geometry, mask and score transform, in the accumulation type acc_t.
template <typename acc_t>
struct Problem {
  int64_t batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, head_dim;
  int64_t window_left, window_right;  // as effective_window: < 0 is unbounded
  // Scores in log2 units are S = qk_scale * Q K^T without the cap, and
  // S = tanh_scale * tanh(qk_scale * Q K^T) with it.
  acc_t qk_scale;    // softmax_scale * log2(e), or softmax_scale / softcap with the cap
  acc_t tanh_scale;  // softcap * log2(e); 0: no cap
  // d score / d(qk_scale * q.k) apart from the cap's tanh derivative: ln 2, or
  // softcap with the cap. dk, accumulated against the scaled q, is scaled by it.
  acc_t dk_scale;
  // The call's batch index of this problem's entry 0: a sequence run alone (make_parts)
  // reads its own row of per-batch ALiBi slopes and draws its own dropout mask.
  int64_t first_batch_entry;
  const float* alibi_slopes;  // nullptr: off; else the slopes of entry first_batch_entry
  int64_t alibi_batch_stride;
  int64_t alibi_diagonal_shift;  // AttentionOptions'
  const float* learnable_sink;  // nullptr: off; (nheads_q,) natural-log logits
  std::optional<DropoutGenerator> dropout;
  acc_t dropout_scale;  // 1 / (1 - dropout_p): the scale of a kept probability
  at::TensorOptions acc_options;

  Problem(const at::Tensor& q, const at::Tensor& k, const AttentionOptions& opts,
          int64_t first_batch_entry, const std::optional<DropoutGenerator>& dropout)
      : batch(q.size(0)),
        nheads_q(q.size(2)),
        nheads_kv(k.size(2)),
        seqlen_q(q.size(1)),
        seqlen_k(k.size(1)),
        head_dim(q.size(3)),
        qk_scale(static_cast<acc_t>(opts.softcap > 0 ? opts.softmax_scale / opts.softcap
                                                     : opts.softmax_scale * M_LOG2E)),
        tanh_scale(static_cast<acc_t>(opts.softcap * M_LOG2E)),
        dk_scale(static_cast<acc_t>(opts.softcap > 0 ? opts.softcap : M_LN2)),
        first_batch_entry(first_batch_entry),
        alibi_slopes(nullptr),
        alibi_batch_stride(0),
        alibi_diagonal_shift(opts.alibi_diagonal_shift),
        learnable_sink(opts.learnable_sink ? opts.learnable_sink->data_ptr<float>() : nullptr),
        dropout(dropout),
        dropout_scale(static_cast<acc_t>(1.0 / (1.0 - opts.dropout_p))),
        acc_options(q.options().dtype(c10::CppTypeToScalarType<acc_t>::value)) {
    std::tie(window_left, window_right) = effective_window(opts, seqlen_q, seqlen_k);
    if (opts.alibi_slopes) {
      alibi_batch_stride = opts.alibi_slopes->dim() == 2 ? opts.alibi_slopes->stride(0) : 0;
      alibi_slopes = opts.alibi_slopes->data_ptr<float>() + first_batch_entry * alibi_batch_stride;
    }
  }

  int64_t group_size() const { return nheads_q / nheads_kv; }
  // Query i's diagonal key (bottom-right alignment).
  int64_t diagonal(int64_t i) const { return i + seqlen_k - seqlen_q; }

  // Query i sees keys [first_visible_key(i), last_visible_key(i)] (empty when
  // first > last): the interval form of key_visible() in attention_params.h.
  int64_t first_visible_key(int64_t i) const {
    return window_left < 0 ? 0 : std::max<int64_t>(0, diagonal(i) - window_left);
  }
  int64_t last_visible_key(int64_t i) const {
    return window_right < 0 ? seqlen_k - 1 : std::min(seqlen_k - 1, diagonal(i) + window_right);
  }
  // Key j is seen by queries [first_query_seeing(j), last_query_seeing(j)].
  int64_t first_query_seeing(int64_t j) const {
    return window_right < 0 ? 0 : std::max<int64_t>(0, j - diagonal(0) - window_right);
  }
  int64_t last_query_seeing(int64_t j) const {
    return window_left < 0 ? seqlen_q - 1 : std::min(seqlen_q - 1, j - diagonal(0) + window_left);
  }

  // Both interval ends grow with i, so a block is fully visible iff its last
  // row sees its first column and its first row sees its last column.
  bool fully_visible(int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    return first_visible_key(i0 + rows - 1) <= j0 && last_visible_key(i0) >= j0 + cols - 1;
  }

  bool capped() const { return tanh_scale > 0; }

  // In log2 units, like the scores.
  acc_t alibi_slope(int64_t b, int64_t h) const {
    return alibi_slopes ? static_cast<acc_t>(alibi_slopes[b * alibi_batch_stride + h] * M_LOG2E)
                        : acc_t(0);
  }

  // Head h's sink logit in log2 units; -inf (a term exp2(-inf) = 0) without a sink.
  acc_t sink_log2(int64_t h) const {
    return learnable_sink ? static_cast<acc_t>(learnable_sink[h] * M_LOG2E)
                          : -std::numeric_limits<acc_t>::infinity();
  }
};

// Into keep_scale (rows, cols): dropout_scale where the mask keeps element
// (i0 + r, j0 + c) of head h of batch entry b, 0 where it drops it.
template <typename acc_t>
void dropout_keep_scales(const Problem<acc_t>& pb, int64_t b, int64_t h, int64_t i0, int64_t j0,
                         at::Tensor& keep_scale) {
  const DropoutGenerator& generator = *pb.dropout;
  const auto batch_head = static_cast<uint32_t>((pb.first_batch_entry + b) * pb.nheads_q + h);
  const int64_t rows = keep_scale.size(0), cols = keep_scale.size(1);
  acc_t* const data = keep_scale.data_ptr<acc_t>();
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* const row = data + r * cols;
    const int64_t i = i0 + r;
    // A draw decides four columns of row i: 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-column tile.
    for (int64_t tile = (j0 / 16) * 16; tile < j0 + cols; tile += 16)
      for (int64_t t = 0; t < 4; ++t) {
        const PhiloxWords words = generator.draw(batch_head, DropoutGenerator::row_group(i),
                                                 DropoutGenerator::column_group(tile + 2 * t));
        for (int64_t j : {tile + 2 * t, tile + 2 * t + 1, tile + 2 * t + 8, tile + 2 * t + 9})
          if (j >= j0 && j < j0 + cols)
            row[j - j0] = generator.keeps(DropoutGenerator::byte_of(words, i, j)) ? pb.dropout_scale : acc_t(0);
      }
  }
}

// Rows [first, first + count) of one head of one batch entry: a (count, head_dim)
// view with the tensor's own row stride.
at::Tensor head_rows(const at::Tensor& t, int64_t b, int64_t head, int64_t first, int64_t count) {
  return t.select(0, b).select(1, head).narrow(0, first, count);
}

// A contiguous (rows, cols) view at the start of a flat scratch buffer.
at::Tensor block_of(const at::Tensor& flat, int64_t rows, int64_t cols) {
  return flat.narrow(0, 0, rows * cols).view({rows, cols});
}

// `rows` in the accumulation dtype of `scratch`: the view itself when it already
// has that dtype (BLAS reads the strided view directly), else a converted copy.
at::Tensor in_acc_dtype(const at::Tensor& rows, const at::Tensor& scratch) {
  if (rows.scalar_type() == scratch.scalar_type()) return rows;
  return block_of(scratch, rows.size(0), rows.size(1)).copy_(rows);
}

// Runs worker(next_task) on each intra-op thread; next_task(task) hands out the
// tasks [0, num_tasks) one at a time, so tasks of uneven cost (causal) balance.
// Each task owns the output rows it writes, so which thread runs it is invisible. A
// single task still gets two workers (one idle) where there are two threads: run on the
// calling thread, outside a parallel region, its BLAS calls would use every thread and
// round differently from the one-thread BLAS of a worker, and the result would depend on
// the thread count.
template <typename Worker>
void run_tasks(int64_t num_tasks, const Worker& worker) {
  std::atomic<int64_t> next{0};
  const auto next_task = [&](int64_t& task) {
    task = next.fetch_add(1, std::memory_order_relaxed);
    return task < num_tasks;
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks == 1 ? 2 : num_tasks), 1,
                   [&](int64_t, int64_t) {
                     // Worker threads do not inherit the caller's dispatch state; the
                     // block math must not be recorded by autograd.
                     at::AutoDispatchBelowADInplaceOrView below_autograd;
                     worker(next_task);
                   });
}

// Scores, in log2 units, of query rows [i0, i0 + rows) of head h against key
// rows [j0, j0 + cols): S = cap(q_scaled k^T) + alibi, and -inf where the key is
// not visible. With the cap on and `tanh_scores` given, tanh(q_scaled k^T) is
// kept there for the backward's derivative.
template <typename acc_t>
void compute_scores(const Problem<acc_t>& pb, const at::Tensor& q_scaled,
                    const at::Tensor& k_rows, int64_t b, int64_t h, int64_t i0, int64_t j0,
                    at::Tensor& scores, at::Tensor* tanh_scores) {
  at::mm_out(scores, q_scaled, k_rows.t());
  if (pb.capped()) {
    if (tanh_scores != nullptr) {
      at::tanh_out(*tanh_scores, scores);
      at::mul_out(scores, *tanh_scores, pb.tanh_scale);
    } else {
      scores.tanh_().mul_(pb.tanh_scale);
    }
  }
  const int64_t rows = scores.size(0), cols = scores.size(1);
  const acc_t slope = pb.alibi_slope(b, h);
  if (slope == 0 && pb.fully_visible(i0, rows, j0, cols)) return;

  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  acc_t* const data = scores.data_ptr<acc_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    acc_t* const row = data + r * cols;
    // Visible columns of this row within the block: [begin, end).
    const int64_t begin = std::clamp<int64_t>(pb.first_visible_key(i) - j0, 0, cols);
    const int64_t end = std::clamp<int64_t>(pb.last_visible_key(i) - j0 + 1, begin, cols);
    std::fill(row, row + begin, kMinusInf);
    std::fill(row + end, row + cols, kMinusInf);
    if (slope != 0) {
      const int64_t diagonal_col = pb.diagonal(i) + pb.alibi_diagonal_shift - j0;
      for (int64_t c = begin; c < end; ++c) {
        row[c] -= slope * static_cast<acc_t>(std::abs(diagonal_col - c));
      }
    }
  }
}

// Running row max and row sum of the online softmax (base 2) over a sequence
// of score blocks, for up to kBlockQ rows.
template <typename acc_t>
class OnlineSoftmax {
 public:
  explicit OnlineSoftmax(const at::TensorOptions& acc_options)
      : storage_(at::empty({kNumVectors, kBlockQ}, acc_options)) {}

  // sink_log2: the rows' sink logit, a first term exp2(sink - max) = 1 with max = sink
  // (-inf: no sink, an empty row).
  void reset(int64_t rows, acc_t sink_log2) {
    rows_ = rows;
    const auto row_vector = [&](int64_t index) { return storage_[index].narrow(0, 0, rows); };
    max_ = row_vector(0).fill_(sink_log2);
    sum_ = row_vector(1).fill_(sink_log2 == -std::numeric_limits<acc_t>::infinity() ? 0 : 1);
    block_max_ = row_vector(2);
    block_sum_ = row_vector(3);
    shift_ = row_vector(4);
    rescale_ = row_vector(5);
  }

  // Folds a block of scores (-inf where masked) into the running max and sum.
  // Leaves exp2(scores - max) in scores, and in rescale() the factor by which
  // everything accumulated from earlier blocks must be multiplied.
  void step(at::Tensor& scores) {
    at::amax_out(block_max_, scores, 1);
    acc_t* const max = max_.data_ptr<acc_t>();
    const acc_t* const block_max = block_max_.data_ptr<acc_t>();
    acc_t* const shift = shift_.data_ptr<acc_t>();
    acc_t* const rescale = rescale_.data_ptr<acc_t>();
    for (int64_t r = 0; r < rows_; ++r) {
      const acc_t new_max = std::max(max[r], block_max[r]);
      // A row that has seen only masked keys is shifted by 0, giving exp2(-inf) = 0, not NaN.
      shift[r] = new_max == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : new_max;
      rescale[r] = std::exp2(max[r] - shift[r]);
      max[r] = new_max;
    }
    scores.sub_(shift_.unsqueeze(1)).exp2_();
    at::sum_out(block_sum_, scores, 1);
    acc_t* const sum = sum_.data_ptr<acc_t>();
    const acc_t* const block_sum = block_sum_.data_ptr<acc_t>();
    for (int64_t r = 0; r < rows_; ++r) sum[r] = sum[r] * rescale[r] + block_sum[r];
  }

  const at::Tensor& rescale() const { return rescale_; }

  // log2 of the sum of exp2(scores) of row r; +inf when the row saw no key and no sink.
  acc_t lse_log2(int64_t r) const {
    const acc_t sum = sum_.data_ptr<acc_t>()[r];
    return sum > 0 ? max_.data_ptr<acc_t>()[r] + std::log2(sum)
                   : std::numeric_limits<acc_t>::infinity();
  }

  // Into `out` (rows,): 1 / row sum, and 0 for rows that saw no key and no sink
  // (their accumulator is 0 and must stay 0).
  void inverse_sums(at::Tensor& out) const {
    const acc_t* const sum = sum_.data_ptr<acc_t>();
    acc_t* const inverse = out.data_ptr<acc_t>();
    for (int64_t r = 0; r < rows_; ++r) inverse[r] = sum[r] > 0 ? acc_t(1) / sum[r] : acc_t(0);
  }

 private:
  static constexpr int64_t kNumVectors = 6;
  at::Tensor storage_;
  int64_t rows_ = 0;
  at::Tensor max_, sum_, block_max_, block_sum_, shift_, rescale_;
};

// Task number -> (batch, head, query block). Query blocks are handed out from
// the last one down: under causal masking the last rows see the most keys, so
// the longest tasks start first and the short ones fill the tail.
struct QueryBlockTask {
  int64_t b, h, i0, rows;

  template <typename acc_t>
  QueryBlockTask(const Problem<acc_t>& pb, int64_t task) {
    const int64_t num_q_blocks = ceil_div(pb.seqlen_q, kBlockQ);
    const int64_t batch_head = task % (pb.batch * pb.nheads_q);
    b = batch_head / pb.nheads_q;
    h = batch_head % pb.nheads_q;
    i0 = (num_q_blocks - 1 - task / (pb.batch * pb.nheads_q)) * kBlockQ;
    rows = std::min(kBlockQ, pb.seqlen_q - i0);
  }
};

template <typename acc_t>
int64_t num_query_block_tasks(const Problem<acc_t>& pb) {
  return ceil_div(pb.seqlen_q, kBlockQ) * pb.batch * pb.nheads_q;
}

// Calls visit(j0, cols) for each key block holding a key visible from query rows
// [i0, i0 + rows). The rows' visible intervals overlap from one row to the next,
// so their union is one interval.
template <typename acc_t, typename Visit>
void for_each_key_block(const Problem<acc_t>& pb, int64_t i0, int64_t rows, const Visit& visit) {
  const int64_t first = pb.first_visible_key(i0);
  const int64_t last = pb.last_visible_key(i0 + rows - 1);
  for (int64_t j0 = first / kBlockK * kBlockK; j0 <= last; j0 += kBlockK) {
    visit(j0, std::min(kBlockK, pb.seqlen_k - j0));
  }
}

// The query-side counterpart of for_each_key_block.
template <typename acc_t, typename Visit>
void for_each_query_block(const Problem<acc_t>& pb, int64_t j0, int64_t cols, const Visit& visit) {
  const int64_t first = pb.first_query_seeing(j0);
  const int64_t last = pb.last_query_seeing(j0 + cols - 1);
  for (int64_t i0 = first / kBlockQ * kBlockQ; i0 <= last; i0 += kBlockQ) {
    visit(i0, std::min(kBlockQ, pb.seqlen_q - i0));
  }
}

template <typename acc_t>
int64_t num_key_block_tasks(const Problem<acc_t>& pb) {
  return ceil_div(pb.seqlen_k, kBlockK) * pb.batch * pb.nheads_kv;
}

// The tensors of a call as the passes read and write them: q, k, v, out, dout, dq,
// dk, dv (batch, seqlen, nheads, head_dim), lse (batch, nheads, seqlen_q). The
// backward's are undefined in the forward.
struct CallTensors {
  at::Tensor q, k, v, out, lse;
  at::Tensor dout, dq, dk, dv;
};

// One dense problem the passes run: the whole call when it is dense, else one
// sequence as a batch of 1, over views of the call's tensors. Variable-length
// batches and seqused thus run the dense algorithm unchanged, each sequence with
// its own lengths (so the mask and ALiBi are aligned per sequence).
template <typename acc_t>
struct Part {
  Problem<acc_t> pb;
  CallTensors t;
  // Backward, per query row (batch, nheads, seqlen_q): the lse (log2 units) the
  // probabilities are recomputed from, and D = rowsum(dout * out).
  at::Tensor row_lse_log2, row_delta;
  // fused_pass: where dq's rows add up, dq's shape in the accumulation dtype (dq itself
  // when it has that dtype).
  at::Tensor dq_sums;
};

// Rows [start, start + length) of one sequence of q's or k's side.
struct SequenceRows {
  int64_t start, length;
};

// Each sequence's rows on one side: from cu_seqlens (variable-length) or the dense
// seqlen, cut to seqused. The values were checked by check_sequence_values.
std::vector<SequenceRows> sequence_rows(const std::optional<at::Tensor>& cu_seqlens,
                                        const std::optional<at::Tensor>& seqused, int64_t batch,
                                        int64_t dense_seqlen) {
  const int* const cu = cu_seqlens ? cu_seqlens->data_ptr<int>() : nullptr;
  const int* const used = seqused ? seqused->data_ptr<int>() : nullptr;
  std::vector<SequenceRows> rows(batch);
  for (int64_t b = 0; b < batch; ++b) {
    rows[b] = cu ? SequenceRows{cu[b], cu[b + 1] - cu[b]} : SequenceRows{0, dense_seqlen};
    if (used) rows[b].length = used[b];
  }
  return rows;
}

// Sequence b of t as a batch of 1: t is (batch, seqlen, ...) dense or (total, ...)
// variable-length, and row_dim the row dimension of the batched form (2 for lse).
at::Tensor sequence_view(const at::Tensor& t, bool varlen, int64_t b, const SequenceRows& rows,
                         int64_t row_dim = 1) {
  if (!t.defined()) return t;
  return (varlen ? t.unsqueeze(0) : t.narrow(0, b, 1)).narrow(row_dim, rows.start, rows.length);
}

// The call's dropout: rng_state [seed, offset] read once (a CPU tensor: no synchronisation).
std::optional<DropoutGenerator> dropout_generator(const AttentionOptions& opts) {
  if (opts.dropout_p == 0.0) return std::nullopt;
  const at::Tensor state = opts.rng_state->to(at::kCPU).contiguous();
  const int64_t* seed_offset = state.data_ptr<int64_t>();
  return DropoutGenerator{static_cast<uint64_t>(seed_offset[0]), static_cast<uint64_t>(seed_offset[1]),
                          dropout_threshold(opts.dropout_p)};
}

template <typename acc_t>
std::vector<Part<acc_t>> make_parts(const CallTensors& t, const AttentionOptions& opts) {
  const SequenceLayout& layout = opts.layout;
  const std::optional<DropoutGenerator> dropout = dropout_generator(opts);
  if (!layout.varlen_q() && !layout.varlen_k() && !layout.seqused_q && !layout.seqused_k)
    return {Part<acc_t>{Problem<acc_t>(t.q, t.k, opts, 0, dropout), t}};

  const ProblemSizes sizes = problem_sizes(t.q, t.k, opts);
  const std::vector<SequenceRows> q_rows =
      sequence_rows(layout.cu_seqlens_q, layout.seqused_q, sizes.batch, sizes.rows_q);
  const std::vector<SequenceRows> k_rows =
      sequence_rows(layout.cu_seqlens_k, layout.seqused_k, sizes.batch, sizes.rows_k);
  std::vector<Part<acc_t>> parts;
  parts.reserve(sizes.batch);
  for (int64_t b = 0; b < sizes.batch; ++b) {
    const auto q_side = [&](const at::Tensor& x, int64_t row_dim = 1) {
      return sequence_view(x, layout.varlen_q(), b, q_rows[b], row_dim);
    };
    const auto k_side = [&](const at::Tensor& x) {
      return sequence_view(x, layout.varlen_k(), b, k_rows[b]);
    };
    CallTensors sequence{q_side(t.q),    k_side(t.k),  k_side(t.v),  q_side(t.out), q_side(t.lse, 2),
                         q_side(t.dout), q_side(t.dq), k_side(t.dk), k_side(t.dv)};
    parts.push_back(Part<acc_t>{Problem<acc_t>(sequence.q, sequence.k, opts, b, dropout),
                                std::move(sequence)});
  }
  // Longest sequences first, so that their tasks start first and short ones fill the tail.
  std::stable_sort(parts.begin(), parts.end(), [](const Part<acc_t>& a, const Part<acc_t>& b) {
    return a.pb.seqlen_q * a.pb.seqlen_k > b.pb.seqlen_q * b.pb.seqlen_k;
  });
  return parts;
}

// run_tasks over the tasks of every part at once, so that the threads share the
// tasks of many short sequences. tasks_of(pb) counts a part's tasks; worker gets
// next_task(part, task), which hands out a part and a task number within it.
template <typename acc_t, typename TasksOf, typename Worker>
void run_part_tasks(const std::vector<Part<acc_t>>& parts, const TasksOf& tasks_of,
                    const Worker& worker) {
  std::vector<int64_t> first_task{0};
  for (const Part<acc_t>& part : parts) first_task.push_back(first_task.back() + tasks_of(part.pb));
  run_tasks(first_task.back(), [&](const auto& next_task) {
    worker([&](const Part<acc_t>*& part, int64_t& part_task) {
      int64_t task;
      if (!next_task(task)) return false;
      // The last part starting at or before `task` (parts without tasks start where the next does).
      const int64_t index =
          std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      part = &parts[index];
      part_task = task - first_task[index];
      return true;
    });
  });
}

template <typename acc_t>
void forward_pass(const std::vector<Part<acc_t>>& parts) {
  const auto tasks_of = [](const Problem<acc_t>& pb) { return num_query_block_tasks(pb); };
  run_part_tasks(parts, tasks_of, [&](const auto& next_task) {
    const at::TensorOptions& opts = parts.front().pb.acc_options;
    const int64_t d = parts.front().pb.head_dim;
    const at::Tensor q_scratch = at::empty({kBlockQ * d}, opts);
    const at::Tensor k_scratch = at::empty({kBlockK * d}, opts);
    const at::Tensor v_scratch = at::empty({kBlockK * d}, opts);
    const at::Tensor acc_scratch = at::empty({kBlockQ * d}, opts);
    const at::Tensor scores_scratch = at::empty({kBlockQ * kBlockK}, opts);
    const at::Tensor keep_scale_scratch = at::empty({kBlockQ * kBlockK}, opts);
    at::Tensor inverse_sums = at::empty({kBlockQ}, opts);
    OnlineSoftmax<acc_t> softmax(opts);

    const Part<acc_t>* part;
    for (int64_t task; next_task(part, task);) {
      const Problem<acc_t>& pb = part->pb;
      const auto& [q, k, v, out, lse, dout, dq, dk, dv] = part->t;
      const QueryBlockTask t(pb, task);
      const int64_t kv_head = t.h / pb.group_size();
      at::Tensor q_scaled = block_of(q_scratch, t.rows, d);
      q_scaled.copy_(head_rows(q, t.b, t.h, t.i0, t.rows)).mul_(pb.qk_scale);
      at::Tensor acc = block_of(acc_scratch, t.rows, d).zero_();
      softmax.reset(t.rows, pb.sink_log2(t.h));

      for_each_key_block(pb, t.i0, t.rows, [&](int64_t j0, int64_t cols) {
        const at::Tensor k_rows = in_acc_dtype(head_rows(k, t.b, kv_head, j0, cols), k_scratch);
        const at::Tensor v_rows = in_acc_dtype(head_rows(v, t.b, kv_head, j0, cols), v_scratch);
        at::Tensor scores = block_of(scores_scratch, t.rows, cols);
        compute_scores(pb, q_scaled, k_rows, t.b, t.h, t.i0, j0, scores, nullptr);
        softmax.step(scores);
        // The row sums above are those of the undropped probabilities, as flash-attn's.
        if (pb.dropout) {
          at::Tensor keep_scale = block_of(keep_scale_scratch, t.rows, cols);
          dropout_keep_scales(pb, t.b, t.h, t.i0, j0, keep_scale);
          scores.mul_(keep_scale);
        }
        acc.mul_(softmax.rescale().unsqueeze(1)).addmm_(scores, v_rows);
      });

      at::Tensor inverse = inverse_sums.narrow(0, 0, t.rows);
      softmax.inverse_sums(inverse);
      head_rows(out, t.b, t.h, t.i0, t.rows).copy_(acc.mul_(inverse.unsqueeze(1)));
      // (`template`: a structured binding is a dependent name inside a template.)
      acc_t* const lse_rows =
          lse.template data_ptr<acc_t>() + t.b * lse.stride(0) + t.h * lse.stride(1) + t.i0 * lse.stride(2);
      for (int64_t r = 0; r < t.rows; ++r) {
        lse_rows[r * lse.stride(2)] = softmax.lse_log2(r) * acc_t(M_LN2);
      }
    }
  });
}

// P = exp2(S - lse_log2) in place; rows with lse = +inf (no visible key) give 0.
void probabilities_from_scores(at::Tensor& scores, const at::Tensor& row_lse_log2) {
  scores.sub_(row_lse_log2.unsqueeze(1)).exp2_();
}

// Turns dP (in place) into the gradient with respect to q_scaled k^T, up to the
// constant factor dk_scale: P * (dP - D), times 1 - tanh^2 with the cap.
// tanh_scores is consumed.
template <typename acc_t>
void score_gradient(const Problem<acc_t>& pb, at::Tensor& dprobs, const at::Tensor& probs,
                    const at::Tensor& row_delta, at::Tensor& tanh_scores) {
  dprobs.sub_(row_delta.unsqueeze(1)).mul_(probs);
  if (pb.capped()) dprobs.mul_(tanh_scores.mul_(tanh_scores).neg_().add_(1));
}

// wide += part, elementwise, for contiguous blocks of one shape: a loop the
// compiler vectorises, which costs the backward 3% where a mixed-dtype
// at::add_ cost 6%.
template <typename acc_t>
void add_to_fp64(const at::Tensor& wide, const at::Tensor& part) {
  double* const sum = wide.data_ptr<double>();
  const acc_t* const term = part.data_ptr<acc_t>();
  for (int64_t i = 0, n = part.numel(); i < n; ++i) sum[i] += term[i];
}

// Per-thread scratch of the backward passes.
struct BackwardScratch {
  at::Tensor q, k, v, dout, acc, scores, tanh_scores, dprobs, keep_scale, dropped_probs;

  BackwardScratch(const at::TensorOptions& opts, int64_t d)
      : q(at::empty({kBlockQ * d}, opts)),
        k(at::empty({kBlockK * d}, opts)),
        v(at::empty({kBlockK * d}, opts)),
        dout(at::empty({kBlockQ * d}, opts)),
        acc(at::empty({std::max(kBlockQ, kBlockK) * d}, opts)),
        scores(at::empty({kBlockQ * kBlockK}, opts)),
        tanh_scores(at::empty({kBlockQ * kBlockK}, opts)),
        dprobs(at::empty({kBlockQ * kBlockK}, opts)),
        keep_scale(at::empty({kBlockQ * kBlockK}, opts)),
        dropped_probs(at::empty({kBlockQ * kBlockK}, opts)) {}
};

// The row terms of query rows [i0, i0 + rows) of head h that the block pairs read: D =
// rowsum(dout * out) and the lse in log2 units, into the part's row_delta and row_lse_log2.
template <typename acc_t>
void compute_row_terms(const Part<acc_t>& part, BackwardScratch& scratch, int64_t b, int64_t h, int64_t i0,
                       int64_t rows) {
  const auto& [q, k, v, out, lse, dout, dq, dk, dv] = part.t;
  const at::Tensor dout_rows = in_acc_dtype(head_rows(dout, b, h, i0, rows), scratch.dout);
  at::Tensor delta = part.row_delta[b][h].narrow(0, i0, rows);
  at::sum_out(delta, at::mul(dout_rows, head_rows(out, b, h, i0, rows)), 1);
  at::Tensor block_lse_log2 = part.row_lse_log2[b][h].narrow(0, i0, rows);
  at::mul_out(block_lse_log2, lse[b][h].narrow(0, i0, rows), M_LOG2E);
}

// One block pair of the backward: query rows [i0, i0 + rows) of head h against key rows [j0,
// j0 + cols) of its kv head, whose rows the caller has put in scratch (q scaled by qk_scale in
// scratch.q, dout, k and v in the accumulation dtype). Leaves the probabilities P V took (the
// dropped ones with dropout) in `probs` and the gradient with respect to q_scaled k^T, up to
// dk_scale, in `dscores`.
struct BlockPairGradients {
  at::Tensor probs, dscores;
};

template <typename acc_t>
BlockPairGradients block_pair_gradients(const Part<acc_t>& part, BackwardScratch& scratch,
                                        const at::Tensor& q_scaled, const at::Tensor& dout_rows,
                                        const at::Tensor& k_rows, const at::Tensor& v_rows, int64_t b, int64_t h,
                                        int64_t i0, int64_t j0) {
  const Problem<acc_t>& pb = part.pb;
  const int64_t rows = q_scaled.size(0), cols = k_rows.size(0);
  at::Tensor probs = block_of(scratch.scores, rows, cols);
  at::Tensor tanh_scores = block_of(scratch.tanh_scores, rows, cols);
  compute_scores(pb, q_scaled, k_rows, b, h, i0, j0, probs, &tanh_scores);
  probabilities_from_scores(probs, part.row_lse_log2[b][h].narrow(0, i0, rows));
  at::Tensor dprobs = block_of(scratch.dprobs, rows, cols);
  at::mm_out(dprobs, dout_rows, v_rows.t());
  // P V took the dropped probabilities; the softmax derivative takes the undropped ones.
  at::Tensor output_probs = probs;
  if (pb.dropout) {
    at::Tensor keep_scale = block_of(scratch.keep_scale, rows, cols);
    dropout_keep_scales(pb, b, h, i0, j0, keep_scale);
    dprobs.mul_(keep_scale);
    at::Tensor dropped = block_of(scratch.dropped_probs, rows, cols);
    output_probs = at::mul_out(dropped, probs, keep_scale);
  }
  score_gradient(pb, dprobs, probs, part.row_delta[b][h].narrow(0, i0, rows), tanh_scores);
  return {output_probs, dprobs};
}

// q rows [i0, i0 + rows) of head h scaled by qk_scale, and its dout rows, in the accumulation
// dtype in scratch.
template <typename acc_t>
std::pair<at::Tensor, at::Tensor> query_side_rows(const Part<acc_t>& part, BackwardScratch& scratch, int64_t b,
                                                  int64_t h, int64_t i0, int64_t rows) {
  const int64_t d = part.pb.head_dim;
  at::Tensor q_scaled = block_of(scratch.q, rows, d);
  q_scaled.copy_(head_rows(part.t.q, b, h, i0, rows)).mul_(part.pb.qk_scale);
  return {q_scaled, in_acc_dtype(head_rows(part.t.dout, b, h, i0, rows), scratch.dout)};
}

// A key's dk and dv are sums over up to group_size * seqlen_q query rows whose terms are not
// normalised (unlike dq's, whose weights are one row of P), so the sums grow like a random
// walk. Added block after block into one fp32 accumulator, every addition rounded at the
// running sum's size: with thousands of rows against a few keys (GQA) the error reached 4-25x
// PyTorch's fp32 error. So each query block's product (a BLAS sum of kBlockQ rows) goes into an
// fp64 accumulator, whose own rounding is negligible at any length. fp32 partials of 4 or 8
// blocks each, added in fp64, were still up to 3.5x PyTorch's error on one key seen by 16384
// rows.
struct KeyBlockScratch : BackwardScratch {
  at::Tensor dk_sums, dv_sums;  // fp64

  KeyBlockScratch(const at::TensorOptions& opts, int64_t d)
      : BackwardScratch(opts, d),
        dk_sums(at::empty({kBlockK * d}, opts.dtype(at::kDouble))),
        dv_sums(at::empty({kBlockK * d}, opts.dtype(at::kDouble))) {}
};

// dk and dv of key rows [j0, j0 + kBlockK) of kv head kv_head of batch entry b, summed over
// the kv head's query heads and, per head, the query blocks that see one of the keys; each
// block pair's gradients also go to with_pair(h, i0, rows, pair, k_rows).
template <typename acc_t, typename WithPair>
void key_block_gradients(const Part<acc_t>& part, KeyBlockScratch& scratch, int64_t b, int64_t kv_head, int64_t j0,
                         const WithPair& with_pair) {
  const Problem<acc_t>& pb = part.pb;
  const int64_t d = pb.head_dim, cols = std::min(kBlockK, pb.seqlen_k - j0);
  const at::Tensor k_rows = in_acc_dtype(head_rows(part.t.k, b, kv_head, j0, cols), scratch.k);
  const at::Tensor v_rows = in_acc_dtype(head_rows(part.t.v, b, kv_head, j0, cols), scratch.v);
  at::Tensor dk_sums = block_of(scratch.dk_sums, cols, d).zero_();
  at::Tensor dv_sums = block_of(scratch.dv_sums, cols, d).zero_();
  at::Tensor block_product = block_of(scratch.acc, cols, d);
  for (int64_t h = kv_head * pb.group_size(); h < (kv_head + 1) * pb.group_size(); ++h) {
    for_each_query_block(pb, j0, cols, [&](int64_t i0, int64_t rows) {
      const auto [q_scaled, dout_rows] = query_side_rows(part, scratch, b, h, i0, rows);
      const auto pair = block_pair_gradients(part, scratch, q_scaled, dout_rows, k_rows, v_rows, b, h, i0, j0);
      with_pair(h, i0, rows, pair, k_rows);
      add_to_fp64<acc_t>(dv_sums, at::mm_out(block_product, pair.probs.t(), dout_rows));
      add_to_fp64<acc_t>(dk_sums, at::mm_out(block_product, pair.dscores.t(), q_scaled));
    });
  }
  head_rows(part.t.dk, b, kv_head, j0, cols).copy_(dk_sums.mul_(pb.dk_scale));
  head_rows(part.t.dv, b, kv_head, j0, cols).copy_(dv_sums);
}

// Two ways to run the backward, one result: the same block pairs (but for some wholly masked
// ones, which add zeros), the same sums in the same order (dq over key blocks in ascending
// order, dk and dv over the group's heads and then their query blocks), each task owning the
// output rows it writes, so the result depends on neither the way, the schedule nor the thread
// count.
//  - two passes (dq_pass, then dkdv_pass) with many small tasks: per (batch, head, query
//    block) the row terms and dq; then per (batch, kv head, key block) dk and dv. The second
//    recomputes S, P and dP: 7 block matmuls per pair.
//  - one pass (fused_pass) per (batch, kv head): its heads' row terms, then per key block
//    dk, dv and every query block's dq term at once, 5 matmuls per pair, dq's sums in dq
//    itself (or a copy of it in the accumulation dtype: no memory per thread). Fewer,
//    larger tasks: taken where they keep every thread busy (use_fused_pass).

// Backward pass 1 of 2: per (batch, head, query block), the row terms and dq.
template <typename acc_t>
void dq_pass(const std::vector<Part<acc_t>>& parts, double softmax_scale) {
  const auto tasks_of = [](const Problem<acc_t>& pb) { return num_query_block_tasks(pb); };
  run_part_tasks(parts, tasks_of, [&](const auto& next_task) {
    const int64_t d = parts.front().pb.head_dim;
    BackwardScratch scratch(parts.front().pb.acc_options, d);

    const Part<acc_t>* part;
    for (int64_t task; next_task(part, task);) {
      const Problem<acc_t>& pb = part->pb;
      const QueryBlockTask t(pb, task);
      const int64_t kv_head = t.h / pb.group_size();
      compute_row_terms(*part, scratch, t.b, t.h, t.i0, t.rows);
      const auto [q_scaled, dout_rows] = query_side_rows(*part, scratch, t.b, t.h, t.i0, t.rows);
      at::Tensor dq_acc = block_of(scratch.acc, t.rows, d).zero_();
      for_each_key_block(pb, t.i0, t.rows, [&](int64_t j0, int64_t cols) {
        const at::Tensor k_rows = in_acc_dtype(head_rows(part->t.k, t.b, kv_head, j0, cols), scratch.k);
        const at::Tensor v_rows = in_acc_dtype(head_rows(part->t.v, t.b, kv_head, j0, cols), scratch.v);
        const auto g = block_pair_gradients(*part, scratch, q_scaled, dout_rows, k_rows, v_rows, t.b, t.h, t.i0, j0);
        dq_acc.addmm_(g.dscores, k_rows);
      });
      // qk_scale * dk_scale is softmax_scale, with the cap or without.
      head_rows(part->t.dq, t.b, t.h, t.i0, t.rows).copy_(dq_acc.mul_(softmax_scale));
    }
  });
}

// Backward pass 2 of 2: per (batch, kv head, key block), dk and dv summed over the kv head's
// query-head group. Tasks go in key-block order, heaviest first under causal masking (early
// keys are seen by most queries).
template <typename acc_t>
void dkdv_pass(const std::vector<Part<acc_t>>& parts) {
  const auto tasks_of = [](const Problem<acc_t>& pb) { return num_key_block_tasks(pb); };
  run_part_tasks(parts, tasks_of, [&](const auto& next_task) {
    KeyBlockScratch scratch(parts.front().pb.acc_options, parts.front().pb.head_dim);
    const Part<acc_t>* part;
    for (int64_t task; next_task(part, task);) {
      const Problem<acc_t>& pb = part->pb;
      const int64_t num_kv_heads = pb.batch * pb.nheads_kv;
      key_block_gradients(*part, scratch, task % num_kv_heads / pb.nheads_kv, task % num_kv_heads % pb.nheads_kv,
                          task / num_kv_heads * kBlockK, [](auto&&...) {});
    }
  });
}

// The whole backward in one pass: per (batch, kv head), the row terms of its heads, then per
// key block (ascending, as dq_pass adds them) dk and dv as dkdv_pass sums them, and each
// query block's dq term added to its rows of dq_sums, as dq_pass accumulates them.
template <typename acc_t>
void fused_pass(const std::vector<Part<acc_t>>& parts, double softmax_scale) {
  const auto tasks_of = [](const Problem<acc_t>& pb) { return pb.batch * pb.nheads_kv; };
  run_part_tasks(parts, tasks_of, [&](const auto& next_task) {
    KeyBlockScratch scratch(parts.front().pb.acc_options, parts.front().pb.head_dim);
    const Part<acc_t>* part;
    for (int64_t task; next_task(part, task);) {
      const Problem<acc_t>& pb = part->pb;
      const int64_t b = task / pb.nheads_kv, kv_head = task % pb.nheads_kv;
      const int64_t first_head = kv_head * pb.group_size(), end_head = first_head + pb.group_size();
      for (int64_t h = first_head; h < end_head; ++h) {
        head_rows(part->dq_sums, b, h, 0, pb.seqlen_q).zero_();
        for (int64_t i0 = 0; i0 < pb.seqlen_q; i0 += kBlockQ)
          compute_row_terms(*part, scratch, b, h, i0, std::min(kBlockQ, pb.seqlen_q - i0));
      }
      for (int64_t j0 = 0; j0 < pb.seqlen_k; j0 += kBlockK)
        key_block_gradients(*part, scratch, b, kv_head, j0,
                            [&](int64_t h, int64_t i0, int64_t rows, const auto& pair, const at::Tensor& k_rows) {
                              head_rows(part->dq_sums, b, h, i0, rows).addmm_(pair.dscores, k_rows);
                            });
      for (int64_t h = first_head; h < end_head; ++h) {
        at::Tensor sums = head_rows(part->dq_sums, b, h, 0, pb.seqlen_q).mul_(softmax_scale);
        if (!part->dq_sums.is_same(part->t.dq)) head_rows(part->t.dq, b, h, 0, pb.seqlen_q).copy_(sums);
      }
    }
  });
}

// Whether fused_pass's tasks, one per (part, batch entry, kv head), keep every thread busy for
// about as long as the two passes' would: its 5 matmuls per block pair against their 7, with
// the longest task bounding the time. Costs in block pairs of the unmasked problem.
template <typename acc_t>
bool use_fused_pass(const std::vector<Part<acc_t>>& parts) {
  double total = 0, longest = 0;
  for (const Part<acc_t>& part : parts) {
    const Problem<acc_t>& pb = part.pb;
    const double task = double(pb.group_size()) * ceil_div(pb.seqlen_q, kBlockQ) * ceil_div(pb.seqlen_k, kBlockK);
    total += task * pb.batch * pb.nheads_kv;
    longest = std::max(longest, task);
  }
  const double threads = at::get_num_threads();
  return 5 * std::max(longest, total / threads) <= 7 * (total / threads);
}

// dsink[b, h] = -sum_i exp(sink_h - lse_i) D_i over the rows i of head h of batch entry b:
// the sink's probability times the gradient with respect to its logit, dP_sink - D = -D
// (it adds no value to out). Summed in fp64 from the rows' lse and D that compute_row_terms left.
template <typename acc_t>
void sink_gradient(const std::vector<Part<acc_t>>& parts, const at::Tensor& learnable_sink,
                   at::Tensor& dsink) {
  for (const Part<acc_t>& part : parts) {
    const Problem<acc_t>& pb = part.pb;
    const at::Tensor sink_log2 = learnable_sink.to(pb.acc_options.dtype()).mul(M_LOG2E).view({1, -1, 1});
    const at::Tensor sink_probs = (sink_log2 - part.row_lse_log2).exp2_();
    dsink.narrow(0, pb.first_batch_entry, pb.batch)
        .copy_(at::sum(sink_probs.mul_(part.row_delta), {2}, false, at::kDouble).neg_());
  }
}

AttentionOptions make_options(double softmax_scale, bool causal, int64_t window_left,
                              int64_t window_right, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                              const std::optional<at::Tensor>& rng_state, SequenceLayout layout,
                              const std::optional<at::Tensor>& learnable_sink) {
  return AttentionOptions{softmax_scale, causal,    window_left, window_right,      softcap,
                          alibi_slopes,  dropout_p, rng_state,   std::move(layout), learnable_sink};
}

}  // namespace

// P = exp(S - lse) of every visible (row, key) of each part into probs (the call's (batch,
// nheads, seqlen_q, seqlen_k) tensor, rounded shape), negated where dropout drops it.
template <typename acc_t>
void probabilities_pass(const std::vector<Part<acc_t>>& parts, at::Tensor& probs) {
  const auto tasks_of = [](const Problem<acc_t>& pb) { return num_query_block_tasks(pb); };
  run_part_tasks(parts, tasks_of, [&](const auto& next_task) {
    const int64_t d = parts.front().pb.head_dim;
    BackwardScratch scratch(parts.front().pb.acc_options, d);  // dq_pass's P, without its dP

    const Part<acc_t>* part;
    for (int64_t task; next_task(part, task);) {
      const Problem<acc_t>& pb = part->pb;
      const at::Tensor& q = part->t.q;
      const at::Tensor& k = part->t.k;
      const at::Tensor& lse = part->t.lse;
      const QueryBlockTask t(pb, task);
      const int64_t kv_head = t.h / pb.group_size();
      at::Tensor q_scaled = block_of(scratch.q, t.rows, d);
      q_scaled.copy_(head_rows(q, t.b, t.h, t.i0, t.rows)).mul_(pb.qk_scale);
      at::Tensor block_lse_log2 = scratch.acc.narrow(0, 0, t.rows);
      at::mul_out(block_lse_log2, lse[t.b][t.h].narrow(0, t.i0, t.rows), M_LOG2E);
      at::Tensor rows = probs[pb.first_batch_entry + t.b][t.h].narrow(0, t.i0, t.rows);
      for_each_key_block(pb, t.i0, t.rows, [&](int64_t j0, int64_t cols) {
        const at::Tensor k_rows = in_acc_dtype(head_rows(k, t.b, kv_head, j0, cols), scratch.k);
        at::Tensor block = block_of(scratch.scores, t.rows, cols);
        compute_scores(pb, q_scaled, k_rows, t.b, t.h, t.i0, j0, block, nullptr);
        probabilities_from_scores(block, block_lse_log2);
        if (pb.dropout) {
          at::Tensor keep_scale = block_of(scratch.keep_scale, t.rows, cols);
          dropout_keep_scales(pb, t.b, t.h, t.i0, j0, keep_scale);
          block.mul_(at::where(keep_scale == 0, -1.0, 1.0));
        }
        rows.narrow(1, j0, cols).copy_(block);
      });
    }
  });
}

at::Tensor attention_probabilities_cpu(FLASHATTN_PROBABILITIES_ARGS) {
  const AttentionOptions opts = make_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                                             dropout_p, rng_state, SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES},
                                             std::nullopt);
  check_probabilities_inputs(q, k, lse, opts, kCpuBackend);
  check_sequence_values(q, k, opts);
  at::Tensor probs = allocate_probabilities(q, k, opts);
  if (is_empty_problem(q, k, opts)) return probs;
  const CallTensors tensors{q, k, at::Tensor(), at::Tensor(), lse};
  if (q.scalar_type() == at::kDouble) {
    probabilities_pass(make_parts<double>(tensors, opts), probs);
  } else {
    probabilities_pass(make_parts<float>(tensors, opts), probs);
  }
  return probs;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(FLASHATTN_FORWARD_ARGS) {
  return attention_forward_cpu_with_options(
      q, k, v,
      make_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
                   SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, learnable_sink));
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu_with_options(const at::Tensor& q, const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      const AttentionOptions& opts) {
  check_forward_inputs(q, k, v, opts, kCpuBackend);
  // make_parts reads the sequence tensors as they are: their values must be sound.
  check_sequence_values(q, k, opts);
  auto [out, lse] = allocate_forward_outputs(q, opts);
  if (is_empty_problem(q, k, opts)) {
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  const CallTensors tensors{q, k, v, out, lse};
  if (q.scalar_type() == at::kDouble) {
    forward_pass(make_parts<double>(tensors, opts));
  } else {
    forward_pass(make_parts<float>(tensors, opts));
  }
  return {out, lse};
}

BackwardGradients attention_backward_cpu(FLASHATTN_BACKWARD_ARGS) {
  // Deterministic whatever `deterministic` says (the comment before dq_pass says why).
  static_cast<void>(deterministic);
  const AttentionOptions opts =
      make_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   dropout_p, rng_state, SequenceLayout{FLASHATTN_SEQUENCE_ARG_NAMES}, learnable_sink);
  check_backward_inputs(dout, q, k, v, out, lse, opts, kCpuBackend);
  check_sequence_values(q, k, opts);
  auto [dq, dk, dv, dsink] = allocate_backward_outputs(q, k, v, opts);
  if (is_empty_problem(q, k, opts)) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dsink};
  }
  const CallTensors tensors{q, k, v, out, lse, dout, dq, dk, dv};
  const auto run = [&](auto parts) {
    for (auto& part : parts) {
      const auto& pb = part.pb;
      part.row_lse_log2 = at::empty({pb.batch, pb.nheads_q, pb.seqlen_q}, pb.acc_options);
      part.row_delta = at::empty_like(part.row_lse_log2);
    }
    if (use_fused_pass(parts)) {
      for (auto& part : parts) {
        const bool dq_has_acc_dtype = part.t.dq.scalar_type() == part.pb.acc_options.dtype();
        part.dq_sums = dq_has_acc_dtype ? part.t.dq : at::empty_like(part.t.dq, part.pb.acc_options);
      }
      fused_pass(parts, softmax_scale);
    } else {
      dq_pass(parts, softmax_scale);
      dkdv_pass(parts);
    }
    if (learnable_sink) sink_gradient(parts, *learnable_sink, dsink);
  };
  if (q.scalar_type() == at::kDouble) {
    run(make_parts<double>(tensors, opts));
  } else {
    run(make_parts<float>(tensors, opts));
  }
  return {dq, dk, dv, dsink};
}

}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("attention_forward", TORCH_FN(flashattn::attention_forward_cpu));
  m.impl("attention_backward", TORCH_FN(flashattn::attention_backward_cpu));
  m.impl("attention_probabilities", TORCH_FN(flashattn::attention_probabilities_cpu));
}
