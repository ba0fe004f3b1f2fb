// Backward kernels for head-dim tile width 96 (bf16 and fp16).
#include "cuda/backward_launch.cuh"

namespace flashattn {
FLASHATTN_INSTANTIATE_BACKWARD(96)
}  // namespace flashattn
