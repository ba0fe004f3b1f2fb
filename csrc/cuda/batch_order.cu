// A variable-length batch's sequences, most keys first: the forward grids take them in this
// order (ForwardBlock), so that the last tiles to run are short ones and the tail where SMs
// idle is short too (FlashAttention-3 sorts its varlen batches the same way).
#include "cuda/batch_order.h"

#include "common/sequence_info.h"

namespace flashattn {
namespace {

constexpr int kThreads = 1024;

// One block: each sequence's rank is the number of sequences ahead of it.
__global__ void __launch_bounds__(kThreads) longest_first_batch_order(const AttentionFwdParams params, int* order) {
  __shared__ int keys[kMaxOrderedBatch];
  for (int b = threadIdx.x; b < params.batch; b += kThreads) keys[b] = SequenceInfo(params, b).seqlen_k;
  __syncthreads();
  for (int b = threadIdx.x; b < params.batch; b += kThreads) {
    const int mine = keys[b];
    int rank = 0;
    for (int other = 0; other < params.batch; ++other)
      rank += keys[other] > mine || (keys[other] == mine && other < b);
    order[rank] = b;
  }
}

}  // namespace

cudaError_t launch_longest_first_batch_order(const AttentionFwdParams& params, int* order, cudaStream_t stream) {
  if (params.batch > kMaxOrderedBatch) return cudaErrorInvalidValue;
  longest_first_batch_order<<<1, kThreads, 0, stream>>>(params, order);
  return cudaGetLastError();
}

}  // namespace flashattn
