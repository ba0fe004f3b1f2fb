// The backward launch entry and its workspace geometry, as the torch-side code sees them
// (plain host C++; the template definitions are in backward_launch.cuh, compiled only in
// instantiations/bwd_hdim*.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"
#include "cuda/device_limits.h"
#include "cuda/score_mod.h"

namespace flashattn {

// What the caller allocates (fp32 / int32, all uninitialised; the launch zeroes what it needs):
//   dq_accum  (workspace_rows, head_dim_rounded) in 8 x 8 tiles (dq_accum_offset, or _transposed: DqAccumTiles)
//   softmax_d, lse_log2  (workspace_rows)
//   dq_semaphore  batch * nheads_q * semaphores_per_head, only when deterministic
// Dense q: rows are (batch, nheads_q, seqlen_q_rounded). Variable-length q: (nheads_q, rows_q
// + 128 batch, rounded up to 128), each sequence from its first row + 128 b, rounded down
// to 128 (backward_workspace_row), so that its padded blocks end before the next sequence's.
struct BackwardWorkspaceGeometry {
  int64_t seqlen_q_rounded;  // the longest sequence, rounded up to whole 128-row blocks
  int64_t head_dim_rounded;
  int64_t semaphores_per_head;
  int64_t batch_stride, head_stride;  // in rows
  int64_t workspace_rows;
};

// Must agree with backward::kQueryRowRounding and backward::kMinBlockM (backward_kernel.cuh,
// checked there by static_assert).
constexpr int kBackwardQueryRowRounding = 128;
constexpr int kBackwardMinBlockM = 16;

FLASHATTN_HOST_DEVICE int64_t round_up_rows(int64_t rows) {
  return (rows + kBackwardQueryRowRounding - 1) / kBackwardQueryRowRounding * kBackwardQueryRowRounding;
}

inline BackwardWorkspaceGeometry backward_workspace_geometry(const AttentionFwdParams& p, int head_dim_tile) {
  const int64_t rounded = round_up_rows(p.seqlen_q);
  BackwardWorkspaceGeometry g{rounded, head_dim_tile, rounded / kBackwardMinBlockM, 0, 0, 0};
  if (p.cu_seqlens_q != nullptr) {
    g.head_stride = round_up_rows(int64_t{p.rows_q} + int64_t{kBackwardQueryRowRounding} * p.batch);
    g.workspace_rows = g.head_stride * p.nheads_q;
  } else {
    g.head_stride = rounded;
    g.batch_stride = rounded * p.nheads_q;
    g.workspace_rows = g.batch_stride * p.batch;
  }
  return g;
}

// Workspace row of query 0 of head h of sequence b, whose first row in q is q_offset:
// backward_workspace_sequence(p, q_offset, b) + h * p.workspace_head_stride (the first part
// is computed once per thread block).
FLASHATTN_HOST_DEVICE int64_t backward_workspace_sequence(const AttentionBwdParams& p, int q_offset, int b) {
  const int64_t start = p.cu_seqlens_q == nullptr
                            ? 0
                            : (int64_t{q_offset} + int64_t{kBackwardQueryRowRounding} * b) /
                                  kBackwardQueryRowRounding * kBackwardQueryRowRounding;
  return b * p.workspace_batch_stride + start;
}
FLASHATTN_HOST_DEVICE int64_t backward_workspace_row(const AttentionBwdParams& p, int q_offset, int b, int h) {
  return backward_workspace_sequence(p, q_offset, b) + h * p.workspace_head_stride;
}

// Where element (workspace row, column) of dq_accum is: in 8 x 8 tiles of fp32 (256
// contiguous bytes, row-major inside), ordered by columns within each group of 8 rows. Then a
// query block (whole groups of 8 rows from a multiple of 8) is one contiguous range, which the
// Hopper kernel adds in one bulk reduction; a warp's m16n8 accumulator pairs of 8 rows x 8
// columns fill one tile, so staging them in shared memory in this layout is free of bank
// conflicts; and 8 columns of a row are 32 contiguous bytes (the postprocess reads). The offset
// is additive in row and column steps that are multiples of 8.
FLASHATTN_HOST_DEVICE constexpr int64_t dq_accum_offset(int64_t row, int col, int width) {
  return ((row / 8) * (width / 8) + col / 8) * 64 + (row % 8) * 8 + col % 8;
}

// The same tiles with their inside transposed (8 rows of a column contiguous), for the kernel
// that computes dQᵀ (the Hopper kernel's 80-query blocks): its accumulator pairs are two rows
// of one column, side by side here. One call's kernels use one orientation; the postprocess
// reads either (DqAccumTiles).
FLASHATTN_HOST_DEVICE constexpr int64_t dq_accum_offset_transposed(int64_t row, int col, int width) {
  return ((row / 8) * (width / 8) + col / 8) * 64 + (col % 8) * 8 + row % 8;
}
enum class DqAccumTiles { kRowMajor, kTransposed };

// params must carry the workspace pointers and the geometry of
// backward_workspace_geometry(params, kHeadDimTile).
// kMod: backward_score_mod(params).
template <typename Element, int kHeadDimTile, ScoreMod kMod>
cudaError_t launch_attention_backward(const AttentionBwdParams& params, const DeviceLimits& limits,
                                      cudaStream_t stream);

}  // namespace flashattn
