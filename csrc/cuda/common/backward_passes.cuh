// The passes around the backward's main kernel, shared by both kernel families: the
// preprocess (D, lse2, the zeroed dQ workspace), the postprocess (dq in the output dtype),
// and the fp32 reduction into the dQ workspace that the main kernels use, with the semaphores
// that order it when deterministic. The main kernel and the postprocess are programmatic
// dependent launches (common/dependent_launch.cuh): each waits for the kernel before where
// it first reads what that one wrote, so their launch and set-up overlap its tail.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "common/sequence_info.h"
#include "cuda/backward_launch.h"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/kernel_launch.cuh"
#include "cuda/common/mma_primitives.cuh"

namespace flashattn {
namespace backward {

// A query block's dQ semaphore (deterministic mode): the number of key blocks that have added
// to it, read with acquire and written with release semantics at GPU scope.
__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(int* ptr, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_pair(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // red, not atomicAdd: with a fence after the adds (deterministic dQ) ptxas kept atomicAdd's
  // unused result and waited for it (ATOMG; Hopper d 256 backward 20 % slower).
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// ---------------------------------------------------------------------------------------
// 1. D = rowsum(dO ∘ O), lse2 = lse·log2(e) and a zeroed dQ workspace row for every (batch,
// head, padded query row). Eight lanes share a row, each reading 16-byte chunks, so a row is
// read in 128-byte pieces. (Zeroing the workspace here rather than by a memset before saves a
// launch and lets the main kernel follow this one as a dependent launch.)
constexpr int kPrepThreads = 256;
constexpr int kPrepLanesPerRow = 8;

template <typename Element>
__global__ void __launch_bounds__(kPrepThreads) attention_backward_preprocess_kernel(
    const AttentionBwdParams p) {
  constexpr int kRowsPerBlock = kPrepThreads / kPrepLanesPerRow;
  allow_dependent_launch();  // the main kernel waits for this one before it reads D, lse2, dQ
  // (batch, head, row < seqlen_q_rounded), whatever the workspace layout: each sequence's rows
  // and the padding up to its whole 128-row blocks.
  const int64_t rows = static_cast<int64_t>(p.batch) * p.nheads_q * p.seqlen_q_rounded;
  const int sub = threadIdx.x % kPrepLanesPerRow;
  // The loop bound is uniform over the block, so every lane reaches the shuffles.
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = row0 + threadIdx.x / kPrepLanesPerRow;
    const int64_t bh = row / p.seqlen_q_rounded;
    const int i = static_cast<int>(row - bh * p.seqlen_q_rounded);
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const SequenceInfo seq(p, row < rows ? b : 0);
    const bool real = row < rows && i < seq.seqlen_q;
    // A variable-length sequence owns only its own padded blocks of the workspace.
    const bool owned = row < rows && (p.cu_seqlens_q == nullptr || i < round_up_rows(seq.seqlen_q));
    float acc = 0.f;
    if (real) {
      const Element* o = seq.q_row(static_cast<const Element*>(p.out), p.out_strides, b, h, i);
      const Element* d = seq.q_row(static_cast<const Element*>(p.dout), p.dout_strides, b, h, i);
      for (int c = sub * 8; c < p.head_dim; c += 8 * kPrepLanesPerRow) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
        const Element* oe = reinterpret_cast<const Element*>(&ov);
        const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          acc = fmaf(MmaElement<Element>::to_float(oe[e]), MmaElement<Element>::to_float(de[e]), acc);
      }
    }
#pragma unroll
    for (int offset = 1; offset < kPrepLanesPerRow; offset *= 2)
      acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (owned) {
      const int64_t w = backward_workspace_row(p, seq.q_offset, b, h) + i;
      if (sub == 0) {
        p.softmax_d[w] = acc;
        p.lse_log2[w] = real ? *seq.lse_row(p, b, h, i) * 1.4426950408889634f : INFINITY;
      }
      // The row's 8 columns of each 8 x 8 tile of dq_accum are 32 contiguous bytes.
      for (int c = sub * 8; c < p.head_dim_rounded; c += 8 * kPrepLanesPerRow) {
        float4* const zero = reinterpret_cast<float4*>(p.dq_accum + dq_accum_offset(w, c, p.head_dim_rounded));
        zero[0] = zero[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// 3. dq = dq_accum · softmax_scale, 8 head dims of a row per thread, the 8 threads of a tile's
// rows side by side: either orientation of the tiles is read in whole 32-byte sectors.
constexpr int kPostThreads = 256;

template <typename Element, DqAccumTiles kTiles>
__global__ void __launch_bounds__(kPostThreads) attention_backward_postprocess_kernel(
    const AttentionBwdParams p) {
  wait_for_previous_kernel();  // the main kernel's dQ adds
  const int chunks = p.head_dim / 8;
  const int row_groups = (p.seqlen_q + 7) / 8;
  const int64_t total = static_cast<int64_t>(p.batch) * p.nheads_q * row_groups * chunks * 8;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kPostThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kPostThreads) {
    const int64_t tile = idx / 8;  // (batch, head, row group, chunk)
    const int c = static_cast<int>(tile % chunks);
    const int64_t group = tile / chunks;
    const int i = static_cast<int>(group % row_groups) * 8 + static_cast<int>(idx % 8);
    const int64_t bh = group / row_groups;
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const SequenceInfo seq(p, b);
    if (i >= seq.seqlen_q) continue;
    const int64_t row = backward_workspace_row(p, seq.q_offset, b, h) + i;
    float v[8];
    if constexpr (kTiles == DqAccumTiles::kTransposed) {
      const float* src = p.dq_accum + dq_accum_offset_transposed(row, c * 8, p.head_dim_rounded);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = src[8 * e];
    } else {
      const float* src = p.dq_accum + dq_accum_offset(row, c * 8, p.head_dim_rounded);
      *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(src);
      *reinterpret_cast<float4*>(v + 4) = *reinterpret_cast<const float4*>(src + 4);
    }
    const float s = p.softmax_scale;
    uint4 packed;
    packed.x = MmaElement<Element>::pack(v[0] * s, v[1] * s);
    packed.y = MmaElement<Element>::pack(v[2] * s, v[3] * s);
    packed.z = MmaElement<Element>::pack(v[4] * s, v[5] * s);
    packed.w = MmaElement<Element>::pack(v[6] * s, v[7] * s);
    Element* dst = seq.q_row(static_cast<Element*>(p.dq), p.dq_strides, b, h, i);
    *reinterpret_cast<uint4*>(dst + c * 8) = packed;
  }
}

inline unsigned int grid_stride_blocks(int64_t work_items, int items_per_block) {
  const int64_t blocks = (work_items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 20)));
}

// The passes around any main kernel: zero the semaphores (deterministic), the preprocess (D,
// lse2, the zeroed dQ workspace), launch_main() (a dependent launch of the main kernel, which
// waits for the preprocess before it reads D, lse2 or adds to dQ), the postprocess (dq in the
// output dtype from the tiles the main kernel adds, in orientation `tiles`; a dependent launch
// that waits for the main kernel first).
template <typename Element, typename LaunchMain>
cudaError_t run_backward_passes(const AttentionBwdParams& p, cudaStream_t stream, DqAccumTiles tiles,
                                const LaunchMain& launch_main) {
  const int64_t heads = static_cast<int64_t>(p.batch) * p.nheads_q;
  cudaError_t err = cudaSuccess;
  if (p.deterministic) {
    err = cudaMemsetAsync(p.dq_semaphore, 0,
                          sizeof(int) * heads * (p.seqlen_q_rounded / kBackwardMinBlockM), stream);
    if (err != cudaSuccess) return err;
  }

  attention_backward_preprocess_kernel<Element>
      <<<grid_stride_blocks(heads * p.seqlen_q_rounded, kPrepThreads / kPrepLanesPerRow),
         kPrepThreads, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  err = launch_main();
  if (err != cudaSuccess) return err;

  const auto postprocess = tiles == DqAccumTiles::kTransposed
                               ? attention_backward_postprocess_kernel<Element, DqAccumTiles::kTransposed>
                               : attention_backward_postprocess_kernel<Element, DqAccumTiles::kRowMajor>;
  const int64_t rows = heads * ((p.seqlen_q + 7) / 8 * 8);
  return launch_on_flat_grid(postprocess, grid_stride_blocks(rows * (p.head_dim / 8), kPostThreads), kPostThreads, 0,
                             stream, p, LaunchOrder::kDependent);
}

}  // namespace backward
}  // namespace flashattn
