// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the
// kernel before it on the stream is still running (its blocks become resident and do
// their set-up), and waits for that kernel's results only where it reads them. It hides
// the gap between a short kernel and the one it follows: on sm_80-class targets both
// device calls compile to nothing and the launch falls back to plain stream order
// (launch_on_flat_grid's LaunchOrder::kDependent, common/kernel_launch.cuh).
#pragma once

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

}  // namespace flashattn
