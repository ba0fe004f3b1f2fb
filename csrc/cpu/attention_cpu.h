// The CPU forward on options already gathered, for the CPU backend's own callers: the
// KV-cache path runs its parts of a sequence through it with AttentionOptions'
// alibi_diagonal_shift, which no op argument sets. The op's checks run as for a call.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "attention_api.h"

namespace flashattn {

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu_with_options(const at::Tensor& q, const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      const AttentionOptions& opts);

}  // namespace flashattn
