// Run-time compilation of CUDA C++ with NVRTC, loaded through the driver API.
//
// Eager CUDA kernels and the kernels the compiler generates are both CUDA C++ built here for the
// GPU in use (sm_<major><minor>), so the same functors (kiln/math/functors.h) compute eager CPU,
// eager CUDA and compiled results. Sources may include "kiln/half.h", "kiln/math/functors.h"
// and "kiln/math/philox.h" (embedded in the library at build time) and the standard headers
// those use; nothing else is on the include path. Compiled cubins are cached in memory per
// device and on disk (compiler/runtime/kernel_cache.h, kind "cuda", reached through core/layer_hooks.h), so a kernel is built once
// per machine, not once per process.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

namespace kiln::cuda::detail {

// An opaque CUfunction.
using JitFunction = void*;

// The function `name` of the module built from source() for `device`. `key` identifies the
// source (its text, or a shorter spec that determines it): source() runs only on a miss.
// Thread safe; a key compiles once while other callers wait. Throws CompileError with NVRTC's
// log and the source on failure.
JitFunction jit_function(int device, const std::string& key, const char* name,
                         const std::function<std::string()>& source);
// The functions `names` of one module (one NVRTC program: the headers are parsed once for all
// of them), in the order given. Otherwise as jit_function.
std::vector<JitFunction> jit_functions(int device, const std::string& key, const std::vector<std::string>& names,
                                       const std::function<std::string()>& source);

// Launches `f` on `stream` with one by-value parameter block: `args` points at each parameter.
void launch(JitFunction f, unsigned grid, unsigned block, unsigned shared_bytes, cudaStream_t stream,
            void** args);
// launch with a grid of grid_x * grid_y blocks.
void launch_grid(JitFunction f, unsigned grid_x, unsigned grid_y, unsigned block, unsigned shared_bytes,
                 cudaStream_t stream, void** args);
// Lets `f` use more than 48 KB of dynamic shared memory.
void set_max_dynamic_shared(JitFunction f, int bytes);

// NVRTC alone, no GPU needed: compiles `source` for sm_<arch> (e.g. 90) and returns the cubin.
// Throws CompileError with the log. Tests on machines without a GPU use it to check every eager
// kernel source.
std::string compile_cubin(const std::string& source, int arch, const std::string& label);

// Counters since process start: NVRTC compilations run, modules loaded.
struct JitStats {
  long compiles = 0, loads = 0;
};
JitStats jit_stats();

}  // namespace kiln::cuda::detail
