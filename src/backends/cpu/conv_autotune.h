// Convolution autotuning on the CPU (compile()'s max_autotune modes, DESIGN §2.5).
//
// While a ConvAutotuneScope is alive on a thread, a float32 convolution that oneDNN can also run
// with Winograd F(4,3) (3x3, stride 1, no dilation, one group) times its direct plan against the
// Winograd plan, reorders to and from the tensors' layout included, the first time it meets that
// configuration, layout and direction (forward, backward-data, backward-weights); the faster one
// is cached for the process and used by every later call inside a scope. Outside a scope
// convolutions always run the direct plan. KILN_CONV_AUTOTUNE (read when a scope is created): 0
// makes scopes inert, to bisect a wrong result; "winograd" still times and records decisions but
// runs Winograd wherever oneDNN has it, whatever won (to test Winograd's numerics).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::cpu {

enum class ConvAlgorithm { direct, winograd };
enum class ConvDirection { forward, backward_data, backward_weights };

const char* name(ConvAlgorithm a);
const char* name(ConvDirection d);

// Turns autotuning on for convolutions run by this thread while alive. Nestable.
class ConvAutotuneScope {
 public:
  ConvAutotuneScope();
  ~ConvAutotuneScope();
  ConvAutotuneScope(const ConvAutotuneScope&) = delete;
  ConvAutotuneScope& operator=(const ConvAutotuneScope&) = delete;

 private:
  bool active_;          // false when KILN_CONV_AUTOTUNE=0
  bool force_winograd_;  // KILN_CONV_AUTOTUNE=winograd
};

// Whether a (non-inert) ConvAutotuneScope is alive on this thread.
bool conv_autotune_active();

// One timed choice.
struct ConvAutotuneDecision {
  std::string config;  // "float32 NHWC input 16x128x32x32, weight 32x128x3x3, stride 1x1, ..."
  std::array<int64_t, 4> input{};   // N, C, H, W
  std::array<int64_t, 4> weight{};  // O, C/groups, kH, kW
  bool channels_last = false;       // activations ran NHWC
  ConvDirection direction = ConvDirection::forward;
  double direct_ms = 0, winograd_ms = 0;  // the fastest of the timed runs
  ConvAlgorithm chosen = ConvAlgorithm::direct;

  std::string str() const;  // "<config> backward_data: direct 2.84 ms, winograd 1.62 ms -> winograd"
};

// Every timed decision of this process so far (configurations Winograd can't run are not timed
// and not listed), in no particular order.
std::vector<ConvAutotuneDecision> conv_autotune_decisions();

// Forgets every decision (tests): the next call in a scope times again.
void clear_conv_autotune_decisions();

}  // namespace kiln::cpu
