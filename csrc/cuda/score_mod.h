// Which instantiation of the attention kernels a call needs for its score modifiers. The
// modifiers are template variants, not runtime flags, so that the plain kernels keep their
// straight-line score code and registers. softcap's tanh is a multi-function-unit operation
// per score, as costly as the exponential, and ALiBi's bias two FP32 operations and a few
// registers per score row: each has its own variant, so that softcap alone (Gemma 2) pays
// nothing for the bias. The learnable sink, the online softmax's starting state, rides on
// the modifier variants (kBias when it is the only modifier): with its read (once per tile)
// in every kernel, the plain Hopper forward measured 1-3 % slower at d 128 in one A/B run
// (benchmarks/RESULTS.md; the cause not isolated further). In the backward lse carries it.
#pragma once

#include <type_traits>

#include "common/attention_params.h"

namespace flashattn {

enum class ScoreMod {
  kNone,         // s * scale
  kBias,         // + ALiBi bias
  kSoftcap,      // softcap * tanh(s * scale / softcap)
  kSoftcapBias,  // softcap, then + ALiBi bias
};

// The backward's variant: lse carries the sink, so the plain kernels serve a call whose only
// modifier it is.
inline ScoreMod backward_score_mod(const AttentionFwdParams& p) {
  if (p.softcap > 0.f) return p.alibi_slopes != nullptr ? ScoreMod::kSoftcapBias : ScoreMod::kSoftcap;
  return p.alibi_slopes != nullptr ? ScoreMod::kBias : ScoreMod::kNone;
}

// The forward's: the backward's, with a sink alone on kBias.
inline ScoreMod forward_score_mod(const AttentionFwdParams& p) {
  const ScoreMod mod = backward_score_mod(p);
  return mod == ScoreMod::kNone && p.learnable_sink != nullptr ? ScoreMod::kBias : mod;
}

// Calls f(std::integral_constant<ScoreMod, mod>{}) (a compile-time value in f).
template <typename F>
decltype(auto) dispatch_score_mod(ScoreMod mod, const F& f) {
  switch (mod) {
    case ScoreMod::kSoftcapBias:
      return f(std::integral_constant<ScoreMod, ScoreMod::kSoftcapBias>{});
    case ScoreMod::kSoftcap:
      return f(std::integral_constant<ScoreMod, ScoreMod::kSoftcap>{});
    case ScoreMod::kBias:
      return f(std::integral_constant<ScoreMod, ScoreMod::kBias>{});
    default:
      return f(std::integral_constant<ScoreMod, ScoreMod::kNone>{});
  }
}

}  // namespace flashattn
