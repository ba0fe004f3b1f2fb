// Forward kernels for head-dim tile width 256 (bf16 and fp16).
#include "cuda/forward_launch.cuh"

namespace flashattn {
FLASHATTN_INSTANTIATE_FORWARD(256)
}  // namespace flashattn
