// compile()'s max_autotune modes as a per-thread switch (DESIGN §2.5).
//
// The kiln backend opens an AutotuneScope around each run of a graph compiled with max_autotune
// or max_autotune_no_cudagraphs. While one is alive on a thread, the kernels that have several
// ways to run time them the first time they meet a configuration and cache the fastest:
//   CPU convolutions    direct against Winograd (cpu/conv_autotune.h)
//   cuDNN convolutions  the heuristics' algorithms (cuda/conv_kernels.cpp)
//   cuBLASLt GEMMs      the heuristics' algorithms (cuda/gemm_kernels.cpp)
// (generated CUDA kernels' launch shapes are timed too: the backend passes its mode to
// compiler/runtime/cuda_launch.h directly). Outside a scope every kernel runs its default plan.
//
// KILN_CONV_AUTOTUNE, read when a scope opens, steers convolutions inside it: 0 leaves them on
// their default plan (to bisect a wrong result); "winograd" (or "winograd_nhwc") still times CPU
// convolutions but runs oneDNN's (or Kiln's) Winograd wherever it can, whatever won (to test its
// numerics).
#pragma once

#include <memory>

namespace kiln::detail {
class Progress;
}

namespace kiln::kernels {

enum class ConvAutotuneMode { off, timed, force_winograd, force_winograd_nhwc };

// Turns autotuning on for this thread while alive. Nestable; the innermost scope's
// KILN_CONV_AUTOTUNE applies.
class AutotuneScope {
 public:
  AutotuneScope();
  ~AutotuneScope();
  AutotuneScope(const AutotuneScope&) = delete;
  AutotuneScope& operator=(const AutotuneScope&) = delete;

 private:
  ConvAutotuneMode outer_conv_mode_;  // restored on exit
  AutotuneScope* outer_scope_;
  std::unique_ptr<kiln::detail::Progress> progress_;  // from the first configuration timed
  friend void note_autotuned();
};

// Whether an AutotuneScope is alive on this thread.
bool autotune_active();

// Counts one configuration timed (a convolution's or GEMM's algorithms, a generated kernel's launch
// shapes) into the innermost scope's progress line: autotuning that runs past 2 s shows on stderr
// (core/progress.h), "[kiln] autotuning (max_autotune): 17 configurations timed, 4.2 s".
void note_autotuned();

// What convolutions do on this thread: `off` outside a scope or under KILN_CONV_AUTOTUNE=0.
ConvAutotuneMode conv_autotune_mode();

// Whether convolutions time their candidates here (CPU and cuDNN): conv_autotune_mode() != off.
bool convolutions_autotuned();

}  // namespace kiln::kernels
