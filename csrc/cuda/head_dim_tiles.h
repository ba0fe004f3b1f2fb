// The head-dimension tile widths the CUDA kernels are compiled for. A head_dim
// runs in the smallest compiled tile that holds it; the columns past head_dim
// are zero-filled on load and never stored. The widths are csrc/SOURCES.txt's
// `tiles` line (FLASHATTN_HEAD_DIMS narrows the set while iterating on one
// kernel), which setup.py / CMake write into flashattn_build_config.h as
// FLASHATTN_FOR_EACH_TILE(X), X(W) for each width built, smallest first.
#pragma once

#include <cuda_runtime.h>

#include "cuda/device_limits.h"
#include "flashattn_build_config.h"

namespace flashattn {

// Calls launcher.template launch<W>() for the smallest compiled W >= head_dim.
// Returns false (and leaves *result alone) when no compiled tile holds head_dim.
template <typename Launcher>
bool dispatch_head_dim_tile(int head_dim, const Launcher& launcher, cudaError_t* result) {
#define FLASHATTN_TRY_TILE(W)                \
  if (head_dim <= W) {                       \
    *result = launcher.template launch<W>(); \
    return true;                             \
  }
  FLASHATTN_FOR_EACH_TILE(FLASHATTN_TRY_TILE)
#undef FLASHATTN_TRY_TILE
  return false;
}

}  // namespace flashattn
