// Timing for max_autotune on a GPU: cuDNN convolution algorithms (conv_kernels.cpp), cuBLASLt
// GEMM algorithms (gemm_kernels.cpp) and the launch shapes of generated kernels (the kiln
// backend) are chosen by running each candidate and keeping the fastest.
//
// A candidate runs once untimed (first-use costs: module loads, lazy library setup), then a few
// times queued behind a spin kernel and timed together by CUDA events: a library call costs the
// host tens of microseconds, more than a small kernel runs, so runs timed one by one would measure
// the host's launching, not the GPU's work. The first candidate (the library's or Kiln's default)
// keeps its place unless another beats it by 3%, so that timing noise never trades a good choice
// for an equal one. Timing synchronizes: never call it while a CUDA graph records.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

namespace kiln::cuda::detail {

// Milliseconds per run of `run` on `stream` (as above), or -1 when a run returns false (the
// candidate is refused: not a choice). The spin kernel holds the GPU for `hold_cycles` SM clocks
// (2 million, about a millisecond: enough for a few legacy cuDNN calls to queue; a plain kernel
// launch needs far less).
float time_queued_runs(int device, cudaStream_t stream, const std::function<bool()>& run, int runs = 3,
                       long long hold_cycles = 2000000);

// The index of the fastest timed candidate (ms >= 0), where index 0 wins unless another is 3%
// faster; -1 when none was timed.
int fastest(const std::vector<float>& ms);

// KILN_CUDA_AUTOTUNE_LOG is set: each timed configuration prints one line to stderr.
bool autotune_log();
// Prints "[kiln.cuda autotune] <what>: <label>=<ms>ms ... -> <winner label>" (when autotune_log()).
void log_autotune(const std::string& what, const std::vector<std::string>& labels, const std::vector<float>& ms,
                  int winner);

}  // namespace kiln::cuda::detail
