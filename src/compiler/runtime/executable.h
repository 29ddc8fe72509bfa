// What the kiln backend builds from a scheduled graph, and how it runs (DESIGN §2.5): the loop
// program, its generated kernels (a shared object of C++ kernels, NVRTC-built CUDA kernels), the
// static memory plan of reduce_overhead, and the executor that walks the program's steps,
// running generated kernels and dispatching the other nodes.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "compiler/codegen/cuda/cuda_codegen.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/lower/memory_plan.h"
#include "compiler/runtime/cuda_launch.h"
#include "compiler/runtime/kernel_cache.h"
#include "compiler/runtime/packed_gemm.h"
#include "kiln/compiler.h"

namespace kiln::compiler::runtime {

// A generated C++ kernel: buffers, run-time scalars (as double and int64), size arguments.
using KernelFn = void (*)(void* const*, const double*, const int64_t*, const int64_t*);

// A generated kernel on a CUDA device: how it launches (its NVRTC-compiled function, work items;
// runtime/cuda_launch.h) and how to fill its parameter block (cuda_codegen.h).
struct CudaKernel : GeneratedKernel {
  std::vector<int> scalars;  // Graph::scalars indices, in slot order
  std::vector<int64_t> size_args;  // a dynamic graph's kernel: its size arguments (Params::z)
  size_t buffers = 0;
};

// reduce_overhead's arena: one block per compiled graph, allocated at the first call, and a tensor
// per planned value over it. Each of those tensors has a Storage of its own (not owning memory):
// the dispatcher treats tensors of one Storage as overlapping and would copy through a temporary
// on every out= call. A call takes the arena with `busy`; a concurrent call of the same graph
// finds it taken and allocates as the default mode does.
struct Arena {
  std::atomic<bool> busy{false};
  std::shared_ptr<kiln::detail::Storage> memory;
  std::vector<Tensor> tensors;  // per graph value; undefined where not planned
};

// The program's steps as the executor reads them: every step's value lists in one pool of ints,
// and the recorded layouts its views and fresh buffers need in one pool of numbers, so that a call
// walks three contiguous arrays instead of each step's and value's own vectors (a dynamic graph
// keeps one program per size; cycling through many sizes, those stay cold in cache).
struct FlatStep {
  lower::Step::Kind kind = lower::Step::Kind::node;
  int kernel = -1;
  int node = -1;
  // Ranges in Executable::step_ints: a node step's input values [inputs, bindings), then bindings
  // [bindings, allocate), allocate [allocate, write_into), write_into pairs [write_into, release)
  // and release [release, end).
  uint32_t inputs = 0, bindings = 0, allocate = 0, write_into = 0, release = 0, end = 0;
  // In step_numbers from `buffers`: each allocated value's rank, dtype, device type and index,
  // sizes and strides, in allocate order.
  uint32_t buffers = 0;
  const int64_t* size_args = nullptr;  // a kernel step: its kernel's size arguments
  // A view node without scalar slots: its input and output values, the output's dtype, and in
  // step_numbers (at `layout`) the input's sizes and strides then the output's; -1 otherwise.
  int view_in = -1, view_out = -1;
  DType view_dtype = DType::float32;
  uint32_t layout = 0;
  uint8_t in_rank = 0, out_rank = 0;
  int64_t offset_delta = 0;  // output storage offset minus the input's
};

struct Executable {
  lower::Program program;
  std::vector<FlatStep> steps;        // flatten_steps(): per program step
  std::vector<int> step_ints;
  std::vector<int64_t> step_numbers;  // fresh buffers' and views' layouts
  std::shared_ptr<SharedObject> library;
  std::vector<KernelFn> kernels;  // per Program kernel (null for CUDA kernels)
  std::vector<CudaKernel> cuda_kernels;  // per Program kernel (function null for CPU kernels)
  // Per node step: which attrs are scalar slots.
  std::vector<std::vector<std::pair<int, int>>> slots;  // per graph node: (attr, scalar index)
  // Per graph node: a linear layer's GEMM run with its weight packed once (packed_gemm.h), else null.
  std::vector<std::shared_ptr<PackedGemm>> packed_gemms;
  bool writes_inputs = false;     // the graph writes a graph input's memory (note_graph_input_writes)
  lower::MemoryPlan plan;         // reduce_overhead; empty otherwise
  std::unique_ptr<Arena> arena;   // set when the plan is not empty
  bool autotune = false;          // max_autotune: library calls and generated CUDA kernels' launch
                                  // shapes are timed (autotune_scope.h, cuda_launch.h)
};

// Builds ex.steps, step_ints and step_numbers from ex.program and ex.slots.
void flatten_steps(Executable& ex);

// Runs the program's steps on `args` (the graph's inputs and run-time scalars) and returns the
// graph's outputs: generated kernels run (CPU) or launch (CUDA, on the device's current stream),
// the other nodes go through the dispatcher (into reduce_overhead's arena where planned).
std::vector<Tensor> run(const Executable& ex, const Arguments& args);

// Fills ex.cuda_kernels from the program's CUDA kernels and their sources, compiling them with
// NVRTC (cached on disk) now, so that a call, or a CUDA graph capture, only launches. NVRTC spends
// most of a lone kernel's time parsing the headers, so kernels compile in batches, one NVRTC
// program per batch of up to 32 kernels of one device, the batches side by side; identical
// sources compile once. Also sizes ex.kernels (the C++ kernels, filled by the caller).
void prepare_cuda_kernels(Executable& ex, const std::vector<codegen::CudaKernelSource>& sources);

}  // namespace kiln::compiler::runtime
