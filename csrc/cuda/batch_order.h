// The order in which the forward grid walks a variable-length batch's sequences.
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"

namespace flashattn {

// Batches of more sequences keep their own order: the ranking below compares every pair.
constexpr int kMaxOrderedBatch = 1024;

// Writes into order[0, params.batch) the batch entries by keys, most first (equal counts in
// batch order), read on the stream from cu_seqlens_k / seqused_k, for params.batch_order.
cudaError_t launch_longest_first_batch_order(const AttentionFwdParams& params, int* order, cudaStream_t stream);

}  // namespace flashattn
