// Standalone check and timing of the Hopper backward main kernel (sm90/backward_kernel.cuh)
// against the sm_80 backward kernel and a naive fp32 reference, torch-free.
//
// Per case: random-normal q, k, v, dout (bf16; v, dout and dk in (batch, heads, seqlen, d)
// layout, the others (batch, seqlen, heads, d), so a stride mix-up shows), the library's
// forward for out and lse, then the full backward path (launch_attention_backward: zeroing,
// preprocess, main kernel, postprocess) twice on the same inputs, with the Hopper kernels
// allowed ("sm90") and not ("sm80"), every gradient and workspace NaN-poisoned first. Both are
// compared with reference kernels that recompute softmax, P, dP and dS in fp32 from the
// inputs alone (one thread per query row for dq, per key row for dk, dv).
// The bar: per gradient, sm90 max abs error <= 3 x the sm80 kernel's + half a bf16 ulp of
// the largest reference value (the rounding of the output alone), and no NaN; and the
// forward's lse, which both paths start from, within 1e-2 of the reference's.
// Then the timing at the benchmark convention (bf16, batch * seqlen = 16384,
// nheads = 2048 / d; TFLOP/s = 2.5 * 4 * b * h * N^2 * d / t, halved when causal; median of
// 10 CUDA-event timings after 3 warm-ups) of the whole backward, sm90 vs sm80.
// Exit status: 0 all passed, 1 a check failed or a CUDA error, 3 a kernel hung (60 s).
//
// Build (here, then run on the H200):
//   mkdir -p .devrun && nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc \
//     benchmarks/kernels/backward_sm90_check.cu -o .devrun/backward_sm90_check
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/backward_launch.cuh"
#include "cuda/forward_launch.cuh"
#include "sweep_common.cuh"

using namespace flashattn;
using bf16 = __nv_bfloat16;

namespace {

// Element strides of a (batch, seqlen, nheads, d) tensor stored with heads outside seqlen or inside.
TensorStrides strides_of(int seqlen, int nheads, int d, bool heads_outer) {
  if (heads_outer) return {int64_t(nheads) * seqlen * d, d, int64_t(seqlen) * d};
  return {int64_t(seqlen) * nheads * d, int64_t(nheads) * d, d};
}

__device__ __forceinline__ const bf16* row_of(const void* base, const TensorStrides& s, int b, int i, int h) {
  return static_cast<const bf16*>(base) + b * s.batch + i * s.row + h * s.head;
}

__device__ float dot_bf16(const bf16* a, const float* b, int n) {
  float acc = 0.f;
  for (int c = 0; c < n; ++c) acc = fmaf(__bfloat162float(a[c]), b[c], acc);
  return acc;
}

// One thread per (b, query head, query row): lse (natural), D = sum_j P dP, and dq (dense
// (b, i, h, d)), from q, k, v, dout with the library's mask definition.
__global__ void reference_query_rows(AttentionBwdParams p, float* lse, float* dsum, float* dq) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= int64_t(p.batch) * p.nheads_q * p.seqlen_q) return;
  const int i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.nheads_q;
  const int b = row / (int64_t(p.seqlen_q) * p.nheads_q);
  const int hk = h / (p.nheads_q / p.nheads_kv);
  const int d = p.head_dim;
  float q[256], g[256], acc[256];
  for (int c = 0; c < d; ++c) {
    q[c] = __bfloat162float(row_of(p.q, p.q_strides, b, i, h)[c]);
    g[c] = __bfloat162float(row_of(p.dout, p.dout_strides, b, i, h)[c]);
    acc[c] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j < p.seqlen_k; ++j) {
    if (!key_visible(i, j, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)) continue;
    const float s = p.softmax_scale * dot_bf16(row_of(p.k, p.k_strides, b, j, hk), q, d);
    const float m_new = fmaxf(m, s);
    l = l * expf(m - m_new) + expf(s - m_new);
    m = m_new;
  }
  const float row_lse = l > 0.f ? m + logf(l) : INFINITY;
  float D = 0.f;
  for (int pass = 0; pass < 2; ++pass) {
    for (int j = 0; j < p.seqlen_k && l > 0.f; ++j) {
      if (!key_visible(i, j, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)) continue;
      const bf16* kj = row_of(p.k, p.k_strides, b, j, hk);
      const float P = expf(p.softmax_scale * dot_bf16(kj, q, d) - row_lse);
      const float dP = dot_bf16(row_of(p.v, p.v_strides, b, j, hk), g, d);
      if (pass == 0) {
        D += P * dP;
      } else {
        const float dS = P * (dP - D);
        for (int c = 0; c < d; ++c) acc[c] = fmaf(dS, __bfloat162float(kj[c]), acc[c]);
      }
    }
  }
  lse[row] = row_lse;
  dsum[row] = D;
  float* out = dq + ((int64_t(b) * p.seqlen_q + i) * p.nheads_q + h) * d;
  for (int c = 0; c < d; ++c) out[c] = p.softmax_scale * acc[c];
}

// One thread per (b, kv head, key row): dk, dv (dense (b, j, hk, d)) summed over the query
// heads of the group, from the reference lse and D.
__global__ void reference_key_rows(AttentionBwdParams p, const float* lse, const float* dsum, float* dk,
                                   float* dv) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= int64_t(p.batch) * p.nheads_kv * p.seqlen_k) return;
  const int j = row % p.seqlen_k, hk = (row / p.seqlen_k) % p.nheads_kv;
  const int b = row / (int64_t(p.seqlen_k) * p.nheads_kv);
  const int group = p.nheads_q / p.nheads_kv, d = p.head_dim;
  float k[256], v[256], acc_k[256], acc_v[256];
  for (int c = 0; c < d; ++c) {
    k[c] = __bfloat162float(row_of(p.k, p.k_strides, b, j, hk)[c]);
    v[c] = __bfloat162float(row_of(p.v, p.v_strides, b, j, hk)[c]);
    acc_k[c] = acc_v[c] = 0.f;
  }
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    for (int i = 0; i < p.seqlen_q; ++i) {
      const int64_t r = (int64_t(b) * p.nheads_q + h) * p.seqlen_q + i;
      if (!key_visible(i, j, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right) || !isfinite(lse[r])) continue;
      const bf16* qi = row_of(p.q, p.q_strides, b, i, h);
      const bf16* gi = row_of(p.dout, p.dout_strides, b, i, h);
      const float P = expf(p.softmax_scale * dot_bf16(qi, k, d) - lse[r]);
      const float dS = P * (dot_bf16(gi, v, d) - dsum[r]);
      for (int c = 0; c < d; ++c) {
        acc_v[c] = fmaf(P, __bfloat162float(gi[c]), acc_v[c]);
        acc_k[c] = fmaf(dS, __bfloat162float(qi[c]), acc_k[c]);
      }
    }
  }
  const int64_t out = ((int64_t(b) * p.seqlen_k + j) * p.nheads_kv + hk) * d;
  for (int c = 0; c < d; ++c) {
    dk[out + c] = p.softmax_scale * acc_k[c];
    dv[out + c] = acc_v[c];
  }
}

// One attention problem with every buffer both backward paths need.
struct Problem {
  int batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, head_dim, tile;
  std::vector<void*> buffers;
  AttentionBwdParams p{};

  template <typename T>
  T* alloc(size_t n) {
    void* ptr = nullptr;
    CUDA_OK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
    buffers.push_back(ptr);
    return static_cast<T*>(ptr);
  }
  size_t q_elems() const { return size_t(batch) * seqlen_q * nheads_q * head_dim; }
  size_t kv_elems() const { return size_t(batch) * seqlen_k * nheads_kv * head_dim; }
  ~Problem() {
    for (void* b : buffers) cudaFree(b);
  }
};

// Inputs, forward (out, lse) and workspaces; mixed_layouts puts v, dout, dk heads-outer.
void make_problem(Problem& pr, int window_left, int window_right, bool mixed_layouts, std::mt19937& rng) {
  AttentionBwdParams& p = pr.p;
  const int d = pr.head_dim;
  p.batch = pr.batch;
  p.nheads_q = pr.nheads_q;
  p.nheads_kv = pr.nheads_kv;
  p.seqlen_q = pr.seqlen_q;
  p.seqlen_k = pr.seqlen_k;
  p.rows_q = pr.seqlen_q;
  p.rows_k = pr.seqlen_k;
  p.lse_strides = TensorStrides{int64_t{pr.nheads_q} * pr.seqlen_q, 1, pr.seqlen_q};
  p.head_dim = d;
  p.softmax_scale = 1.f / std::sqrt(float(d));
  p.softmax_scale_log2 = p.softmax_scale * float(M_LOG2E);
  p.window_left = window_left;
  p.window_right = window_right;
  p.is_bf16 = true;
  p.q = bench::random_normal_bf16(pr.q_elems(), rng);
  p.k = bench::random_normal_bf16(pr.kv_elems(), rng);
  p.v = bench::random_normal_bf16(pr.kv_elems(), rng);
  p.dout = bench::random_normal_bf16(pr.q_elems(), rng);
  for (const void* b : {p.q, p.k, p.v, p.dout}) pr.buffers.push_back(const_cast<void*>(b));
  p.out = pr.alloc<bf16>(pr.q_elems());
  p.dq = pr.alloc<bf16>(pr.q_elems());
  p.dk = pr.alloc<bf16>(pr.kv_elems());
  p.dv = pr.alloc<bf16>(pr.kv_elems());
  p.lse = pr.alloc<float>(size_t(pr.batch) * pr.nheads_q * pr.seqlen_q);
  p.q_strides = p.out_strides = p.dq_strides = strides_of(pr.seqlen_q, pr.nheads_q, d, false);
  p.dout_strides = strides_of(pr.seqlen_q, pr.nheads_q, d, mixed_layouts);
  p.k_strides = p.dv_strides = strides_of(pr.seqlen_k, pr.nheads_kv, d, false);
  p.v_strides = p.dk_strides = strides_of(pr.seqlen_k, pr.nheads_kv, d, mixed_layouts);

  const BackwardWorkspaceGeometry geo = backward_workspace_geometry(p, pr.tile);
  const size_t rows = geo.workspace_rows;
  p.seqlen_q_rounded = static_cast<int>(geo.seqlen_q_rounded);
  p.head_dim_rounded = static_cast<int>(geo.head_dim_rounded);
  p.workspace_batch_stride = geo.batch_stride;
  p.workspace_head_stride = geo.head_stride;
  p.workspace_rows = geo.workspace_rows;
  p.dq_accum = pr.alloc<float>(rows * geo.head_dim_rounded);
  p.softmax_d = pr.alloc<float>(rows);
  p.lse_log2 = pr.alloc<float>(rows);
  p.dq_semaphore = pr.alloc<int>(size_t(pr.batch) * pr.nheads_q * geo.semaphores_per_head);
  p.deterministic = false;
}

template <int W>
void run_forward(const Problem& pr, const DeviceLimits& limits) {
  CUDA_OK((launch_attention_forward<bf16, W, ScoreMod::kNone>(pr.p, limits, 0)));
  bench::synchronize_or_exit("forward");
}

// The whole backward path, with every output and workspace poisoned with NaN first.
template <int W>
void run_backward(const Problem& pr, const DeviceLimits& limits, const char* what) {
  const AttentionBwdParams& p = pr.p;
  const size_t rows = p.workspace_rows;
  CUDA_OK(cudaMemset(p.dq, 0xff, pr.q_elems() * sizeof(bf16)));
  CUDA_OK(cudaMemset(p.dk, 0xff, pr.kv_elems() * sizeof(bf16)));
  CUDA_OK(cudaMemset(p.dv, 0xff, pr.kv_elems() * sizeof(bf16)));
  CUDA_OK(cudaMemset(p.dq_accum, 0xff, rows * p.head_dim_rounded * sizeof(float)));
  CUDA_OK(cudaMemset(p.softmax_d, 0xff, rows * sizeof(float)));
  CUDA_OK(cudaMemset(p.lse_log2, 0xff, rows * sizeof(float)));
  CUDA_OK((launch_attention_backward<bf16, W, ScoreMod::kNone>(p, limits, 0)));
  bench::synchronize_or_exit(what);
}

std::vector<float> to_host_float(const bf16* dev, size_t n) {
  std::vector<bf16> h(n);
  CUDA_OK(cudaMemcpy(h.data(), dev, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

// Max abs difference of a strided (batch, seqlen, nheads, d) gradient from a dense one; NaN
// anywhere gives +inf.
float max_abs_error(const std::vector<float>& got, const TensorStrides& s, const std::vector<float>& want,
                    int batch, int seqlen, int nheads, int d) {
  float err = 0.f;
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < seqlen; ++i)
      for (int h = 0; h < nheads; ++h)
        for (int c = 0; c < d; ++c) {
          const float x = got[b * s.batch + i * s.row + h * s.head + c];
          const float y = want[((size_t(b) * seqlen + i) * nheads + h) * d + c];
          const float e = std::fabs(x - y);
          err = std::isnan(e) ? INFINITY : std::max(err, e);
        }
  return err;
}

float max_abs(const std::vector<float>& v) {
  float m = 0.f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

struct Gradients {
  std::vector<float> dq, dk, dv;
};

Gradients fetch(const Problem& pr) {
  // The strided buffers are exactly q_elems / kv_elems long in either layout.
  return {to_host_float(static_cast<const bf16*>(pr.p.dq), pr.q_elems()),
          to_host_float(static_cast<const bf16*>(pr.p.dk), pr.kv_elems()),
          to_host_float(static_cast<const bf16*>(pr.p.dv), pr.kv_elems())};
}

int g_cases = 0, g_failures = 0;

template <int W>
void check_case(int head_dim, int seqlen_q, int seqlen_k, int group, int window_left, int window_right,
                const char* mask_name, const DeviceLimits& hopper, const DeviceLimits& sm80, std::mt19937& rng) {
  Problem pr{2, 4, 4 / group, seqlen_q, seqlen_k, head_dim, W};
  make_problem(pr, window_left, window_right, /*mixed_layouts=*/true, rng);
  const AttentionBwdParams& p = pr.p;
  run_forward<W>(pr, hopper);

  const size_t q_rows = size_t(pr.batch) * pr.nheads_q * seqlen_q;
  const size_t k_rows = size_t(pr.batch) * pr.nheads_kv * seqlen_k;
  float* ref_lse = pr.alloc<float>(q_rows);
  float* ref_d = pr.alloc<float>(q_rows);
  float* ref_dq = pr.alloc<float>(pr.q_elems());
  float* ref_dk = pr.alloc<float>(pr.kv_elems());
  float* ref_dv = pr.alloc<float>(pr.kv_elems());
  reference_query_rows<<<(q_rows + 63) / 64, 64>>>(p, ref_lse, ref_d, ref_dq);
  CUDA_OK(cudaGetLastError());
  reference_key_rows<<<(k_rows + 63) / 64, 64>>>(p, ref_lse, ref_d, ref_dk, ref_dv);
  CUDA_OK(cudaGetLastError());
  bench::synchronize_or_exit("reference backward");
  Gradients want;
  for (auto [dst, src, n] : {std::tuple{&want.dq, ref_dq, pr.q_elems()}, std::tuple{&want.dk, ref_dk, pr.kv_elems()},
                             std::tuple{&want.dv, ref_dv, pr.kv_elems()}}) {
    dst->resize(n);
    CUDA_OK(cudaMemcpy(dst->data(), src, n * sizeof(float), cudaMemcpyDeviceToHost));
  }

  // Both backward paths start from the forward's lse, so a wrong one would hide behind the
  // relative bar: check it against the reference's (+inf where a row sees no key).
  std::vector<float> lse(q_rows), lse_want(q_rows);
  CUDA_OK(cudaMemcpy(lse.data(), p.lse, q_rows * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(lse_want.data(), ref_lse, q_rows * sizeof(float), cudaMemcpyDeviceToHost));
  float lse_err = 0.f;
  for (size_t r = 0; r < q_rows; ++r) {
    const bool same_inf = std::isinf(lse[r]) && lse[r] == lse_want[r];
    const float e = same_inf ? 0.f : std::fabs(lse[r] - lse_want[r]);
    lse_err = std::isnan(e) ? INFINITY : std::max(lse_err, e);
  }

  // The dispatch takes the Hopper kernel only where TMA can map every input; say so if not.
  using Shape = typename Sm90BackwardPlan<W, ScoreMod::kNone>::Shape;
  Sm90BackwardArgs args;
  const bool sm90_path = make_backward_sm90_args<bf16, Shape>(p, &args) && Shape::kSmemBytes <= hopper.max_smem_per_block;

  char what[160];
  std::snprintf(what, sizeof(what), "d=%d W=%d sq=%d sk=%d hq=%d hkv=%d mask=%s", head_dim, W, seqlen_q, seqlen_k,
                pr.nheads_q, pr.nheads_kv, mask_name);
  run_backward<W>(pr, hopper, what);
  const Gradients ours = fetch(pr);
  run_backward<W>(pr, sm80, what);
  const Gradients base = fetch(pr);

  const float err[2][3] = {
      {max_abs_error(ours.dq, p.dq_strides, want.dq, pr.batch, seqlen_q, pr.nheads_q, head_dim),
       max_abs_error(ours.dk, p.dk_strides, want.dk, pr.batch, seqlen_k, pr.nheads_kv, head_dim),
       max_abs_error(ours.dv, p.dv_strides, want.dv, pr.batch, seqlen_k, pr.nheads_kv, head_dim)},
      {max_abs_error(base.dq, p.dq_strides, want.dq, pr.batch, seqlen_q, pr.nheads_q, head_dim),
       max_abs_error(base.dk, p.dk_strides, want.dk, pr.batch, seqlen_k, pr.nheads_kv, head_dim),
       max_abs_error(base.dv, p.dv_strides, want.dv, pr.batch, seqlen_k, pr.nheads_kv, head_dim)}};
  const float ref_max[3] = {max_abs(want.dq), max_abs(want.dk), max_abs(want.dv)};
  bool pass = sm90_path && lse_err <= 1e-2f;
  for (int gi = 0; gi < 3; ++gi)
    pass = pass && std::isfinite(err[0][gi]) && err[0][gi] <= 3.f * err[1][gi] + ref_max[gi] / 512.f;
  ++g_cases;
  g_failures += !pass;
  std::printf("%-4s %-52s path=%s | dq %.2e (sm80 %.2e) | dk %.2e (sm80 %.2e) | dv %.2e (sm80 %.2e) | "
              "max|ref| %.2e %.2e %.2e | fwd lse err %.1e\n",
              pass ? "PASS" : "FAIL", what, sm90_path ? "sm90" : "NOT-SM90", err[0][0], err[1][0], err[0][1],
              err[1][1], err[0][2], err[1][2], ref_max[0], ref_max[1], ref_max[2], lse_err);
}

template <int W>
void check_width(const DeviceLimits& hopper, const DeviceLimits& sm80, std::mt19937& rng) {
  const int shapes[][2] = {{333, 333}, {239, 1}, {1, 239}, {113, 203}, {1024, 1024}};
  for (const auto& sh : shapes)
    for (int causal = 0; causal < 2; ++causal)
      for (int group : {1, 2})
        check_case<W>(W, sh[0], sh[1], group, -1, causal ? 0 : -1, causal ? "causal" : "none", hopper, sm80, rng);
  // Sliding window (both edges inside the sequence) and a head_dim short of the tile.
  for (int group : {1, 2}) {
    check_case<W>(W, 333, 333, group, 70, 9, "window(70,9)", hopper, sm80, rng);
    check_case<W>(W, 113, 203, group, 30, 40, "window(30,40)", hopper, sm80, rng);
    check_case<W>(W - 24, 333, 333, group, -1, 0, "causal", hopper, sm80, rng);
  }
}

template <int W>
void time_width(const DeviceLimits& hopper, const DeviceLimits& sm80, std::mt19937& rng) {
  for (int seqlen : {2048, 8192}) {
    for (int causal = 0; causal < 2; ++causal) {
      Problem pr{16384 / seqlen, 2048 / W, 2048 / W, seqlen, seqlen, W, W};
      make_problem(pr, -1, causal ? 0 : -1, /*mixed_layouts=*/false, rng);
      run_forward<W>(pr, hopper);
      run_backward<W>(pr, hopper, "sm90 backward (timing shape)");
      const Gradients ours = fetch(pr);
      run_backward<W>(pr, sm80, "sm80 backward (timing shape)");
      const Gradients base = fetch(pr);
      float diff = 0.f;
      for (auto [a, b] : {std::pair{&ours.dq, &base.dq}, std::pair{&ours.dk, &base.dk}, std::pair{&ours.dv, &base.dv}}) {
        float m = 0.f;
        for (size_t i = 0; i < a->size(); ++i) {
          const float e = std::fabs((*a)[i] - (*b)[i]);
          m = std::isnan(e) ? INFINITY : std::max(m, e);
        }
        diff = std::max(diff, m / std::max(max_abs(*b), 1e-30f));
      }
      const auto timed = [&](const DeviceLimits& limits, const char* what) {
        return bench::median_ms([&] { CUDA_OK((launch_attention_backward<bf16, W, ScoreMod::kNone>(pr.p, limits, 0))); }, 3, 10, what);
      };
      const float t90 = timed(hopper, "sm90 backward timing"), t80 = timed(sm80, "sm80 backward timing");
      const double flops = 2.5 * bench::forward_flops(pr.batch, pr.nheads_q, seqlen, W, causal);
      std::printf("time d=%3d seqlen=%5d batch=%2d heads=%2d causal=%d | sm90 %8.3f ms %6.1f TFLOP/s | "
                  "sm80 %8.3f ms %6.1f TFLOP/s | speedup %.2fx | max|sm90-sm80|/max|sm80| %.2e\n",
                  W, seqlen, pr.batch, pr.nheads_q, causal, t90, flops / (t90 * 1e-3) * 1e-12, t80,
                  flops / (t80 * 1e-3) * 1e-12, t80 / t90, diff);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const bool check_only = argc > 1 && std::string(argv[1]) == "--check-only";
  int device = 0, major = 0, smem = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_OK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (major != 9) {
    std::printf("FAIL: needs an sm_90 device (got compute capability %d.x)\n", major);
    return 1;
  }
  const DeviceLimits hopper{smem, sms, true}, sm80{smem, sms, false};
  std::printf(
      "Hopper backward check. Lines: PASS/FAIL, case (head_dim, tile W, seqlen_q/k, query/kv heads, mask),\n"
      "path=sm90 when the dispatch takes the Hopper kernel, then per gradient the max abs error vs the fp32\n"
      "reference of the sm90 path and, in parentheses, of the sm80 kernel on the same inputs; PASS needs\n"
      "sm90 <= 3 x sm80 + max|ref|/512 for dq, dk and dv, and the forward's lse within 1e-2 of the reference's\n"
      "(both backward paths start from it). 'time' lines: whole backward (zeroing, preprocess, main,\n"
      "postprocess), median of 10, and the largest sm90 - sm80 gradient difference relative to max|sm80|.\n");
  std::mt19937 rng(1234);
  check_width<64>(hopper, sm80, rng);
  check_width<128>(hopper, sm80, rng);
  check_width<256>(hopper, sm80, rng);
  std::printf("SUMMARY: %d cases, %d failed\n", g_cases, g_failures);
  if (!check_only) {
    time_width<64>(hopper, sm80, rng);
    time_width<128>(hopper, sm80, rng);
    time_width<256>(hopper, sm80, rng);
  }
  return g_failures == 0 ? 0 : 1;
}
