#include "build_info.h"

#include <torch/version.h>

#include "flashattn_build_config.h"

#ifndef FLASHATTN_BUILD_VERSION
#define FLASHATTN_BUILD_VERSION "unknown"
#endif
#ifndef FLASHATTN_BUILD_CUDA_VERSION
#define FLASHATTN_BUILD_CUDA_VERSION ""
#endif
#ifndef FLASHATTN_BUILD_CUDA_ARCHS
#define FLASHATTN_BUILD_CUDA_ARCHS ""
#endif
#ifndef FLASHATTN_BUILD_HEAD_DIM_TILES
#define FLASHATTN_BUILD_HEAD_DIM_TILES ""
#endif

namespace flashattn {

std::vector<std::pair<std::string, std::string>> build_info() {
  return {
      {"version", FLASHATTN_BUILD_VERSION},
      {"torch_version", TORCH_VERSION},
      {"cuda_version", FLASHATTN_BUILD_CUDA_VERSION},
      {"cuda_archs", FLASHATTN_BUILD_CUDA_ARCHS},
      {"head_dim_tiles", FLASHATTN_BUILD_HEAD_DIM_TILES},
#ifdef FLASHATTN_WITH_CUDA
      {"cuda_kernels", "yes"},
#else
      {"cuda_kernels", "no"},
#endif
#ifdef FLASHATTN_BUILD_SM90A
      {"hopper_kernels", "yes"},
#else
      {"hopper_kernels", "no"},
#endif
  };
}

}  // namespace flashattn
