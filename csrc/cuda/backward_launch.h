// The backward launch entry and its workspace geometry, as the torch-side code sees them
// (plain host C++; the template definitions are in backward_launch.cuh, compiled only in
// instantiations/bwd_hdim*.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_params.h"
#include "device_limits.h"

namespace flashattn {

// What the caller allocates (fp32 / int32, all uninitialised; the launch zeroes what it needs):
//   dq_accum  (batch, nheads_q, seqlen_q_rounded, head_dim_rounded)
//   softmax_d, lse_log2  (batch, nheads_q, seqlen_q_rounded)
//   dq_semaphore  batch * nheads_q * semaphores_per_head, only when deterministic
struct BackwardWorkspaceGeometry {
  int64_t seqlen_q_rounded;
  int64_t head_dim_rounded;
  int64_t semaphores_per_head;
};

// Must agree with backward::kQueryRowRounding and backward::kMinBlockM (backward_kernel.cuh,
// checked there by static_assert).
constexpr int kBackwardQueryRowRounding = 128;
constexpr int kBackwardMinBlockM = 16;

inline BackwardWorkspaceGeometry backward_workspace_geometry(int64_t seqlen_q, int head_dim_tile) {
  const int64_t rounded =
      (seqlen_q + kBackwardQueryRowRounding - 1) / kBackwardQueryRowRounding * kBackwardQueryRowRounding;
  return {rounded, head_dim_tile, rounded / kBackwardMinBlockM};
}

// params must carry the workspace pointers and seqlen_q_rounded / head_dim_rounded from
// backward_workspace_geometry(params.seqlen_q, kHeadDimTile).
template <typename Element, int kHeadDimTile>
cudaError_t launch_attention_backward(const AttentionBwdParams& params, const DeviceLimits& limits,
                                      cudaStream_t stream);

}  // namespace flashattn
