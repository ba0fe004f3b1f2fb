#include "cuda/cuda_backend.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace flashattn {
namespace {
bool cuda_dtype_supported(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
}  // namespace

const BackendFeatures& cuda_features() {
  static const BackendFeatures features{"CUDA", /*softcap=*/true, /*alibi=*/true,
                                        /*dropout=*/true, /*learnable_sink=*/true,
                                        &cuda_dtype_supported};
  return features;
}

const BackendFeatures& cuda_kvcache_features() {
  static const BackendFeatures features{"CUDA", /*softcap=*/true, /*alibi=*/true,
                                        /*dropout=*/false, /*learnable_sink=*/true,
                                        &cuda_dtype_supported};
  return features;
}

void check_cuda_device(const at::Tensor& q) {
  // Read through the runtime rather than ATen/cuda/CUDAContext.h, whose headers
  // need the cuBLAS/cuSPARSE development files that a minimal toolkit lacks.
  int major = 0, minor = 0;
  const int device = q.device().index();
  check_cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                    "reading the compute capability");
  check_cuda_status(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                    "reading the compute capability");
  TORCH_CHECK(major >= 8, "flashattn_ext: the CUDA kernels need compute capability 8.0 or newer, "
              "got ", major, ".", minor, " for q on ", q.device());
}

namespace {

void read_forward_scheduler(DeviceLimits* limits) {
  limits->forward_scheduler = ForwardScheduler::kAuto;
  limits->persistent_grid_cap = 0;
  const char* value = std::getenv("FLASHATTN_FORWARD_SCHEDULER");
  if (value == nullptr || *value == '\0') return;
  const std::string setting(value);
  if (setting == "static") {
    limits->forward_scheduler = ForwardScheduler::kStatic;
    return;
  }
  limits->forward_scheduler = ForwardScheduler::kPersistent;
  const std::string persistent = "persistent";
  bool valid = setting == persistent;
  if (!valid && setting.rfind(persistent + ":", 0) == 0) {
    const std::string cap = setting.substr(persistent.size() + 1);
    valid = !cap.empty() && cap.size() <= 9 && cap.find_first_not_of("0123456789") == std::string::npos &&
            std::stoi(cap) > 0;
    if (valid) limits->persistent_grid_cap = std::stoi(cap);
  }
  TORCH_CHECK(valid, "flashattn_ext: FLASHATTN_FORWARD_SCHEDULER must be unset, static, persistent or "
              "persistent:N (N > 0 blocks), got '", setting, "'");
}

}  // namespace

DeviceLimits device_limits(const at::Tensor& q) {
  static std::mutex mutex;
  static std::vector<DeviceLimits> cache;
  const int device = q.device().index();
  DeviceLimits limits{};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (device >= static_cast<int>(cache.size())) cache.resize(device + 1, DeviceLimits{});
    if (cache[device].num_sms == 0) {
      DeviceLimits read{};
      check_cuda_status(cudaDeviceGetAttribute(&read.max_smem_per_block,
                                               cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                        "reading the shared-memory limit");
      check_cuda_status(cudaDeviceGetAttribute(&read.num_sms, cudaDevAttrMultiProcessorCount, device),
                        "reading the multiprocessor count");
      int major = 0, minor = 0;
      check_cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                        "reading the compute capability");
      check_cuda_status(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                        "reading the compute capability");
      int memory_khz = 0, bus_bits = 0;
      if (cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
          cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess)
        read.dram_bytes_per_s = 2.0 * memory_khz * 1e3 * bus_bits / 8;
      else
        (void)cudaGetLastError();  // a device that does not say leaves only the split model's estimate unset
#ifdef FLASHATTN_BUILD_SM90A
      read.hopper_kernels = major == 9 && minor == 0;  // sm_90a code runs on 9.0 only
#endif
      cache[device] = read;
    }
    limits = cache[device];
  }
  // Read per call, so that one process can time or test both kernel families.
  const char* disable = std::getenv("FLASHATTN_DISABLE_HOPPER_KERNELS");
  if (disable != nullptr && *disable != '\0' && std::string(disable) != "0") limits.hopper_kernels = false;
  read_forward_scheduler(&limits);
  return limits;
}

bool host_value_checks_enabled() {
  const char* skip = std::getenv("FLASHATTN_SKIP_VALUE_CHECKS");
  if (skip != nullptr && std::string(skip) == "1") return false;
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}

bool has_16_byte_rows(const at::Tensor& t) {
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    aligned = aligned && (t.size(d) <= 1 || (t.stride(d) * t.element_size()) % 16 == 0);
  return aligned;
}

at::Tensor with_16_byte_rows(const at::Tensor& t) {
  return has_16_byte_rows(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

void check_cuda_status(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "flashattn_ext: ", what, " failed: ", cudaGetErrorName(status),
              ": ", cudaGetErrorString(status));
}

void fail_head_dim_not_compiled(int64_t head_dim) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "flashattn_ext: head_dim ", head_dim, " needs a tile width "
                              "this build did not compile (compiled: " FLASHATTN_BUILD_HEAD_DIM_TILES
                              "); rebuild with FLASHATTN_HEAD_DIMS unset");
}

}  // namespace flashattn
