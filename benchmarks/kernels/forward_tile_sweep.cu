// Standalone sweep of forward tile shapes: builds the forward kernel for several
// (kBlockM, kBlockN, kWarps) at each head-dim width, checks each against a naive
// fp32 reference kernel, and times it at the benchmark convention (bf16,
// batch * seqlen = 16384, nheads = 2048 / d); the Hopper shapes on the static and on the
// persistent grid. Used to choose ForwardTilePlan and Sm90ForwardPlan; torch-free so it
// builds in seconds.
//
// Build (on the GPU machine, or here and carry the binary; -DFLASHATTN_SWEEP_SOFTCAP=30 times
// the softcap variant instead of plain scores):
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90,code=sm_90 -I csrc \
//        benchmarks/kernels/forward_tile_sweep.cu -o forward_tile_sweep
//   (the Hopper kernel: -gencode=arch=compute_90a,code=sm_90a -DFLASHATTN_SWEEP_SM90)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/forward_launch.cuh"
#include "cuda/sm90/forward_launch.cuh"
#include "sweep_common.cuh"

// The candidates, as a list of ForwardTileShape<W, kBlockM, kBlockN, kWarps>
// (mma.sync kernel) or, with -DFLASHATTN_SWEEP_SM90 (and an sm_90a build),
// Sm90ForwardShape<W, kBlockN, consumer warpgroups> (wgmma kernel); a header
// given with -include that defines FLASHATTN_SWEEP_SHAPES overrides both.
#if defined(FLASHATTN_SWEEP_SHAPES)
#elif defined(FLASHATTN_SWEEP_SM90)
// The shipped plan first (Sm90ForwardPlan), then what it was chosen against.
#define FLASHATTN_SWEEP_SHAPES                                                              \
  Sm90ForwardShape<64, 128, 1, 3>, Sm90ForwardShape<128, 128, 2, 3>,                        \
      Sm90ForwardShape<256, 80, 2, 2>, Sm90ForwardShape<64, 128, 2, 3>,                     \
      Sm90ForwardShape<64, 128, 1, 2>, Sm90ForwardShape<64, 128, 2, 2, false>,              \
      Sm90ForwardShape<64, 128, 2, 4>, Sm90ForwardShape<64, 64, 3, 4>,                      \
      Sm90ForwardShape<128, 128, 2, 2>, Sm90ForwardShape<128, 128, 2, 2, false>,            \
      Sm90ForwardShape<256, 64, 2, 2>, Sm90ForwardShape<256, 64, 2, 2, false>,              \
      Sm90ForwardShape<256, 32, 2, 3>
#else
#define FLASHATTN_SWEEP_SHAPES                                                          \
  ForwardTileShape<64, 128, 64, 4>, ForwardTileShape<64, 128, 128, 8>,                  \
      ForwardTileShape<64, 64, 128, 4>, ForwardTileShape<128, 128, 64, 4>,              \
      ForwardTileShape<128, 128, 32, 4>, ForwardTileShape<128, 64, 64, 4>,              \
      ForwardTileShape<128, 128, 64, 8>, ForwardTileShape<256, 128, 64, 8>,             \
      ForwardTileShape<256, 128, 32, 8>, ForwardTileShape<256, 64, 32, 4>
#endif

using namespace flashattn;
using bf16 = __nv_bfloat16;

// -DFLASHATTN_SWEEP_SOFTCAP=c: every shape with softcap c (the kSoftcap instantiation).
#if defined(FLASHATTN_SWEEP_SOFTCAP)
constexpr float kSoftcap = FLASHATTN_SWEEP_SOFTCAP;
constexpr ScoreMod kSweepMod = ScoreMod::kSoftcap;
#else
constexpr float kSoftcap = 0.f;
constexpr ScoreMod kSweepMod = ScoreMod::kNone;
#endif

template <typename Shape>
constexpr bool kIsSm90Shape = requires { Shape::kConsumerWarpgroups; };

// The device's limits for the Hopper launch layer, and the persistent grid's tile counter.
DeviceLimits g_limits{};
int* g_tile_counter = nullptr;

// grid_cap > 0: the Hopper kernel on a persistent grid of at most that many blocks (0: as many
// as the SMs hold), zeroing its tile counter first as the op does; < 0: the static grid.
template <typename Shape>
cudaError_t launch_shape(AttentionFwdParams p, int grid_cap = -1) {
  if constexpr (kIsSm90Shape<Shape>) {
    DeviceLimits limits = g_limits;
    limits.forward_scheduler = grid_cap < 0 ? ForwardScheduler::kStatic : ForwardScheduler::kPersistent;
    limits.persistent_grid_cap = grid_cap > 0 ? grid_cap : 0;
    if (grid_cap >= 0) {
      const cudaError_t e = cudaMemsetAsync(g_tile_counter, 0, sizeof(int));
      if (e != cudaSuccess) return e;
      p.tile_counter = g_tile_counter;
    }
    bool launched = false;
    const cudaError_t e = launch_forward_sm90<bf16, Shape, kSweepMod>(p, limits, 0, &launched);
    return e == cudaSuccess && !launched ? cudaErrorNotSupported : e;
  } else {
    return launch_forward_with_shape<bf16, Shape, kSweepMod>(p, g_limits, 0);
  }
}

template <typename Shape>
void describe(char* buf, size_t n) {
  if constexpr (kIsSm90Shape<Shape>)
    std::snprintf(buf, n, "sm90 M=%3d N=%3d consumer_wgs=%d stages=%d overlap=%d blocks/SM=%d", Shape::kBlockM,
                  Shape::kBlockN, Shape::kConsumerWarpgroups, Shape::kStages, int(Shape::kOverlap), Shape::kBlocksPerSM);
  else
    std::snprintf(buf, n, "sm80 M=%3d N=%3d warps=%d ks_unroll=%d", Shape::kBlockM, Shape::kBlockN,
                  Shape::kWarps, Shape::kScoreKUnroll);
}

// One thread per query row: the plain definition, with the library's mask.
__global__ void reference_forward(AttentionFwdParams p, float* out) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t rows = int64_t(p.batch) * p.nheads_q * p.seqlen_q;
  if (row >= rows) return;
  const int i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.nheads_q, b = row / (int64_t(p.seqlen_q) * p.nheads_q);
  const int hk = h / (p.nheads_q / p.nheads_kv);
  const bf16* q = static_cast<const bf16*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head + i * p.q_strides.row;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_strides.batch + hk * p.k_strides.head;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_strides.batch + hk * p.v_strides.head;
  float acc[256];
  for (int d = 0; d < p.head_dim; ++d) acc[d] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j < p.seqlen_k; ++j) {
    if (!key_visible(i, j, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)) continue;
    float s = 0.f;
    for (int d = 0; d < p.head_dim; ++d) s += __bfloat162float(q[d]) * __bfloat162float(k[j * p.k_strides.row + d]);
    s *= p.softmax_scale;
    if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap);
    const float m_new = fmaxf(m, s), c = expf(m - m_new), e = expf(s - m_new);
    l = l * c + e;
    for (int d = 0; d < p.head_dim; ++d) acc[d] = acc[d] * c + e * __bfloat162float(v[j * p.v_strides.row + d]);
    m = m_new;
  }
  float* o = out + ((int64_t(b) * p.seqlen_q + i) * p.nheads_q + h) * p.head_dim;  // (b, i, h, d), like the kernel
  for (int d = 0; d < p.head_dim; ++d) o[d] = l > 0 ? acc[d] / l : 0.f;
}

struct Problem {
  int batch, nheads, seqlen, head_dim;
  bool causal;
  bf16 *q, *k, *v, *out;
  float* lse;
  AttentionFwdParams params() const {
    AttentionFwdParams p{};
    p.q = q; p.k = k; p.v = v; p.out = out; p.lse = lse;
    const TensorStrides s{int64_t(seqlen) * nheads * head_dim, int64_t(nheads) * head_dim, head_dim};
    p.q_strides = p.k_strides = p.v_strides = p.out_strides = s;
    p.batch = batch; p.nheads_q = p.nheads_kv = nheads; p.seqlen_q = p.seqlen_k = seqlen;
    p.rows_q = p.rows_k = seqlen;
    p.lse_strides = TensorStrides{int64_t(nheads) * seqlen, 1, seqlen};
    p.head_dim = head_dim;
    p.softmax_scale = 1.f / std::sqrt(float(head_dim));
    p.softmax_scale_log2 = p.softmax_scale * float(M_LOG2E);
    p.window_left = -1;
    p.window_right = causal ? 0 : -1;
    p.softcap = kSoftcap;
    p.is_bf16 = true;
    return p;
  }
};

Problem make_problem(int batch, int nheads, int seqlen, int head_dim, bool causal, std::mt19937& rng) {
  Problem pr{batch, nheads, seqlen, head_dim, causal};
  const size_t n = size_t(batch) * seqlen * nheads * head_dim;
  pr.q = bench::random_normal_bf16(n, rng);
  pr.k = bench::random_normal_bf16(n, rng);
  pr.v = bench::random_normal_bf16(n, rng);
  CUDA_OK(cudaMalloc(&pr.out, n * sizeof(bf16)));
  CUDA_OK(cudaMalloc(&pr.lse, size_t(batch) * nheads * seqlen * sizeof(float)));
  return pr;
}

void free_problem(Problem& p) {
  cudaFree(p.q); cudaFree(p.k); cudaFree(p.v); cudaFree(p.out); cudaFree(p.lse);
}

template <typename Shape>
float max_error_vs_reference(std::mt19937& rng, bool causal, int grid_cap) {
  Problem pr = make_problem(2, 3, 333, Shape::kHeadDim - 8, causal, rng);
  const AttentionFwdParams p = pr.params();
  const size_t n = size_t(pr.batch) * pr.seqlen * pr.nheads * pr.head_dim;
  CUDA_OK(cudaMemset(pr.out, 0xff, n * sizeof(bf16)));  // NaN poison
  CUDA_OK(launch_shape<Shape>(p, grid_cap));
  float* ref;
  CUDA_OK(cudaMalloc(&ref, n * sizeof(float)));
  const int rows = pr.batch * pr.nheads * pr.seqlen;
  reference_forward<<<(rows + 127) / 128, 128>>>(p, ref);
  CUDA_OK(cudaGetLastError());
  std::vector<bf16> got(n);
  std::vector<float> want(n);
  CUDA_OK(cudaMemcpy(got.data(), pr.out, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(want.data(), ref, n * sizeof(float), cudaMemcpyDeviceToHost));
  float err = 0.f;
  for (size_t i = 0; i < n; ++i) {
    const float e = std::fabs(__bfloat162float(got[i]) - want[i]);
    err = std::isnan(e) ? INFINITY : std::max(err, e);
  }
  cudaFree(ref);
  free_problem(pr);
  return err;
}

// Each Hopper shape on both grids (the persistent one checked on 3 blocks, so that a block walks
// several tiles), the mma.sync shapes on the static grid.
template <typename Shape>
void sweep_shape(std::mt19937& rng) {
  for (const bool persistent : {false, true}) {
    if (persistent && !kIsSm90Shape<Shape>) continue;
    const int check_cap = persistent ? 3 : -1, timing_cap = persistent ? 0 : -1;
    const float err = std::max(max_error_vs_reference<Shape>(rng, false, check_cap),
                               max_error_vs_reference<Shape>(rng, true, check_cap));
    for (bool causal : {false, true}) {
      for (int seqlen : {1024, 2048, 8192}) {
        const int d = Shape::kHeadDim, nheads = 2048 / d, batch = 16384 / seqlen;
        Problem pr = make_problem(batch, nheads, seqlen, d, causal, rng);
        const AttentionFwdParams p = pr.params();
        const double t =
            bench::median_ms([&] { CUDA_OK(launch_shape<Shape>(p, timing_cap)); }, 3, 10, "forward") * 1e-3;
        const double flops = bench::forward_flops(batch, nheads, seqlen, d, causal);
        char what[96];
        describe<Shape>(what, sizeof(what));
        std::printf("fwd d=%3d softcap=%g %s grid=%-10s smem=%6d causal=%d seqlen=%5d  %7.1f TFLOP/s  max_err=%.3g\n",
                    d, kSoftcap, what, persistent ? "persistent" : "static", Shape::kSmemBytes, causal, seqlen,
                    flops / t * 1e-12, err);
        free_problem(pr);
      }
    }
  }
}

template <typename... Shapes>
void sweep(std::mt19937& rng) {
  (sweep_shape<Shapes>(rng), ...);
}

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out as it is timed, should a timeout end the run
  std::mt19937 rng(0);
  CUDA_OK(cudaDeviceGetAttribute(&g_limits.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  CUDA_OK(cudaDeviceGetAttribute(&g_limits.num_sms, cudaDevAttrMultiProcessorCount, 0));
  g_limits.hopper_kernels = true;
  CUDA_OK(cudaMalloc(&g_tile_counter, sizeof(int)));
  sweep<FLASHATTN_SWEEP_SHAPES>(rng);
  cudaFree(g_tile_counter);
  return 0;
}
