// The online softmax of the forward kernels (both families): a block of scores from the
// m16n8 accumulator layout that mma.sync and each warp of a wgmma m64 product share,
// folded into the running max and sum of its rows, and the rescale of O that follows.
#pragma once

#include <cmath>

#include "common/attention_mask.h"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/score_transform.cuh"

namespace flashattn {

// Online-softmax step for one S block of a warp's rows: scores to the log2
// domain (score_transform.cuh: one FMUL for plain scores; the max is taken after
// scaling so any sign of softmax_scale is right), the element mask when a boundary cuts the tile (a separate
// instantiation, so unmasked tiles run straight-line code), the running max and
// sum, and P = exp2(S - max) left in acc_s. The factor each row's O must be
// scaled by goes to `corrections` (rescale_output applies it), so that a caller
// can rescale O later, once a product still accumulating into it has finished.
template <bool kMasked, int kMTiles, int kNTiles, typename Transform, typename Mask>
__device__ __forceinline__ void softmax_scores(float (&acc_s)[kMTiles][kNTiles][4], float (&row_max)[kMTiles][2],
                                               float (&row_sum)[kMTiles][2], float (&corrections)[kMTiles][2],
                                               const Transform& transform, const Mask& mask, int warp_row_begin,
                                               int n_begin, int lane) {
  const int quad_row = lane / 4, quad_col = (lane % 4) * 2;
  // The ALiBi distance of this lane's first column in each of its rows; the other columns
  // are compile-time offsets from it.
  float row_distance[kMTiles][2];
  if constexpr (Transform::kUsesDistance) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        row_distance[mt][h] =
            float(mask.diagonal_of_row(warp_row_begin + mt * 16 + quad_row + h * 8) - (n_begin + quad_col));
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& s = acc_s[mt][nt][e];
        s = transform(s, Transform::kUsesDistance ? row_distance[mt][e / 2] - float(nt * 8 + e % 2) : 0.f);
        if (kMasked) {
          const int i = warp_row_begin + mt * 16 + quad_row + (e / 2) * 8;
          const int j = n_begin + nt * 8 + quad_col + (e % 2);
          if (!mask.visible(i, j)) s = -INFINITY;
        }
      }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
        block_max = fmaxf(block_max, fmaxf(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
      const float new_max = fmaxf(row_max[mt][h], quad_max(block_max));
      // A row with nothing visible yet keeps max -inf; subtract 0 instead so
      // exp2(-inf - -inf) never makes a NaN.
      const float max_used = new_max == -INFINITY ? 0.f : new_max;
      const float correction = fast_exp2(row_max[mt][h] - max_used);
      row_max[mt][h] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& s = acc_s[mt][nt][2 * h + e];
          s = fast_exp2(s - max_used);
          sum += s;
        }
      row_sum[mt][h] = row_sum[mt][h] * correction + sum;
      corrections[mt][h] = correction;
    }
}

// The rows' state before the first key block with a learnable sink of logit sink_log2 (log2
// units, -inf: none): max = sink, sum = exp2(sink - max) = 1, held by the first lane of each
// quad (the epilogue sums the quad's parts).
template <int kMTiles>
__device__ __forceinline__ void start_rows_at_sink(float (&row_max)[kMTiles][2], float (&row_sum)[kMTiles][2],
                                                   float sink_log2, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = sink_log2;
      row_sum[mt][h] = lane % 4 == 0 && sink_log2 != -INFINITY ? 1.f : 0.f;
    }
}

// O *= correction per row. Past the first blocks the running max rarely moves,
// so the rescale (W/8 multiplies per row per block, as many as the scores of a
// 32-wide block) is skipped when no row of the warp needs it; exact, since the
// factor is then 1.
template <int kMTiles, int kDTiles>
__device__ __forceinline__ void rescale_output(float (&acc_o)[kMTiles][kDTiles][4],
                                               const float (&corrections)[kMTiles][2]) {
  bool any_max_moved = false;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) any_max_moved |= corrections[mt][0] != 1.f || corrections[mt][1] != 1.f;
  if (__any_sync(0xffffffffu, any_max_moved)) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[mt][dt][2 * h] *= corrections[mt][h];
          acc_o[mt][dt][2 * h + 1] *= corrections[mt][h];
        }
  }
}

// The whole step where O can be rescaled at once: softmax_scores, then rescale_output.
template <bool kMasked, int kMTiles, int kNTiles, int kDTiles, typename Transform, typename Mask>
__device__ __forceinline__ void softmax_update(float (&acc_s)[kMTiles][kNTiles][4],
                                               float (&acc_o)[kMTiles][kDTiles][4],
                                               float (&row_max)[kMTiles][2],
                                               float (&row_sum)[kMTiles][2], const Transform& transform,
                                               const Mask& mask, int warp_row_begin,
                                               int n_begin, int lane) {
  float corrections[kMTiles][2];
  softmax_scores<kMasked>(acc_s, row_max, row_sum, corrections, transform, mask, warp_row_begin, n_begin, lane);
  rescale_output(acc_o, corrections);
}

}  // namespace flashattn
