// What the launch layers need to know of the device to plan tiles and grids.
#pragma once

namespace flashattn {

struct DeviceLimits {
  int max_smem_per_block;  // opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
  int num_sms;
};

}  // namespace flashattn
