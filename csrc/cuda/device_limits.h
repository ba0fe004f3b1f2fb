// What the launch layers need to know of the device to plan tiles and grids.
#pragma once

namespace flashattn {

struct DeviceLimits {
  int max_smem_per_block;  // opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
  int num_sms;
  // The Hopper kernels run: an sm_90 device, a build with sm_90a code, and
  // FLASHATTN_DISABLE_HOPPER_KERNELS not set (it selects the sm_80 kernels, for comparison).
  bool hopper_kernels;
};

}  // namespace flashattn
