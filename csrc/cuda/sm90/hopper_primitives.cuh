// Thin wrappers over the sm_90 PTX the Hopper kernels are built from:
// mbarriers (the completion signal of TMA copies and the hand-back of a
// shared-memory stage), TMA tile loads (cp.async.bulk.tensor), wgmma's
// shared-memory matrix descriptors and its fence/commit/wait, bulk reduce-adds from shared to
// global memory, named barriers, and setmaxnreg.
//
// Shared-memory tiles are stored the way TMA's 128-byte swizzle writes them and
// wgmma's 128-byte-swizzle descriptors read them: column blocks of 64 16-bit
// elements (128 bytes per row), each a stack of 1024-byte atoms of 8 rows, where
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8). Atoms must be
// 1024-byte aligned.
#pragma once

#include <cstdint>

namespace flashattn {
namespace sm90 {

constexpr int kSwizzleBytes = 128;       // one row of a column block
constexpr int kSwizzleElements = 64;     // 16-bit elements per column-block row
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows
// An H100/H200 SM's shared memory, and what the runtime keeps of it for each resident block.
constexpr int kSmemPerSM = 228 * 1024;
constexpr int kReservedSmemPerBlock = 1024;

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// A word handed between warps through shared memory, ordered by the mbarrier arrive (release)
// after the store and the wait (acquire) before the load.
__device__ __forceinline__ void store_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t load_shared_u32(uint32_t addr) {
  uint32_t value;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
  return value;
}
// Sixteen bytes from shared memory (a 16-byte-aligned address).
__device__ __forceinline__ uint4 load_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Makes the barriers thread 0 initialised visible before the block's barrier publishes them.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrives and announces `bytes` of TMA traffic that will complete on the barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Waits until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// One box of a 4-d tensor map (coordinates innermost first) into shared memory,
// completing on `bar`. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t smem_dst, const void* tensor_map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// A contiguous global range (16-byte aligned, a multiple of 16 bytes) into shared memory,
// completing on `bar` like a TMA tile.
__device__ __forceinline__ void bulk_load(uint32_t smem_dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// Adds `bytes` bytes of fp32 values in shared memory (16-byte aligned, a multiple of 16 bytes)
// element-wise into global memory, in this thread's current bulk group: the copy engine does the
// additions in L2, so the issuing thread neither waits for them nor holds registers for them.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_src), "r"(bytes)
               : "memory");
}

// Closes this thread's current bulk group.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's bulk groups still read their shared-memory
// sources (the sources may then be overwritten; the global writes may still be in flight).
template <int kPending>
__device__ __forceinline__ void bulk_wait_sources_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until at most kPending of this thread's bulk groups are incomplete.
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Orders this thread's global-memory accesses through the async proxy (bulk copies and
// reductions) with its ordinary ones, both ways.
__device__ __forceinline__ void fence_async_proxy_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Makes this thread's ordinary shared-memory writes visible to the async proxy
// (wgmma operand reads, TMA), which does not see them otherwise.
__device__ __forceinline__ void fence_shared_to_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The named barriers of the Hopper kernels, one list (id 0 is __syncthreads).
enum NamedBarrier : int {
  kConsumersBarrier = 1,  // every consumer thread of the block
  kDqFullBarrier = 2,     // backward: the consumers' dQ tile is in shared memory (consumers + dQ writer)
  kDqTurnBarrier = 4,     // backward by head dims, deterministic: the query block's turn to add dQ has come
  kDqAddedBarrier = 5,    // backward by head dims, deterministic: the consumers have issued their dQ adds
  kTailLandedBarrier = 6,  // backward, variable-length q: a straddling query block's Q, dO have landed
  kTailZeroedBarrier = 7,  // backward, variable-length q: their rows past the sequence's end are zero
};

// Barrier `id` (1..15; 0 is __syncthreads) that completes once `threads` threads (whole
// warps) have reached it, so some warpgroups of a block can synchronise without the others.
__device__ __forceinline__ void named_barrier_sync(NamedBarrier id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<int>(id)), "r"(threads) : "memory");
}

// Arrives at barrier `id` (see named_barrier_sync) without waiting for it to complete.
__device__ __forceinline__ void named_barrier_arrive(NamedBarrier id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(static_cast<int>(id)), "r"(threads) : "memory");
}

// Zeroes rows [row_begin, rows) of a tile that tma_load_tile filled (each of its column
// blocks is `rows` rows of 128 bytes; the swizzle moves 16-byte pieces only within a row),
// with the `threads` threads of `thread` 0.., then fences for the async proxy. The callers
// synchronise before any product reads the tile.
template <int kColumnBlocks>
__device__ __forceinline__ void zero_tile_rows(uint32_t tile, int rows, int row_begin, int thread, int threads) {
  const int pieces_per_block = (rows - row_begin) * (kSwizzleBytes / 16);
  for (int i = thread; i < kColumnBlocks * pieces_per_block; i += threads) {
    const uint32_t addr = tile + (i / pieces_per_block) * rows * kSwizzleBytes + row_begin * kSwizzleBytes +
                          (i % pieces_per_block) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
  }
  fence_shared_to_async_proxy();
}

// A (rows x kColumnBlocks * 64) tile of a 4-d map, row0 .. row0 + rows - 1 of (head, batch),
// one TMA box per column block, each its own swizzled stack.
template <int kColumnBlocks>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const void* tensor_map, uint32_t bar, int rows,
                                              int row0, int head, int batch) {
#pragma unroll
  for (int cb = 0; cb < kColumnBlocks; ++cb)
    tma_load_4d(dst + cb * rows * kSwizzleBytes, tensor_map, bar, cb * kSwizzleElements, row0, head, batch);
}

__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

// wgmma shared-memory matrix descriptor for an operand swizzled in rows of kRowBytes (128,
// the tiles TMA writes; 32, the backward's score tile of 80 queries, in column blocks of 16).
// lbo / sbo: the leading- and stride-dimension byte offsets (PTX ISA, "Matrix
// Descriptor Format"); for K-major operands the stride is between 8-row atoms
// and the leading offset is unused, for MN-major ones the leading offset steps
// between column blocks and the stride between 8-row atoms.
template <int kRowBytes = kSwizzleBytes>
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t smem_addr, uint32_t lbo_bytes,
                                                        uint32_t sbo_bytes) {
  static_assert(kRowBytes == 128 || kRowBytes == 64 || kRowBytes == 32, "wgmma's swizzle widths");
  constexpr uint64_t kMode = kRowBytes == 128 ? 1 : kRowBytes == 64 ? 2 : 3;
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (kMode << 62);
}

// The two layouts the kernels' operands take. K-major (the contraction dimension
// contiguous, e.g. Q and K in S = Q K^T): a k16 step moves 32 bytes inside a 128-byte
// row, four steps make one column block (k_major_step gives the byte offset).
// MN-major (e.g. V as the B of P V): a k16 step is 16 rows, the column blocks of a
// tile of `rows` rows lie rows * kRowBytes apart.
__device__ __forceinline__ uint32_t k_major_step(int ks, int rows) {
  return (ks / 4) * rows * kSwizzleBytes + (ks % 4) * 32;
}

__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t smem_addr) {
  return swizzled_descriptor(smem_addr, 16, kSwizzleAtomBytes);
}

template <int kRowBytes = kSwizzleBytes>
__device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t smem_addr, int rows) {
  return swizzled_descriptor<kRowBytes>(smem_addr, rows * kRowBytes, 8 * kRowBytes);
}

// An operand's descriptor built once per tile; at(offset) is the descriptor of the operand
// `offset` bytes further on (a k16 step, a column block), made by adding offset / 16 to the
// start-address field alone: the field holds address / 16 of an address below 256 KB, so the
// sum never carries out of it. One integer add per wgmma instead of the mask, shift and or
// of a fresh descriptor (five instructions on the consumers' path before each wgmma). The
// backward builds its operands per product, before each chain of wgmma (held across its loop,
// they spilled the W = 64 dropout variants).
struct SwizzledOperand {
  uint32_t lo, hi;
  __device__ __forceinline__ explicit SwizzledOperand(uint64_t descriptor)
      : lo(uint32_t(descriptor)), hi(uint32_t(descriptor >> 32)) {}
  __device__ __forceinline__ uint64_t at(uint32_t byte_offset) const {
    return (uint64_t(hi) << 32) | (lo + (byte_offset >> 4));
  }
};

__device__ __forceinline__ SwizzledOperand k_major_operand(uint32_t smem_addr) {
  return SwizzledOperand(k_major_descriptor(smem_addr));
}

template <int kRowBytes = kSwizzleBytes>
__device__ __forceinline__ SwizzledOperand mn_major_operand(uint32_t smem_addr, int rows) {
  return SwizzledOperand(mn_major_descriptor<kRowBytes>(smem_addr, rows));
}

// Four 8 x 8 matrices of 16-bit elements from a warp's registers into shared memory, register i
// of each lane holding matrix i's pair (row lane / 4, columns 2 (lane % 4), + 1), the layout of an
// mma accumulator fragment; lane l gives the address of row l % 8 of matrix l / 8 (16 bytes).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kPendingGroups>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPendingGroups) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers
// across a wgmma issue or wait (it does not know the tensor cores own them).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The registers each thread of a block of `warpgroups` starts with when `blocks_per_sm` of them
// share an SM (what __launch_bounds__ lets ptxas take: 64K over them, rounded down to 8).
// setmaxnreg trades registers within a block only (a grow waits on the block's own pool), so
// this, times the warpgroups, is all the block's warpgroups can hold together: more (the SM's
// 64K over the blocks, when the rounding loses registers) leaves a grow waiting forever.
constexpr int launch_registers(int warpgroups, int blocks_per_sm) {
  const int launched = 65536 / (128 * warpgroups * blocks_per_sm) / 8 * 8;
  return launched < 256 ? launched : 256;
}

// The registers per thread setmaxnreg can give each consumer warpgroup once the producer
// warpgroup has shrunk to `producer`, in the multiples of 8 setmaxnreg takes, at most its 256.
constexpr int consumer_registers(int producer, int consumer_warpgroups, int blocks_per_sm) {
  const int warpgroups = 1 + consumer_warpgroups;
  const int block_registers = launch_registers(warpgroups, blocks_per_sm) * warpgroups;  // per thread of a warpgroup
  const int share = (block_registers - producer) / consumer_warpgroups / 8 * 8;
  return share < 256 ? share : 256;
}

template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_shrink() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_grow() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace sm90
}  // namespace flashattn
