// Shapes for forward_tile_sweep.cu (SWEEP_SHAPES_HEADER; with -DFLASHATTN_SWEEP_SM90), each Hopper
// shape timed on the static and the persistent grid: the shipped d 64 / 128 / 256 shapes, then
// the d 64 shapes of one block per SM that the static grid ruled out at short sequences: three
// consumer warpgroups of 192 rows (+5 % at N 8192, -24 % at N 1024 causal against the shipped
// two blocks of 64 rows, RESULTS.md; 64- and 80-key blocks, as 128 spilled at their 160
// registers with S_{j+1} beside P_j until the masked blocks got loops of their own (2026-12-06),
// and 128 with the products in sequence, FlashAttention-3's d 64 tile less its overlap) and two
// of 128 rows. A block per SM idles at each of its tiles'
// start and end, which is what the persistent grid hides (+15 % at d 128, N 1024 causal).
// Predicted: the persistent grid gains the 192-row shapes 10-20 % at N 1024 causal and 3-8 % at
// N 2048, so that one of them comes within 5 % of the shipped shape at N 1024 and keeps its
// +5 % at N 8192.
#define FLASHATTN_SWEEP_SHAPES                                                                            \
  Sm90ForwardShape<64, 128, 1, 3>, Sm90ForwardShape<128, 128, 2, 3>, Sm90ForwardShape<256, 80, 2, 2>,     \
      Sm90ForwardShape<64, 64, 3, 4>, Sm90ForwardShape<64, 80, 3, 3>, Sm90ForwardShape<64, 128, 3, 2, false>, \
      Sm90ForwardShape<64, 128, 2, 3>
