// Before the KV-cache attention: each query row rotated (rotary embedding) and written
// into the packed-GQA layout the attention kernel reads (where q is not read in place),
// and each new key / value row (the key rotated) written into the cache at its position.
// One warp per row.
#pragma once

#include <cstdint>

#include "common/kvcache_params.h"
#include "common/sequence_info.h"
#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

// dst[0, head_dim) = src rotated as the token at `position` (rotary_dim leading
// columns; the rest copied), or copied when position < 0. Each lane writes pairs of
// columns (head_dim is a multiple of 8).
template <typename Element>
__device__ __forceinline__ void rotate_row(Element* dst, const Element* src, int position,
                                           const KvcachePrepareParams& p, int head_dim, int lane) {
  using Mma = MmaElement<Element>;
  const Element* cos_row = static_cast<const Element*>(p.rotary_cos) + int64_t(position) * (p.rotary_dim / 2);
  const Element* sin_row = static_cast<const Element*>(p.rotary_sin) + int64_t(position) * (p.rotary_dim / 2);
  const int half = p.rotary_dim / 2;
  for (int col = 2 * lane; col < head_dim; col += 64) {
    float out[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = col + e;
      const float x = Mma::to_float(src[c]);
      if (position < 0 || c >= p.rotary_dim) {
        out[e] = x;
        continue;
      }
      // (x_c, x_partner) is rotated by the angle of pair `pair`; the first of the two
      // gets x cos - partner sin, the second x cos + partner sin.
      const bool first = p.rotary_interleaved ? c % 2 == 0 : c < half;
      const int partner = p.rotary_interleaved ? (first ? c + 1 : c - 1) : (first ? c + half : c - half);
      const int pair = p.rotary_interleaved ? c / 2 : (first ? c : c - half);
      const float cs = Mma::to_float(cos_row[pair]), sn = Mma::to_float(sin_row[pair]);
      const float other = Mma::to_float(src[partner]);
      out[e] = first ? x * cs - other * sn : x * cs + other * sn;
    }
    *reinterpret_cast<uint32_t*>(dst + col) = Mma::pack(out[0], out[1]);
  }
}

template <typename Element>
__global__ void kvcache_prepare_kernel(const __grid_constant__ KvcacheFwdParams attn,
                                       const __grid_constant__ KvcachePrepareParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t q_rows = p.q_packed != nullptr ? int64_t(attn.batch) * attn.seqlen_q * attn.nheads_q : 0;
  const int64_t new_rows = p.cache_seqlens != nullptr ? int64_t(attn.batch) * p.seqlen_new * attn.nheads_kv : 0;
  const int head_dim = attn.head_dim;
  const auto clamp_position = [&](int position) {
    return p.rotary_cos == nullptr ? -1 : min(max(position, 0), p.rotary_rows - 1);
  };
  if (row < q_rows) {
    const int h = static_cast<int>(row % attn.nheads_q);
    const int i = static_cast<int>(row / attn.nheads_q % attn.seqlen_q);
    const int b = static_cast<int>(row / attn.nheads_q / attn.seqlen_q);
    const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : attn.seqlen_k;
    const Element* src = static_cast<const Element*>(p.q) + b * p.q_strides.batch + i * p.q_strides.row +
                         h * p.q_strides.head;
    Element* dst = static_cast<Element*>(p.q_packed) + b * attn.q_strides.batch +
                   (h / attn.group) * attn.q_strides.head +
                   int64_t(i * attn.group + h % attn.group) * attn.q_strides.row;
    rotate_row(dst, src, clamp_position(cached + (p.rotate_q_per_position ? i : 0)), p, head_dim, lane);
  } else if (row < q_rows + new_rows) {
    const int64_t r = row - q_rows;
    const int hk = static_cast<int>(r % attn.nheads_kv);
    const int t = static_cast<int>(r / attn.nheads_kv % p.seqlen_new);
    const int b = static_cast<int>(r / attn.nheads_kv / p.seqlen_new);
    const int position = p.cache_seqlens[b] + t;
    // The host checks the cache holds the new rows; a value it could not read (CUDA graph
    // replay) that does not is written nowhere rather than outside the cache row.
    if (position < 0 || position >= attn.seqlen_k) return;
    const CacheSequence seq(attn, b);
    const Element* k_src = static_cast<const Element*>(p.k_new) + b * p.k_new_strides.batch +
                           t * p.k_new_strides.row + hk * p.k_new_strides.head;
    const Element* v_src = static_cast<const Element*>(p.v_new) + b * p.v_new_strides.batch +
                           t * p.v_new_strides.row + hk * p.v_new_strides.head;
    rotate_row(seq.cache_element(static_cast<Element*>(const_cast<void*>(attn.k)), attn.k_strides, hk, position),
               k_src, clamp_position(position), p, head_dim, lane);
    rotate_row(seq.cache_element(static_cast<Element*>(const_cast<void*>(attn.v)), attn.v_strides, hk, position),
               v_src, -1, p, head_dim, lane);
  }
}

}  // namespace flashattn
