// One launch of a kernel over a flattened 1-D grid (a grid's y and z stop at 65535, batch *
// heads does not), shared by every launch layer: the dynamic shared-memory opt-in above the
// default 48 KB, the grid bound, the launch order, and the launch check.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace flashattn {

// kAfterPrevious: plain stream order. kDependent: programmatic dependent launch
// (common/dependent_launch.cuh), where the code that will run has the wait: compiled from
// sm_90+ PTX (an sm_80 binary, or sm_80 PTX compiled for a Hopper GPU at load time, has none
// and would read before the kernel before has written), else plain stream order.
enum class LaunchOrder { kAfterPrevious, kDependent };

template <typename Kernel, typename Args>
cudaError_t launch_on_flat_grid(Kernel kernel, int64_t blocks, int threads, int smem_bytes, cudaStream_t stream,
                                const Args& args, LaunchOrder order = LaunchOrder::kAfterPrevious) {
  if (smem_bytes > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (status != cudaSuccess) return status;
  }
  if (blocks == 0) return cudaSuccess;  // no tile: nothing to compute (no keys at all, say)
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  if (order == LaunchOrder::kAfterPrevious) {
    kernel<<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(args);
    return cudaGetLastError();
  }
  cudaFuncAttributes attributes{};
  cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status != cudaSuccess) return status;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &dependent;
  config.numAttrs = attributes.ptxVersion >= 90 ? 1 : 0;
  status = cudaLaunchKernelEx(&config, kernel, args);
  return status == cudaSuccess ? cudaGetLastError() : status;
}

}  // namespace flashattn
