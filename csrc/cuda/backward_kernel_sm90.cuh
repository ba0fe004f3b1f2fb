// Main backward kernel for Hopper (sm_90a): wgmma tensor-core products fed by TMA, with a
// producer warpgroup and two consumer warpgroups. It replaces only the main kernel of
// backward_kernel.cuh; the preprocess (D, lse2, zeroed dQ workspace) and postprocess (dq in the
// output dtype) kernels run around it unchanged, and so do the block ownership and the mask
// handling: one thread block per (key block, kv head, batch), flattened into blockIdx.x, keeps
// dK and dV of its kBlockN keys in registers while it walks every query head of its GQA group
// and, per head, the query blocks that see one of its keys (MaskGeometry ranges); the element
// mask runs only on the tiles a boundary cuts.
//
// Per query block of kBlockM = 64 queries, each consumer warpgroup, owning 64 of the keys:
//   Sᵀ  = K Qᵀ,  dPᵀ = V dOᵀ                  (wgmma SS, M = keys, N = queries, K = head dim;
//                                              both from shared memory K-major, issued together)
//   Pᵀ  = exp2(Sᵀ·scale·log2e − lse2),  dSᵀ = Pᵀ ∘ (dPᵀ − D)      (on the accumulators)
//   dV += Pᵀ dO,  dK += dSᵀ Q                 (wgmma RS: Pᵀ, dSᵀ from registers, the
//                                              accumulator layout being the A fragment; dO, Q
//                                              MN-major from shared memory)
//   dSᵀ → shared memory, then, after both warpgroups wrote theirs (named barrier):
//   dQ[:, half] = dS K[:, half]               (wgmma SS, M = queries, N = W / 2, K = all
//                                              kBlockN keys, A = dSᵀ and B = K both MN-major)
//   dQ_accum += dQ                            (fp32 red.global.add.v2)
// Splitting dQ by head-dim halves between the warpgroups, rather than by keys, adds each
// element to the workspace once per key block instead of twice, and keeps the dQ accumulator at
// W / 4 registers. dSᵀ is double-buffered: a warpgroup waits for its own dQ product before the
// next block's barrier, so once it passes that barrier the other buffer is free of both.
//
// Producer: one thread issues the TMA copies, K and V once, then per query block Q, dO (4-d
// maps, 128-byte swizzle, zero fill past the sequence and past head_dim) and the 64 lse2 and D
// values (1-d bulk copies from the workspaces, padded to whole blocks) into a ring of kStages
// stages, completing on "full" mbarriers; a stage is reused once all 8 consumer warps have
// arrived on its "empty" mbarrier.
//
// Tiles (Sm90BackwardShape, chosen in backward_launch_sm90.cuh). What bounds them:
//  - registers: a consumer thread holds dK + dV (W floats: 128 at W = 128), Sᵀ and dPᵀ (32 + 32),
//    then Pᵀ, dSᵀ as A fragments (16 + 16) and dQ (W / 4) within the 240 that setmaxnreg gives
//    it; at W = 256, dK + dV alone would take 256, so W = 256 stays on the sm_80 kernel.
//  - wgmma: M = 64 rows per warpgroup fixes 64 keys per warpgroup, so kBlockN = 128 for two
//    consumer warpgroups; kBlockM = 64 is one 128-byte swizzle column block of dSᵀ, and N = 64
//    for Sᵀ / dPᵀ.
//  - shared memory: K, V (kBlockN x W) + kStages x (Q, dO) (kBlockM x W) + 2 dSᵀ tiles
//    (kBlockN x kBlockM): 162 KB at W = 128, 98 KB at W = 64, within the 227 KB of sm_90.
//
// Not here: deterministic dQ (the launch layer keeps it on the sm_80 kernel, whose semaphore
// order this kernel does not implement), W not a multiple of 64 and W = 256.
//
// Build: compiled only for the sm_90a target (wgmma, setmaxnreg); instantiated through
// backward_launch.cuh in instantiations/bwd_hdim<W>.cu; tested standalone by
// benchmarks/kernels/backward_sm90_check.cu. Versions:
//   v1  TMA + mbarrier ring, 1 producer + 2 consumer warpgroups, dQ split by head-dim halves
//       with per-thread fp32 vector atomics; no overlap of a warpgroup's own products across
//       query blocks.
#pragma once

#include <cuda.h>

#include "backward_kernel.cuh"
#include "hopper_primitives.cuh"
#include "wgmma_ops.cuh"

namespace flashattn {

template <int kHeadDim_, int kStages_ = 2>
struct Sm90BackwardShape {
  static constexpr int kHeadDim = kHeadDim_;  // the head-dim tile W
  static constexpr int kStages = kStages_;
  static constexpr int kBlockN = 128;
  static constexpr int kBlockM = 64;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kKeysPerWarpgroup = kBlockN / kConsumerWarpgroups;
  static constexpr int kDqColumns = kHeadDim / kConsumerWarpgroups;  // dQ columns per warpgroup
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
  static constexpr int kColumnBlocks = kHeadDim / sm90::kSwizzleElements;

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kScoreBytes = kBlockN * kBlockM * 2;  // dSᵀ: key rows, query columns
  static constexpr int kRowStatBytes = kBlockM * 4;          // lse2 or D of one query block
  // Byte offsets from the 1024-byte aligned base; the tiles come first so each stays aligned.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kKVBytes;
  static constexpr int kOffDO = kOffQ + kStages * kQBytes;
  static constexpr int kOffDS = kOffDO + kStages * kQBytes;
  static constexpr int kOffLse = kOffDS + 2 * kScoreBytes;
  static constexpr int kOffD = kOffLse + kStages * kRowStatBytes;
  static constexpr int kOffBarriers = kOffD + kStages * kRowStatBytes;
  static constexpr int kBarriers = 1 + 2 * kStages;  // K/V full; per stage full, empty
  static constexpr int kSmemBytes = sm90::kSwizzleAtomBytes + kOffBarriers + 8 * kBarriers;
  static constexpr int kStageBytes = 2 * kQBytes + 2 * kRowStatBytes;  // TMA bytes per stage

  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kHeadDim % sm90::kSwizzleElements == 0, "head-dim tile is whole 64-column blocks");
  static_assert(kBlockM == sm90::kSwizzleElements, "a dSᵀ row is one swizzle row (the MN-major A of dQ)");
  static_assert(kKeysPerWarpgroup == 64, "a warpgroup's keys are the M = 64 of its products");
  static_assert(backward::kQueryRowRounding % kBlockM == 0, "the lse2 / D bulk copies stay in the workspace");
  static_assert(128 * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <= 65536,
                "register budget");
};

// The kernel's arguments: the plain params and one TMA map per tile input, each 4-d
// (head_dim, seqlen, nheads, batch) with the tensor's own strides.
struct Sm90BackwardArgs {
  AttentionBwdParams params;
  CUtensorMap q_map, k_map, v_map, do_map;
};

namespace backward {

// Pᵀ in place of Sᵀ (this warp's 16 keys x 64 queries, the m16n8 accumulator layout:
// element 4j + e is key row g + 8 (e / 2), query 8j + 2t + e % 2). kMasked: the tile is cut by
// the mask or the end of the keys; keys past seqlen_k have an empty visible range.
template <bool kMasked>
__device__ __forceinline__ void scores_to_probabilities(float (&s)[32], const float* lse2, float scale_log2,
                                                        int query0, const int (&visible_begin)[2],
                                                        const int (&visible_end)[2], int t) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = 8 * j + 2 * t;
    const float2 l = *reinterpret_cast<const float2*>(lse2 + col);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // lse2 = +inf (a query that sees no key, or past seqlen_q) gives exp2(-inf) = 0.
      const float x = fast_exp2(fmaf(s[4 * j + e], scale_log2, -((e & 1) ? l.y : l.x)));
      if constexpr (kMasked) {
        const int query = query0 + col + (e & 1);
        s[4 * j + e] = query >= visible_begin[e >> 1] && query < visible_end[e >> 1] ? x : 0.f;
      } else {
        s[4 * j + e] = x;
      }
    }
  }
}

}  // namespace backward

template <typename Element, typename Shape>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    attention_backward_sm90_kernel(const __grid_constant__ Sm90BackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int W = Shape::kHeadDim, BN = Shape::kBlockN, BM = Shape::kBlockM;
  constexpr int kStages = Shape::kStages;
  using Mma = MmaElement<Element>;
  const AttentionBwdParams& p = args.params;

  extern __shared__ unsigned char smem[];
  const uint32_t base =
      (smem_address(smem) + sm90::kSwizzleAtomBytes - 1) & ~uint32_t(sm90::kSwizzleAtomBytes - 1);
  unsigned char* const base_ptr = smem + (base - smem_address(smem));
  const uint32_t k_smem = base + Shape::kOffK, v_smem = base + Shape::kOffV;
  const auto q_smem = [&](int stage) { return base + Shape::kOffQ + stage * Shape::kQBytes; };
  const auto do_smem = [&](int stage) { return base + Shape::kOffDO + stage * Shape::kQBytes; };
  const auto ds_smem = [&](int buf) { return base + Shape::kOffDS + buf * Shape::kScoreBytes; };
  const auto lse_smem = [&](int stage) { return base + Shape::kOffLse + stage * Shape::kRowStatBytes; };
  const auto d_smem = [&](int stage) { return base + Shape::kOffD + stage * Shape::kRowStatBytes; };
  const uint32_t barriers = base + Shape::kOffBarriers;
  const uint32_t kv_full = barriers;
  const auto full = [&](int stage) { return barriers + 8 * (1 + stage); };
  const auto empty = [&](int stage) { return barriers + 8 * (1 + kStages + stage); };

  const backward::BackwardBlock blk(p, BM, BN);
  const int n0 = blk.n0, h_kv = blk.h_kv, b = blk.b, group = blk.group;
  // Iteration it: query head h_kv * group + it / num_m, query block m_first + it % num_m.
  const int m_first = blk.m_first, num_m = blk.num_m, num_iters = blk.num_iters;
  const MaskGeometry& mask = blk.mask;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    sm90::mbarrier_init(kv_full, 1);
    for (int st = 0; st < kStages; ++st) {
      sm90::mbarrier_init(full(st), 1);
      sm90::mbarrier_init(empty(st), Shape::kConsumerWarps);
    }
    sm90::mbarrier_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    sm90::warpgroup_registers_shrink<Shape::kProducerRegisters>();
    if (threadIdx.x == 0 && num_iters > 0) {
      sm90::prefetch_tensor_map(&args.q_map);
      sm90::prefetch_tensor_map(&args.do_map);
      sm90::mbarrier_arrive_expect_bytes(kv_full, 2 * Shape::kKVBytes);
      sm90::tma_load_tile<Shape::kColumnBlocks>(k_smem, &args.k_map, kv_full, BN, n0, h_kv, b);
      sm90::tma_load_tile<Shape::kColumnBlocks>(v_smem, &args.v_map, kv_full, BN, n0, h_kv, b);
      for (int it = 0; it < num_iters; ++it) {
        const int stage = it % kStages;
        if (it >= kStages) sm90::mbarrier_wait(empty(stage), ((it / kStages) + 1) & 1);
        const int h = h_kv * group + it / num_m;
        const int m0 = (m_first + it % num_m) * BM;
        sm90::mbarrier_arrive_expect_bytes(full(stage), Shape::kStageBytes);
        sm90::tma_load_tile<Shape::kColumnBlocks>(q_smem(stage), &args.q_map, full(stage), BM, m0, h, b);
        sm90::tma_load_tile<Shape::kColumnBlocks>(do_smem(stage), &args.do_map, full(stage), BM, m0, h, b);
        const int64_t row = (static_cast<int64_t>(b) * p.nheads_q + h) * p.seqlen_q_rounded + m0;
        sm90::bulk_load(lse_smem(stage), p.lse_log2 + row, Shape::kRowStatBytes, full(stage));
        sm90::bulk_load(d_smem(stage), p.softmax_d + row, Shape::kRowStatBytes, full(stage));
      }
    }
    return;
  }

  sm90::warpgroup_registers_grow<Shape::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_row = ((threadIdx.x / 32) % 4) * 16;                // this warp's rows of an M = 64 product
  const int key_row0 = consumer * Shape::kKeysPerWarpgroup + warp_row;  // its keys in the block

  // The queries [visible_begin, visible_end) that see each of this lane's two keys.
  int visible_begin[2], visible_end[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = n0 + key_row0 + g + 8 * half;
    visible_begin[half] = mask.query_begin(key);
    visible_end[half] = key < p.seqlen_k ? mask.query_end(key + 1) : 0;
  }
  const int wg_key_begin = n0 + consumer * Shape::kKeysPerWarpgroup;

  float acc_dk[W / 2], acc_dv[W / 2];
#pragma unroll
  for (int i = 0; i < W / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  // Operands of this warpgroup. K and V rows of its keys are the K-major A of Sᵀ and dPᵀ; the
  // dQ product reads K MN-major over all keys, from its half of the head-dim columns (a 64-byte
  // offset into a swizzle row at W = 64, which the address-based swizzle allows like the
  // 32-byte k-steps of the K-major operands).
  const uint32_t k_rows = k_smem + consumer * Shape::kKeysPerWarpgroup * sm90::kSwizzleBytes;
  const uint32_t v_rows = v_smem + consumer * Shape::kKeysPerWarpgroup * sm90::kSwizzleBytes;
  const int dq_col0 = consumer * Shape::kDqColumns;
  const uint32_t k_dq_cols = k_smem + (dq_col0 / sm90::kSwizzleElements) * BN * sm90::kSwizzleBytes +
                             (dq_col0 % sm90::kSwizzleElements) * 2;
  using sm90::k_major_descriptor;
  using sm90::mn_major_descriptor;

  if (num_iters > 0) sm90::mbarrier_wait(kv_full, 0);
  for (int it = 0; it < num_iters; ++it) {
    const int stage = it % kStages;
    const int ds_buf = it & 1;
    const int h = h_kv * group + it / num_m;
    const int m0 = (m_first + it % num_m) * BM;

    float s[32], dp[32];  // Sᵀ then Pᵀ; dPᵀ then dSᵀ
    sm90::mbarrier_wait(full(stage), (it / kStages) & 1);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < W / 16; ++ks)
      Wgmma<Element, BM>::ss(s, k_major_descriptor(k_rows + sm90::k_major_step(ks, BN)),
                             k_major_descriptor(q_smem(stage) + sm90::k_major_step(ks, BM)), ks > 0);
    sm90::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < W / 16; ++ks)
      Wgmma<Element, BM>::ss(dp, k_major_descriptor(v_rows + sm90::k_major_step(ks, BN)),
                             k_major_descriptor(do_smem(stage) + sm90::k_major_step(ks, BM)), ks > 0);
    sm90::wgmma_commit();

    sm90::wgmma_wait<1>();
    sm90::fence_registers(s);
    const float* lse2 = reinterpret_cast<const float*>(base_ptr + Shape::kOffLse + stage * Shape::kRowStatBytes);
    if (mask.tile_fully_visible(m0, min(m0 + BM, p.seqlen_q), wg_key_begin, wg_key_begin + Shape::kKeysPerWarpgroup))
      backward::scores_to_probabilities<false>(s, lse2, p.softmax_scale_log2, m0, visible_begin, visible_end, t);
    else
      backward::scores_to_probabilities<true>(s, lse2, p.softmax_scale_log2, m0, visible_begin, visible_end, t);

    sm90::wgmma_wait<0>();
    sm90::fence_registers(dp);
    const float* dsum = reinterpret_cast<const float*>(base_ptr + Shape::kOffD + stage * Shape::kRowStatBytes);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(dsum + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? d.y : d.x));
    }
    // Pᵀ and dSᵀ as the A fragments of the k16 steps over the 64 queries.
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 8 * kk + 4 * (r >> 1) + 2 * (r & 1);  // n-tile 2kk + r/2, row half r % 2
        pa[kk][r] = Mma::pack(s[i], s[i + 1]);
        dsa[kk][r] = Mma::pack(dp[i], dp[i + 1]);
      }

    sm90::fence_registers(acc_dv);
    sm90::fence_registers(acc_dk);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      Wgmma<Element, W>::rs_b_mn_major(acc_dv, pa[kk],
                                       mn_major_descriptor(do_smem(stage) + kk * 16 * sm90::kSwizzleBytes, BM));
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      Wgmma<Element, W>::rs_b_mn_major(acc_dk, dsa[kk],
                                       mn_major_descriptor(q_smem(stage) + kk * 16 * sm90::kSwizzleBytes, BM));
    sm90::wgmma_commit();

    // dSᵀ into its swizzled tile (key rows of 64 queries = one 128-byte row each): the 16-byte
    // chunk j of row r sits at chunk j ^ (r % 8), and r % 8 = g for both of this lane's rows.
    {
      unsigned char* ds_tile = base_ptr + Shape::kOffDS + ds_buf * Shape::kScoreBytes;
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = key_row0 + g + 8 * (r & 1), chunk = 2 * kk + (r >> 1);
          *reinterpret_cast<uint32_t*>(ds_tile + row * sm90::kSwizzleBytes + ((chunk ^ g) * 16) + 4 * t) = dsa[kk][r];
        }
    }
    sm90::fence_shared_to_async_proxy();
    sm90::named_barrier_sync(1, Shape::kConsumerThreads);

    float dq[Shape::kDqColumns / 2];
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<Element, Shape::kDqColumns>::ss_ab_mn_major(
          dq, mn_major_descriptor(ds_smem(ds_buf) + kk * 16 * sm90::kSwizzleBytes, BN),
          mn_major_descriptor(k_dq_cols + kk * 16 * sm90::kSwizzleBytes, BN), kk > 0);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_registers(dq);
    sm90::fence_registers(acc_dv);
    sm90::fence_registers(acc_dk);
    __syncwarp();
    if (lane == 0) sm90::mbarrier_arrive(empty(stage));

    // Rows past seqlen_q would only add zeros: skip them. Columns past head_dim add zeros to the
    // padding of dq_accum, which nothing reads.
    float* dq_rows = p.dq_accum + ((static_cast<int64_t>(b) * p.nheads_q + h) * p.seqlen_q_rounded + m0) * W;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row + g + 8 * half;
      if (m0 + row < p.seqlen_q) {
#pragma unroll
        for (int j = 0; j < Shape::kDqColumns / 8; ++j)
          backward::red_add_pair(dq_rows + row * W + dq_col0 + 8 * j + 2 * t, dq[4 * j + 2 * half],
                                 dq[4 * j + 2 * half + 1]);
      }
    }
  }

  // dK·scale and dV, straight from the accumulators: rows < seqlen_k, columns < head_dim (a
  // multiple of 8, so a pair is wholly in or out).
  Element* dk = backward::element_at(static_cast<Element*>(p.dk), p.dk_strides, b, n0, h_kv);
  Element* dv = backward::element_at(static_cast<Element*>(p.dv), p.dv_strides, b, n0, h_kv);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = key_row0 + g + 8 * half;
    if (n0 + row < p.seqlen_k) {
#pragma unroll
      for (int j = 0; j < W / 8; ++j) {
        const int col = 8 * j + 2 * t;
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(dk + row * p.dk_strides.row + col) =
              Mma::pack(acc_dk[4 * j + 2 * half] * p.softmax_scale, acc_dk[4 * j + 2 * half + 1] * p.softmax_scale);
          *reinterpret_cast<uint32_t*>(dv + row * p.dv_strides.row + col) =
              Mma::pack(acc_dv[4 * j + 2 * half], acc_dv[4 * j + 2 * half + 1]);
        }
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a image exists (backward_launch_sm90.cuh)
#endif
}

}  // namespace flashattn
