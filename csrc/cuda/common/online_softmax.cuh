// The online softmax of the forward kernels (both families): a block of scores from the
// m16n8 accumulator layout that mma.sync and each warp of a wgmma m64 product share,
// folded into the running max and sum of its rows, and the rescale of O that follows.
#pragma once

#include <cmath>
#include <type_traits>

#include "common/attention_mask.h"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/score_transform.cuh"

namespace flashattn {

// ALiBi's frame. The bias -slope |diag_i - j| of row i (diag_i: the key on its diagonal) is
// -slope (diag_i - ref) + slope (j - ref) left of the diagonal and -slope (diag_i - ref) +
// 2 slope (diag_i - ref) - slope (j - ref) right of it, ref = the diagonal of the warp's first
// row. The online softmax runs without each row's constant -slope (diag_i - ref), which
// changes neither P nor O: a key block wholly on one side of its rows' diagonals then adds
// +-slope (j - ref) per column (one FMA per column, shared by the lane's rows, folded into the
// score's scaling) and a per-row term folded into the max, instead of |diag_i - j| per score;
// only blocks that the diagonal crosses take the distance per score. bias_frame_row_offset is
// the constant; the kernels shift the sink into the frame and the max back out of it.
template <typename Mask>
__device__ __forceinline__ float bias_frame_row_offset(float slope_log2, const Mask& mask, int row,
                                                       int warp_row_begin) {
  return -slope_log2 * float(mask.diagonal_of_row(row) - mask.diagonal_of_row(warp_row_begin));
}

// Adds `sign` x the frame's row constant to each of the lane's rows' max: -1 moves a starting
// max (the sink) into the frame, +1 moves the final max back out of it.
template <int kMTiles, typename Transform, typename Mask>
__device__ __forceinline__ void shift_rows_for_bias_frame(float (&row_max)[kMTiles][2], const Transform& transform,
                                                          const Mask& mask, int warp_row_begin, int lane, float sign) {
  if constexpr (Transform::kBiasFrame) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        row_max[mt][h] += sign * bias_frame_row_offset(transform.slope_log2, mask,
                                                       warp_row_begin + mt * 16 + lane / 4 + h * 8, warp_row_begin);
  }
}

// Online-softmax step for one S block of a warp's rows: scores to the log2
// domain (score_transform.cuh; in masked blocks one FMUL for plain scores and the max taken
// after scaling, so any sign of softmax_scale is right; ALiBi in the frame above), the element
// mask when a boundary cuts the tile (a separate instantiation, so unmasked tiles run
// straight-line code), the running max and
// sum, and P = exp2(S - max) left in acc_s. The factor each row's O must be
// scaled by goes to `corrections` (rescale_output applies it), so that a caller
// can rescale O later, once a product still accumulating into it has finished.
template <bool kMasked, int kMTiles, int kNTiles, typename Transform, typename Mask>
__device__ __forceinline__ void softmax_scores(float (&acc_s)[kMTiles][kNTiles][4], float (&row_max)[kMTiles][2],
                                               float (&row_sum)[kMTiles][2], float (&corrections)[kMTiles][2],
                                               const Transform& transform, const Mask& mask, int warp_row_begin,
                                               int n_begin, int lane) {
  const int quad_row = lane / 4, quad_col = (lane % 4) * 2;
  // Unmasked blocks of a logit that is a scale times a function of the score (plain, softcap
  // alone) take the block max of that function (its min where the scale is negative), scale it
  // once per row, and form each exponent with one FMA: a multiply per score fewer, on the
  // critical path of every forward.
  constexpr bool kFusedScale = Transform::kAffineLogit && !kMasked;
  const float logit_scale = kFusedScale ? transform.logit_scale() : 0.f;
  // Each row's term of the bias frame, added to its max; or, outside the frame, the ALiBi
  // distance of this lane's first column in each of its rows.
  float row_term[kMTiles][2] = {};
  float row_distance[kMTiles][2];
  if constexpr (Transform::kUsesDistance && !Transform::kBiasFrame) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        row_distance[mt][h] =
            float(mask.diagonal_of_row(warp_row_begin + mt * 16 + quad_row + h * 8) - (n_begin + quad_col));
  }
  if constexpr (Transform::kBiasFrame) {
    const int ref = mask.diagonal_of_row(warp_row_begin);
    const int n_last = n_begin + kNTiles * 8 - 1;
    const bool left = n_last <= ref;  // every key at or left of every row's diagonal
    const bool right = n_begin > mask.diagonal_of_row(warp_row_begin + kMTiles * 16 - 1);
    const float slope = transform.slope_log2;
    if (left || right) {
      const float col_slope = left ? slope : -slope;
      const float col_base = col_slope * float(n_begin + quad_col - ref);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          row_term[mt][h] = right ? -2.f * bias_frame_row_offset(slope, mask, warp_row_begin + mt * 16 + quad_row + h * 8,
                                                                  warp_row_begin)
                                  : 0.f;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_s[mt][nt][e] =
                transform.scaled_plus(acc_s[mt][nt][e], fmaf(col_slope, float(nt * 8 + e % 2), col_base));
    } else {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row_begin + mt * 16 + quad_row + h * 8;
          row_term[mt][h] = -bias_frame_row_offset(slope, mask, row, warp_row_begin);
          const float row_distance = float(mask.diagonal_of_row(row) - (n_begin + quad_col));
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = acc_s[mt][nt][2 * h + e];
              x = transform(x, row_distance - float(nt * 8 + e));
            }
        }
    }
  }
  // Masked (after the transform: a masked score ends as -inf whatever the transform): a score is
  // kept where its key lies in its row's visible range [key_begin, key_end), held per row as
  // this lane's first visible column and a count, so that a score costs one unsigned compare
  // and a select; the mask's predicate per score (key_visible's four conditions) took about 11
  // instructions, on the critical path of every tile's first block (RESULTS.md 2026-12-06).
  // The KV-cache kernels' packed GQA rows keep the predicate per score: with the ranges their
  // W 192 and 256 kernels spilled 8-24 bytes (and their masked blocks are few: a cache's end).
  constexpr bool kRowRanges = std::is_same_v<Mask, MaskGeometry>;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& s = acc_s[mt][nt][e];
        if constexpr (kFusedScale)
          s = transform.pre_logit(s);
        else if constexpr (!Transform::kBiasFrame)
          s = transform(s, Transform::kUsesDistance ? row_distance[mt][e / 2] - float(nt * 8 + e % 2) : 0.f);
        if constexpr (kMasked && !kRowRanges) {
          const int i = warp_row_begin + mt * 16 + quad_row + (e / 2) * 8;
          const int j = n_begin + nt * 8 + quad_col + (e % 2);
          if (!mask.visible(i, j)) s = -INFINITY;
        }
      }
    if constexpr (kMasked && kRowRanges) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row_begin + mt * 16 + quad_row + h * 8;
        // count 0 where the row sees no key (a causal row above the keys' diagonal).
        const int key_begin = mask.key_begin(row);
        const int first = key_begin - (n_begin + quad_col);
        const unsigned count = max(mask.key_end(row + 1) - key_begin, 0);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (unsigned(nt * 8 + e - first) >= count) acc_s[mt][nt][2 * h + e] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = -INFINITY;
      if (kFusedScale && Transform::kScaleMayBeNegative && logit_scale < 0.f) {
        float block_min = INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          block_min = fminf(block_min, fminf(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
        block_max = block_min * logit_scale;
      } else {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          block_max = fmaxf(block_max, fmaxf(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
        if constexpr (kFusedScale) block_max *= logit_scale;
      }
      const float term = Transform::kBiasFrame ? row_term[mt][h] : 0.f;
      const float new_max =
          fmaxf(row_max[mt][h], Transform::kBiasFrame ? quad_max(block_max) + term : quad_max(block_max));
      // A row with nothing visible yet keeps max -inf; subtract 0 instead so
      // exp2(-inf - -inf) never makes a NaN.
      const float max_used = new_max == -INFINITY ? 0.f : new_max;
      const float correction = fast_exp2(row_max[mt][h] - max_used);
      row_max[mt][h] = new_max;
      const float exponent_base = Transform::kBiasFrame ? max_used - term : max_used;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& s = acc_s[mt][nt][2 * h + e];
          s = fast_exp2(kFusedScale ? fmaf(s, logit_scale, -exponent_base) : s - exponent_base);
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
