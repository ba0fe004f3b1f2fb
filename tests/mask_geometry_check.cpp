// MaskGeometry (csrc/common/attention_mask.h) against key_visible, the mask's one definition,
// exhaustively on small sizes: each row's visible keys are [key_begin(row), key_end(row + 1)),
// the range the forward kernels mask each row's scores with; each key's visible queries are
// [query_begin(key), query_end(key + 1)), the backward's; and a tile reported fully visible
// has every pair visible. Prints the first mismatch and exits 1; built and run by
// test_mask_geometry.py.
#include <cstdio>

#include "common/attention_mask.h"

using flashattn::MaskGeometry;

static int mismatch(const MaskGeometry& m, const char* what, int a, int b) {
  std::printf("seqlen_q %d seqlen_k %d window (%d, %d): %s at (%d, %d)\n", m.seqlen_q, m.seqlen_k,
              m.window_left, m.window_right, what, a, b);
  return 1;
}

int main() {
  long pairs = 0;
  for (int seqlen_q = 1; seqlen_q <= 13; ++seqlen_q)
    for (int seqlen_k = 1; seqlen_k <= 13; ++seqlen_k)
      for (int window_left = -1; window_left <= 14; ++window_left)
        for (int window_right = -1; window_right <= 14; ++window_right) {
          const MaskGeometry m{seqlen_q, seqlen_k, window_left, window_right};
          for (int i = 0; i < seqlen_q; ++i)
            for (int j = -1; j <= seqlen_k; ++j, ++pairs) {
              const bool visible = m.visible(i, j);
              if (visible != (m.key_begin(i) <= j && j < m.key_end(i + 1))) return mismatch(m, "row range", i, j);
              if (j >= 0 && j < seqlen_k && visible != (m.query_begin(j) <= i && i < m.query_end(j + 1)))
                return mismatch(m, "key range", i, j);
            }
          for (int r0 = 0; r0 < seqlen_q; r0 += 3)
            for (int c0 = 0; c0 < seqlen_k; c0 += 2) {
              const int r1 = r0 + 3 < seqlen_q ? r0 + 3 : seqlen_q, c1 = c0 + 4;
              bool all = true;
              for (int i = r0; i < r1; ++i)
                for (int j = c0; j < c1; ++j) all = all && m.visible(i, j);
              if (m.tile_fully_visible(r0, r1, c0, c1) && !all) return mismatch(m, "tile fully visible", r0, c0);
            }
        }
  std::printf("%ld (query, key) pairs agree\n", pairs);
  return 0;
}
