// The forward launch for one head-dim tile width: the Hopper kernel where it runs,
// else the mma.sync kernel. Included only by the instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/forward_launch.h"
#include "cuda/sm80/forward_launch.cuh"
#include "cuda/sm90/forward_launch.cuh"

namespace flashattn {

template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_attention_forward(const AttentionFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream) {
  using HopperPlan = Sm90ForwardPlan<W, kMod>;
  using HopperShape = typename HopperPlan::Shape;
  if constexpr (!std::is_void_v<HopperShape>) {
    if (limits.hopper_kernels && HopperShape::kSmemBytes <= limits.max_smem_per_block) {
      bool launched = false;
      cudaError_t status = cudaSuccess;
      using LongSequenceShape = typename HopperPlan::LongSequenceShape;
      if constexpr (!std::is_void_v<LongSequenceShape>) {
        if (runs_long_sequence_shape(params))
          status = launch_forward_sm90<Element, LongSequenceShape, kMod>(params, limits, stream, &launched);
      }
      if (status == cudaSuccess && !launched)
        status = launch_forward_sm90<Element, HopperShape, kMod>(params, limits, stream, &launched);
      if (status != cudaSuccess || launched) return status;
      // else TMA cannot describe an input (a stride not a multiple of 16 bytes): the sm_80 kernel runs it.
    }
  }
  using Plan = ForwardVariantPlan<W, kMod>;
  if (Plan::Primary::kSmemBytes <= limits.max_smem_per_block)
    return launch_forward_with_shape<Element, typename Plan::Primary, kMod>(params, limits, stream);
  if (Plan::Fallback::kSmemBytes <= limits.max_smem_per_block)
    return launch_forward_with_shape<Element, typename Plan::Fallback, kMod>(params, limits, stream);
  return cudaErrorInvalidConfiguration;
}

// One file per (W, variant): FLASHATTN_INSTANTIATE_FORWARD(W, kNone) and so on.
#define FLASHATTN_INSTANTIATE_FORWARD(W, MOD)                                                         \
  template cudaError_t launch_attention_forward<__nv_bfloat16, W, ScoreMod::MOD>(                     \
      const AttentionFwdParams&, const DeviceLimits&, cudaStream_t);                                 \
  template cudaError_t launch_attention_forward<__half, W, ScoreMod::MOD>(const AttentionFwdParams&, \
                                                                          const DeviceLimits&, cudaStream_t);

}  // namespace flashattn
