// Backward kernels for head-dim tile width 32 (bf16 and fp16).
#include "cuda/backward_launch.cuh"

namespace flashattn {
FLASHATTN_INSTANTIATE_BACKWARD(32)
}  // namespace flashattn
