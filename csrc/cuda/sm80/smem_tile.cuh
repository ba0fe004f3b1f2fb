// A (kRows x kCols) tile of 16-bit elements in shared memory, in one of two layouts.
//
// Padded (the default): row-major with each row padded by 16 bytes. With rows of a multiple
// of 64 bytes the padding puts the 8 row addresses of one ldmatrix (and one cp.async
// wavefront) on 8 distinct 16-byte bank groups, so neither conflicts; it costs kCols/8 % of
// the tile.
//
// Swizzled (rows of whole 128-byte segments): row-major without padding, the 16-byte chunk c
// of row r stored at chunk c ^ (r % 8) of its segment. ldmatrix's 8 rows of one column still
// fall in 8 distinct bank groups, and the 8 chunks of a 128-byte line of global memory land in
// one aligned segment of shared memory. With the padding they straddle two segments, and the
// L2 served each decoding line as 2.6 requests and 6 sectors instead of 1 and 4 (Nsight
// Compute, H100, 2026-12-07: 1.5 x the K/V bytes in L2 traffic, where cuDNN's kernel had 1.0).
#pragma once

#include <cstdint>

#include "cuda/common/mma_primitives.cuh"

namespace flashattn {

template <int kRows_, int kCols_, bool kSwizzled_ = false>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr bool kSwizzled = kSwizzled_;
  static constexpr int kStride = kSwizzled ? kCols : kCols + 8;  // elements
  static constexpr int kElements = kRows * kStride;
  static constexpr int kBytes = kElements * 2;
  static constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks
  static_assert(kCols % 16 == 0, "tile width must be a whole number of mma k-steps");
  static_assert(!kSwizzled || kCols % 64 == 0, "a swizzled tile's rows are whole 128-byte segments");

  __device__ __forceinline__ static uint32_t address(uint32_t base, int row, int col) {
    if constexpr (kSwizzled)
      return base + static_cast<uint32_t>((row * kStride + (((col / 8) ^ (row % 8)) * 8 + col % 8)) * 2);
    else
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
          // Swizzled, a row's chunk moves with r % 8 unless the passes step whole groups of 8 rows.
          const uint32_t pass_dst = kSwizzled && kRowsPerPass % 8 != 0 ? address(smem_base, r, col)
                                                                       : dst + pass * kRowsPerPass * kStride * 2;
          cp_async_16(pass_dst, in_range ? src : gmem, in_range);
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
