// Operator schemas of flashattn_ext. Each backend file registers its kernels for
// these with TORCH_LIBRARY_IMPL (the Meta kernels in csrc/meta/); the Python package
// adds autograd in flashattn_ext/ops.py.
//
// The schemas carry every feature planned (window, softcap, ALiBi, dropout, learnable
// sinks, deterministic backward), so adding a kernel feature never changes them: a
// backend that lacks a feature refuses it with NotImplementedError.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

// The sequence arguments, shared by both ops. cu_seqlens_q (int32, batch + 1) makes q
// variable-length: (total_q, nheads, head_dim), sequence b its rows cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1], max_seqlen_q at least the longest (likewise k and v with
// cu_seqlens_k). seqused_q / seqused_k (int32, batch) keep only the first seqused[b]
// rows of each sequence, varlen or dense; the rows past them get out = 0, lse = +inf
// and zero gradients.
#define FLASHATTN_SEQUENCE_SCHEMA                                                          \
  "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, "        \
  "Tensor? seqused_k=None, int max_seqlen_q=-1, int max_seqlen_k=-1"

// learnable_sink (fp32, (nheads,); FlashAttention-4's learnable_sink, gpt-oss's sinks): one
// logit per query head that joins every row's softmax denominator and contributes no
// value. lse includes it, so the backward's P = exp(s - lse) sums to 1 - exp(sink - lse)
// over the keys, and a row that sees no key gets out = 0 and lse = sink.
#define FLASHATTN_SINK_SCHEMA "Tensor? learnable_sink=None"

TORCH_LIBRARY(flashattn_ext, m) {
  // q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim).
  // Returns out like q and lse (batch, nheads, seqlen_q) fp32 ((nheads, total_q) for a
  // variable-length q), natural log; a row
  // that sees no key gets out = 0 and lse = +inf. `deterministic` does not change the
  // forward: it is the choice of backward, carried by the op so that its autograd
  // formula (flashattn_ext/ops.py) needs no state of its own.
  // Dropout (dropout_p > 0) keeps each probability with probability 1 - dropout_p (rounded
  // to a multiple of 1/256) and scales it by 1 / (1 - dropout_p) before P V; the mask is a function of rng_state
  // (int64 [seed, offset]) and the element's position (csrc/common/philox.h). lse is that of the
  // undropped probabilities.
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
      "float dropout_p, Tensor? rng_state, bool deterministic=False, " FLASHATTN_SEQUENCE_SCHEMA
      ", " FLASHATTN_SINK_SCHEMA ") -> (Tensor out, Tensor lse)");
  // Recomputes the attention blocks (and the dropout mask) from q, k, the saved lse and
  // rng_state; never stores P. dsink is fp32 (batch, nheads), each batch entry's share of
  // the sink's gradient (the autograd formula sums it over the batch; kept apart so that
  // torch.vmap can unfold it), and (batch, 0) without a sink.
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "Tensor? alibi_slopes, float dropout_p, Tensor? rng_state, bool deterministic, "
      FLASHATTN_SEQUENCE_SCHEMA ", " FLASHATTN_SINK_SCHEMA
      ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsink)");
  // The attention probabilities of a forward call, for testing (return_attn_probs=True; it
  // forms the N x N matrix the kernels exist to avoid): flash-attn's S_dmask, (batch, nheads,
  // seqlen_q, seqlen_k) in q's dtype, each seqlen the longest sequence rounded up to a
  // multiple of 128: P = exp(S - lse) from q, k and the forward's lse (so with a learnable
  // sink, its share is missing from each row), 0 where a key is not visible and in the
  // padding, and -P where dropout drops the element (the mask of rng_state, as the forward
  // drew it). Computed by the CPU backend (CUDA tensors are copied to it and back).
  m.def(
      "attention_probabilities(Tensor q, Tensor k, Tensor lse, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
      "Tensor? rng_state, " FLASHATTN_SEQUENCE_SCHEMA ") -> Tensor");
  // flash_attn_with_kvcache (inference: no autograd). q (batch, seqlen_q, nheads, head_dim);
  // k_cache, v_cache (batch_cache, seqlen_cache, nheads_kv, head_dim), or with block_table
  // (int32 (batch, max_blocks_per_seq)) paged: (num_blocks, page_size, nheads_kv, head_dim),
  // row r of sequence b in block block_table[b][r / page_size] at row r % page_size.
  // Batch entry b uses cache row cache_batch_idx[b] (default b). k_new / v_new
  // (batch, seqlen_new, nheads_kv, head_dim) are written in place at rows cache_seqlens[b] ..
  // cache_seqlens[b] + seqlen_new - 1, k_new rotated first when rotary_cos / rotary_sin
  // ((seqlen_ro, rotary_dim / 2)) are given; nothing else of the caches is written. Then q
  // (rotated too) attends to rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1, the
  // mask and window aligned bottom-right on them. cache_seqlens (int32 (batch,)) absent: the
  // whole cache row, and no k_new. Rotary positions are cache rows: k_new row t at
  // cache_seqlens[b] + t, q row i at cache_seqlens[b] + i when causal or windowed, else all at
  // cache_seqlens[b] (flash-attn's rule). num_splits: the keys split in that many parts whose
  // partial results are merged by log-sum-exp (0: the backend chooses; the result does not
  // depend on it beyond rounding). Returns out like q and lse (batch, nheads, seqlen_q) as
  // attention_forward does.
  m.def(
      "attention_kvcache_forward(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_new, "
      "Tensor? v_new, Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, float softmax_scale, "
      "bool causal, int window_left, int window_right, float softcap, bool rotary_interleaved, "
      "Tensor? alibi_slopes, int num_splits, " FLASHATTN_SINK_SCHEMA ") -> (Tensor out, Tensor lse)");
}

// attention_kvcache_forward has no derivative (nor has flash-attn's). A mutable op cannot
// take a Python formula (torch.library.register_autograd wants a functional schema), so it
// gets torch's "not implemented" autograd kernels: a backward through its out raises an
// error naming the op, rather than silently giving zero gradients, and the ADInplaceOrView
// kernel bumps the caches' version counters, so autograd sees that they were written.
// attention_probabilities, a testing aid, has no derivative either: the same error.
TORCH_LIBRARY_IMPL(flashattn_ext, Autograd, m) {
  m.impl("attention_kvcache_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("attention_probabilities", torch::autograd::autogradNotImplementedFallback());
}
TORCH_LIBRARY_IMPL(flashattn_ext, ADInplaceOrView, m) {
  m.impl("attention_kvcache_forward", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}
