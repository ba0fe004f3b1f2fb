// Launch layer of the Hopper forward kernel: its tile plan, the TMA maps, the
// shared-memory opt-in, the grid. Included by forward_launch.cuh, which calls it
// first on sm_90 devices of builds that compiled the sm_90a image.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/sm90/forward_kernel.cuh"
#include "cuda/common/kernel_launch.cuh"
#include "cuda/device_limits.h"
#include "cuda/sm90/tma_tile_map.cuh"

namespace flashattn {

// The Hopper tile plan per head-dim tile width W and score-mod variant (void: none, the
// mma.sync kernel runs). What bounds it:
//  - registers: a consumer thread holds O (W / 2 floats), S (kBlockN / 2) and P
//    (kBlockN / 4 words) within the 240 registers setmaxnreg gives it;
//  - shared memory: Q (kBlockM x W) + kStages x (K + V) (kBlockN x W), within the
//    227 KB of an sm_90 block. The overlapped pipeline holds two key blocks of K
//    and one of V at once; with K and V in separate rings K runs a block ahead, so
//    two stages keep the copies ahead at W = 256 (kBlockN = 80: 225 KB), where W = 64
//    and 128 measured best with three (kBlockN = 128: 105 / 225 KB).
//  - blocks per SM: W = 64 runs one consumer warpgroup (kBlockM = 64), so two blocks
//    (105 KB, 32K registers each) share an SM and one's loads and epilogue hide under
//    the other's products: +12 % at N 1024 causal, +8 % at N 1024, -1 % at N 8192
//    against two warpgroups of one block. W = 128 has no room for a second block.
//  - dropout at W = 256: its draws beside S of the next block spill (8-80 bytes), so those
//    variants run the products in sequence over 64-key blocks. At W = 128 softcap with dropout
//    and ALiBi with dropout (not the three together) keep one key loop: in three
//    (kUnmaskedLoop) each spilled 4 bytes.
// LongSequenceShape (void: none) runs the calls of long dense sequences (runs_long_sequence_shape):
// at W = 64, three consumer warpgroups of 64 rows (FlashAttention-3's and FA4's 192 x 128 tile,
// S of the next block beside P of this one in the unmasked blocks, within their 160 registers).
// Their warps hide each other's waits, which the one consumer warpgroup of Shape cannot (its
// warps are latency-bound: RESULTS.md). Measured on the H100 against Shape: +6-8 % at N 2048
// and +10 % at N 8192 with the products in sequence, overlapped a further +6-7 % at N 2048-16384
// (2026-12-05, 2026-12-06); causal, where its 192-row diagonal blocks and the fewer tiles lose
// 9-25 % at N 1024-2048 and 2 % at N 4096, +7-8 % at N 8192-16384.
template <int W, ScoreMod kMod>
struct Sm90ForwardPlan {
  using Shape = void;
  using LongSequenceShape = void;
};
template <ScoreMod kMod>
struct Sm90ForwardPlan<64, kMod> {
  using Shape = Sm90ForwardShape<64, 128, 1, 3>;
  using LongSequenceShape =
      std::conditional_t<kMod == ScoreMod::kNone, Sm90ForwardShape<64, 128, 3, 2>, void>;
};
template <ScoreMod kMod>
struct Sm90ForwardPlan<128, kMod> {
  using Shape = Sm90ForwardShape<128, 128, 2, 3, true, 0,
                                 /*kUnmaskedLoop=*/kMod != ScoreMod::kSoftcapDropout &&
                                     kMod != ScoreMod::kBiasDropout>;
  using LongSequenceShape = void;
};
template <ScoreMod kMod>
struct Sm90ForwardPlan<256, kMod> {
  using Shape = std::conditional_t<has_dropout(kMod), Sm90ForwardShape<256, 64, 2, 2, /*kOverlap=*/false>,
                                   Sm90ForwardShape<256, 80, 2, 2>>;
  using LongSequenceShape = void;
};

// Whether a call takes the plan's LongSequenceShape: dense batches (no cu_seqlens, seqused), no
// window, and query and key sequences of at least 2048, or 8192 with a causal mask.
inline bool runs_long_sequence_shape(const AttentionFwdParams& p) {
  const bool causal = p.window_left < 0 && p.window_right == 0;
  const int min_seqlen = causal ? 8192 : 2048;
  return p.window_left < 0 && (p.window_right < 0 || causal) && !SequenceInfo::has_sequence_bounds(p) &&
         p.seqlen_q >= min_seqlen && p.seqlen_k >= min_seqlen;
}

// Launches the Hopper kernel, or sets *launched = false (and launches nothing)
// where TMA cannot describe an input.
template <typename Element, typename Shape, ScoreMod kMod>
cudaError_t launch_forward_sm90(const AttentionFwdParams& params, const DeviceLimits& limits, cudaStream_t stream,
                                bool* launched) {
  *launched = false;
  Sm90ForwardArgs args{};
  args.params = params;
  args.order = ForwardTileOrder(params, Shape::kBlockM);
  const bool mapped =
      encode_tile_map<Element>(&args.q_map, params.q, params.q_strides, params.head_dim, params.rows_q,
                               params.nheads_q, q_map_batches(params), Shape::kBlockM) &&
      encode_tile_map<Element>(&args.k_map, params.k, params.k_strides, params.head_dim, params.rows_k,
                               params.nheads_kv, k_map_batches(params), Shape::kBlockN) &&
      encode_tile_map<Element>(&args.v_map, params.v, params.v_strides, params.head_dim, params.rows_k,
                               params.nheads_kv, k_map_batches(params), Shape::kBlockN);
  if (!mapped) return cudaSuccess;
  *launched = true;
  // The modifier variants are not instantiated for dense calls a second time: kDense pays
  // off at short sequences of the plain kernel, where a few registers matter.
  const bool dense = kMod == ScoreMod::kNone && !SequenceInfo::has_sequence_bounds(params);
  const int64_t persistent_blocks = persistent_forward_blocks(params, limits, Shape::kBlockM, Shape::kBlockN,
                                                               int64_t{limits.num_sms} * Shape::kBlocksPerSM);
  if (persistent_blocks > 0) {
    const auto kernel = dense ? attention_forward_sm90_kernel<Element, Shape, kMod == ScoreMod::kNone, kMod, true>
                              : attention_forward_sm90_kernel<Element, Shape, false, kMod, true>;
    return launch_on_flat_grid(kernel, persistent_blocks, Shape::kThreads,
                               Shape::kSmemBytes + Shape::kSchedulerBytes, stream, args);
  }
  const auto kernel = dense ? attention_forward_sm90_kernel<Element, Shape, kMod == ScoreMod::kNone, kMod>
                            : attention_forward_sm90_kernel<Element, Shape, false, kMod>;
  return launch_on_flat_grid(kernel, ForwardBlock::grid_blocks(params, Shape::kBlockM), Shape::kThreads,
                             Shape::kSmemBytes, stream, args);
}

}  // namespace flashattn
