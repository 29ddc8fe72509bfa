// What the library-backed CUDA kernels (gemm_kernels.cpp: cuBLASLt, conv_kernels.cpp: cuDNN)
// share: per-thread library handles, workspaces from the caching allocator, status checks, and
// the precision settings of float32 GEMMs and convolutions.
//
// Handles: one cuBLASLt and one cuDNN handle per (thread, device), created on first use. A
// thread's handles go back to a process-wide pool when it exits and the next new thread takes
// them, so short-lived threads neither leak handles nor pay for creating them. cudnn_handle()
// binds the handle to the calling thread's current stream of `device` on every call.
#pragma once

#include <cublasLt.h>

#include <cstdint>

#include "kiln/tensor.h"

struct cudnnContext;  // cudnn.h's handle type, so that this header needs no cuDNN headers

namespace kiln::cuda::detail {

// Throws DeviceError "[kiln::<what>] cuBLASLt error: <status name> (<description>). ..." unless
// `status` is CUBLAS_STATUS_SUCCESS.
void check_cublas(cublasStatus_t status, const char* what);

// The calling thread's cuBLASLt handle for `device` (the current device must be `device`).
cublasLtHandle_t cublaslt_handle(int device);
// The calling thread's cuDNN handle for `device`, bound to current_stream(device) (the current
// device must be `device`). Only in builds with cuDNN (KILN_WITH_CUDNN).
cudnnContext* cudnn_handle(int device);

// A uint8 device buffer of `bytes` from the caching allocator for a library's scratch space;
// undefined for 0 bytes. Keep the tensor alive until the library call is queued: the allocator
// reuses a freed block only for work queued after it on the same stream.
Tensor workspace(int64_t bytes, Device device);

// PyTorch's torch.backends.cuda.matmul precision for float32 GEMMs: "highest" (exact float32,
// the default), "high" or "medium" (TF32 tensor cores). The environment variable
// KILN_FLOAT32_MATMUL_PRECISION sets the initial value.
enum class MatmulPrecision { highest, high, medium };
MatmulPrecision float32_matmul_precision();
void set_float32_matmul_precision(MatmulPrecision precision);

// PyTorch's torch.backends.cudnn.allow_tf32: whether float32 convolutions may run on TF32 tensor
// cores. On by default, as in PyTorch; KILN_CUDNN_ALLOW_TF32=0 turns it off at start-up.
bool cudnn_allow_tf32();
void set_cudnn_allow_tf32(bool allow);

}  // namespace kiln::cuda::detail
