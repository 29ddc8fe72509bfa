// reduce_overhead on a GPU: a compiled graph runs as one CUDA graph replay instead of one launch
// per kernel (DESIGN §2.5).
//
// The first call runs the graph normally (it compiles every kernel and plans every library call).
// The second records it into a CUDA graph on a private stream, with its intermediates in a private
// memory pool (caching_allocator.h) that keeps their addresses for the graph's lifetime, then
// replays it; later calls replay. Inputs whose memory was the same on the first two calls (module
// parameters, buffers) are read in place; the others are copied into static buffers first (and
// back after the replay when the graph writes them), so a caller's tensor is never written where
// eager would not write it.
//
// Outputs: the graph ends by copying each output into a buffer of its own memory, which the
// call returns (no allocation, no copy launched). A later replay writes that buffer again only
// once the caller has let go of every view of what it got from there; while the caller still
// holds it, the copy node is pointed at a new tensor instead (cudaGraphExecMemcpyNodeSetParams1D),
// so results of earlier calls always stay valid, as eager's do. The graph's memory (its
// intermediates, its outputs and these buffers) counts as reserved, not allocated, in
// kiln::cuda's statistics, as PyTorch counts its CUDA graph pools; what the caller gets in new
// tensors counts as allocated. An output with gaps or overlaps is copied out after the replay.
//
// A call whose run-time scalars or in-place inputs changed address is
// re-recorded; a graph that cannot be recorded (an op that reads back to the host, e.g. an index
// bound check) runs normally from then on, with a perf_hints log line saying why.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kiln/compiler/graph.h"

namespace kiln::compiler::runtime {

class CudaGraphRunner {
 public:
  using RunFn = std::function<std::vector<Tensor>(const Arguments&)>;
  // Whether CUDA graphs apply: Kiln has CUDA and the graph's inputs or outputs live on a GPU.
  static bool applies(const Graph& g);

  // `written_inputs[i]`: whether the graph writes input i's memory (an in-place op on it).
  CudaGraphRunner(RunFn run, std::vector<bool> written_inputs);
  ~CudaGraphRunner();
  CudaGraphRunner(const CudaGraphRunner&) = delete;
  CudaGraphRunner& operator=(const CudaGraphRunner&) = delete;

  std::vector<Tensor> operator()(const Arguments& args);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::compiler::runtime
