// Where a producer or a consumer is in a ring of kStages shared-memory stages: the stage
// index and the parity of its mbarriers' current phase, advanced together. Carried as
// state rather than recomputed from a loop counter, so that a kernel that works through
// several tiles (a persistent grid) continues the ring where the last tile left it.
#pragma once

#include <cstdint>

namespace flashattn {
namespace sm90 {

template <int kStages>
struct PipelineState {
  int index = 0;
  // The parity a wait on this stage's "full" barrier expects. A producer waits on the stage's
  // "empty" barrier with phase ^ 1, the phase before: on its first pass over the ring that is
  // the phase before the barrier's first, which mbarrier.try_wait.parity counts as completed,
  // so the first kStages waits pass at once without a counter of filled stages.
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
