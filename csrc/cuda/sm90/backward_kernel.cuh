// Main backward kernel for Hopper (sm_90a): wgmma tensor-core products fed by TMA, with a
// producer warpgroup and two consumer warpgroups. It replaces only the main kernel of
// sm80/backward_kernel.cuh; the passes of common/backward_passes.cuh (D, lse2, zeroed dQ
// workspace; dq in the output dtype) run around it, and common/tile_scheduler.cuh gives the
// block ownership and the mask handling: one thread block per (key block, kv head, batch),
// flattened into blockIdx.x, keeps dK and dV of its kBlockN keys in registers while it walks every query head of its GQA group
// and, per head, the query blocks that see one of its keys (MaskGeometry ranges); the element
// mask runs only on the tiles a boundary cuts.
//
// Two ways to split the work between the consumer warpgroups (Sm90BackwardShape::kSplitHeadDim):
//
// By keys (W <= 128): kBlockN = 128, each warpgroup owns 64 keys and all W head-dim columns of
// their dK, dV. Per query block of kBlockM queries (64; 128 at W = 64; 80 at W = 128 without a
// window), each warpgroup:
//   Sᵀ  = K Qᵀ,  dPᵀ = V dOᵀ                  (wgmma SS, M = its 64 keys, N = kBlockM, K = head
//                                              dim; both from shared memory K-major, issued together)
//   Pᵀ  = exp2(logit(Sᵀ) − lse2),  dSᵀ = Pᵀ ∘ (dPᵀ − D)           (on the accumulators;
//                                              logit: score_transform.cuh; with softcap
//                                              dSᵀ also ∘ (1 − t²))
//   dV += Pᵀ dO                               (wgmma RS: Pᵀ from registers, the accumulator
//                                              layout being the A fragment; dO MN-major from
//                                              shared memory)
//   dSᵀ → shared memory; in the next iteration (lagged), once both warpgroups' dSᵀ are there:
//   dQ[:, half] = dS K[:, half]               (wgmma SS, M = 64 queries, N = W / 2, K = all
//                                              kBlockN keys, A = dSᵀ and B = K both MN-major;
//                                              with 128 queries warpgroup c takes queries
//                                              64c.. and all W columns: dQ[rows c] = dS[rows c] K;
//                                              with 80, dQᵀ[half] = K[:, half]ᵀ dSᵀ, M = the
//                                              warpgroup's 64 columns, N = 80, the score tile
//                                              swizzled in 32-byte rows as the MN-major B)
//   dK += dSᵀ Q                               (wgmma RS as dV's; issued after the previous query
//                                              block's dQ, it runs while that is stored: issue_dk)
//   dQ → shared memory (fp32, dq_accum's 8 x 8 tiles), then dQ_accum += dQ by one bulk reduction
//                                             (cp.reduce.async.bulk .add.f32) that a warp of the
//                                             producer warpgroup issues, the dQ writer
//
// By head dims (W = 256): dK + dV of 64 keys x 256 columns would take all 256 registers of a
// warpgroup's thread, so kBlockN = 64 keys are shared by both warpgroups and each owns half of
// the head-dim columns of dK, dV (128 registers). Per query block, warpgroup c:
//   Sᵀ, dPᵀ for the 64 keys x its 32 queries  (wgmma SS, N = 32)
//   Pᵀ, dSᵀ of its 32 queries → shared memory; named barrier; then over all 64 queries:
//   dV[:, half c] += Pᵀ dO[:, half c]         (wgmma SS: A = Pᵀ K-major, B MN-major)
//   dQ[:, half c] = dS K[:, half c]           (as above, K = the 64 keys; added to dQ_accum by
//                                             fp32 red.global.add.v2: no room for a dQ tile)
//   dK[:, half c] += dSᵀ Q[:, half c]         (as dV's, issued after dQ: it runs under the adds)
//
// Splitting dQ by head-dim halves between the warpgroups, rather than by keys, adds each
// element to the workspace once per key block instead of twice, and keeps the dQ accumulator at
// W / 4 registers. By keys (Shape::kLaggedDq, but at 80 queries), a warpgroup's dQ of a query
// block runs an iteration late, after its next block's dV and dK: then the warpgroups wait for
// each other only at the scores of the next block (the other's previous iteration done, mbarrier
// score_buffer_done), not at one point of every iteration, and one's exponentials can run under
// the other's products (with a named barrier before dQ, both left it together): +5-11 % at d 64,
// +1-5 % at d 128 causal, N 4096-16384 (H100); at 80 queries (dQᵀ) -2 to -10 %, so that tile
// keeps the barrier. The score tiles are double-buffered: an iteration's dSᵀ goes to one buffer
// while the previous block's dQ reads the other. Without the lag, a warpgroup waits for its own
// products of a buffer before the next block's named barrier, so once it passes that barrier the
// other buffer is free of both warpgroups.
//
// Producer: one thread issues the TMA copies, K and V once, then per query block Q and dO (4-d
// maps, 128-byte swizzle, zero fill past the tensor's rows and past head_dim) into a ring of kStages
// stages, completing on "full" mbarriers; a stage is reused once all 8 consumer warps have
// arrived on its "empty" mbarrier. The dQ writer (by keys) waits on the named barrier
// kDqFullBarrier for the consumers' dQ tile, adds it to the workspace with one bulk reduction
// and, once that has read the tile, arrives on the mbarrier dq_empty, which the consumers wait
// on before they store the next one (a named barrier there made both warpgroups meet). Per-thread
// atomics instead (v1, v2) stalled the consumers on the load/store queue with all 8 warps at the
// same point; one bulk add per row (64 of them per block) instead was limited by the copy
// engine's rate of operations (d 64 lost 28 %).
// With variable-length q, two tail zeroer warps zero the rows of Q and dO that a straddling
// query block's copies bring from past its sequence's end.
//
// lse2 and D of a query block: 2 kBlockM consumer threads load one value each from the workspaces
// an iteration ahead, at its start, and store it into the other of two buffers before the
// iteration's named barrier or, with the lagged dQ, its arrival on score_buffer_done, which
// orders the stores before the next iteration's reads (and every read of the buffer, two
// iterations back, before the stores). Each warpgroup's own copy under a named barrier of its
// 128 threads instead cost 2-5 % at d 256 (H100). Tried and dropped: reading
// them from global memory where they are used (the latency shows after Sᵀ: 12-15 % slower at
// W = 64 / 128) and copying them into the TMA stages (bulk copies, or the producer warp's
// stores): as fast, but ordered only by the mbarriers, which compute-sanitizer's racecheck does
// not model (it reported those accesses as races).
//
// Tiles (Sm90BackwardShape, chosen in sm90/backward_launch.cuh). What bounds them:
//  - registers (240 per consumer thread after setmaxnreg): by keys, dK + dV take W (128 at
//    W = 128), Sᵀ and dPᵀ kBlockM, then Pᵀ, dSᵀ as A fragments kBlockM / 2 and dQ 32 (40 as
//    dQᵀ of 80 queries); by head dims, dK + dV take 128, Sᵀ and dPᵀ 32, dQ 64. 128 queries fit
//    at W = 64 only (FA3's d 64 tile: each iteration does twice the products for the same
//    barriers, waits and dQ add), 80 at W = 128 (FA3's tile without a mask).
//  - wgmma: M = 64 rows per warpgroup fixes 64 keys per warpgroup product; a score tile is column
//    blocks of 64 queries (one 128-byte swizzle row per key), one of which is the MN-major A of
//    a warpgroup's dQ; at 80 queries, column blocks of 16 in 32-byte rows, all of them dQᵀ's B.
//  - shared memory: K, V (kBlockN x W) + kStages x (Q, dO) (kBlockM x W) + 2 buffers of the score
//    tiles (dSᵀ; and Pᵀ when split by head dims; kBlockN x kBlockM each) + by keys the fp32 dQ
//    tile (kBlockM x W): 194 KB at W = 64, 192 KB at W = 128 (226 KB with 80 queries), 224 KB
//    at W = 256 (two stages), within the 227 KB of sm_90.
//
// Deterministic dQ: the adds of a (batch, head, query block) follow one order of key blocks, kept
// by a semaphore per query block (dq_add_turn, dq_adds_last_key_block_first in
// common/tile_scheduler.cuh). By keys the dQ writer waits for its key block's turn before each
// bulk add and passes the turn on once the add is complete; by head dims a turn keeper warp of
// the producer warpgroup waits, and two named barriers shared with the consumers order their
// atomics between its acquire and its release. Not here: W not a multiple of 64.
//
// Build: compiled only for the sm_90a target (wgmma, setmaxnreg); instantiated through
// backward_launch.cuh in instantiations/bwd_hdim<W>.cu; tested standalone by
// benchmarks/kernels/backward_sm90_check.cu.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "cuda/backward_launch.h"
#include "cuda/common/backward_passes.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/fast_divmod.cuh"
#include "cuda/common/mma_primitives.cuh"
#include "cuda/common/score_transform.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/hopper_primitives.cuh"
#include "cuda/sm90/pipeline_state.cuh"
#include "cuda/sm90/wgmma_ops.cuh"

namespace flashattn {

template <int kHeadDim_, bool kSplitHeadDim_, int kStages_ = 2, int kBlockM_ = 64, bool kDkAfterDq_ = true,
          bool kLaggedDq_ = true, bool kWindowFree_ = false>
struct Sm90BackwardShape {
  static constexpr int kHeadDim = kHeadDim_;  // the head-dim tile W
  static constexpr bool kSplitHeadDim = kSplitHeadDim_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 128;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kKeysPerWarpgroup = 64;                                       // M of Sᵀ, dV, dK
  static constexpr int kQueriesPerWarpgroup = kSplitHeadDim ? kBlockM / 2 : kBlockM;  // N of Sᵀ, dPᵀ
  static constexpr int kAccColumns = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;       // dK, dV columns
  // dQ split between the warpgroups by head-dim halves, or with 128 queries by query rows
  // (warpgroup c: queries 64c.., all W columns; FA3's d 64 tile). kBlockM not a multiple of
  // wgmma's M = 64 (80, FA3's d 128 tile without a mask) computes dQᵀ = Kᵀ dSᵀ instead: the
  // warpgroup's 64 head-dim columns as M, the queries as N.
  static constexpr bool kDqSplitByRows = !kSplitHeadDim && kBlockM == 64 * kConsumerWarpgroups;
  static constexpr bool kDqTransposed = !kSplitHeadDim && kBlockM % 64 != 0;
  static constexpr int kDqColumns = kDqSplitByRows ? kHeadDim : kHeadDim / kConsumerWarpgroups;
  static constexpr int kDqN = kDqTransposed ? kBlockM : kDqColumns;  // N of the dQ product
  // dK's product issued after dQ's rather than beside dV's (the kernel's issue_dk says why); by
  // keys it holds dSᵀ's fragments through the dQ product, which some variants lack registers for.
  static constexpr bool kDkAfterDq = kDkAfterDq_;
  static constexpr DqAccumTiles kDqTiles = kDqTransposed ? DqAccumTiles::kTransposed : DqAccumTiles::kRowMajor;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
  static constexpr int kColumnBlocks = kHeadDim / sm90::kSwizzleElements;

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kScoreBytes = kBlockN * kBlockM * 2;  // one score tile: key rows, query columns
  static constexpr int kScoreTiles = kSplitHeadDim ? 2 : 1;  // dSᵀ (and Pᵀ), per buffer
  // The score tile's swizzle rows: 128 bytes (column blocks of 64 queries) where kBlockM is a
  // multiple of 64, else 32 (column blocks of 16: a fifth block of 64 would take 16 KB more).
  static constexpr int kScoreRowBytes = kBlockM % 64 == 0 ? 128 : 32;
  static constexpr int kRowStatBytes = kBlockM * 4;          // lse2 or D of one query block
  // Query blocks that do not divide the workspace's 128-row padding read lse2 and D only of
  // the sequence's rows (the last block would read past the workspace).
  static constexpr bool kBoundedRowStats = kBackwardQueryRowRounding % kBlockM != 0;
  // Byte offsets from the 1024-byte aligned base; the tiles come first so each stays aligned.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kKVBytes;
  static constexpr int kOffDO = kOffQ + kStages * kQBytes;
  static constexpr int kOffScores = kOffDO + kStages * kQBytes;
  static constexpr int kOffLse = kOffScores + 2 * kScoreTiles * kScoreBytes;
  static constexpr int kOffD = kOffLse + 2 * kRowStatBytes;  // both double-buffered by iteration
  // dQ of a query block in fp32, laid out as dq_accum is (its 8 x 8 tiles), for one bulk add (by
  // keys only: by head dims it would take 64 KB more than there is).
  static constexpr bool kDqThroughSharedMemory = !kSplitHeadDim;
  // By keys, each warpgroup's dQ product reads the dSᵀ of both. Lagged, it runs an iteration
  // late, so that the warpgroups need not meet at one point of every iteration (the kernel's
  // loop); else after a named barrier of both, as by head dims.
  static constexpr bool kLaggedDq = kLaggedDq_ && !kSplitHeadDim;
  // Launched only for calls without a window (the plan's UnmaskedShape, where it is its own type):
  // the mask is then only the end of the keys.
  static constexpr bool kWindowFree = kWindowFree_;
  static constexpr int kDqBytes = kBlockM * kHeadDim * 4;
  static constexpr int kOffDq = kOffD + 2 * kRowStatBytes;
  static constexpr int kOffBarriers = kOffDq + (kDqThroughSharedMemory ? kDqBytes : 0);
  // K/V full; per stage full, empty; by keys, per score buffer "done" and the dQ tile's "empty".
  static constexpr int kBarriers = 1 + 2 * kStages + (kDqThroughSharedMemory ? 1 : 0) + (kLaggedDq ? 2 : 0);
  static constexpr int kSmemBytes = sm90::kSwizzleAtomBytes + kOffBarriers + 8 * kBarriers;
  static constexpr int kStageBytes = 2 * kQBytes;  // TMA bytes per stage

  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters =
      sm90::consumer_registers(kProducerRegisters, kConsumerWarpgroups, /*blocks_per_sm=*/1);
  static_assert(kHeadDim % sm90::kSwizzleElements == 0, "head-dim tile is whole 64-column blocks");
  static_assert(kAccColumns % sm90::kSwizzleElements == 0, "a warpgroup's dK, dV columns are whole column blocks");
  static_assert(kBlockM == sm90::kSwizzleElements || kDqSplitByRows || kDqTransposed,
                "a warpgroup's dQ reads one column block of 64 queries of the score tile (the MN-major A)");
  static_assert(!kDqTransposed || (kDqColumns == 64 && kBlockM % 16 == 0 && kBlockM <= 256),
                "dQᵀ: M = the warpgroup's 64 head-dim columns, N = the queries in wgmma's steps of 8 (k16 of dV, dK)");
  static_assert(kBlockN == kKeysPerWarpgroup * (kSplitHeadDim ? 1 : kConsumerWarpgroups), "key ownership");
  static_assert(2 * kBlockM <= kConsumerThreads, "one consumer thread per lse2 or D value");
  static_assert(kOffDq % 16 == 0, "bulk adds read 16-byte aligned shared memory");
  static_assert(kOffScores % 1024 == 0 && kScoreBytes % 1024 == 0, "score tiles start on a swizzle pattern");
  static_assert(kDqThroughSharedMemory || !kDqTransposed, "dQᵀ is added through the transposed tile");
  static_assert(!kLaggedDq || kDqThroughSharedMemory, "the lagged dQ is handed to the dQ writer");
  static_assert(kDkAfterDq || !kSplitHeadDim, "by head dims dK reads dSᵀ from shared memory, written before the barrier");
  static_assert(kSmemBytes <= 227 * 1024, "fits the shared memory of an sm_90 block");
  static_assert(kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters <=
                    (1 + kConsumerWarpgroups) * sm90::launch_registers(1 + kConsumerWarpgroups, 1),
                "register budget: setmaxnreg shares the block's launch registers");
};

// The kernel's arguments: the plain params and one TMA map per tile input, each 4-d
// (head_dim, seqlen, nheads, batch) with the tensor's own strides.
struct Sm90BackwardArgs {
  AttentionBwdParams params;
  CUtensorMap q_map, k_map, v_map, do_map;
};

namespace backward {

// The lse2 or D pair of this lane's query columns 8j + 2t, 8j + 2t + 1, read where it is used
// (held for all columns, they took 32 registers per row statistic at 128 queries).
__device__ __forceinline__ float2 row_stat_pair(const float* row_stats, int j, int t) {
  return *reinterpret_cast<const float2*>(row_stats + 8 * j + 2 * t);
}

// Pᵀ in place of Sᵀ (this warp's 16 keys x kColumns queries, the m16n8 accumulator layout:
// element 4j + e is key row g + 8 (e / 2), query 8j + 2t + e % 2; lse2_row: the lse2 of the
// warpgroup's queries in shared memory), in three passes: the logits, the mask, the exponentials.
// The mask sets a hidden score's logit to -inf (exp2 gives 0) and the exponentials come after the
// mask's branch has merged, in one basic block with dS, which ptxas interleaves them with: in a
// block of their own (one per masked or unmasked path), they ran back to back, each waiting on the
// MUFU pipe. kWindowFree (no window, no causal mask: a key sees every query or, past seqlen_k,
// none): one select per score on a per-lane predicate, no branch. Else `cut` (the tile is cut by
// the mask or the end of the keys) selects each score by its query against the lane's visible
// range [visible_begin, visible_end) of that half's key. !kMaskLogits masks Pᵀ after the
// exponentials instead (the kernel's kMaskLogits says where). key_distance[half]: the
// ALiBi distance (query + seqlen_k - seqlen_q - key) of query0 + 2t from the lane's key of that
// half. With softcap, the derivative 1 - t^2 of each pair waits for dS at tanh_derivative(j,
// half), this lane's own slot of the score tile dS goes to (registers are what the kernel lacks:
// 36 bytes of spills at W = 128).
template <bool kWindowFree, bool kMaskLogits, int kColumns, typename Transform, typename DerivativeSlot>
__device__ __forceinline__ void scores_to_probabilities(float (&s)[kColumns / 2], const float* lse2_row,
                                                        const Transform& transform, const float (&key_distance)[2],
                                                        const DerivativeSlot& tanh_derivative, bool cut, int query0,
                                                        const int (&visible_begin)[2], const int (&visible_end)[2],
                                                        int t) {
  const auto visible = [&](int j, int e) {
    if constexpr (kWindowFree) {
      return visible_end[e >> 1] > 0;
    } else {
      const int query = query0 + 8 * j + 2 * t + (e & 1);
      return query >= visible_begin[e >> 1] && query < visible_end[e >> 1];
    }
  };
  const auto mask_with = [&](float hidden) {
    if (kWindowFree || cut) {
#pragma unroll
      for (int j = 0; j < kColumns / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * j + e] = visible(j, e) ? s[4 * j + e] : hidden;
    }
  };
#pragma unroll
  for (int j = 0; j < kColumns / 8; ++j) {
    const float2 lse2 = row_stat_pair(lse2_row, j, t);
    if constexpr (Transform::kSoftcap) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[4 * j + e] = transform.capped(s[4 * j + e]);
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *tanh_derivative(j, half) = pack_tanh_derivative(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]);
    }
    // lse2 = +inf (a query that sees no key, or past seqlen_q) gives exp2(-inf) = 0.
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s[4 * j + e] = transform.logit_of(s[4 * j + e], key_distance[e >> 1] + float(8 * j + (e & 1)),
                                        -((e & 1) ? lse2.y : lse2.x));
  }
  if constexpr (kMaskLogits) mask_with(-INFINITY);
#pragma unroll
  for (int i = 0; i < kColumns / 2; ++i) s[i] = fast_exp2(s[i]);
  if constexpr (!kMaskLogits) mask_with(0.f);
}

// Where the 16-byte chunk `chunk` (8 queries from query 8 * chunk) of key row key_row0 + r sits in a
// swizzled score tile (key_row0 a multiple of 8, r < 16): column blocks of kRowBytes / 2 queries,
// each kKeyRows rows of kRowBytes, chunk c of row r in column block c / n (n = kRowBytes / 16
// chunks per row) at chunk (c % n) ^ ((r * kRowBytes / 128) % n), the swizzle XOR-ing address
// bits 7.. into the chunk's.
template <int kKeyRows, int kRowBytes>
__device__ __forceinline__ int score_tile_offset(int key_row0, int r, int chunk) {
  constexpr int kChunks = kRowBytes / 16;
  return ((chunk / kChunks) * kKeyRows + key_row0 + r) * kRowBytes +
         ((chunk % kChunks) ^ ((r % 8) * kRowBytes / 128)) * 16;
}

// This lane's pair (j, half) of a warp's 16 key rows x queries from query 8 * chunk0.
template <int kKeyRows, int kRowBytes>
__device__ __forceinline__ uint32_t* score_tile_pair(unsigned char* tile, int key_row0, int chunk0, int j, int half,
                                                     int g, int t) {
  return reinterpret_cast<uint32_t*>(tile + score_tile_offset<kKeyRows, kRowBytes>(key_row0, g + 8 * half, chunk0 + j) +
                                     4 * t);
}

// The chunk a lane addresses for stmatrix in k16 step kk of the same: row lane % 8 of matrix
// m = lane / 8, the rows 8 (m % 2).. and queries 8 (m / 2).. of the step, as accumulator_as_a
// orders a fragment's four registers.
template <int kKeyRows, int kRowBytes>
__device__ __forceinline__ uint32_t score_tile_chunk(uint32_t tile, int key_row0, int chunk0, int kk, int lane) {
  const int m = lane / 8;
  return tile + score_tile_offset<kKeyRows, kRowBytes>(key_row0, lane % 8 + 8 * (m & 1), chunk0 + 2 * kk + (m >> 1));
}

// A warp's 16 key rows x kColumns queries, as the A fragments of the k16 steps over them
// (accumulator_as_a), into a swizzled score tile at shared address `tile`: one stmatrix per step
// (four 32-bit stores per lane each before, with their address arithmetic).
template <int kColumns, int kKeyRows, int kRowBytes>
__device__ __forceinline__ void store_score_fragments(uint32_t tile, const uint32_t (&fragment)[kColumns / 16][4],
                                                      int key_row0, int chunk0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kColumns / 16; ++kk)
    sm90::stmatrix_x4(score_tile_chunk<kKeyRows, kRowBytes>(tile, key_row0, chunk0, kk, lane), fragment[kk]);
}

// The same from the fp32 accumulator values.
template <typename Element, int kColumns, int kKeyRows, int kRowBytes>
__device__ __forceinline__ void store_score_tile(uint32_t tile, const float (&v)[kColumns / 2], int key_row0,
                                                 int chunk0, int lane) {
  uint32_t fragment[kColumns / 16][4];
#pragma unroll
  for (int kk = 0; kk < kColumns / 16; ++kk)
    accumulator_as_a<Element>(fragment[kk], reinterpret_cast<const float(&)[kColumns / 8][4]>(v), kk);
  store_score_fragments<kColumns, kKeyRows, kRowBytes>(tile, fragment, key_row0, chunk0, lane);
}

// Zeroes rows [row_begin, kRows) of two tiles that tma_load_tile filled (each column block
// kRows rows of 128 bytes; the swizzle moves 16-byte pieces only within a row) with `threads`
// threads, then fences for the async proxy. The backward's tail zeroers run it in the producer
// warpgroup's 24 registers: a loop over every piece of the tiles without a division (the
// forward's and the consumers' sm90::zero_tile_rows, a loop over the rows to zero, spilled
// 36 bytes there, and its variants moved ptxas's allocation of the consumers into spills).
template <int kColumnBlocks, int kRows>
__device__ __forceinline__ void zero_rows_from(uint32_t tile_a, uint32_t tile_b, int row_begin, int thread,
                                               int threads) {
  constexpr int kPiecesPerRow = sm90::kSwizzleBytes / 16;
#pragma unroll 1
  for (int i = thread; i < kColumnBlocks * kRows * kPiecesPerRow; i += threads) {
    if ((i / kPiecesPerRow) % kRows >= row_begin) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(tile_a + 16 * i), "r"(0) : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(tile_b + 16 * i), "r"(0) : "memory");
    }
  }
  sm90::fence_shared_to_async_proxy();
}

}  // namespace backward

template <typename Element, typename Shape, ScoreMod kMod>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    attention_backward_sm90_kernel(const __grid_constant__ Sm90BackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int W = Shape::kHeadDim, BN = Shape::kBlockN, BM = Shape::kBlockM;
  constexpr int kStages = Shape::kStages;
  constexpr bool kSplit = Shape::kSplitHeadDim;
  constexpr int NQ = Shape::kQueriesPerWarpgroup, NA = Shape::kAccColumns;
  // Pᵀ masked before its exponentials (scores_to_probabilities), except at W = 64: there the mask
  // after them keeps the exponentials ahead of the wait for dPᵀ, under its product, and dropout's
  // keep bits of 128 queries leave no registers for the mask before them (16 bytes of spills).
  // W = 64 softcap alone spills 4 bytes with the mask after them.
  constexpr bool kMaskLogits = W != 64 || kMod == ScoreMod::kSoftcap;
  using Mma = MmaElement<Element>;
  const AttentionBwdParams& p = args.params;

  extern __shared__ unsigned char smem[];
  const uint32_t base =
      (smem_address(smem) + sm90::kSwizzleAtomBytes - 1) & ~uint32_t(sm90::kSwizzleAtomBytes - 1);
  unsigned char* const base_ptr = smem + (base - smem_address(smem));
  const uint32_t k_smem = base + Shape::kOffK, v_smem = base + Shape::kOffV;
  const auto q_smem = [&](int stage) { return base + Shape::kOffQ + stage * Shape::kQBytes; };
  const auto do_smem = [&](int stage) { return base + Shape::kOffDO + stage * Shape::kQBytes; };
  // Score tile `tile` (0: dSᵀ, 1: Pᵀ) of buffer `buf`.
  const auto score_offset = [&](int buf, int tile) {
    return Shape::kOffScores + (buf * Shape::kScoreTiles + tile) * Shape::kScoreBytes;
  };
  const uint32_t barriers = base + Shape::kOffBarriers;
  const uint32_t kv_full = barriers;
  const auto full = [&](int stage) { return barriers + 8 * (1 + stage); };
  const auto empty = [&](int stage) { return barriers + 8 * (1 + kStages + stage); };
  // By keys: every consumer thread has finished the iteration that wrote score buffer `buf` (its
  // dSᵀ is there, its dQ product of the iteration before is complete); the dQ writer has read
  // the dQ tile.
  const uint32_t dq_empty = barriers + 8 * (1 + 2 * kStages);
  const auto score_buffer_done = [&](int buf) { return barriers + 8 * (2 + 2 * kStages + buf); };

  const bool last_key_block_first = dq_adds_last_key_block_first(p);
  const BackwardBlock blk(p, BM, BN, p.deterministic && last_key_block_first);
  // A dependent launch (common/backward_passes.cuh): the postprocess may start once every block
  // has begun; D, lse2 and the zeroed dQ workspace are read and added to only after the
  // preprocess has finished (the wait), and an empty block waits too, so that this grid never
  // finishes before it and the postprocess cannot read the workspace it is still zeroing.
  allow_dependent_launch();
  if (blk.empty) {
    wait_for_previous_kernel();
    return;
  }
  const SequenceInfo& seq = blk.seq;
  const int64_t workspace_sequence = backward_workspace_sequence(p, seq.q_offset, blk.b);
  const int n0 = blk.n0, h_kv = blk.h_kv, b = blk.b, group = blk.group;
  // Iteration it: query head h_kv * group + it / num_m, query block m_first + it % num_m.
  const int m_first = blk.m_first, num_m = blk.num_m, num_iters = blk.num_iters;
  const FastDivmod query_blocks(num_m);
  const auto head_of = [&](int it) { return h_kv * group + query_blocks.div(it); };
  const auto query_block_start = [&](int it) { return (m_first + query_blocks.mod(it)) * BM; };  // in the sequence
  // dQ's fp32 workspace tile of iteration it (its rows from a multiple of 8: dq_accum_offset is
  // additive from there).
  const auto dq_workspace_block = [&](int it) {
    return p.dq_accum +
           dq_accum_offset(workspace_sequence + head_of(it) * p.workspace_head_stride + query_block_start(it), 0, W);
  };
  const uint32_t dq_smem = base + Shape::kOffDq;
  // The consumers and the producer warpgroup's dQ warp (the writer by keys, the turn keeper by head dims).
  constexpr int kDqBarrierThreads = Shape::kConsumerThreads + 32;
  const MaskGeometry& mask = blk.mask;
  // Deterministic: iteration it's query block semaphore, and the number of key blocks that add
  // to it before this one (dq_add_turn).
  const auto dq_semaphore = [&](int it) {
    return p.dq_semaphore + (int64_t{b} * p.nheads_q + head_of(it)) * (p.seqlen_q_rounded / kBackwardMinBlockM) +
           query_block_start(it) / BM;
  };
  const auto dq_turn = [&](int it) {
    return dq_add_turn(mask, n0 / BN, query_block_start(it) / BM, BM, BN, last_key_block_first);
  };
  const int warpgroup = threadIdx.x / 128;
  constexpr int kTailZeroingWarps = 2;  // warps 2, 3 of the producer warpgroup
  constexpr int kTailZeroingThreads = Shape::kConsumerThreads + 32 * kTailZeroingWarps;  // their barriers

  if (threadIdx.x == 0) {
    sm90::mbarrier_init(kv_full, 1);
    for (int st = 0; st < kStages; ++st) {
      sm90::mbarrier_init(full(st), 1);
      sm90::mbarrier_init(empty(st), Shape::kConsumerWarps);
    }
    if (Shape::kDqThroughSharedMemory) sm90::mbarrier_init(dq_empty, 1);
    if (Shape::kLaggedDq) {
      sm90::mbarrier_init(score_buffer_done(0), Shape::kConsumerThreads);
      sm90::mbarrier_init(score_buffer_done(1), Shape::kConsumerThreads);
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
      const int k_batch = SequenceInfo::k_map_batch(p, b), q_batch = SequenceInfo::q_map_batch(p, b);
      sm90::tma_load_tile<Shape::kColumnBlocks>(k_smem, &args.k_map, kv_full, BN, seq.k_offset + n0, h_kv, k_batch);
      sm90::tma_load_tile<Shape::kColumnBlocks>(v_smem, &args.v_map, kv_full, BN, seq.k_offset + n0, h_kv, k_batch);
      sm90::PipelineState<kStages> write;
      for (int it = 0; it < num_iters; ++it, write.advance()) {
        const int stage = write.index;
        // The consumers free a stage one phase after it was filled.
        if (it >= kStages) sm90::mbarrier_wait(empty(stage), write.phase ^ 1);
        const int h = head_of(it), m0 = seq.q_offset + query_block_start(it);
        sm90::mbarrier_arrive_expect_bytes(full(stage), Shape::kStageBytes);
        sm90::tma_load_tile<Shape::kColumnBlocks>(q_smem(stage), &args.q_map, full(stage), BM, m0, h, q_batch);
        sm90::tma_load_tile<Shape::kColumnBlocks>(do_smem(stage), &args.do_map, full(stage), BM, m0, h, q_batch);
      }
    } else if (Shape::kDqThroughSharedMemory && threadIdx.x / 32 == 1 && num_iters > 0) {
      // The dQ writer: one bulk add of the block's dQ tile, its groups of 8 rows that start before
      // seqlen_q (the rows past it hold zeros), into the workspace; the tile goes back to the
      // consumers once the add has read it. Deterministic: the add waits for its turn on the
      // query block's semaphore (dq_add_turn) and, once complete, passes the turn on.
      const bool issuer = threadIdx.x % 32 == 0;
      wait_for_previous_kernel();        // the zeroed workspace, which the bulk adds (async proxy)
      sm90::fence_async_proxy_global();  // read after the preprocess's generic stores
      for (int it = 0; it < num_iters; ++it) {
        const int m0 = query_block_start(it);
        const int row_groups = (min(BM, seq.seqlen_q - m0) + 7) / 8;
        int* const semaphore = p.deterministic ? dq_semaphore(it) : nullptr;
        const int turn = p.deterministic ? dq_turn(it) : 0;
        sm90::named_barrier_sync(sm90::kDqFullBarrier, kDqBarrierThreads);
        if (issuer) {
          if (p.deterministic) {
            while (backward::load_acquire(semaphore) != turn) {
            }
            sm90::fence_async_proxy_global();
          }
          sm90::bulk_reduce_add_f32(dq_workspace_block(it), dq_smem, row_groups * 8 * W * 4);
          sm90::bulk_commit_group();
          sm90::bulk_wait_sources_read<0>();
          if (it + 1 < num_iters) sm90::mbarrier_arrive(dq_empty);
        }
        __syncwarp();
        if (p.deterministic && issuer) {
          sm90::bulk_wait<0>();
          sm90::fence_async_proxy_global();
          backward::store_release(semaphore, turn + 1);
        }
      }
      if (issuer) sm90::bulk_wait<0>();
    } else if (!Shape::kDqThroughSharedMemory && p.deterministic && threadIdx.x / 32 == 1 && num_iters > 0) {
      // The turn keeper of the consumers' dQ atomics (deterministic, by head dims): a warp of the
      // producer warpgroup, so that the turn's arithmetic and wait stay out of the consumers'
      // loop (inlined there it cost 4 % even when not deterministic). The barriers order every
      // consumer's atomics between the acquire and the release (fence and release being
      // cumulative over what the barrier ordered before them).
      const bool keeper = threadIdx.x % 32 == 0;
      for (int it = 0; it < num_iters; ++it) {
        int* const semaphore = dq_semaphore(it);
        const int turn = dq_turn(it);
        if (keeper) {
          while (backward::load_acquire(semaphore) != turn) {
          }
        }
        __syncwarp();
        sm90::named_barrier_arrive(sm90::kDqTurnBarrier, kDqBarrierThreads);
        sm90::named_barrier_sync(sm90::kDqAddedBarrier, kDqBarrierThreads);
        if (keeper) {
          __threadfence();
          backward::store_release(semaphore, turn + 1);
        }
      }
    } else if (threadIdx.x / 32 >= 2 && SequenceInfo::queries_may_overrun(p) && num_iters > 0) {
      // The tail zeroers: in the query block that straddles the sequence's end (the last of each
      // head, if any), the rows of Q and dO past seqlen_q. The consumers arrive on
      // kTailLandedBarrier once the block's copies have landed and wait on kTailZeroedBarrier;
      // they cannot release the stage before, so its "full" phase is still the block's (and the
      // zeroers' wait on it returns at once). Here rather than in the consumers: their loop holds
      // every register it has, and the zeroing in it spilled (8-28 bytes at W = 64).
      const int straddling = (seq.seqlen_q - 1) / BM - m_first;  // iteration of the head's straddling block
      if (straddling < num_m && (straddling + m_first + 1) * BM > seq.seqlen_q) {
        const int rows_valid = seq.seqlen_q - (straddling + m_first) * BM;
        for (int it = straddling; it < num_iters; it += num_m) {
          const int stage = it % kStages;
          sm90::named_barrier_sync(sm90::kTailLandedBarrier, kTailZeroingThreads);
          sm90::mbarrier_wait(full(stage), (it / kStages) & 1);
          backward::zero_rows_from<Shape::kColumnBlocks, BM>(q_smem(stage), do_smem(stage), rows_valid,
                                                             threadIdx.x - 64, 32 * kTailZeroingWarps);
          sm90::named_barrier_arrive(sm90::kTailZeroedBarrier, kTailZeroingThreads);
        }
      }
    }
    return;
  }

  sm90::warpgroup_registers_grow<Shape::kConsumerRegisters>();
  wait_for_previous_kernel();  // the producer's first copies are already under way
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_row = ((threadIdx.x / 32) % 4) * 16;  // this warp's rows of an M = 64 product
  // This warpgroup's keys (rows of Sᵀ, dK, dV) in the block, queries (columns of Sᵀ) in the
  // query block, and dK / dV columns.
  const int wg_key0 = kSplit ? 0 : consumer * Shape::kKeysPerWarpgroup;
  const int key_row0 = wg_key0 + warp_row;
  const int wg_query0 = kSplit ? consumer * NQ : 0;
  const int acc_col0 = kSplit ? consumer * NA : 0;

  int visible_begin[2], visible_end[2];
  lane_visible_queries(mask, n0 + key_row0 + g, visible_begin, visible_end);

  float acc_dk[NA / 2], acc_dv[NA / 2];
#pragma unroll
  for (int i = 0; i < NA / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  // Operands of this warpgroup. K and V rows of its keys are the K-major A of Sᵀ and dPᵀ, Q and
  // dO rows of its queries the K-major B; by head dims, dO and Q from its first column block are
  // the MN-major B of dV, dK. The dQ product reads K MN-major over all keys, from its half of the
  // head-dim columns (a 64-byte offset into a swizzle row at W = 64, which the address-based
  // swizzle allows like the 32-byte k-steps of the K-major operands).
  const uint32_t k_rows = k_smem + wg_key0 * sm90::kSwizzleBytes;
  const uint32_t v_rows = v_smem + wg_key0 * sm90::kSwizzleBytes;
  const uint32_t query_rows = wg_query0 * sm90::kSwizzleBytes;
  const uint32_t acc_cols = (acc_col0 / sm90::kSwizzleElements) * BM * sm90::kSwizzleBytes;
  // This warpgroup's dQ: its query rows and head-dim columns.
  const int dq_query0 = Shape::kDqSplitByRows ? consumer * 64 : 0;
  const int dq_col0 = Shape::kDqSplitByRows ? 0 : consumer * Shape::kDqColumns;
  const uint32_t k_dq_cols = k_smem + (dq_col0 / sm90::kSwizzleElements) * BN * sm90::kSwizzleBytes +
                             (dq_col0 % sm90::kSwizzleElements) * 2;

  // This thread's share of the lse2 / D prefetch: value `stat_index` of a block's lse2 (0..BM-1)
  // or D (BM..2 BM-1); threads 128 + 2 BM.. have none. Stored into the buffer of the next
  // iteration where this one's last read of it is done; the named barrier before dQ orders the
  // stores before the next iteration's reads, or with the lagged dQ score_buffer_done does.
  const int stat_index = threadIdx.x - 128;
  const auto fetch_row_stat = [&](int it) {
    const int64_t row = workspace_sequence + head_of(it) * p.workspace_head_stride + query_block_start(it);
    if (Shape::kBoundedRowStats && query_block_start(it) + stat_index % BM >= seq.seqlen_q)
      return stat_index < BM ? INFINITY : 0.f;  // what the preprocess writes to the padding
    return stat_index < BM ? __ldg(p.lse_log2 + row + stat_index) : __ldg(p.softmax_d + row + stat_index - BM);
  };
  float* const row_stat_buffers = reinterpret_cast<float*>(base_ptr + Shape::kOffLse);  // [lse2 x 2][D x 2]
  const auto store_row_stat = [&](int it, float value) {
    const int kind = stat_index / BM;  // 0: lse2, 1: D
    row_stat_buffers[(2 * kind + (it & 1)) * BM + stat_index % BM] = value;
  };
  // Rows a tile copy brings from past a sequence's end belong to the next sequence or to rows
  // seqused leaves out, and may hold anything: P and dS are 0 there, but 0 * inf or NaN is not,
  // and the products sum over those rows (dK, dV over queries, dQ over keys). The tiles that
  // straddle an end get those rows zeroed before any product reads them (TMA already zero-fills
  // past the tensor's own end, so dense calls skip this). Keys here, once; queries by the tail
  // zeroers of the producer warpgroup.
  if (num_iters > 0) {
    if (stat_index < 2 * BM) store_row_stat(0, fetch_row_stat(0));
    sm90::mbarrier_wait(kv_full, 0);
    const int key_rows_valid = seq.seqlen_k - n0;
    if (SequenceInfo::keys_may_overrun(p) && key_rows_valid < BN) {
      sm90::zero_tile_rows<Shape::kColumnBlocks>(k_smem, BN, key_rows_valid, stat_index, Shape::kConsumerThreads);
      sm90::zero_tile_rows<Shape::kColumnBlocks>(v_smem, BN, key_rows_valid, stat_index, Shape::kConsumerThreads);
    }
    sm90::named_barrier_sync(sm90::kConsumersBarrier, Shape::kConsumerThreads);
  }

  // dQ of query block `it` from its dSᵀ in score buffer `buf`, and its hand-over: to the dQ
  // writer through the shared-memory tile (by keys), or by atomics (by head dims).
  const auto issue_dq = [&](float(&dq)[Shape::kDqN / 2], int buf) {
    constexpr int kScoreRow = Shape::kScoreRowBytes;
    const auto ds_tile =
        sm90::mn_major_operand<kScoreRow>(base + score_offset(buf, 0) + dq_query0 / (kScoreRow / 2) * BN * kScoreRow, BN);
    const auto k_tile = sm90::mn_major_operand(k_dq_cols, BN);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint64_t ds_operand = ds_tile.at(kk * 16 * kScoreRow);
      const uint64_t k_operand = k_tile.at(kk * 16 * sm90::kSwizzleBytes);
      if constexpr (Shape::kDqTransposed)
        Wgmma<Element, Shape::kDqN>::ss_ab_mn_major(dq, k_operand, ds_operand, kk > 0);  // dQᵀ = Kᵀ dSᵀ
      else
        Wgmma<Element, Shape::kDqN>::ss_ab_mn_major(dq, ds_operand, k_operand, kk > 0);  // dQ = dS K
    }
    sm90::wgmma_commit();
  };
  const auto hand_over_dq = [&](float(&dq)[Shape::kDqN / 2], int it) {
    sm90::fence_registers(dq);
    // Rows past seqlen_q hold zeros: the atomics skip them, the bulk add all but those of its last
    // group of 8 rows (which land in the sequence's padded workspace rows). Columns past head_dim
    // add zeros to the padding of dq_accum, which nothing reads. This lane's first dQ element in
    // a tile, the rest at compile-time offsets from it:
    const int dq_lane = Shape::kDqTransposed ? dq_accum_offset_transposed(2 * t, dq_col0 + warp_row + g, W)
                                             : dq_accum_offset(dq_query0 + warp_row + g, dq_col0 + 2 * t, W);
    if constexpr (Shape::kDqThroughSharedMemory) {
      // The tile is free once the writer's add of the previous query block has read it.
      if (it > 0) sm90::mbarrier_wait(dq_empty, (it - 1) & 1);
      float* const dq_tile = reinterpret_cast<float*>(base_ptr + Shape::kOffDq) + dq_lane;
      // Accumulator rows g, g + 8 (half), columns 8j + 2t, + 1: queries x head dims, or by dQᵀ
      // head dims x queries, whose pair is then two rows of a transposed tile.
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < Shape::kDqN / 8; ++j)
          *reinterpret_cast<float2*>(dq_tile + (Shape::kDqTransposed ? dq_accum_offset_transposed(8 * j, 8 * half, W)
                                                                     : dq_accum_offset(8 * half, 8 * j, W))) =
              make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
      sm90::fence_shared_to_async_proxy();
      sm90::named_barrier_arrive(sm90::kDqFullBarrier, kDqBarrierThreads);
    } else {
      // Deterministic: the turn keeper warp lets the adds start once it is the block's turn, and
      // passes the turn on after they are issued.
      if (p.deterministic) sm90::named_barrier_sync(sm90::kDqTurnBarrier, kDqBarrierThreads);
      float* const dq_block = dq_workspace_block(it) + dq_lane;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (query_block_start(it) + dq_query0 + warp_row + g + 8 * half < seq.seqlen_q) {
#pragma unroll
          for (int j = 0; j < Shape::kDqColumns / 8; ++j)
            backward::red_add_pair(dq_block + dq_accum_offset(8 * half, 8 * j, W), dq[4 * j + 2 * half],
                                   dq[4 * j + 2 * half + 1]);
        }
      }
      if (p.deterministic) sm90::named_barrier_arrive(sm90::kDqAddedBarrier, kDqBarrierThreads);
    }
  };

  // Query block `it` of the ring's stage. By keys (Shape::kLaggedDq), its dQ product waits for
  // the other warpgroup's dSᵀ, so it runs in the next iteration, after that iteration's own
  // products are issued (the last block's after the loop). A warpgroup then waits for the other
  // only once it reaches the scores of the next query block (score_buffer_done of the previous
  // one), not at a fixed point of each iteration: with a named barrier before dQ both warpgroups
  // left it together and ran their exponentials and dS at the same time, the tensor cores idle
  // under both. The first iteration's dQ product has no query block: it reads the idle score
  // buffer and is dropped (the first iteration peeled off the loop instead spilled up to 208
  // bytes in the softcap variants), a fifth of one iteration's products per thread block.
  sm90::PipelineState<kStages> read;
  for (int it = 0; it < num_iters; ++it, read.advance()) {
    const int stage = read.index;
    const int buf = it & 1;
    const int h = head_of(it), m0 = query_block_start(it);
    const bool prefetch = stat_index < 2 * BM && it + 1 < num_iters;
    const float next_row_stat = prefetch ? fetch_row_stat(it + 1) : 0.f;

    float s[NQ / 2], dp[NQ / 2];  // Sᵀ then Pᵀ; dPᵀ then dSᵀ
    sm90::mbarrier_wait(full(stage), read.phase);
    if (SequenceInfo::queries_may_overrun(p) && m0 + BM > seq.seqlen_q) {
      sm90::named_barrier_arrive(sm90::kTailLandedBarrier, kTailZeroingThreads);
      sm90::named_barrier_sync(sm90::kTailZeroedBarrier, kTailZeroingThreads);
    }
    const auto k_tile = sm90::k_major_operand(k_rows), q_tile = sm90::k_major_operand(q_smem(stage) + query_rows);
    const auto v_tile = sm90::k_major_operand(v_rows), do_tile = sm90::k_major_operand(do_smem(stage) + query_rows);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < W / 16; ++ks)
      Wgmma<Element, NQ>::ss(s, k_tile.at(sm90::k_major_step(ks, BN)), q_tile.at(sm90::k_major_step(ks, BM)), ks > 0);
    sm90::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < W / 16; ++ks)
      Wgmma<Element, NQ>::ss(dp, v_tile.at(sm90::k_major_step(ks, BN)), do_tile.at(sm90::k_major_step(ks, BM)), ks > 0);
    sm90::wgmma_commit();

    // Dropout's draws run under the two products; dS takes the undropped Pᵀ, dV the dropped
    // one (its 1 / (1 - p) applied at the end).
    using KeepBits = std::conditional_t<(NQ > 64), uint64_t, uint32_t>;
    KeepBits keep_bits = 0;
    if constexpr (has_dropout(kMod)) {
      constexpr int kDrawColumns = NQ < 64 ? NQ : 64;  // one call's 32 bits
      static_assert(NQ % kDrawColumns == 0, "whole draws of the warpgroup's queries");
      // One part at a time: with both parts' draws in flight, W = 64 (128 queries) spilled 24 bytes.
#pragma unroll 1
      for (int part = 0; part < NQ / kDrawColumns; ++part)
        keep_bits |= KeepBits(DropoutMask(p, b, h).transposed_keep_bits<kDrawColumns>(
                         (n0 + key_row0) / 16, m0 + wg_query0 + part * kDrawColumns, lane))
                     << (32 * part);
    }

    sm90::wgmma_wait<1>();
    sm90::fence_registers(s);
    // The other warpgroup has finished the previous iteration: its dSᵀ is in score buffer buf ^ 1,
    // its dQ product of two iterations back, the last reader of buffer buf, is complete, and so
    // are its reads of lse2 / D buffer buf ^ 1 and the stores of this block's into buffer buf.
    // (In the first iteration the parity is that of the phase before the barrier's first: done.)
    if constexpr (Shape::kLaggedDq) sm90::mbarrier_wait(score_buffer_done(buf ^ 1), ((it - 1) >> 1) & 1);
    const float* const lse2_row = row_stat_buffers + buf * BM + wg_query0;
    const float* const dsum_row = row_stat_buffers + (2 + buf) * BM + wg_query0;
    const int wg_key_begin = n0 + wg_key0, wg_query_begin = m0 + wg_query0;
    const ScoreTransform<kMod> transform(p, b, h);
    float key_distance[2];
    // The dS tile of this iteration's buffer, free since the other warpgroup's previous iteration
    // (lagged dQ) or the previous iteration's barrier.
    const auto tanh_derivative = [&](int j, int half) {
      return backward::score_tile_pair<BN, Shape::kScoreRowBytes>(base_ptr + score_offset(buf, 0), key_row0,
                                                                  wg_query0 / 8, j, half, g, t);
    };
    if constexpr (ScoreTransform<kMod>::kUsesDistance) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        key_distance[half] = float(mask.diagonal_of_row(wg_query_begin + 2 * t) - (n0 + key_row0 + g + 8 * half));
    }
    const bool cut = !mask.tile_fully_visible(wg_query_begin, min(wg_query_begin + NQ, seq.seqlen_q), wg_key_begin,
                                              wg_key_begin + Shape::kKeysPerWarpgroup);
    backward::scores_to_probabilities<Shape::kWindowFree, kMaskLogits, NQ>(
        s, lse2_row, transform, key_distance, tanh_derivative, cut, wg_query_begin, visible_begin, visible_end, t);

    sm90::wgmma_wait<0>();
    sm90::fence_registers(dp);
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j) {
      const float2 dsum = backward::row_stat_pair(dsum_row, j, t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool kept = !has_dropout(kMod) || ((keep_bits >> (4 * j + e)) & 1);
        const float dp_kept = has_dropout(kMod) ? (kept ? dp[4 * j + e] * p.dropout_scale : 0.f) : dp[4 * j + e];
        dp[4 * j + e] = s[4 * j + e] * (dp_kept - ((e & 1) ? dsum.y : dsum.x));
        if constexpr (ScoreTransform<kMod>::kSoftcap) {
          const float2 derivative = unpack_tanh_derivative(*tanh_derivative(j, e >> 1));
          dp[4 * j + e] *= (e & 1) ? derivative.y : derivative.x;
        }
        if constexpr (has_dropout(kMod)) s[4 * j + e] = kept ? s[4 * j + e] : 0.f;
      }
    }

    // dK += dSᵀ Q. Where registers allow (Shape::kDkAfterDq) it is issued after dQ, so that it runs
    // while dQ goes out (the shared-memory tile or the atomics) and the wait for dQ does not wait
    // for it too; it is retired at the end of the iteration (held into the next one, it made
    // ptxas serialise every wgmma). Else beside dV.
    const auto issue_dk = [&](const uint32_t(&ds_fragments)[BM / 16][4]) {
      sm90::fence_registers(acc_dk);
      const auto q_tile = sm90::mn_major_operand(q_smem(stage) + (kSplit ? acc_cols : 0), BM);
      const auto ds_tile = sm90::k_major_operand(base + score_offset(buf, 0));  // by head dims
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        if constexpr (kSplit)
          Wgmma<Element, NA>::ss_b_mn_major(acc_dk, ds_tile.at(sm90::k_major_step(kk, BN)),
                                            q_tile.at(kk * 16 * sm90::kSwizzleBytes));
        else
          Wgmma<Element, W>::rs_b_mn_major(acc_dk, ds_fragments[kk], q_tile.at(kk * 16 * sm90::kSwizzleBytes));
      }
      sm90::wgmma_commit();
    };
    // Pᵀ and dSᵀ as the A fragments of the k16 steps over the queries (by keys).
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];
    if constexpr (!kSplit) {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        accumulator_as_a<Element>(pa[kk], reinterpret_cast<const float(&)[NQ / 8][4]>(s), kk);
        accumulator_as_a<Element>(dsa[kk], reinterpret_cast<const float(&)[NQ / 8][4]>(dp), kk);
      }
      sm90::fence_registers(acc_dv);
      const auto do_tile = sm90::mn_major_operand(do_smem(stage), BM);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        Wgmma<Element, W>::rs_b_mn_major(acc_dv, pa[kk], do_tile.at(kk * 16 * sm90::kSwizzleBytes));
      sm90::wgmma_commit();
      if constexpr (!Shape::kDkAfterDq) issue_dk(dsa);
    } else {
      backward::store_score_tile<Element, NQ, BN, Shape::kScoreRowBytes>(base + score_offset(buf, 1), s, key_row0,
                                                                         wg_query0 / 8, lane);
    }
    // dSᵀ into its tile: from dK's fragments where dK follows dQ (with the fp32 values as well,
    // ptxas serialised every wgmma for want of registers), else from the fp32 values (from the
    // fragments, the W = 64 variants of 128 queries spilled 4-8 bytes).
    if constexpr (kSplit || !Shape::kDkAfterDq)
      backward::store_score_tile<Element, NQ, BN, Shape::kScoreRowBytes>(base + score_offset(buf, 0), dp, key_row0,
                                                                         wg_query0 / 8, lane);
    else
      backward::store_score_fragments<NQ, BN, Shape::kScoreRowBytes>(base + score_offset(buf, 0), dsa, key_row0,
                                                                     wg_query0 / 8, lane);
    if (prefetch) store_row_stat(it + 1, next_row_stat);
    sm90::fence_shared_to_async_proxy();

    float dq[Shape::kDqN / 2];
    if constexpr (Shape::kLaggedDq) {
      issue_dq(dq, buf ^ 1);
    } else {
      sm90::named_barrier_sync(sm90::kConsumersBarrier, Shape::kConsumerThreads);
      if constexpr (kSplit) {
        sm90::fence_registers(acc_dv);
        sm90::wgmma_fence();
        const auto p_tile = sm90::k_major_operand(base + score_offset(buf, 1));
        const auto do_tile = sm90::mn_major_operand(do_smem(stage) + acc_cols, BM);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
          Wgmma<Element, NA>::ss_b_mn_major(acc_dv, p_tile.at(sm90::k_major_step(kk, BN)),
                                            do_tile.at(kk * 16 * sm90::kSwizzleBytes));
        sm90::wgmma_commit();
      }
      issue_dq(dq, buf);
    }
    if constexpr (Shape::kDkAfterDq) issue_dk(dsa);
    sm90::wgmma_wait<Shape::kDkAfterDq ? 1 : 0>();  // dV and dQ
    sm90::fence_registers(acc_dv);
    if (!Shape::kLaggedDq || it > 0) hand_over_dq(dq, Shape::kLaggedDq ? it - 1 : it);
    if constexpr (Shape::kDkAfterDq) {
      sm90::wgmma_wait<0>();
      sm90::fence_registers(acc_dk);
    }
    // Every thread arrives on score_buffer_done after its own stores (the dSᵀ tile, lse2 / D), so
    // that nothing but the barrier orders them before the other warpgroup's reads.
    if constexpr (Shape::kLaggedDq) sm90::mbarrier_arrive(score_buffer_done(buf));
    __syncwarp();
    if (lane == 0) sm90::mbarrier_arrive(empty(stage));
  }
  if (Shape::kLaggedDq && num_iters > 0) {
    const int last = num_iters - 1;
    float dq[Shape::kDqN / 2];
    sm90::mbarrier_wait(score_buffer_done(last & 1), (last >> 1) & 1);
    issue_dq(dq, last & 1);
    sm90::wgmma_wait<0>();
    hand_over_dq(dq, last);
  }

  // dV and dK·scale through shared memory, where K's and V's tiles are free once every consumer's
  // products are complete, into 16-byte stores of whole rows: rows < seqlen_k, columns < head_dim
  // (a multiple of 8). Stored straight from the accumulators, 4 bytes of 8 rows per warp store,
  // the epilogue held a fifth of the consumer warps' samples at N 1024 (d 128; Nsight Compute).
  // A tile is BN rows x W columns, row-major, its 16-byte pieces XOR-swizzled by row % 8: both
  // an 8 x 8 matrix of stmatrix and 8 consecutive pieces of a row then fall in distinct banks.
  const auto piece_address = [&](uint32_t tile, int row, int piece) {
    return tile + row * (W * 2) + ((piece ^ (row % 8)) * 16);
  };
  const auto stage = [&](uint32_t tile, float(&acc)[NA / 2], float scale) {
#pragma unroll
    for (int i = 0; i < NA / 2; ++i) acc[i] *= scale;
    // Matrix lane / 8 of each stmatrix: rows + 8 (lane / 8 % 2), the 8 columns of 2 kk + lane / 16,
    // as accumulator_as_a orders a fragment's registers.
    const int row = key_row0 + 8 * (lane / 8 % 2) + lane % 8, piece0 = acc_col0 / 8 + lane / 16;
#pragma unroll
    for (int kk = 0; kk < NA / 16; ++kk) {
      uint32_t r[4];
      accumulator_as_a<Element>(r, reinterpret_cast<const float(&)[NA / 8][4]>(acc), kk);
      sm90::stmatrix_x4(piece_address(tile, row, piece0 + 2 * kk), r);
    }
  };
  // A consumer thread copies one piece of every kRowStep-th row (a multiple of 8: one swizzled place).
  constexpr int kPieces = W / 8, kRowStep = Shape::kConsumerThreads / kPieces;
  static_assert(Shape::kConsumerThreads % kPieces == 0 && kRowStep % 8 == 0 && BN % kRowStep == 0,
                "whole rounds of rows");
  const int consumer_thread = threadIdx.x - 128;
  const int piece = consumer_thread % kPieces, row0 = consumer_thread / kPieces;
  const auto copy_out = [&](uint32_t tile, void* out, const TensorStrides& strides) {
    if (piece * 8 >= p.head_dim) return;
    // Rows are whole 16-byte pieces apart (the allocation's head_dim is a multiple of 8): indexed
    // as such, or ptxas split each store into four.
    uint4* const dst =
        reinterpret_cast<uint4*>(seq.k_row(static_cast<Element*>(out), strides, b, h_kv, n0 + row0)) + piece;
    const int64_t row_pieces = strides.row / 8;
    const uint32_t src = piece_address(tile, row0, piece);
    const int rows = seq.seqlen_k - n0 - row0;
#pragma unroll
    for (int k = 0; k < BN / kRowStep; ++k)
      if (k * kRowStep < rows) dst[k * kRowStep * row_pieces] = sm90::load_shared_v4(src + k * kRowStep * W * 2);
  };
  sm90::named_barrier_sync(sm90::kConsumersBarrier, Shape::kConsumerThreads);
  stage(v_smem, acc_dv, has_dropout(kMod) ? p.dropout_scale : 1.f);
  stage(k_smem, acc_dk, p.softmax_scale);
  sm90::named_barrier_sync(sm90::kConsumersBarrier, Shape::kConsumerThreads);
  copy_out(v_smem, p.dv, p.dv_strides);
  copy_out(k_smem, p.dk, p.dk_strides);
#else
  __trap();  // launched only where the sm_90a image exists (sm90/backward_launch.cuh)
#endif
}

}  // namespace flashattn
