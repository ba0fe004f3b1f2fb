// Thin wrappers over the PTX that the sm_80+ attention kernels are built from:
// cp.async (global -> shared, 16 bytes, zero-fill for out-of-range rows),
// ldmatrix (shared -> mma fragments), mma.sync m16n8k16 with fp32 accumulators,
// and the packing of fp32 accumulators into 16-bit operands.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4*g + t:
//   A (16x16, row-major)   a0:(g, 2t..2t+1)  a1:(g+8, 2t..)  a2:(g, 2t+8..)  a3:(g+8, 2t+8..)
//   B (16x8,  "col-major") b0:(k=2t..2t+1, n=g)              b1:(k=2t+8.., n=g)
//   C (16x8,  fp32)        c0,c1:(g, 2t..2t+1)               c2,c3:(g+8, 2t..2t+1)
// C of two adjacent n-tiles is therefore exactly the A operand of the next
// product (P = softmax(S) feeding P·V), which is why P never leaves registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashattn {

__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte asynchronous copy; when `in_range` is false the destination is
// zero-filled and the source is not read (it must still be a valid address). The L2
// fetches the whole 128-byte line from DRAM at the first copy of it (the other copies of
// the line come from the same or the next instructions): decoding +2-3 % (RESULTS.md).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool in_range) {
  const int src_bytes = in_range ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPendingGroups>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_src));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_src));
}

// 16-bit element types the tensor cores take, with their mma and packing.
template <typename Element>
struct MmaElement;

template <>
struct MmaElement<__nv_bfloat16> {
  // Explicit, since torch builds with __CUDA_NO_BFLOAT16_CONVERSIONS__.
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct MmaElement<__half> {
  // Explicit, since torch builds with __CUDA_NO_HALF_CONVERSIONS__.
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// One MUFU.EX2; the callers fold log2(e) into the softmax scale so no extra multiply is needed.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the 4 lanes (t = 0..3) that hold one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A row's packed pairs of four n8 tiles, one per lane of its quad (v[k]: tile k's columns 2t,
// 2t + 1 at lane t), rearranged so that lane t holds tile t's 8 columns (v[k]: columns 2k, 2k + 1):
// a transpose of the quad's 4 x 4 words in two exchanges, so that a lane stores 16 contiguous
// bytes instead of four 4-byte pieces.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int lane) {
#pragma unroll
  for (int stride = 1; stride <= 2; stride *= 2) {
    const bool upper = lane & stride;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k & stride) continue;  // the pair (k, k + stride)
      const uint32_t sent = upper ? v[k] : v[k + stride];
      const uint32_t received = __shfl_xor_sync(0xffffffffu, sent, stride);
      if (upper)
        v[k] = received;
      else
        v[k + stride] = received;
    }
  }
}

// The A fragment of k-step kk taken from fp32 accumulators whose n-tiles 2kk, 2kk+1 hold its
// 16 columns (the C and A layouts of m16n8k16 coincide).
template <typename Element, int kNTiles>
__device__ __forceinline__ void accumulator_as_a(uint32_t (&a)[4], const float (&c)[kNTiles][4],
                                                 int kk) {
  a[0] = MmaElement<Element>::pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = MmaElement<Element>::pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = MmaElement<Element>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = MmaElement<Element>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

}  // namespace flashattn
