// Where a producer or a consumer is in a ring of kStages shared-memory stages: the stage
// index and the parity of its mbarriers' current phase, advanced together. Carried as
// state rather than recomputed from a loop counter, so that a kernel that works through
// several tiles (a persistent grid) can continue the ring where the last tile left it.
// The Hopper backward carries its Q/dO ring so, the forward its K and V rings (S runs a
// block ahead of P V, so the consumers hold one state per ring).
#pragma once

#include <cstdint>

namespace flashattn {
namespace sm90 {

template <int kStages>
struct PipelineState {
  int index = 0;
  // The parity a wait on this stage's "full" barrier expects; a producer refilling the stage
  // waits on its "empty" barrier with phase ^ 1 (the consumers free it one phase after it
  // was filled).
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

}  // namespace sm90
}  // namespace flashattn
