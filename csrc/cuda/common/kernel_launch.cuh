// One launch of an attention kernel over a flattened 1-D grid (a grid's y and z stop at
// 65535, batch * heads does not), shared by every launch layer: the dynamic shared-memory
// opt-in above the default 48 KB, the grid bound, and the launch check.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace flashattn {

template <typename Kernel, typename Args>
cudaError_t launch_on_flat_grid(Kernel kernel, int64_t blocks, int threads, int smem_bytes, cudaStream_t stream,
                                const Args& args) {
  if (smem_bytes > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (status != cudaSuccess) return status;
  }
  if (blocks == 0) return cudaSuccess;  // no tile: nothing to compute (no keys at all, say)
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace flashattn
