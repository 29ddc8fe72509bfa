// CUDA C++ for the CUDA kernels of a lowered Program (DESIGN §2.5, "codegen"), compiled at run
// time with NVRTC (kernels/cuda/jit.h).
//
// Each kernel becomes `extern "C" __global__ void kiln_fused(Params p)`: a grid-stride loop over
// its (coalesced) iteration space with every size and stride a literal (a dynamic graph's: the
// run-time arguments z[k], so that one source serves every size), and the scalar math of
// kiln/math/functors.h, the functors the eager kernels and the CPU code generator use. Params is
// one by-value struct of 8-byte slots:
//   void* b[buffers];   buffer pointers; a host buffer's slot holds its value's bits instead
//   double s[n];        the kernel's run-time scalars (those in `scalars`, in that order)
//   long long is[n];    the same scalars as int64
//   long long z[m];     a dynamic graph's sizes, strides and offsets (size_args; m >= 1)
// Pure string generation: needs no CUDA toolkit.
#pragma once

#include <string>
#include <vector>

#include "compiler/lower/loop_ir.h"

namespace kiln::compiler::codegen {

using lower::Kernel;

// Generated kernels are named "kiln_fused_" + the first fused ops ("kiln_fused_cat_sub_mul_relu"),
// so that profilers (ncu, bench/kernel_table.py) tell them apart.
inline constexpr const char* kCudaKernelName = "kiln_fused";
inline constexpr int kCudaBlock = 256;

struct CudaKernelSource {
  std::string source;
  std::string name;          // the kernel's entry point in `source`
  std::vector<int> scalars;  // Graph::scalars indices the kernel reads, in slot order
  int64_t numel = 0;         // work items (0: nothing to launch): elements of the iteration
                             // space, or a reduction's kept positions (per_block)
  bool per_block = false;    // a reduction: one block per work item
  // The parameter block's size in 8-byte slots: buffers + 2 * max(scalars, 1) + max(size_args, 1).
  size_t slots() const;
  size_t buffers = 0;
  std::vector<int64_t> size_args;  // a dynamic graph's kernel: the values of z[0], z[1], ...
};

// The source of one kernel on a CUDA device (pointwise, or a sum/max/min reduction with its
// prologue and epilogue). Throws CompileError for what it does not handle (cuda_codegen_supports).
// dynamic_sizes: print sizes, strides and offsets as run-time arguments (lower::Program::dynamic_sizes).
CudaKernelSource generate_cuda(const Kernel& k, bool dynamic_sizes = false);

// Several kernels in one translation unit, for one NVRTC program: the preamble and headers are
// parsed once (about 70 of a lone kernel's 90 ms of NVRTC). Each kernel's definitions live in a
// namespace of their own, and entry point i is renamed `<name>_<i>`.
struct CudaModuleSource {
  std::string source;
  std::vector<std::string> names;  // per kernel, in order: its entry point in `source`
};
CudaModuleSource batch_cuda(const std::vector<const CudaKernelSource*>& kernels);

// Whether generate_cuda handles kernel `k`.
bool cuda_codegen_supports(const Kernel& k);

}  // namespace kiln::compiler::codegen
