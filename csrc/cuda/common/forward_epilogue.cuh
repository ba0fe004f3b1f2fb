// The forward epilogue of both kernel families: a warp's rows of O and lse from the
// accumulators to global memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

// Epilogue: O / l and lse = (m + log2 l) * ln 2 for a warp's rows. A row that saw no key
// gets O = 0 and lse = no_key_lse: +inf for a final result, which makes the backward's P
// exactly 0 for it; -inf for a split-KV partial, which gives it no weight in the merge.
// Output is the element type of O (fp32 for partials). kept_scale: dropout's 1 / (1 - p),
// which the kept probabilities in O still lack (lse is that of the undropped ones).
template <typename Output, int kMTiles, int kDTiles>
__device__ __forceinline__ void store_forward_rows(const float (&acc_o)[kMTiles][kDTiles][4],
                                                   const float (&row_max)[kMTiles][2],
                                                   const float (&row_sum)[kMTiles][2], Output* out_ptr,
                                                   int64_t out_row_stride, float* lse_ptr, int warp_row,
                                                   int valid_q_rows, int head_dim, int lane,
                                                   float no_key_lse = INFINITY, float kept_scale = 1.f) {
  const int quad_row = lane / 4, quad_col = (lane % 4) * 2;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(row_sum[mt][h]);
      const bool has_keys = sum > 0.f;
      const float inv_sum = has_keys ? kept_scale / sum : 0.f;
      const int row = warp_row + mt * 16 + quad_row + h * 8;
      const auto store_lse = [&] {
        if (lane % 4 == 0) lse_ptr[row] = has_keys ? (row_max[mt][h] + log2f(sum)) * float(M_LN2) : no_key_lse;
      };
      if constexpr (std::is_same_v<Output, float>) {
        if (row < valid_q_rows) {
          Output* out_row = out_ptr + int64_t(row) * out_row_stride;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            const int col = dt * 8 + quad_col;
            if (col < head_dim)
              *reinterpret_cast<float2*>(out_row + col) =
                  make_float2(acc_o[mt][dt][2 * h] * inv_sum, acc_o[mt][dt][2 * h + 1] * inv_sum);
          }
          store_lse();
        }
      } else {
        Output* out_row = out_ptr + int64_t(row) * out_row_stride;
        // 16 bytes per lane, a quad's 64 bytes of its row contiguous (rows 16-byte aligned: O is
        // allocated with head_dim a multiple of 8); four-byte stores of 8 rows per warp store
        // were what made the Hopper backward's epilogue slow.
        static_assert(kDTiles % 4 == 0, "whole groups of four n8 tiles");
#pragma unroll
        for (int group = 0; group < kDTiles / 4; ++group) {
          uint32_t v[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)
            v[k] = MmaElement<Output>::pack(acc_o[mt][4 * group + k][2 * h] * inv_sum,
                                            acc_o[mt][4 * group + k][2 * h + 1] * inv_sum);
          quad_transpose(v, lane);
          const int piece = 4 * group + lane % 4;
          if (row < valid_q_rows && piece * 8 < head_dim)
            reinterpret_cast<uint4*>(out_row)[piece] = make_uint4(v[0], v[1], v[2], v[3]);
        }
        if (row < valid_q_rows) store_lse();
      }
    }
}

}  // namespace flashattn
