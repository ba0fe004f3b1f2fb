// What the launch layers need to know of the device to plan tiles and grids.
#pragma once

namespace flashattn {

// How the Hopper forward's grid walks its tiles (sm90/forward_launch.cuh,
// persistent_forward): one block per tile (the default), or resident blocks that loop
// over them (FLASHATTN_FORWARD_SCHEDULER=persistent; persistent:N also caps the grid at N
// blocks, so that tests with few tiles still walk several per block).
enum class ForwardScheduler { kStatic, kPersistent };

struct DeviceLimits {
  int max_smem_per_block;  // opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
  int num_sms;
  // The Hopper kernels run: an sm_90 device, a build with sm_90a code, and
  // FLASHATTN_DISABLE_HOPPER_KERNELS not set (it selects the sm_80 kernels, for comparison).
  bool hopper_kernels;
  ForwardScheduler forward_scheduler = ForwardScheduler::kStatic;  // read per call, like hopper_kernels
  int forward_persistent_blocks = 0;  // > 0: a persistent forward grid of at most this many blocks
};

}  // namespace flashattn
