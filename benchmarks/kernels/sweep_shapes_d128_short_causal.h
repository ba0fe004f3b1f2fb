// Shapes for forward_tile_sweep.cu (SWEEP_SHAPES_HEADER; with -DFLASHATTN_SWEEP_SM90): the d 128
// forward with one consumer warpgroup, so that two blocks share an SM and one's loads and
// epilogue run under the other's products, as the d 64 plan does (+12 % at N 1024 causal
// there). The question is the short causal cells, 0.69-0.80 x the best peer (RESULTS.md):
// a block of N 1024 causal walks 4.5 key blocks on average, so its prologue and epilogue
// weigh as much as its loop. Predicted: +5-15 % at N 1024 / 2048 causal, and 10-20 % lost at
// N 8192 (64-row tiles read K and V twice as often), so a plan would take it for short
// sequences only. The shipped shape first. Compiled for sm_90a here: no spills.
#define FLASHATTN_SWEEP_SHAPES                                                                             \
  Sm90ForwardShape<128, 128, 2, 3>, Sm90ForwardShape<128, 64, 1, 2>, Sm90ForwardShape<128, 64, 1, 3>,     \
      Sm90ForwardShape<128, 128, 1, 2>
