// What this binary was built from and for; the build passes the FLASHATTN_BUILD_* macros.
#pragma once

#include <string>
#include <vector>
#include <utility>

namespace flashattn {

// (key, value) pairs: version, torch_version, cuda_version, cuda_archs,
// head_dim_tiles, cuda_kernels ("yes"/"no").
std::vector<std::pair<std::string, std::string>> build_info();

}  // namespace flashattn
