// Host side of the TMA copies: the 4-d tensor maps the Hopper kernels' producers read
// their tiles through (one per input tensor, built per call on the host and passed to the
// kernel by value).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <type_traits>

#include "common/attention_params.h"
#include "cuda/sm90/hopper_primitives.cuh"

namespace flashattn {

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

// The batch extent of q's / k's maps: a variable-length tensor is one batch entry
// (SequenceInfo::q_map_batch gives its coordinate, 0).
inline int q_map_batches(const AttentionFwdParams& p) { return p.cu_seqlens_q != nullptr ? 1 : p.batch; }
inline int k_map_batches(const AttentionFwdParams& p) { return p.cu_seqlens_k != nullptr ? 1 : p.batch; }

}  // namespace flashattn
