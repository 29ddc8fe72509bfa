// The CUDA runtime as the rest of Kiln uses it: error checks that throw kiln errors, a device
// guard, the per-thread current stream, and cached device properties.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kiln/cuda.h"
#include "kiln/error.h"

namespace kiln::cuda::detail {

// Throws DeviceError "[kiln::<what>] CUDA error: <cudaGetErrorString>" (an out-of-memory error
// says so and suggests what to do).
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what);
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) [[unlikely]] throw_cuda_error(err, what);
}
// Checks the last launch of a kernel.
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

// Throws DeviceError unless Kiln has CUDA and `index` names a visible device.
void check_device(int index, const char* what);
// -1 → the current device; otherwise `index`, checked.
int resolve_device(int index, const char* what);

// Sets the current device for this scope (no-op when it already is).
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The calling thread's current stream on `device` (the legacy default stream unless a
// StreamGuard is active).
cudaStream_t current_stream(int device);
void set_current_stream(int device, cudaStream_t stream);
// Whether `device`'s current stream is recording a CUDA graph (what runs now is replayed later:
// values computed on the host from tensors, or cached from their current values, go stale).
bool capturing(int device);

const cudaDeviceProp& properties(int device);

}  // namespace kiln::cuda::detail
