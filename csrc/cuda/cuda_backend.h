// Torch-side helpers shared by the CUDA forward and backward entry points.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "attention_api.h"
#include "cuda/head_dim_tiles.h"

namespace flashattn {

// Features and dtypes the CUDA kernels implement (argument checks refuse the rest): of the
// attention ops, and of the KV-cache op.
const BackendFeatures& cuda_features();
const BackendFeatures& cuda_kvcache_features();

// Refuses devices older than sm_80 (no bf16 mma.sync / cp.async) by name.
void check_cuda_device(const at::Tensor& q);

// Limits of q's device, read once per device and cached.
DeviceLimits device_limits(const at::Tensor& q);

// Throws with the CUDA error string when a launch (or its planning) failed.
void check_cuda_status(cudaError_t status, const char* what);

// The kernels move rows in 16-byte pieces (cp.async, vector loads and stores): whether a
// tensor's data pointer and (batch, row, head) strides are 16-byte multiples, and the
// tensor itself where they are, else (a view at an odd element offset, say) a fresh
// contiguous copy; the KV caches, written in place, are refused instead.
bool has_16_byte_rows(const at::Tensor& t);
at::Tensor with_16_byte_rows(const at::Tensor& t);

// Whether to read cu_seqlens / seqused / cache_seqlens / block_table values on the host
// to check them: a device synchronisation per call. Not while a CUDA graph is being
// captured (it cannot synchronise), nor with FLASHATTN_SKIP_VALUE_CHECKS=1 (an eager
// decoding loop, where the synchronisation costs more than the attention). The kernels
// never read or write outside the tensors whatever the values.
bool host_value_checks_enabled();

// The forward kernel of params' dtype, head-dim tile and score mod on `stream` (the
// attention op's, and the KV-cache op's for long chunks on a contiguous cache).
void run_forward_kernel(const AttentionFwdParams& params, const DeviceLimits& limits, cudaStream_t stream);

// Error for a head_dim whose tile width this build did not compile.
[[noreturn]] void fail_head_dim_not_compiled(int64_t head_dim);

}  // namespace flashattn
