// The head-dimension tile widths the CUDA kernels are compiled for. A head_dim
// runs in the smallest compiled tile that holds it; the columns past head_dim
// are zero-filled on load and never stored. setup.py / CMake write
// FLASHATTN_TILE_<W> into flashattn_build_config.h for each width built
// (FLASHATTN_HEAD_DIMS narrows the set while iterating on one kernel).
#pragma once

#include <cuda_runtime.h>

#include "cuda/device_limits.h"
#include "flashattn_build_config.h"

namespace flashattn {

// The widths, smallest first, as a string for error messages and build_info().
const char* compiled_head_dim_tiles();

// Calls launcher.template launch<W>() for the smallest compiled W >= head_dim.
// Returns false (and leaves *result alone) when no compiled tile holds head_dim.
template <typename Launcher>
bool dispatch_head_dim_tile(int head_dim, const Launcher& launcher, cudaError_t* result) {
#define FLASHATTN_TRY_TILE(W)                           \
  if (head_dim <= W) {                                  \
    *result = launcher.template launch<W>();            \
    return true;                                        \
  }
#ifdef FLASHATTN_TILE_32
  FLASHATTN_TRY_TILE(32)
#endif
#ifdef FLASHATTN_TILE_64
  FLASHATTN_TRY_TILE(64)
#endif
#ifdef FLASHATTN_TILE_96
  FLASHATTN_TRY_TILE(96)
#endif
#ifdef FLASHATTN_TILE_128
  FLASHATTN_TRY_TILE(128)
#endif
#ifdef FLASHATTN_TILE_192
  FLASHATTN_TRY_TILE(192)
#endif
#ifdef FLASHATTN_TILE_256
  FLASHATTN_TRY_TILE(256)
#endif
#undef FLASHATTN_TRY_TILE
  (void)launcher;
  return false;
}

}  // namespace flashattn
