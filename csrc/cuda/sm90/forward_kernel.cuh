// Forward attention kernel for Hopper (sm_90a): wgmma tensor-core products fed
// by TMA, with a producer warpgroup and consumer warpgroups (FlashAttention-3 class).
//
// Same algorithm and tiles as sm80/forward_kernel.cuh (kBlockM query rows of one (batch,
// head), key blocks last first, the element mask only on the blocks a boundary cuts; one
// thread block per tile, or a persistent grid whose blocks take tile after tile), different
// machinery:
//  - warpgroup 0 is the producer: one thread issues TMA copies of Q once and of
//    the K and V blocks into two rings of kStages shared-memory stages, one for K and
//    one for V, K of block j + 1 before V of block j; the copies complete on "full"
//    mbarriers and a stage is reused once every consumer warp has arrived on its
//    "empty" mbarrier: a K stage once its S has completed, a V stage once its P V has,
//    so K runs a block ahead of V. It gives most of its registers to the consumers
//    (setmaxnreg).
//  - each consumer warpgroup owns 64 query rows: S = Q K^T is one chain of
//    wgmma with Q and K from shared memory, the softmax runs on the accumulator
//    registers (the wgmma m64 accumulator of each warp has the m16n8 layout of
//    mma.sync, so common/online_softmax.cuh serves both), and
//    O += P V takes P from registers and V from shared memory (MN-major).
//  - within a warpgroup the two products overlap the softmax: S_{j+1} = Q K_{j+1}^T
//    is issued before O += P_j V_j, and its softmax runs while P_j V_j does.
//  - TMA zero-fills rows past the sequence and columns past head_dim, so the
//    ragged edges need no predication in the copies.
// Consumer warpgroups run unsynchronised with each other, so one's softmax
// overlaps the other's products.
//
// Build: compiled only for the sm_90a target (wgmma and setmaxnreg need it);
// instantiations in instantiations/fwd_hdim<W>.cu.
#pragma once

#include <cuda.h>

#include "common/attention_params.h"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/forward_epilogue.cuh"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/hopper_primitives.cuh"
#include "cuda/sm90/pipeline_state.cuh"
#include "cuda/sm90/wgmma_ops.cuh"

namespace flashattn {

// kOverlap: S_{j+1} and its softmax run under P_j V_j (v2); without it (W = 256 with dropout,
// for registers) the products run one after the other (v1). kBlocksPerSM_: the blocks an SM
// holds at once, which sets the consumers' registers (0: two with one consumer warpgroup, else
// one). kUnmaskedLoop_: the key blocks no mask boundary cuts run in a loop of their own,
// overlapped and without the element mask's code, and the few a boundary cuts one product after
// the other; else one loop, every block overlapped, the mask a branch (at W = 256 three loops
// measured 1-2.5 % slower than one).
template <int kHeadDim_, int kBlockN_, int kConsumerWarpgroups_, int kStages_ = 2, bool kOverlap_ = true,
          int kBlocksPerSM_ = 0, bool kUnmaskedLoop_ = (kHeadDim_ < 256)>
struct Sm90ForwardShape {
  static constexpr bool kOverlap = kOverlap_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kStages = kStages_;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr bool kUnmaskedLoop = kUnmaskedLoop_;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
  static constexpr int kColumnBlocks = kHeadDim / sm90::kSwizzleElements;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kTileBytes = kQBytes + kStages * 2 * kKVBytes;
  static constexpr int kBarriers = 1 + 4 * kStages;  // Q full; per stage K full, V full, K empty, V empty
  // + slack to align the tiles to a swizzle atom.
  static constexpr int kSmemBytes = sm90::kSwizzleAtomBytes + kTileBytes + 8 * kBarriers;
  // What a persistent grid's blocks take beyond kSmemBytes: the Q empty, tile full and tile empty
  // barriers and the tile word.
  static constexpr int kSchedulerBytes = 8 * 3 + 8;
  // kBlocksPerSM is what __launch_bounds__ promises ptxas, and it sets the registers each block
  // is launched with, which setmaxnreg shares out (consumer_registers). One consumer warpgroup
  // leaves room for two blocks per SM, so one block's loads and epilogue overlap the other's
  // products (short key loops: causal, small N). Shared memory must hold that many blocks too,
  // else the promise costs registers and buys nothing.
  static constexpr int kBlocksPerSM = kBlocksPerSM_ > 0 ? kBlocksPerSM_ : (kConsumerWarpgroups == 1 ? 2 : 1);
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters =
      sm90::consumer_registers(kProducerRegisters, kConsumerWarpgroups, kBlocksPerSM);
  static_assert(kHeadDim % sm90::kSwizzleElements == 0, "head-dim tile is whole 64-column blocks");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N and k16 steps");
  static_assert(kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters <=
                    (1 + kConsumerWarpgroups) * sm90::launch_registers(1 + kConsumerWarpgroups, kBlocksPerSM),
                "register budget: setmaxnreg shares the block's launch registers");
  static_assert(kBlocksPerSM * (kSmemBytes + kSchedulerBytes + sm90::kReservedSmemPerBlock) <= sm90::kSmemPerSM,
                "shared memory for kBlocksPerSM blocks");
};

// Which softmax a key block takes: kCut (a mask boundary cuts it: the element mask), kUncut
// (none does), kAsk (the block decides, after its S has landed, which is when the answer
// costs a register least).
enum class Sm90KeyBlock { kCut, kUncut, kAsk };

// The kernel's arguments: the plain params and one TMA map per input, each map
// 4-d (head_dim, seqlen, nheads, batch) with the tensor's own strides.
struct Sm90ForwardArgs {
  AttentionFwdParams params;
  ForwardTileOrder order;
  CUtensorMap q_map, k_map, v_map;
};

// kDense: instantiated for calls without per-sequence bounds (SequenceInfo's `dense`);
// holding those bounds in registers cost the d 64/128 kernels 3-5 % at short sequences.
// kPersistent: the grid is as many blocks as the SMs hold at once, each taking its first tile
// by its index and every next one from params.tile_counter (zeroed before the launch), in the
// static grid's order; a block's next Q and K blocks then load while it finishes the last tile
// (else one block per tile: the static grid).
template <typename Element, typename Shape, bool kDense, ScoreMod kMod, bool kPersistent = false>
__global__ void __launch_bounds__(Shape::kThreads, Shape::kBlocksPerSM)
    attention_forward_sm90_kernel(const __grid_constant__ Sm90ForwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kHeadDim = Shape::kHeadDim;
  constexpr int kStages = Shape::kStages;
  constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
  const AttentionFwdParams& params = args.params;

  extern __shared__ unsigned char smem[];
  const uint32_t base = (smem_address(smem) + sm90::kSwizzleAtomBytes - 1) & ~uint32_t(sm90::kSwizzleAtomBytes - 1);
  const uint32_t q_smem = base;
  const auto k_smem = [&](int stage) { return q_smem + Shape::kQBytes + stage * 2 * Shape::kKVBytes; };
  const auto v_smem = [&](int stage) { return k_smem(stage) + Shape::kKVBytes; };
  const uint32_t barriers = base + Shape::kTileBytes;
  const uint32_t q_full = barriers;
  const auto k_full = [&](int stage) { return barriers + 8 * (1 + stage); };
  const auto v_full = [&](int stage) { return barriers + 8 * (1 + kStages + stage); };
  const auto k_empty = [&](int stage) { return barriers + 8 * (1 + 2 * kStages + stage); };
  const auto v_empty = [&](int stage) { return barriers + 8 * (1 + 3 * kStages + stage); };
  // Persistent grid only (Shape::kSchedulerBytes past the barriers above): Q's stage freed by
  // the consumers' last S of a tile; the next tile's index handed from the producer thread,
  // which takes it from the counter, to the consumers, through one word.
  const uint32_t q_empty = barriers + 8 * Shape::kBarriers;
  const uint32_t tile_full = q_empty + 8, tile_empty = q_empty + 16, tile_slot = q_empty + 24;

  // The static grid decodes its one tile with the compiler's divisions: with FastDivmod's, ptxas
  // moved the d 128 kernel's per-block values from uniform to vector registers (13 more vector
  // instructions in its unmasked loop), and it read 0.92-0.98 x at N 8192.
  const ForwardBlock first_blk = kPersistent
                                     ? ForwardBlock(params, args.order, kBlockM, kBlockN, kDense, blockIdx.x)
                                     : ForwardBlock(params, TileOrder<Division>(params, kBlockM), kBlockM, kBlockN,
                                                    kDense, blockIdx.x);
  if (!kPersistent && first_blk.empty) return;
  const unsigned num_tiles = kPersistent ? static_cast<unsigned>(ForwardBlock::grid_blocks(params, kBlockM)) : 0;
  const auto key_blocks = [](const ForwardBlock& blk) {
    return blk.empty ? 0 : blk.n_block_last - blk.n_block_first + 1;  // <= 0: no visible key
  };
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);

  if (threadIdx.x == 0) {
    sm90::mbarrier_init(q_full, 1);
    for (int st = 0; st < kStages; ++st) {
      sm90::mbarrier_init(k_full(st), 1);
      sm90::mbarrier_init(v_full(st), 1);
      sm90::mbarrier_init(k_empty(st), Shape::kConsumerWarps);
      sm90::mbarrier_init(v_empty(st), Shape::kConsumerWarps);
    }
    if constexpr (kPersistent) {
      sm90::mbarrier_init(q_empty, Shape::kConsumerWarps);
      sm90::mbarrier_init(tile_full, 1);
      sm90::mbarrier_init(tile_empty, Shape::kConsumerWarps);
    }
    sm90::mbarrier_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    sm90::warpgroup_registers_shrink<Shape::kProducerRegisters>();
    if (threadIdx.x == 0 && (kPersistent || key_blocks(first_blk) > 0)) {
      sm90::prefetch_tensor_map(&args.q_map);
      sm90::prefetch_tensor_map(&args.k_map);
      sm90::prefetch_tensor_map(&args.v_map);
      constexpr int kColumnBlocks = Shape::kColumnBlocks;
      // K of block it + 1 before V of block it: S_{it+1} is issued before P_it V_it. A stage of K
      // is freed once its S has completed, one of V once its P V has, so K runs ahead of V.
      // The rings carry on from one tile to the next (a wait on a stage's "empty" barrier before
      // its first fill passes: the parity asked for is that of the phase before the first).
      sm90::PipelineState<kStages> k_write, v_write;
      uint32_t q_loads = 0;
      const auto load_tile = [&](const ForwardBlock& blk) {
        const int num_blocks = key_blocks(blk);
        if (num_blocks <= 0) return;
        const SequenceInfo& seq = blk.seq;
        if (kPersistent && q_loads > 0) sm90::mbarrier_wait(q_empty, (q_loads - 1) & 1);
        ++q_loads;
        sm90::mbarrier_arrive_expect_bytes(q_full, Shape::kQBytes);
        sm90::tma_load_tile<kColumnBlocks>(q_smem, &args.q_map, q_full, kBlockM, seq.q_offset + blk.m_begin, blk.head,
                                           SequenceInfo::q_map_batch(params, blk.batch));
        const int k_batch = SequenceInfo::k_map_batch(params, blk.batch);
        const auto load = [&](sm90::PipelineState<kStages>& write, const auto& tile, const auto& full,
                              const auto& empty, const CUtensorMap* map, int it) {
          const int stage = write.index;
          if (kPersistent || it >= kStages) sm90::mbarrier_wait(empty(stage), write.phase ^ 1);
          sm90::mbarrier_arrive_expect_bytes(full(stage), Shape::kKVBytes);
          sm90::tma_load_tile<kColumnBlocks>(tile(stage), map, full(stage), kBlockN,
                                             seq.k_offset + (blk.n_block_last - it) * kBlockN, blk.kv_head, k_batch);
          write.advance();
        };
        load(k_write, k_smem, k_full, k_empty, &args.k_map, 0);
        for (int it = 0; it < num_blocks; ++it) {
          if (it + 1 < num_blocks) load(k_write, k_smem, k_full, k_empty, &args.k_map, it + 1);
          load(v_write, v_smem, v_full, v_empty, &args.v_map, it);
        }
      };
      if constexpr (!kPersistent) {
        load_tile(first_blk);
      } else {
        // Every tile, the first too, is handed to the consumers, but for the empty ones (past a
        // shorter sequence's end), which the producer skips while the consumers still work on
        // the last tile.
        const auto next_tile = [&] { return atomicAdd(params.tile_counter, 1) + gridDim.x; };
        for (unsigned tile = blockIdx.x, handed = 0;; ++handed, tile = next_tile()) {
          while (tile < num_tiles && ForwardBlock(params, args.order, kBlockM, kBlockN, kDense, tile).empty)
            tile = next_tile();
          sm90::mbarrier_wait(tile_empty, (handed & 1) ^ 1);
          sm90::store_shared_u32(tile_slot, tile);
          sm90::mbarrier_arrive(tile_full);
          if (tile >= num_tiles) break;
          load_tile(ForwardBlock(params, args.order, kBlockM, kBlockN, kDense, tile));
        }
      }
    }
  } else {

    sm90::warpgroup_registers_grow<Shape::kConsumerRegisters>();
    const int lane = threadIdx.x % 32;
    const int consumer = warpgroup - 1;
    const int warp_row = consumer * 64 + ((threadIdx.x / 32) % 4) * 16;  // this warp's 16 rows
    using Transform = ScoreTransform<kMod, /*kLinearBias=*/true>;
    // Q rows of this warpgroup and K rows are K-major operands, V the MN-major B of P V.
    const auto q_operand = sm90::k_major_operand(q_smem + consumer * 64 * sm90::kSwizzleBytes);

    // Where this warpgroup reads the K ring (S runs a block ahead of P V) and the V ring.
    sm90::PipelineState<kStages> k_read, v_read;
    uint32_t q_loads = 0;
    // Hands the stage `read` is at back to the producer (its products have completed).
    const auto release = [&](sm90::PipelineState<kStages>& read, const auto& empty) {
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(empty(read.index));
      read.advance();
    };

    const auto compute_tile = [&](const ForwardBlock& blk) {
      const SequenceInfo& seq = blk.seq;
      const int num_blocks = key_blocks(blk);
      float acc_o[1][kDTiles][4];
      float row_max[1][2], row_sum[1][2];
      start_rows_at_sink(row_max, row_sum, !reads_sink(kMod) ? -INFINITY : sink_logit_log2(params, blk.head),
                         lane);
      shift_rows_for_bias_frame(row_max, Transform(params, blk.batch, blk.head), blk.mask, blk.m_begin + warp_row,
                                lane, -1.f);
  #pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
  #pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
      auto& acc_o_flat = reinterpret_cast<float(&)[kHeadDim / 2]>(acc_o);

      // S = Q K^T of the next key block into acc_s, issued and committed (not waited for).
      const auto issue_scores = [&](float (&acc_s)[kBlockN / 2]) {
        const int stage = k_read.index;
        sm90::mbarrier_wait(k_full(stage), k_read.phase);
        const auto k_operand = sm90::k_major_operand(k_smem(stage));
        sm90::wgmma_fence();
  #pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
          Wgmma<Element, kBlockN>::ss(acc_s, q_operand.at(sm90::k_major_step(ks, kBlockM)),
                                      k_operand.at(sm90::k_major_step(ks, kBlockN)), ks > 0);
        sm90::wgmma_commit();
      };
      // Whether no mask boundary cuts key block `it`. Such blocks form one run (each boundary is
      // a half-plane in the key index), which the unmasked loop below takes.
      const auto fully_visible = [&](int it) {
        const int n_begin = (blk.n_block_last - it) * kBlockN;
        return blk.mask.tile_fully_visible(blk.m_begin, blk.m_begin + kBlockM, n_begin, n_begin + kBlockN);
      };
      // With dropout, which of a block's P the mask keeps, from its softmax until P is packed.
      uint32_t keep_flags[kBlockN / 16][2];
      // The softmax of block `it`'s scores, P left in acc_s (with dropout, its keep_flags drawn).
      const auto softmax_block = [&](Sm90KeyBlock kind, float (&acc_s)[1][kNTiles][4], float (&corrections)[1][2],
                                     int it) {
        const int n_begin = (blk.n_block_last - it) * kBlockN;
        if (kind == Sm90KeyBlock::kAsk ? !fully_visible(it) : kind == Sm90KeyBlock::kCut)
          softmax_scores<true>(acc_s, row_max, row_sum, corrections, Transform(params, blk.batch, blk.head),
                               blk.mask, blk.m_begin + warp_row, n_begin, lane);
        else
          softmax_scores<false>(acc_s, row_max, row_sum, corrections, Transform(params, blk.batch, blk.head),
                                blk.mask, blk.m_begin + warp_row, n_begin, lane);
        if constexpr (has_dropout(kMod))
          DropoutMask(params, blk.batch, blk.head).row_keep_flags(keep_flags, (blk.m_begin + warp_row) / 16, n_begin,
                                                                  lane);
      };
      // P packed into the A fragments of P V (two n8 accumulator tiles = one k16 fragment).
      const auto pack_p = [&](const float (&acc_s)[1][kNTiles][4], uint32_t (&p)[kBlockN / 16][4]) {
  #pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          accumulator_as_a<Element>(p[kk], acc_s[0], kk);
        }
        if constexpr (has_dropout(kMod)) DropoutMask::drop_packed(p, keep_flags);
      };

      // Software pipeline within the warpgroup: while O += P_it V_it runs on the
      // tensor cores, S_{it+1} is already computed and its softmax runs on the
      // other units; O's rescale for block it+1 waits until P_it V_it has landed.
      uint32_t p[kBlockN / 16][4];
      float corrections[1][2];
      if (num_blocks > 0) {
        sm90::mbarrier_wait(q_full, q_loads & 1);
        ++q_loads;
        float acc_s[1][kNTiles][4];
        auto& acc_s_flat = reinterpret_cast<float(&)[kBlockN / 2]>(acc_s);
        issue_scores(acc_s_flat);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc_s_flat);
        release(k_read, k_empty);
        softmax_block(Sm90KeyBlock::kAsk, acc_s, corrections, 0);
        pack_p(acc_s, p);
        // Keys past the sequence's end have P = 0, but the rows of V the copy brought for
        // them belong to the next sequence or to rows seqused leaves out, and 0 * inf or NaN
        // there would reach O: the block that straddles the end (the first) zeroes them,
        // here rather than in the loop, which keeps the loop free of the branch.
        const int v_rows_valid = seq.seqlen_k - blk.n_block_last * kBlockN;
        if (!kDense && SequenceInfo::keys_may_overrun(params) && v_rows_valid < kBlockN) {
          sm90::mbarrier_wait(v_full(v_read.index), v_read.phase);
          sm90::zero_tile_rows<Shape::kColumnBlocks>(v_smem(v_read.index), kBlockN, v_rows_valid, threadIdx.x - 128,
                                                     Shape::kConsumerWarpgroups * 128);
          sm90::named_barrier_sync(sm90::kConsumersBarrier, Shape::kConsumerWarpgroups * 128);
        }
      }
      // O = O * correction + P V of the next V block, issued and committed; the stage is handed
      // back to the producer once it has completed.
      const auto issue_pv = [&]() {
        const int stage = v_read.index;
        rescale_output(acc_o, corrections);
        sm90::mbarrier_wait(v_full(stage), v_read.phase);
        sm90::fence_registers(acc_o_flat);
        const auto v_operand = sm90::mn_major_operand(v_smem(stage), kBlockN);
        sm90::wgmma_fence();
  #pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
          Wgmma<Element, kHeadDim>::rs_b_mn_major(acc_o_flat, p[kk], v_operand.at(kk * 16 * sm90::kSwizzleBytes));
        sm90::wgmma_commit();
      };

      // Block it + 1's S and softmax beside block it's P V. The last block's P V is peeled off the
      // loops so that every iteration has the same two products in flight (with the branch
      // inside, ptxas could not tell which one wgmma_wait<1> retires, and serialised every
      // wgmma). With Shape::kUnmaskedLoop the blocks no boundary cuts run S_{it+1} and its
      // softmax under P_it V_it (Shape::kOverlap) in a loop of their own, the few that a boundary
      // cuts (the diagonal's, first; a window's left edge, last) one product after the other:
      // with the element mask beside P_it, three consumer warpgroups' 160 registers spilled
      // (44-132 bytes at W = 64).
      const auto step = [&](int it, Sm90KeyBlock kind) {
        float acc_s[1][kNTiles][4];
        auto& acc_s_flat = reinterpret_cast<float(&)[kBlockN / 2]>(acc_s);
        if (Shape::kOverlap && kind != Sm90KeyBlock::kCut) {
          issue_scores(acc_s_flat);
          issue_pv();
          sm90::wgmma_wait<1>();  // S_{it+1}; P_it V_it may still run
          sm90::fence_registers(acc_s_flat);
          release(k_read, k_empty);
          // P_it must stay untouched until P_it V_it completes (wgmma reads its A
          // registers asynchronously): block it+1's P waits in acc_s, packed after.
          softmax_block(kind, acc_s, corrections, it + 1);
          sm90::wgmma_wait<0>();
          sm90::fence_registers(acc_o_flat);
          release(v_read, v_empty);
        } else {
          issue_pv();
          sm90::wgmma_wait<0>();
          sm90::fence_registers(acc_o_flat);
          release(v_read, v_empty);
          issue_scores(acc_s_flat);
          sm90::wgmma_wait<0>();
          sm90::fence_registers(acc_s_flat);
          release(k_read, k_empty);
          softmax_block(kind, acc_s, corrections, it + 1);
        }
        pack_p(acc_s, p);
      };
      int it = 0;
      if constexpr (Shape::kUnmaskedLoop) {
        for (; it + 1 < num_blocks && !fully_visible(it + 1); ++it) step(it, Sm90KeyBlock::kCut);
        for (; it + 1 < num_blocks && fully_visible(it + 1); ++it) step(it, Sm90KeyBlock::kUncut);
      }
      for (; it + 1 < num_blocks; ++it) step(it, Shape::kUnmaskedLoop ? Sm90KeyBlock::kCut : Sm90KeyBlock::kAsk);
      if (num_blocks > 0) {
        if constexpr (kPersistent) {  // every S of the tile has completed: Q's stage is free
          __syncwarp();
          if (lane == 0) sm90::mbarrier_arrive(q_empty);
        }
        issue_pv();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc_o_flat);
        release(v_read, v_empty);
      }

      shift_rows_for_bias_frame(row_max, Transform(params, blk.batch, blk.head), blk.mask, blk.m_begin + warp_row,
                                lane, 1.f);
      store_forward_rows<Element>(acc_o, row_max, row_sum, blk.out_rows<Element>(params), params.out_strides.row,
                                  blk.lse_rows(params), warp_row, blk.valid_q_rows, params.head_dim, lane, INFINITY,
                                  has_dropout(kMod) ? params.dropout_scale : 1.f);
    };

    if constexpr (!kPersistent) {
      compute_tile(first_blk);
    } else {
      for (unsigned handed = 0;; ++handed) {
        sm90::mbarrier_wait(tile_full, handed & 1);
        const unsigned tile = sm90::load_shared_u32(tile_slot);
        __syncwarp();
        if (lane == 0) sm90::mbarrier_arrive(tile_empty);
        if (tile >= num_tiles) break;
        compute_tile(ForwardBlock(params, args.order, kBlockM, kBlockN, kDense, tile));
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a image exists (sm90/forward_launch.cuh)
#endif
}

}  // namespace flashattn
