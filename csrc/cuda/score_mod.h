// Which instantiation of the attention kernels a call needs for its score modifiers. The
// modifiers are template variants, not runtime flags, so that the plain kernels keep their
// straight-line score code and registers. softcap's tanh is a multi-function-unit operation
// per score, as costly as the exponential, and ALiBi's bias two FP32 operations and a few
// registers per score row: each has its own variant, so that softcap alone (Gemma 2) pays
// nothing for the bias. The learnable sink, the online softmax's starting state, rides on
// the modifier variants (kBias when it is the only modifier): with its read (once per tile)
// in every kernel, the plain Hopper forward measured 1-3 % slower at d 128 in one A/B run
// (benchmarks/RESULTS.md; the cause not isolated further). In the backward lse carries it.
// Dropout's Philox draws are a few dozen integer operations per eight scores: a variant bit
// of their own.
#pragma once

#include <type_traits>

#include "common/attention_params.h"

namespace flashattn {

// Bits: 1 ALiBi bias, 2 softcap (the logit's transform: score_transform.cuh), 4 dropout (the
// probabilities' mask: dropout_mask.cuh). Each combination is its own instantiation.
enum class ScoreMod {
  kNone = 0,                // s * scale
  kBias = 1,                // + ALiBi bias
  kSoftcap = 2,             // softcap * tanh(s * scale / softcap)
  kSoftcapBias = 3,         // softcap, then + ALiBi bias
  kDropout = 4,             // each of the above, then dropout
  kBiasDropout = 5,
  kSoftcapDropout = 6,
  kSoftcapBiasDropout = 7,
};

constexpr FLASHATTN_HOST_DEVICE bool has_bias(ScoreMod mod) { return (int(mod) & 1) != 0; }
constexpr FLASHATTN_HOST_DEVICE bool has_softcap(ScoreMod mod) { return (int(mod) & 2) != 0; }
constexpr FLASHATTN_HOST_DEVICE bool has_dropout(ScoreMod mod) { return (int(mod) & 4) != 0; }
// The part that turns a score into a logit (kNone, kBias, kSoftcap, kSoftcapBias).
constexpr FLASHATTN_HOST_DEVICE ScoreMod logit_mod(ScoreMod mod) { return ScoreMod(int(mod) & 3); }
// Whether the forward reads the learnable sink: every variant with a logit modifier.
constexpr FLASHATTN_HOST_DEVICE bool reads_sink(ScoreMod mod) { return logit_mod(mod) != ScoreMod::kNone; }

// The backward's variant: lse carries the sink, so the plain kernels serve a call whose only
// modifier it is.
inline ScoreMod backward_score_mod(const AttentionFwdParams& p) {
  const int bias = p.alibi_slopes != nullptr ? 1 : 0;
  const int softcap = p.softcap > 0.f ? 2 : 0;
  const int dropout = p.rng_state != nullptr ? 4 : 0;
  return ScoreMod(bias | softcap | dropout);
}

// The forward's: the backward's, with a sink and no logit modifier on kBias.
inline ScoreMod forward_score_mod(const AttentionFwdParams& p) {
  const ScoreMod mod = backward_score_mod(p);
  return !reads_sink(mod) && p.learnable_sink != nullptr ? ScoreMod(int(mod) | 1) : mod;
}

// Calls f(std::integral_constant<ScoreMod, mod>{}) (a compile-time value in f).
template <typename F>
decltype(auto) dispatch_score_mod(ScoreMod mod, const F& f) {
  using M = ScoreMod;
  switch (mod) {
    case M::kSoftcapBiasDropout: return f(std::integral_constant<M, M::kSoftcapBiasDropout>{});
    case M::kSoftcapDropout: return f(std::integral_constant<M, M::kSoftcapDropout>{});
    case M::kBiasDropout: return f(std::integral_constant<M, M::kBiasDropout>{});
    case M::kDropout: return f(std::integral_constant<M, M::kDropout>{});
    case M::kSoftcapBias: return f(std::integral_constant<M, M::kSoftcapBias>{});
    case M::kSoftcap: return f(std::integral_constant<M, M::kSoftcap>{});
    case M::kBias: return f(std::integral_constant<M, M::kBias>{});
    default: return f(std::integral_constant<M, M::kNone>{});
  }
}

}  // namespace flashattn
