// Where batch entry b's query and key rows are, for every layout the ops take: dense
// (batch, seqlen, ...), variable-length (total, ...) with cu_seqlens offsets, and
// seqused (only the first rows of each sequence count). The kernels and the
// backward workspaces address rows only through this, so a new sequence layout
// (a KV cache, pages) changes this file and not the main loops.
#pragma once

#include "common/attention_params.h"
#include "common/kvcache_params.h"

namespace flashattn {

// Element (b, row, head, 0) of a tensor with strides s (64-bit row arithmetic).
template <typename T>
FLASHATTN_HOST_DEVICE T* element_row(T* base, const TensorStrides& s, int b, int head, int64_t row) {
  return base + b * s.batch + head * s.head + row * s.row;
}

struct SequenceInfo {
  int seqlen_q, seqlen_k;  // rows of this sequence
  int q_offset, k_offset;  // its first row in q's / k's row dimension (0 dense)

  // Bounds are clamped so that no value of cu_seqlens / seqused (checked on the host
  // outside CUDA graph capture) makes a kernel touch rows outside the tensors or past
  // the grid, which is sized by the longest sequence.
  // `dense` (a compile-time constant where a kernel is instantiated for dense calls
  // only) skips the per-sequence bounds: the lengths then stay the params' own values,
  // which the compiler reads from the constant bank instead of holding in registers.
  FLASHATTN_HOST_DEVICE SequenceInfo(const AttentionFwdParams& p, int b, bool dense = false)
      : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k), q_offset(0), k_offset(0) {
    if (dense) return;
    side(p.cu_seqlens_q, p.seqused_q, 0, p.seqlen_q, p.rows_q, b, seqlen_q, q_offset);
    side(p.cu_seqlens_k, p.seqused_k, p.seqused_k_add, p.seqlen_k, p.rows_k, b, seqlen_k, k_offset);
  }
  // Whether a call has any per-sequence bound (else every kernel may take `dense`).
  FLASHATTN_HOST_DEVICE static bool has_sequence_bounds(const AttentionFwdParams& p) {
    return p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_q != nullptr ||
           p.seqused_k != nullptr;
  }

  // Element (b, row, head, 0) of a tensor with these strides, row counted from the sequence start.
  template <typename T>
  FLASHATTN_HOST_DEVICE T* q_row(T* base, const TensorStrides& s, int b, int head, int row) const {
    return element_row(base, s, b, head, int64_t{q_offset} + row);
  }
  template <typename T>
  FLASHATTN_HOST_DEVICE T* k_row(T* base, const TensorStrides& s, int b, int head, int row) const {
    return element_row(base, s, b, head, int64_t{k_offset} + row);
  }
  // lse of query `row` of head `head`.
  FLASHATTN_HOST_DEVICE float* lse_row(const AttentionFwdParams& p, int b, int head, int row) const {
    return p.lse + b * p.lse_strides.batch + head * p.lse_strides.head + int64_t(q_offset + row);
  }
  // The batch coordinate of a TMA tile map: variable-length tensors are mapped as one batch entry.
  FLASHATTN_HOST_DEVICE static int q_map_batch(const AttentionFwdParams& p, int b) {
    return p.cu_seqlens_q != nullptr ? 0 : b;
  }
  FLASHATTN_HOST_DEVICE static int k_map_batch(const AttentionFwdParams& p, int b) {
    return p.cu_seqlens_k != nullptr ? 0 : b;
  }
  // Whether rows past a sequence's end, inside the tensor, can hold anything (the
  // next sequence, rows seqused leaves out), for keys and for queries: the Hopper
  // kernels' tile copies read them (only the dense tensor's own end is zero-filled by TMA).
  FLASHATTN_HOST_DEVICE static bool keys_may_overrun(const AttentionFwdParams& p) {
    return p.cu_seqlens_k != nullptr || p.seqused_k != nullptr;
  }
  FLASHATTN_HOST_DEVICE static bool queries_may_overrun(const AttentionFwdParams& p) {
    return p.cu_seqlens_q != nullptr || p.seqused_q != nullptr;
  }

 private:
  FLASHATTN_HOST_DEVICE static int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
  FLASHATTN_HOST_DEVICE static void side(const int* cu, const int* used, int used_add, int max_len, int rows,
                                         int b, int& len, int& offset) {
    if (cu != nullptr) {
      offset = clamp(cu[b], 0, rows);
      len = clamp(cu[b + 1] - offset, 0, rows - offset);
    } else {
      offset = 0;
      len = rows;
    }
    if (used != nullptr) len = clamp(used[b] + used_add, 0, len);
    len = len < max_len ? len : max_len;
  }
};

// Batch entry b's keys in a KV cache (kvcache_params.h): its rows [leftpad, seqused) of
// its cache row, contiguous or through its pages. Row j counts from leftpad, so the
// mask geometry of (seqlen_q, seqlen_k) aligns causal to the end as for any sequence.
struct CacheSequence {
  int seqlen_k;   // rows visible to the queries
  int leftpad;    // the first of them in the cache row
  int cache_row;  // the cache's batch index (contiguous cache)
  const int* pages;  // this entry's block_table row (paged cache), else nullptr
  int page_size, pages_per_row, num_pages;

  FLASHATTN_HOST_DEVICE CacheSequence(const KvcacheFwdParams& p, int b)
      : leftpad(p.cache_leftpad != nullptr ? clamp(p.cache_leftpad[b], 0, p.seqlen_k) : 0),
        cache_row(p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b),
        pages(p.block_table != nullptr ? p.block_table + b * p.block_table_batch_stride : nullptr),
        page_size(p.page_size),
        pages_per_row(p.pages_per_row),
        num_pages(p.num_pages) {
    const int end = p.seqused_k != nullptr ? clamp(p.seqused_k[b] + p.seqlen_new, 0, p.seqlen_k) : p.seqlen_k;
    seqlen_k = end > leftpad ? end - leftpad : 0;
  }
  // Element (row, head, 0) of a cache tensor, row counted from the cache row's start
  // (not from leftpad): the prepare kernel writes new rows there.
  template <typename T>
  FLASHATTN_HOST_DEVICE T* cache_element(T* base, const TensorStrides& s, int head, int row) const {
    if (pages != nullptr) return paged_element(base, s, head, page_of(row), row);
    return base + int64_t(cache_row) * s.batch + int64_t(row) * s.row + int64_t(head) * s.head;
  }
  // The page that holds row (counted as in cache_element) of a paged cache, and the element
  // there: the lookup split from the address so a kernel can read it ahead.
  FLASHATTN_HOST_DEVICE int page_of(int row) const {
    return clamp(pages[clamp(row / page_size, 0, pages_per_row - 1)], 0, num_pages - 1);
  }
  template <typename T>
  FLASHATTN_HOST_DEVICE T* paged_element(T* base, const TensorStrides& s, int head, int page, int row) const {
    return base + int64_t(page) * s.batch + int64_t(row % page_size) * s.row + int64_t(head) * s.head;
  }
  // Key j of the sequence.
  template <typename T>
  FLASHATTN_HOST_DEVICE T* k_row(T* base, const TensorStrides& s, int head, int j) const {
    return cache_element(base, s, head, leftpad + j);
  }
  // Whether keys [j, j + n) lie at one row stride: a contiguous cache, or all in one page.
  FLASHATTN_HOST_DEVICE bool rows_strided(int j, int n) const {
    return pages == nullptr || (leftpad + j) % page_size + n <= page_size;
  }

 private:
  FLASHATTN_HOST_DEVICE static int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
};

}  // namespace flashattn
