// Launch layer of the Hopper forward kernel: its tile plan, the TMA maps, the
// shared-memory opt-in, the grid. Included by forward_launch.cuh, which calls it
// first on sm_90 devices of builds that compiled the sm_90a image.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <climits>
#include <type_traits>

#include "forward_kernel_sm90.cuh"

namespace flashattn {

// The Hopper tile plan per head-dim tile width W (void: none, the mma.sync kernel runs).
// What bounds it:
//  - registers: a consumer thread holds O (W / 2 floats), S (kBlockN / 2) and P
//    (kBlockN / 4 words) within the 240 registers setmaxnreg gives it;
//  - shared memory: Q (kBlockM x W) + kStages x (K + V) (kBlockN x W), within the
//    227 KB of an sm_90 block. The overlapped pipeline needs 3 stages (two key
//    blocks are in use at once): W = 64 and 128 fit them with kBlockN = 128
//    (113 / 225 KB); W = 256 fits 2 stages of kBlockN = 64 (193 KB) and runs the
//    products in sequence, which beat 3 stages of kBlockN = 32 there (618 against
//    541 TFLOP/s at N 8192 on the H200; benchmarks/RESULTS.md has the sweep).
template <int W>
struct Sm90ForwardPlan {
  using Shape = void;
};
template <>
struct Sm90ForwardPlan<64> {
  using Shape = Sm90ForwardShape<64, 128, 2, 3>;
};
template <>
struct Sm90ForwardPlan<128> {
  using Shape = Sm90ForwardShape<128, 128, 2, 3>;
};
template <>
struct Sm90ForwardPlan<256> {
  using Shape = Sm90ForwardShape<256, 64, 2, 2, /*kOverlap=*/false>;
};

// cuTensorMapEncodeTiled from the driver, through the runtime, so that the
// extension does not link libcuda itself.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// A 4-d map (head_dim, seqlen, nheads, batch) over a (batch, seqlen, nheads,
// head_dim) tensor with its own strides, read in boxes of 64 columns x box_rows
// rows with the 128-byte swizzle. False where TMA cannot describe the tensor
// (a stride or the base address not a multiple of 16 bytes).
template <typename Element>
bool encode_tile_map(CUtensorMap* map, const void* base, const TensorStrides& strides, int head_dim,
                     int seqlen, int nheads, int batch, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  constexpr CUtensorMapDataType kType =
      std::is_same_v<Element, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  // A dimension of size 1 is never stepped over, so any valid stride stands in for it.
  const auto stride_bytes = [](int64_t stride, int size) {
    return static_cast<cuuint64_t>(size > 1 ? stride * 2 : 16);
  };
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(nheads), cuuint64_t(batch)};
  const cuuint64_t byte_strides[3] = {stride_bytes(strides.row, seqlen), stride_bytes(strides.head, nheads),
                                      stride_bytes(strides.batch, batch)};
  const cuuint32_t box[4] = {sm90::kSwizzleElements, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, kType, 4, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Launches the Hopper kernel, or sets *launched = false (and launches nothing)
// where TMA cannot describe an input.
template <typename Element, typename Shape>
cudaError_t launch_forward_sm90(const AttentionFwdParams& params, cudaStream_t stream, bool* launched) {
  *launched = false;
  Sm90ForwardArgs args{};
  args.params = params;
  const bool mapped =
      encode_tile_map<Element>(&args.q_map, params.q, params.q_strides, params.head_dim, params.seqlen_q,
                               params.nheads_q, params.batch, Shape::kBlockM) &&
      encode_tile_map<Element>(&args.k_map, params.k, params.k_strides, params.head_dim, params.seqlen_k,
                               params.nheads_kv, params.batch, Shape::kBlockN) &&
      encode_tile_map<Element>(&args.v_map, params.v, params.v_strides, params.head_dim, params.seqlen_k,
                               params.nheads_kv, params.batch, Shape::kBlockN);
  if (!mapped) return cudaSuccess;
  const auto kernel = attention_forward_sm90_kernel<Element, Shape>;
  const cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes);
  if (status != cudaSuccess) return status;
  const int64_t num_m_blocks = (params.seqlen_q + Shape::kBlockM - 1) / Shape::kBlockM;
  const int64_t blocks = num_m_blocks * params.batch * params.nheads_q;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(blocks), Shape::kThreads, Shape::kSmemBytes, stream>>>(args);
  *launched = true;
  return cudaGetLastError();
}

}  // namespace flashattn
