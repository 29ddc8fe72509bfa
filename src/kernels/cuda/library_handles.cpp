// Library handles, workspaces and precision settings (see library_handles.h).
#include "kernels/cuda/library_handles.h"

#ifdef KILN_WITH_CUDNN
#include <cudnn.h>
#endif

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cuda/cuda_runtime.h"
#include "core/tensor_factory.h"
#include "kiln/error.h"

namespace kiln::cuda::detail {

namespace {

constexpr int kMaxDevices = 64;  // as cuda_runtime.cpp

// Handles of one kind no thread holds, per device. Never destroyed: at process exit the driver
// may be gone before static destructors run, and destroying a handle then can crash.
template <class Handle>
struct HandlePool {
  std::mutex mutex;
  std::array<std::vector<Handle>, kMaxDevices> free;

  Handle take(int device, Handle (*create)()) {
    {
      std::lock_guard lock(mutex);
      if (!free[device].empty()) {
        Handle h = free[device].back();
        free[device].pop_back();
        return h;
      }
    }
    return create();  // the caller has made `device` current
  }
  void give(int device, Handle h) {
    std::lock_guard lock(mutex);
    free[device].push_back(h);
  }
};

// One thread's handles of one kind; they return to the pool when the thread exits.
template <class Handle>
class ThreadHandles {
 public:
  explicit ThreadHandles(HandlePool<Handle>* pool) : pool_(pool) {}
  ~ThreadHandles() {
    for (int d = 0; d < kMaxDevices; ++d)
      if (handles_[d] != nullptr) pool_->give(d, handles_[d]);
  }
  ThreadHandles(const ThreadHandles&) = delete;
  ThreadHandles& operator=(const ThreadHandles&) = delete;

  Handle get(int device, Handle (*create)()) {
    KILN_CHECK(device >= 0 && device < kMaxDevices, DeviceError,
               "[kiln::cuda] device index " + std::to_string(device) + " is out of range.");
    Handle& h = handles_[device];
    if (h == nullptr) h = pool_->take(device, create);
    return h;
  }

 private:
  HandlePool<Handle>* pool_;
  std::array<Handle, kMaxDevices> handles_{};
};

cublasLtHandle_t create_cublaslt() {
  cublasLtHandle_t h = nullptr;
  check_cublas(cublasLtCreate(&h), "cuda::cublaslt_handle");
  return h;
}

MatmulPrecision initial_matmul_precision() {
  const char* v = std::getenv("KILN_FLOAT32_MATMUL_PRECISION");
  if (v == nullptr) return MatmulPrecision::highest;
  std::string_view s(v);
  if (s == "high") return MatmulPrecision::high;
  if (s == "medium") return MatmulPrecision::medium;
  return MatmulPrecision::highest;
}

bool initial_cudnn_allow_tf32() {
  const char* v = std::getenv("KILN_CUDNN_ALLOW_TF32");
  return v == nullptr || std::string_view(v) != "0";
}

std::atomic<MatmulPrecision>& matmul_precision_setting() {
  static std::atomic<MatmulPrecision> setting{initial_matmul_precision()};
  return setting;
}

std::atomic<bool>& cudnn_tf32_setting() {
  static std::atomic<bool> setting{initial_cudnn_allow_tf32()};
  return setting;
}

}  // namespace

void check_cublas(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) [[likely]]
    return;
  std::string msg = std::string("[kiln::") + what +
                    "] cuBLASLt error: " + cublasLtGetStatusName(status) + " (" +
                    cublasLtGetStatusString(status) + ").";
  if (status == CUBLAS_STATUS_ALLOC_FAILED)
    msg +=
        " The GPU is out of memory: free tensors, call kiln::cuda::empty_cache(), or use smaller "
        "batches.";
  throw DeviceError(msg);
}

cublasLtHandle_t cublaslt_handle(int device) {
  static auto* pool = new HandlePool<cublasLtHandle_t>;
  thread_local ThreadHandles<cublasLtHandle_t> handles(pool);
  return handles.get(device, create_cublaslt);
}

#ifdef KILN_WITH_CUDNN
cudnnContext* cudnn_handle(int device) {
  static auto* pool = new HandlePool<cudnnHandle_t>;
  thread_local ThreadHandles<cudnnHandle_t> handles(pool);
  cudnnHandle_t h = handles.get(device, [] {
    cudnnHandle_t created = nullptr;
    cudnnStatus_t status = cudnnCreate(&created);
    if (status != CUDNN_STATUS_SUCCESS)
      throw DeviceError(
          std::string("[kiln::cuda::cudnn_handle] cuDNN error: ") + cudnnGetErrorString(status) +
          ". Check that cuDNN matches the CUDA driver and that the GPU has free memory.");
    return created;
  });
  cudnnStatus_t status = cudnnSetStream(h, current_stream(device));
  if (status != CUDNN_STATUS_SUCCESS)
    throw DeviceError(std::string("[kiln::cuda::cudnn_handle] cuDNN error: ") +
                      cudnnGetErrorString(status) + ".");
  return h;
}
#endif

Tensor workspace(int64_t bytes, Device device) {
  if (bytes <= 0) return Tensor();
  return kiln::detail::make_empty({bytes}, DType::uint8, device);
}

MatmulPrecision float32_matmul_precision() {
  return matmul_precision_setting().load(std::memory_order_relaxed);
}
void set_float32_matmul_precision(MatmulPrecision precision) {
  matmul_precision_setting().store(precision);
}

bool cudnn_allow_tf32() {
  return cudnn_tf32_setting().load(std::memory_order_relaxed);
}
void set_cudnn_allow_tf32(bool allow) {
  cudnn_tf32_setting().store(allow);
}

}  // namespace kiln::cuda::detail
