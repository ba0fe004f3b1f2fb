// The CUDA backend of the ops defined in ops_schema.cpp.
#include <torch/library.h>

#include "attention_ops.h"

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("attention_forward", &flashattn::attention_forward_cuda);
  m.impl("attention_backward", &flashattn::attention_backward_cuda);
  m.impl("attention_kvcache_forward", &flashattn::attention_kvcache_forward_cuda);
  m.impl("attention_probabilities", &flashattn::attention_probabilities_cuda);
}
