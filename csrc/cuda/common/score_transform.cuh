// A raw score s = q . k of query i and key j to the softmax's log2-domain logit, per score-mod
// variant (cuda/score_mod.h), for every kernel of both families, forward and backward:
//   kNone         s * scale * log2(e)
//   kBias         (s * scale - slope * |i + seqlen_k - seqlen_q - j|) * log2(e)
//   kSoftcap      softcap * tanh(s * scale / softcap) * log2(e)
//   kSoftcapBias  (softcap * tanh(s * scale / softcap) - slope * |...|) * log2(e)
// (flash-attn 2.x: the ALiBi bias joins the capped score; slope = 0 without ALiBi). The
// position enters as `distance` = i + seqlen_k - seqlen_q - j in float, which callers build
// from per-row and per-tile bases plus compile-time offsets: an int-to-float conversion per
// score would cost as much as the exponential. Kernels construct a transform from their
// __grid_constant__ params where each block's scores need it: a scale held in a register
// through the loop cost the mma.sync W = 128 forward spills.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "cuda/score_mod.h"

namespace flashattn {

// One MUFU.TANH (max relative error about 2^-11, below bf16's and at fp16's rounding).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// kLinearBias: the forward's online softmax runs ALiBi in its linear frame (kBiasFrame,
// online_softmax.cuh): a second code path per score block, which the Hopper forward has the
// registers for and the mma.sync one does not.
template <ScoreMod kMod, bool kLinearBias>
struct LogitTransform {
  static constexpr bool kUsesDistance = has_bias(kMod);
  static constexpr bool kBiasFrame = kUsesDistance && kLinearBias;
  static constexpr bool kSoftcap = has_softcap(kMod);

  float multiplier;   // after tanh with softcap (softcap * log2 e), else scale * log2 e
  float softcap_pre;  // scale / softcap
  float slope_log2;   // ALiBi slope * log2 e; 0 without ALiBi

  __device__ __forceinline__ LogitTransform(const AttentionFwdParams& p, int batch, int head)
      : multiplier(kSoftcap ? p.softcap * float(M_LOG2E) : p.softmax_scale_log2),
        softcap_pre(kSoftcap ? p.softmax_scale / p.softcap : 0.f),
        slope_log2(kUsesDistance && p.alibi_slopes != nullptr
                       ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * float(M_LOG2E)
                       : 0.f) {}

  // Without a distance term (softcap alone) the logit is logit_scale() * pre_logit(s), and
  // logit_scale() = softcap * log2 e is positive.
  static constexpr bool kAffineLogit = !kUsesDistance;
  static constexpr bool kScaleMayBeNegative = false;
  __device__ __forceinline__ float pre_logit(float s) const { return kSoftcap ? capped(s) : s; }
  __device__ __forceinline__ float logit_scale() const { return multiplier; }

  // softcap's tanh(s * scale / softcap), kept by the backward for the derivative 1 - t^2.
  __device__ __forceinline__ float capped(float s) const { return fast_tanh(s * softcap_pre); }
  // The logit plus `offset` (the backward's -lse2) from s, or from capped(s) with softcap (the
  // backward keeps the capped score).
  __device__ __forceinline__ float logit_of(float s_or_capped, float distance, float offset) const {
    const float x = fmaf(s_or_capped, multiplier, offset);
    return kUsesDistance ? fmaf(-slope_log2, fabsf(distance), x) : x;
  }
  __device__ __forceinline__ float operator()(float s, float distance) const {
    const float x = (kSoftcap ? capped(s) : s) * multiplier;
    return kUsesDistance ? fmaf(-slope_log2, fabsf(distance), x) : x;
  }
  // The scaled (capped) score plus a bias given in log2 units (the forward's ALiBi frame).
  __device__ __forceinline__ float scaled_plus(float s, float bias_log2) const {
    return fmaf(kSoftcap ? capped(s) : s, multiplier, bias_log2);
  }
};

template <bool kLinearBias>
struct LogitTransform<ScoreMod::kNone, kLinearBias> {
  static constexpr bool kUsesDistance = false;
  static constexpr bool kBiasFrame = false;
  static constexpr bool kSoftcap = false;
  static constexpr bool kAffineLogit = true;
  static constexpr bool kScaleMayBeNegative = true;  // softmax_scale may be negative
  float scale_log2;

  __device__ __forceinline__ LogitTransform(const AttentionFwdParams& p, int, int) : scale_log2(p.softmax_scale_log2) {}
  __device__ __forceinline__ float logit_of(float s, float, float offset) const { return fmaf(s, scale_log2, offset); }
  __device__ __forceinline__ float operator()(float s, float) const { return s * scale_log2; }
  __device__ __forceinline__ float pre_logit(float s) const { return s; }
  __device__ __forceinline__ float logit_scale() const { return scale_log2; }
};

// A variant's transform: its logit bits only (dropout acts on the probabilities).
template <ScoreMod kMod, bool kLinearBias = false>
using ScoreTransform = LogitTransform<logit_mod(kMod), kLinearBias>;

// softcap's derivative d capped / d s = 1 - t^2 of two capped scores t, kept by the backward
// from P to dS as an fp16 pair in the 32-bit slot of the dS tile that the pair's dS takes
// later: it lies in [0, 1], and fp16's 2^-11 is below the rounding dS gets for its products.
__device__ __forceinline__ uint32_t pack_tanh_derivative(float t0, float t1) {
  const __half2 d = __floats2half2_rn(fmaf(-t0, t0, 1.f), fmaf(-t1, t1, 1.f));
  return *reinterpret_cast<const uint32_t*>(&d);
}
__device__ __forceinline__ float2 unpack_tanh_derivative(uint32_t packed) {
  return __half22float2(*reinterpret_cast<const __half2*>(&packed));
}

// The learnable sink's logit of `head` in log2 units, -inf without one: each row's online
// softmax starts from it (max = sink, sum = 1), so lse includes it and it takes its share of
// the probability mass without adding a value. The modifier variants read it, once per tile.
__device__ __forceinline__ float sink_logit_log2(const AttentionFwdParams& p, int head) {
  return p.learnable_sink != nullptr ? p.learnable_sink[head] * float(M_LOG2E) : -INFINITY;
}

}  // namespace flashattn
