// The dtypes the CPU kernels take (attention_cpu.cpp, kvcache_cpu.cpp): fp32 and fp64
// compute in their own precision, bf16 and fp16 in fp32.
#pragma once

#include <c10/core/ScalarType.h>

namespace flashattn {

inline bool cpu_dtype_supported(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

}  // namespace flashattn
