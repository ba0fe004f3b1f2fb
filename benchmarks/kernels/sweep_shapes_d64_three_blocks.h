// Shapes for forward_tile_sweep.cu (SWEEP_SHAPES_HEADER; with -DFLASHATTN_SWEEP_SM90): the d 64
// forward with three blocks of one consumer warpgroup per SM (64-key blocks, 2-4 stages; 136
// registers per consumer thread) against the shipped two (128-key blocks). d 64 is the widest
// gap to FA4 (0.76-0.85 x, RESULTS.md): its exponentials cost as much as its products, and a
// third warpgroup per SM has its softmax under two others' products. Three consumer
// warpgroups in one block of 192 rows were measured: +5 % at N 8192, -24 % at N 1024 causal.
// Predicted here: 0-8 % gained at N 8192 (K and V read from L2 three times as often as by the
// 192-row tile), within 5 % at N 1024. The shipped shape first. Measured (RESULTS.md,
// 2026-12-05 16:50 UTC, H100): three blocks lost 5-9 % at N 8192 and gained only at N 1024
// causal; not taken.
#define FLASHATTN_SWEEP_SHAPES                                                                             \
  Sm90ForwardShape<64, 128, 1, 3>, Sm90ForwardShape<64, 64, 1, 2, true, 3>, Sm90ForwardShape<64, 64, 1, 3, true, 3>, \
      Sm90ForwardShape<64, 64, 1, 4, true, 3>
