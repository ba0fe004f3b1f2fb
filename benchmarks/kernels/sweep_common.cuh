// Pieces shared by the torch-free kernel harnesses in benchmarks/kernels: the checked CUDA
// call, random-normal bf16 inputs, a wait that gives up on a hung kernel, and the median of
// CUDA-event timings. Header only; the harnesses' build lines are in their own headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#define CUDA_OK(call)                                                                             \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace bench {

// Normal values by Box-Muller on two uniforms hashed from (seed, index): drawn on the device,
// since a host generator took most of a sweep's time (100M values per benchmark problem).
__global__ void fill_random_normal_bf16(__nv_bfloat16* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B9u ^ uint32_t(i >> 32) * 0x85EBCA6Bu ^ seed;
    const auto mix = [](uint32_t x) {  // murmur3's finaliser
      x ^= x >> 16; x *= 0x85EBCA6Bu; x ^= x >> 13; x *= 0xC2B2AE35u; return x ^ (x >> 16);
    };
    const uint32_t a = mix(h), b = mix(h ^ 0x68E31DA4u);
    const float u1 = (float(a >> 8) + 1.f) * (1.f / 16777217.f), u2 = float(b >> 8) * (1.f / 16777216.f);
    out[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// n values drawn from N(0, 1), rounded to bf16, in a new device buffer (the seed from rng).
inline __nv_bfloat16* random_normal_bf16(size_t n, std::mt19937& rng) {
  __nv_bfloat16* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, n * sizeof(__nv_bfloat16)));
  fill_random_normal_bf16<<<1024, 256>>>(dev, n, uint32_t(rng()));
  CUDA_OK(cudaGetLastError());
  return dev;
}

// Waits for the legacy default stream, but exits (status 3, after saying what hung) when it
// has not finished within `seconds`: a kernel whose mbarrier wait never completes would
// otherwise hold the process until an outer timeout kills it without a word.
inline void synchronize_or_exit(const char* what, double seconds = 60.0) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(0);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "CUDA error after %s: %s\n", what, cudaGetErrorString(e));
      std::exit(1);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) {
      std::printf("HANG: %s did not finish within %.0f s\n", what, seconds);
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Median of `reps` CUDA-event timings (ms) of launch() on the default stream, after `warmup`
// untimed runs.
template <typename Launch>
float median_ms(const Launch& launch, int warmup, int reps, const char* what) {
  for (int i = 0; i < warmup; ++i) launch();
  synchronize_or_exit(what);
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CUDA_OK(cudaEventRecord(start));
    launch();
    CUDA_OK(cudaEventRecord(stop));
    synchronize_or_exit(what);
    float t;
    CUDA_OK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// FLOP of the forward at the benchmark convention (4·b·h·N²·d, halved when causal); the
// backward counts 2.5 times as much.
inline double forward_flops(int batch, int nheads, int seqlen, int head_dim, bool causal) {
  return 4.0 * batch * nheads * double(seqlen) * seqlen * head_dim / (causal ? 2 : 1);
}

}  // namespace bench
