// The forward launch entry, as the torch-side code sees it (the template
// definitions are in forward_launch.cuh, compiled only in instantiations/).
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"
#include "cuda/device_limits.h"
#include "cuda/score_mod.h"

namespace flashattn {

// Runs the forward for one compiled head-dim tile width W (>= params.head_dim) and score-mod
// variant (forward_score_mod(params)) on `stream`.
template <typename Element, int W, ScoreMod kMod>
cudaError_t launch_attention_forward(const AttentionFwdParams& params, const DeviceLimits& limits,
                                     cudaStream_t stream);

}  // namespace flashattn
