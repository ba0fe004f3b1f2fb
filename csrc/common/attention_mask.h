// Block-level consequences of the mask defined by key_visible() in
// attention_params.h: which keys a block of queries can see (and the reverse),
// and whether a (query block, key block) tile needs the element-wise mask at all.
// Kernels use these to skip invisible tiles and to mask only the tiles that
// straddle a boundary.
#pragma once

#include "common/attention_params.h"

namespace flashattn {

struct MaskGeometry {
  int seqlen_q;
  int seqlen_k;
  int window_left;   // < 0: unbounded
  int window_right;  // < 0: unbounded

  FLASHATTN_HOST_DEVICE int diagonal_offset() const { return seqlen_k - seqlen_q; }
  // The key on query row i's diagonal (ALiBi's distance is measured from it).
  FLASHATTN_HOST_DEVICE int diagonal_of_row(int i) const { return i + diagonal_offset(); }

  // Keys [begin, end) that some query in [row_begin, row_end) can see (end <= begin: none).
  FLASHATTN_HOST_DEVICE int key_begin(int row_begin) const {
    if (window_left < 0) return 0;
    const int j = row_begin + diagonal_offset() - window_left;
    return j > 0 ? j : 0;
  }
  FLASHATTN_HOST_DEVICE int key_end(int row_end) const {
    if (window_right < 0) return seqlen_k;
    const int j = row_end + diagonal_offset() + window_right;
    return j < seqlen_k ? j : seqlen_k;
  }

  // Queries [begin, end) that see some key in [col_begin, col_end).
  FLASHATTN_HOST_DEVICE int query_begin(int col_begin) const {
    if (window_right < 0) return 0;
    const int i = col_begin - diagonal_offset() - window_right;
    return i > 0 ? i : 0;
  }
  FLASHATTN_HOST_DEVICE int query_end(int col_end) const {
    if (window_left < 0) return seqlen_q;
    const int i = col_end - diagonal_offset() + window_left;
    return i < seqlen_q ? i : seqlen_q;
  }

  // True when every key of [col_begin, col_end) is visible from every query of
  // [row_begin, row_end): the tile can skip the element-wise mask.
  FLASHATTN_HOST_DEVICE bool tile_fully_visible(int row_begin, int row_end, int col_begin,
                                                int col_end) const {
    if (col_end > seqlen_k) return false;
    if (window_right >= 0 && col_end - 1 > row_begin + diagonal_offset() + window_right) return false;
    if (window_left >= 0 && col_begin < row_end - 1 + diagonal_offset() - window_left) return false;
    return true;
  }

  FLASHATTN_HOST_DEVICE bool visible(int i, int j) const {
    return key_visible(i, j, seqlen_q, seqlen_k, window_left, window_right);
  }
};

// The mask of packed-GQA tile rows (kvcache_params.h): row r is query r / group, so a
// run of rows covers the queries from its first row's to its last row's, and every
// question is the query mask's.
struct PackedRowsMask {
  MaskGeometry queries;
  int group;

  FLASHATTN_HOST_DEVICE int key_begin(int row_begin) const { return queries.key_begin(row_begin / group); }
  FLASHATTN_HOST_DEVICE int key_end(int row_end) const { return queries.key_end((row_end - 1) / group + 1); }
  FLASHATTN_HOST_DEVICE bool tile_fully_visible(int row_begin, int row_end, int col_begin, int col_end) const {
    return queries.tile_fully_visible(row_begin / group, (row_end - 1) / group + 1, col_begin, col_end);
  }
  FLASHATTN_HOST_DEVICE bool visible(int row, int j) const { return queries.visible(row / group, j); }
  FLASHATTN_HOST_DEVICE int diagonal_of_row(int row) const { return queries.diagonal_of_row(row / group); }
};

}  // namespace flashattn
