// Launch layer of the Hopper backward main kernel (sm90/backward_kernel.cuh): its tile plan,
// the TMA maps, the shared-memory opt-in, the grid. backward_launch.cuh calls it first, between
// the shared preprocess and postprocess kernels, on sm_90 devices of builds that compiled the
// sm_90a image.
//
// Build: header only, through backward_launch.cuh (instantiations/bwd_hdim<W>.cu) or the
// standalone check benchmarks/kernels/backward_sm90_check.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/sm90/backward_kernel.cuh"
#include "cuda/common/kernel_launch.cuh"
#include "cuda/sm90/tma_tile_map.cuh"

namespace flashattn {

// The Hopper backward plan per head-dim tile width W (void: none, the mma.sync kernel runs).
// What bounds it (sm90/backward_kernel.cuh has the details):
//  - registers: split by keys, dK + dV take W of the 240 registers a consumer thread has and
//    Sᵀ + dPᵀ kBlockM more, so W = 256 splits the head dimension instead (128 + 32) and only
//    W = 64 has room for 128 queries per iteration (64 + 128); W = 32, 96, 192 are not whole
//    128-byte swizzle columns (192 would be, split by head dims, only as 96 + 96);
//  - shared memory (two Q/dO stages): 194 KB at W = 64, 192 KB at W = 128, 224 KB at W = 256.
//  - softcap with ALiBi or dropout at W = 64: 128 queries spill there (4-100 bytes), so those
//    variants take 64. Dropout alone keeps 128 (no spill with dK beside dV: kDkAfterDq).
//  - W = 128 without a window (UnmaskedShape; the mask only the sequences' ends) and without a
//    score modifier takes 80 queries (FA3's and FA4's tile there): each wgmma that reads both
//    operands from shared memory (Sᵀ, dPᵀ, dQ) moves 10 % fewer bytes per product (at 64 queries
//    they need the full 128 bytes per cycle an SM has), and the barriers and waits of an
//    iteration serve 25 % more products. Measured +1-2 % (H100, N 1024-8192): that bandwidth is
//    not what bounds the loop. Causal and local calls keep 64, as FA3 does (not measured with 80).
template <int W, ScoreMod kMod>
struct Sm90BackwardPlan {
  using Shape = void;
  using UnmaskedShape = void;
};
template <ScoreMod kMod>
struct Sm90BackwardPlan<64, kMod> {
  static constexpr bool kSpillsAt128 = has_softcap(kMod) && kMod != ScoreMod::kSoftcap;
  // At 128 queries, dK after dQ spilled (4-44 bytes) with softcap or dropout.
  static constexpr bool kDkAfterDq = kSpillsAt128 || !(has_softcap(kMod) || has_dropout(kMod));
  // Softcap alone at 128 queries spilled 16-20 bytes with the lagged dQ (either place of dK).
  static constexpr bool kLaggedDq = kMod != ScoreMod::kSoftcap;
  using Shape = Sm90BackwardShape<64, false, 2, kSpillsAt128 ? 64 : 128, kDkAfterDq, kLaggedDq>;
  using UnmaskedShape = Shape;
};
template <ScoreMod kMod>
struct Sm90BackwardPlan<128, kMod> {
  using Shape = Sm90BackwardShape<128, false>;
  // At 80 queries the lagged dQ measured 0.90-0.98 x the named barrier (H100, N 1024-16384).
  using UnmaskedShape = std::conditional_t<kMod == ScoreMod::kNone,
                                           Sm90BackwardShape<128, false, 2, 80, true, false, /*kWindowFree=*/true>, Shape>;
};
template <ScoreMod kMod>
struct Sm90BackwardPlan<256, kMod> {
  using Shape = Sm90BackwardShape<256, true>;
  using UnmaskedShape = Shape;
};

// Fills the kernel's arguments; false where TMA cannot describe an input (a stride or a base
// address not a multiple of 16 bytes), and the caller runs the sm_80 kernel instead.
template <typename Element, typename Shape>
bool make_backward_sm90_args(const AttentionBwdParams& params, Sm90BackwardArgs* args) {
  args->params = params;
  return encode_tile_map<Element>(&args->q_map, params.q, params.q_strides, params.head_dim, params.rows_q,
                                  params.nheads_q, q_map_batches(params), Shape::kBlockM) &&
         encode_tile_map<Element>(&args->do_map, params.dout, params.dout_strides, params.head_dim,
                                  params.rows_q, params.nheads_q, q_map_batches(params), Shape::kBlockM) &&
         encode_tile_map<Element>(&args->k_map, params.k, params.k_strides, params.head_dim, params.rows_k,
                                  params.nheads_kv, k_map_batches(params), Shape::kBlockN) &&
         encode_tile_map<Element>(&args->v_map, params.v, params.v_strides, params.head_dim, params.rows_k,
                                  params.nheads_kv, k_map_batches(params), Shape::kBlockN);
}

// The main kernel only, a dependent launch of the preprocess (common/backward_passes.cuh).
template <typename Element, typename Shape, ScoreMod kMod>
cudaError_t launch_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream) {
  return launch_on_flat_grid(attention_backward_sm90_kernel<Element, Shape, kMod>,
                             BackwardBlock::grid_blocks(args.params, Shape::kBlockN), Shape::kThreads,
                             Shape::kSmemBytes, stream, args, LaunchOrder::kDependent);
}

// The whole backward with the Hopper main kernel of the plan's shape for this call; false (and
// nothing launched) where the block's shared memory is not there or TMA cannot describe an
// input, and the caller runs the sm_80 kernel instead.
template <typename Element, int W, ScoreMod kMod>
bool run_backward_sm90(const AttentionBwdParams& params, const DeviceLimits& limits, cudaStream_t stream,
                       cudaError_t* result) {
  using Plan = Sm90BackwardPlan<W, kMod>;
  const auto run = [&](auto shape) {
    using Shape = decltype(shape);
    Sm90BackwardArgs args;
    if (Shape::kSmemBytes > limits.max_smem_per_block || !make_backward_sm90_args<Element, Shape>(params, &args))
      return false;
    *result = backward::run_backward_passes<Element>(params, stream, Shape::kDqTiles, [&] {
      return launch_backward_sm90<Element, Shape, kMod>(args, stream);
    });
    return true;
  };
  const bool windowed = params.window_left >= 0 || params.window_right >= 0;
  return windowed ? run(typename Plan::Shape{}) : run(typename Plan::UnmaskedShape{});
}

}  // namespace flashattn
