// Convolution autotuning on the CPU (compile()'s max_autotune modes, DESIGN §2.5).
//
// While an AutotuneScope (kernels/autotune_scope.h) is alive on a thread, a float32 3x3
// convolution (stride 1, no dilation, one group) times its direct plan against the Winograd
// F(4x4, 3x3) algorithms that can run it: oneDNN's Winograd plan (reorders to and from the
// tensors' layout included) and, for channels-last activations without bias, Kiln's own
// (winograd_nhwc.h: forward and backward-data). It does so the first time it meets that
// configuration, layout, direction (forward, backward-data, backward-weights) and thread count
// (timed with the threads it will run with); the fastest is cached for the process and used by
// every later call inside a scope at that thread count (an alternative must beat direct by 5%). Outside a scope convolutions always run the direct plan; KILN_CONV_AUTOTUNE
// steers them inside one (autotune_scope.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::cpu {

// direct and winograd are oneDNN's; winograd_nhwc is Kiln's own (winograd_nhwc.h).
enum class ConvAlgorithm { direct, winograd, winograd_nhwc };
enum class ConvDirection { forward, backward_data, backward_weights };

const char* name(ConvAlgorithm a);
const char* name(ConvDirection d);

// One timed choice.
struct ConvAutotuneDecision {
  std::string config;  // "float32 NHWC input 16x128x32x32, weight 32x128x3x3, stride 1x1, ..."
  std::array<int64_t, 4> input{};   // N, C, H, W
  std::array<int64_t, 4> weight{};  // O, C/groups, kH, kW
  bool channels_last = false;       // activations ran NHWC
  ConvDirection direction = ConvDirection::forward;
  int threads = 1;  // the OpenMP threads it was timed with (and holds for)
  // The fastest of the timed runs; negative for an algorithm that cannot run the configuration.
  double direct_ms = 0, winograd_ms = -1, winograd_nhwc_ms = -1;
  ConvAlgorithm chosen = ConvAlgorithm::direct;

  // "<config> backward_data, 2 threads: direct 2.84 ms, winograd 2.16 ms, winograd_nhwc 1.62 ms -> winograd_nhwc"
  std::string str() const;
};

// Whether oneDNN runs its Winograd convolution on this CPU: it implements it for AVX-512 only
// (ONEDNN_MAX_CPU_ISA can cap it further). Without it, the timed alternative on AVX2 machines is
// Kiln's own Winograd (winograd_nhwc: portable C++, vectorized by the compiler for the build's
// -march), and KILN_CONV_AUTOTUNE=winograd warns once and runs the timed choice.
bool onednn_winograd_available();

// Every timed decision of this process so far (configurations no Winograd can run are not timed
// and not listed), in no particular order.
std::vector<ConvAutotuneDecision> conv_autotune_decisions();

// Forgets every decision (tests): the next call in a scope times again.
void clear_conv_autotune_decisions();

}  // namespace kiln::cpu
