// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the
// kernel before it on the stream is still running (its blocks become resident and do
// their set-up), and waits for that kernel's results only where it reads them. It hides
// the gap between a short kernel and the one it follows: on sm_80-class targets both
// device calls compile to nothing and the launch falls back to plain stream order.
#pragma once

#include <cuda_runtime.h>

namespace flashattn {

// In the kernel before: from here on, the next kernel's blocks may be scheduled.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// In the kernel after: blocks until the kernel before has finished and its writes are visible.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launches kernel as a dependent of the previous kernel on the stream where the code that
// will run has the wait (compiled from sm_90+ PTX: an sm_80 binary, or sm_80 PTX compiled
// for a Hopper GPU at load time, has none and would read before the kernel before has
// written), else in plain stream order.
template <typename Kernel, typename Args>
cudaError_t launch_dependent(Kernel kernel, unsigned blocks, unsigned threads, cudaStream_t stream,
                             const Args& args) {
  cudaFuncAttributes attributes{};
  cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status != cudaSuccess) return status;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &dependent;
  config.numAttrs = attributes.ptxVersion >= 90 ? 1 : 0;
  status = cudaLaunchKernelEx(&config, kernel, args);
  return status == cudaSuccess ? cudaGetLastError() : status;
}

}  // namespace flashattn
