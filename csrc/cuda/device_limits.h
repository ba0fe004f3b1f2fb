// What the launch layers need to know of the device to plan tiles and grids.
#pragma once

namespace flashattn {

// Which grid the forward runs where it has more tiles than the SMs hold blocks at once
// (FLASHATTN_FORWARD_SCHEDULER, read per call): kAuto (unset) persistent where the Hopper
// kernel's key loops are short (tile_scheduler.cuh's persistent_forward_blocks; the mma.sync
// kernel static), kStatic (`static`) never, kPersistent (`persistent`, `persistent:N`) always
// where the kernel has one.
enum class ForwardScheduler { kAuto, kStatic, kPersistent };

struct DeviceLimits {
  int max_smem_per_block;  // opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
  int num_sms;
  // Peak DRAM bandwidth, bytes/s (memory clock x bus width x 2 transfers per clock); 0 where
  // the device does not say.
  double dram_bytes_per_s;
  // The Hopper kernels run: an sm_90 device, a build with sm_90a code, and
  // FLASHATTN_DISABLE_HOPPER_KERNELS not set (it selects the sm_80 kernels, for comparison).
  bool hopper_kernels;
  ForwardScheduler forward_scheduler;
  // FLASHATTN_FORWARD_SCHEDULER=persistent:N: a persistent grid of at most N blocks, so that
  // tests of small problems walk several tiles per block (0: as many as the SMs hold).
  int persistent_grid_cap;
};

}  // namespace flashattn
