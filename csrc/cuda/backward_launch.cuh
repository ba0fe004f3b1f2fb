// The backward launch for one head-dim tile width: the Hopper main kernel
// (sm90/backward_launch.cuh) where it runs, else the mma.sync one (sm80/backward_launch.cuh),
// between the passes of common/backward_passes.cuh. Included only by the instantiation files
// and the standalone check benchmarks/kernels/backward_sm90_check.cu.
#pragma once

#include <type_traits>

#include "cuda/backward_launch.h"
#include "cuda/common/backward_passes.cuh"
#include "cuda/sm80/backward_launch.cuh"
#include "cuda/sm90/backward_launch.cuh"

namespace flashattn {

template <typename Element, int kHeadDimTile, ScoreMod kMod>
cudaError_t launch_attention_backward(const AttentionBwdParams& params, const DeviceLimits& limits,
                                      cudaStream_t stream) {
  using Plans = backward::BackwardVariantPlans<kHeadDimTile, kMod>;
  if (params.head_dim_rounded != kHeadDimTile ||
      params.seqlen_q_rounded % kBackwardQueryRowRounding != 0 ||
      params.seqlen_q_rounded < params.seqlen_q)
    return cudaErrorInvalidValue;
  if constexpr (!std::is_void_v<typename Sm90BackwardPlan<kHeadDimTile, kMod>::Shape>) {
    cudaError_t result = cudaSuccess;
    if (limits.hopper_kernels && run_backward_sm90<Element, kHeadDimTile, kMod>(params, limits, stream, &result))
      return result;
  }
  if (Plans::Large::kSmemBytes <= limits.max_smem_per_block)
    return backward::launch_with_tile<Element, typename Plans::Large, kMod>(params, stream);
  if (Plans::Small::kSmemBytes <= limits.max_smem_per_block)
    return backward::launch_with_tile<Element, typename Plans::Small, kMod>(params, stream);
  return cudaErrorInvalidConfiguration;
}

// Explicit instantiations of one head-dim tile and score-mod variant for both element types
// (one .cu per width and variant).
#define FLASHATTN_INSTANTIATE_BACKWARD(W, MOD)                                                        \
  template cudaError_t launch_attention_backward<__nv_bfloat16, W, ScoreMod::MOD>(                    \
      const AttentionBwdParams&, const DeviceLimits&, cudaStream_t);                                 \
  template cudaError_t launch_attention_backward<__half, W, ScoreMod::MOD>(const AttentionBwdParams&, \
                                                                           const DeviceLimits&, cudaStream_t);

}  // namespace flashattn

