// CUDA flash_attn_with_kvcache (attention_kvcache_forward): checks, then three launches on
// the current stream: prepare (rotary, packed-GQA q, new rows into the cache), the
// attention kernel of q's head-dim tile into split-KV partials, and the combine; or, for
// a long chunk on a contiguous cache, prepare and the dense forward kernel.
// Nothing here depends on tensor values (the number of splits and every size come from
// shapes), so a decode step can be captured in a CUDA graph and replayed with new
// cache_seqlens.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_api.h"
#include "attention_ops.h"
#include "cuda/cuda_backend.h"
#include "cuda/kvcache/kvcache_launch.h"
#include "kvcache_api.h"

namespace flashattn {
namespace {

struct KvcacheTileInfoReader {
  DeviceLimits limits;
  int packed_rows;
  KvcacheTileInfo* info;

  template <int W>
  cudaError_t launch() const {
    *info = kvcache_tile_info<W>(limits, packed_rows);
    return cudaSuccess;
  }
};

struct KvcacheAttentionLauncher {
  const KvcacheFwdParams& params;
  DeviceLimits limits;
  cudaStream_t stream;

  template <int W>
  cudaError_t launch() const {
    // The sink joins in the combine kernel, once per row, and there is no dropout: the
    // logit's modifiers only (the dispatch's other cases never run).
    return dispatch_score_mod(backward_score_mod(params),
                              [&](auto mod) { return launch_variant<W, logit_mod(mod())>(); });
  }
  template <int W, ScoreMod kMod>
  cudaError_t launch_variant() const {
    return params.is_bf16 ? launch_kvcache_attention<__nv_bfloat16, W, kMod>(params, limits, stream)
                          : launch_kvcache_attention<__half, W, kMod>(params, limits, stream);
  }
};

// The cache is written in place, so it cannot be copied to an aligned one as q can.
void check_cache_rows_aligned(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(has_16_byte_rows(cache), "flashattn_ext: the CUDA kernels read ", name, " in 16-byte pieces: its data "
              "pointer and its strides (got ", cache.strides(), ") must be multiples of 16 bytes");
}

const int* int_data(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<int>() : nullptr; }

// Chunked prefill on the Hopper (wgmma) forward: against a 32k cache (one batch entry, 32
// query heads) it reads 354-654 TFLOP/s at chunks of 256-2048 rows where the split kernel's
// mma.sync reads 245-260, but 178 against 220 at 128 rows, whose 32 tiles of 128 rows
// leave most of the 132 SMs idle (benchmarks/RESULTS.md). So a chunk goes there when its
// 128-row tiles number at least 3/8 of the SMs (50 of 132: between those 32 and the 64 of
// 256 rows). The dense kernel takes the cache as k, v with seqused_k = cache_seqlens +
// the appended rows, so only what that layout can say: a contiguous cache, batch entry b
// in cache row b from row 0, q as given (rotary needs the prepare kernel's rotated copy).
// num_splits does not apply.
constexpr int64_t kDenseChunkTileRows = 128;

bool chunk_runs_dense(const KvcacheOptions& opts, const KvcacheSizes& sizes, const DeviceLimits& limits) {
  const int64_t tiles = sizes.batch * sizes.nheads_q * ((sizes.seqlen_q + kDenseChunkTileRows - 1) / kDenseChunkTileRows);
  return limits.hopper_kernels && sizes.seqlen_q >= kDenseChunkTileRows && 8 * tiles >= 3 * limits.num_sms &&
         !opts.paged() && !opts.cache_batch_idx.has_value() && !opts.cache_leftpad.has_value() &&
         !opts.rotary_cos.has_value();
}

void run_dense_chunk(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
                     const at::Tensor& lse, const KvcacheOptions& opts, int64_t seqlen_new, const DeviceLimits& limits,
                     cudaStream_t stream) {
  const AttentionOptions dense{opts.softmax_scale, opts.causal, opts.window_left, opts.window_right, opts.softcap,
                               opts.alibi_slopes,  0.0,         std::nullopt,
                               SequenceLayout{std::nullopt, std::nullopt, std::nullopt, opts.cache_seqlens},
                               opts.learnable_sink};
  AttentionFwdParams params = make_forward_params(q, k_cache, v_cache, out, lse, dense);
  params.seqused_k_add = static_cast<int>(seqlen_new);
  run_forward_kernel(params, limits, stream);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_kvcache_forward_cuda(FLASHATTN_KVCACHE_FORWARD_ARGS) {
  const KvcacheOptions opts = FLASHATTN_KVCACHE_OPTIONS;
  check_kvcache_inputs(q, k_cache, v_cache, opts, cuda_kvcache_features());
  check_cuda_device(q);
  check_cache_rows_aligned(k_cache, "k_cache");
  check_cache_rows_aligned(v_cache, "v_cache");
  const c10::cuda::CUDAGuard device_guard(q.device());
  if (host_value_checks_enabled())
    check_kvcache_values(q, k_cache, opts);
  const KvcacheSizes sizes = kvcache_sizes(q, k_cache, opts);
  auto [out, lse] = allocate_kvcache_outputs(q);
  const DeviceLimits limits = device_limits(q);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  const bool dense_chunk = chunk_runs_dense(opts, sizes, limits);
  // ALiBi's slope is a query head's and the kernel's score transform takes one per tile, so
  // an ALiBi call packs no GQA: a tile head is a query head.
  const int group = opts.alibi_slopes.has_value() ? 1 : static_cast<int>(sizes.nheads_q / sizes.nheads_kv);
  const int64_t tile_heads = sizes.nheads_q / group;
  const int64_t packed_rows = sizes.seqlen_q * group;
  // The attention kernel reads q in place where its packed rows lie at one stride (one
  // query row: packed row r of tile head h is query head h * group + r; or one query head
  // per tile head); otherwise, and to rotate it, the prepare kernel writes a packed copy.
  const bool copy_q = !dense_chunk && (opts.rotary_cos.has_value() || (group > 1 && sizes.seqlen_q > 1));
  const at::Tensor q_read =
      copy_q ? at::empty({sizes.batch, tile_heads, packed_rows, sizes.head_dim}, q.options()) : with_16_byte_rows(q);
  KvcacheFwdParams p{};
  p.q = q_read.data_ptr();
  if (copy_q)
    p.q_strides = TensorStrides{q_read.stride(0), q_read.stride(2), q_read.stride(1)};
  else if (sizes.seqlen_q == 1)
    p.q_strides = TensorStrides{q_read.stride(0), q_read.stride(2), group * q_read.stride(2)};
  else
    p.q_strides = strides_of(q_read);
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.k_strides = strides_of(k_cache);
  p.v_strides = strides_of(v_cache);
  p.out = out.data_ptr();
  p.out_strides = strides_of(out);
  p.lse = lse.data_ptr<float>();
  p.lse_strides = TensorStrides{lse.stride(0), 1, lse.stride(1)};
  p.batch = static_cast<int>(sizes.batch);
  p.nheads_q = static_cast<int>(sizes.nheads_q);
  p.nheads_kv = static_cast<int>(sizes.nheads_kv);
  p.seqlen_q = p.rows_q = static_cast<int>(sizes.seqlen_q);
  p.seqlen_k = p.rows_k = static_cast<int>(sizes.capacity);
  p.head_dim = static_cast<int>(sizes.head_dim);
  // The keys each sequence ends at: cache_seqlens[b] + seqlen_new (absent: whole cache rows).
  p.seqused_k = int_data(opts.cache_seqlens);
  p.seqlen_new = static_cast<int>(sizes.seqlen_new);
  p.softmax_scale = static_cast<float>(opts.softmax_scale);
  p.softmax_scale_log2 = static_cast<float>(opts.softmax_scale * M_LOG2E);
  p.softcap = static_cast<float>(opts.softcap);
  if (opts.learnable_sink.has_value()) p.learnable_sink = opts.learnable_sink->data_ptr<float>();
  set_alibi_slopes(p, opts.alibi_slopes);
  const AttentionOptions window_opts{opts.softmax_scale, opts.causal, opts.window_left, opts.window_right,
                                     opts.softcap,       std::nullopt, 0.0, std::nullopt, SequenceLayout{},
                                     std::nullopt};
  std::tie(p.window_left, p.window_right) = effective_window(window_opts, sizes.seqlen_q, sizes.capacity);
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
  if (opts.paged()) {
    p.block_table = opts.block_table->data_ptr<int>();
    p.block_table_batch_stride = opts.block_table->stride(0);
    p.pages_per_row = static_cast<int>(opts.block_table->size(1));
    p.page_size = static_cast<int>(sizes.page_size);
    p.num_pages = static_cast<int>(sizes.cache_rows);
  }
  p.cache_batch_idx = int_data(opts.cache_batch_idx);
  p.cache_leftpad = int_data(opts.cache_leftpad);
  p.group = group;
  p.tile_heads = static_cast<int>(tile_heads);
  p.tile_heads_per_kv_head = static_cast<int>(tile_heads / sizes.nheads_kv);
  p.packed_rows = static_cast<int>(packed_rows);
  KvcacheTileInfo tile{};
  cudaError_t status = cudaSuccess;
  if (!dispatch_head_dim_tile(p.head_dim, KvcacheTileInfoReader{limits, p.packed_rows, &tile}, &status))
    fail_head_dim_not_compiled(p.head_dim);
  // A dense chunk runs no split kernel: no partials.
  p.num_splits = dense_chunk ? 0
                             : kvcache_num_splits(static_cast<int>(opts.num_splits), p.batch, p.tile_heads,
                                                  p.packed_rows, p.seqlen_k, opts.paged(), tile, limits);
  const at::Tensor out_partial = at::empty({p.num_splits, sizes.batch, tile_heads, packed_rows, sizes.head_dim},
                                           q.options().dtype(at::kFloat));
  const at::Tensor lse_partial =
      at::empty({p.num_splits, sizes.batch, tile_heads, packed_rows}, q.options().dtype(at::kFloat));
  p.out_partial = out_partial.data_ptr<float>();
  p.lse_partial = lse_partial.data_ptr<float>();

  KvcachePrepareParams prep{};
  prep.q = q.data_ptr();
  prep.q_strides = strides_of(q);
  prep.q_packed = copy_q ? q_read.data_ptr() : nullptr;
  if (opts.appends()) {
    prep.k_new = opts.k_new->data_ptr();
    prep.v_new = opts.v_new->data_ptr();
    prep.k_new_strides = strides_of(*opts.k_new);
    prep.v_new_strides = strides_of(*opts.v_new);
    prep.seqlen_new = static_cast<int>(sizes.seqlen_new);
    prep.cache_seqlens = int_data(opts.cache_seqlens);
  }
  if (opts.rotary_cos.has_value()) {
    prep.rotary_cos = opts.rotary_cos->data_ptr();
    prep.rotary_sin = opts.rotary_sin->data_ptr();
    prep.rotary_rows = static_cast<int>(opts.rotary_cos->size(0));
    prep.rotary_dim = static_cast<int>(sizes.rotary_dim);
    prep.rotary_interleaved = opts.rotary_interleaved;
    prep.rotate_q_per_position = rotary_q_positions_advance(opts, sizes.capacity);
  }
  check_cuda_status(launch_kvcache_prepare(p, prep, stream), "the KV-cache prepare kernel launch");
  if (out.numel() == 0) return {out, lse};
  if (dense_chunk) {
    run_dense_chunk(q_read, k_cache, v_cache, out, lse, opts, sizes.seqlen_new, limits, stream);
    return {out, lse};
  }
  const KvcacheAttentionLauncher launcher{p, limits, stream};
  if (!dispatch_head_dim_tile(p.head_dim, launcher, &status)) fail_head_dim_not_compiled(p.head_dim);
  check_cuda_status(status, "the KV-cache attention kernel launch");
  check_cuda_status(launch_kvcache_combine(p, stream), "the KV-cache combine kernel launch");
  return {out, lse};
}

}  // namespace flashattn
