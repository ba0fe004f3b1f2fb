// A (kRows x kCols) tile of 16-bit elements in shared memory, row-major with each
// row padded by 16 bytes. With rows of a multiple of 64 bytes the padding puts the
// 8 row addresses of one ldmatrix (and one cp.async wavefront) on 8 distinct
// 16-byte bank groups, so neither conflicts; it costs kCols/8 % of the tile.
#pragma once

#include <cstdint>

#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kStride = kCols + 8;  // elements
  static constexpr int kElements = kRows * kStride;
  static constexpr int kBytes = kElements * 2;
  static constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks
  static_assert(kCols % 16 == 0, "tile width must be a whole number of mma k-steps");

  __device__ __forceinline__ static uint32_t address(uint32_t base, int row, int col) {
    return base + static_cast<uint32_t>((row * kStride + col) * 2);
  }

  // Copies rows [0, valid_rows) and columns [0, head_dim) of a global tile whose
  // rows are row_stride elements apart; everything else is zero-filled, so the
  // ragged edges of the sequence and of the head dimension read nothing out of
  // bounds and contribute nothing to the products.
  template <int kThreads, typename Element>
  __device__ __forceinline__ static void load_async(uint32_t smem_base, const Element* gmem,
                                                    int64_t row_stride, int valid_rows,
                                                    int head_dim, int thread) {
    if constexpr (kThreads % kChunksPerRow == 0) {
      // A thread copies the same 16-byte column of every kRowsPerPass-th row,
      // so its addresses advance by one constant per pass: a few integer ops
      // per copy instead of a division and a 64-bit multiply.
      constexpr int kRowsPerPass = kThreads / kChunksPerRow;
      constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
      const int row = thread / kChunksPerRow;
      const int col = (thread % kChunksPerRow) * 8;
      const bool col_in_range = col < head_dim;
      const Element* src = gmem + row * row_stride + col;
      const int64_t pass_stride = kRowsPerPass * row_stride;
      const uint32_t dst = address(smem_base, row, col);
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int r = row + pass * kRowsPerPass;
        if (kRows % kRowsPerPass == 0 || r < kRows) {
          const bool in_range = col_in_range && r < valid_rows;
          cp_async_16(dst + pass * kRowsPerPass * kStride * 2, in_range ? src : gmem, in_range);
        }
        src += pass_stride;
      }
    } else {
      // Widths whose rows don't divide the block (W = 96, 192): chunk by chunk.
      load_rows_async<kThreads>(smem_base, [&](int row) { return gmem + row * row_stride; }, valid_rows,
                                head_dim, thread);
    }
  }
  // The same for rows that are not evenly strided (a paged KV cache): row r of the tile
  // is copied from row_pointer(r); the copies past valid_rows zero-fill and take row 0's
  // address, so valid_rows >= 1.
  template <int kThreads, typename RowPointer>
  __device__ __forceinline__ static void load_rows_async(uint32_t smem_base, const RowPointer& row_pointer,
                                                         int valid_rows, int head_dim, int thread) {
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
    for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
      const int chunk = thread + it * kThreads;
      if (kChunks % kThreads == 0 || chunk < kChunks) {
        const int row = chunk / kChunksPerRow;
        const int col = (chunk % kChunksPerRow) * 8;
        const bool in_range = row < valid_rows && col < head_dim;
        cp_async_16(address(smem_base, row, col), in_range ? row_pointer(row) + col : row_pointer(0), in_range);
      }
    }
  }
};

}  // namespace flashattn
