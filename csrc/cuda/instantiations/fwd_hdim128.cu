// Forward kernels for head-dim tile width 128 (bf16 and fp16).
#include "cuda/forward_launch.cuh"

namespace flashattn {
FLASHATTN_INSTANTIATE_FORWARD(128)
}  // namespace flashattn
