// Plain description of one attention call, shared by every backend.
// No torch types here: the CUDA kernels include this header and stay
// torch-free, so they compile fast and can be built and tested alone.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHATTN_HOST_DEVICE inline
#endif

namespace flashattn {

// Layout of q/k/v/out/dout/dq/dk/dv is (batch, seqlen, nheads, head_dim) with a
// contiguous last dimension; every other stride is carried as given (elements). A
// variable-length side, (total, nheads, head_dim), has batch stride 0: its sequences
// start at their cu_seqlens row (sequence_info.h).
struct TensorStrides {
  int64_t batch;
  int64_t row;
  int64_t head;
};

struct AttentionFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // (batch, nheads_q, seqlen_q), or (nheads_q, total_q) variable-length

  TensorStrides q_strides, k_strides, v_strides, out_strides;
  TensorStrides lse_strides;  // row stride 1

  int batch;
  int nheads_q;
  int nheads_kv;  // nheads_q % nheads_kv == 0 (MQA/GQA)
  int seqlen_q;   // the longest query sequence (dense: every one), <= rows_q
  int seqlen_k;   // the longest key sequence, <= rows_k
  int rows_q;     // rows of q per (batch entry, head): seqlen_q dense, total_q variable-length
  int rows_k;
  int head_dim;  // multiple of 8, <= 256

  // Variable-length batches (nullptr: dense; see sequence_info.h). cu_seqlens_*: batch + 1
  // row offsets; seqused_*: rows used of each sequence.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_q;
  const int* seqused_k;
  // Added to each seqused_k: the rows a KV-cache call appends (its seqused_k is
  // cache_seqlens, the lengths before them); 0 elsewhere.
  int seqused_k_add;

  float softmax_scale;
  float softmax_scale_log2;  // softmax_scale * log2(e)

  // Key j is visible from query i iff
  //   i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k - seqlen_q) + window_right
  // (bottom-right alignment); a negative bound means unbounded on that side.
  // Causal is window_right == 0.
  int window_left;
  int window_right;

  float softcap;               // 0: off; else s = softcap * tanh(s / softcap)
  const float* alibi_slopes;   // nullptr: off; else slope per (batch, head)
  int64_t alibi_batch_stride;  // 0 when the slopes are shared by the batch
  const float* learnable_sink; // nullptr: off; else (nheads_q,) logits joining each row's softmax

  // Dropout (common/philox.h): nullptr: off; else the call's [seed, offset] in the kernels'
  // memory, read by them (never by the host: CUDA-graph capture replays fresh values).
  const int64_t* rng_state;
  uint32_t dropout_threshold;  // a byte below it drops its probability (common/philox.h)
  float dropout_scale;         // 1 / (1 - dropout_p), the scale of a kept probability

  bool is_bf16;  // else fp16 (CUDA); the CPU backend dispatches on its own

  // The Hopper forward's persistent grid takes its tiles from this counter, zeroed before the
  // launch (nullptr: one block per tile).
  int* tile_counter;
  // The forward grids' order of a variable-length batch's sequences (cuda/batch_order.h, most
  // keys first), or nullptr: batch order.
  const int* batch_order;
};

struct AttentionBwdParams : AttentionFwdParams {
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;

  // fp32 workspaces, owned by the caller, laid out by the backward kernel's launch layer.
  // Rows as backward_workspace_row (backward_launch.h) lays them out.
  float* dq_accum;   // (rows, head_dim_rounded) in 8 x 8 tiles (dq_accum_offset or _transposed), zeroed first
  float* softmax_d;  // (rows): D = rowsum(dout * out)
  float* lse_log2;   // (rows): lse * log2(e), +inf for rows that see no key and padding
  int* dq_semaphore; // deterministic mode: one turn counter per (batch, head, query block)

  int seqlen_q_rounded;  // the longest query sequence, in whole 128-row blocks
  int head_dim_rounded;
  int64_t workspace_batch_stride, workspace_head_stride;  // rows (backward_workspace_row)
  int64_t workspace_rows;
  bool deterministic;
};

// Whether key column j is visible from query row i (the one definition of the mask).
FLASHATTN_HOST_DEVICE bool key_visible(int i, int j, int seqlen_q, int seqlen_k, int window_left,
                        int window_right) {
  const int diag = i + seqlen_k - seqlen_q;
  if (j < 0 || j >= seqlen_k) return false;
  if (window_left >= 0 && j < diag - window_left) return false;
  if (window_right >= 0 && j > diag + window_right) return false;
  return true;
}

}  // namespace flashattn
