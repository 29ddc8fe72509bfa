#include "kernels/autotune_scope.h"

#include <cstdlib>
#include <string_view>

#include "core/progress.h"

namespace kiln::kernels {
namespace {

thread_local int t_depth = 0;
thread_local AutotuneScope* t_scope = nullptr;
thread_local ConvAutotuneMode t_conv_mode = ConvAutotuneMode::off;

ConvAutotuneMode conv_mode_from_environment() {
  const char* v = std::getenv("KILN_CONV_AUTOTUNE");  // read per scope, so that tests can flip it
  if (v == nullptr) return ConvAutotuneMode::timed;
  const std::string_view s(v);
  if (s == "0") return ConvAutotuneMode::off;
  if (s == "winograd") return ConvAutotuneMode::force_winograd;
  if (s == "winograd_nhwc") return ConvAutotuneMode::force_winograd_nhwc;
  return ConvAutotuneMode::timed;
}

}  // namespace

AutotuneScope::AutotuneScope() : outer_conv_mode_(t_conv_mode), outer_scope_(t_scope) {
  ++t_depth;
  t_conv_mode = conv_mode_from_environment();
  t_scope = this;
}

AutotuneScope::~AutotuneScope() {
  --t_depth;
  t_conv_mode = outer_conv_mode_;
  t_scope = outer_scope_;
}

void note_autotuned() {
  AutotuneScope* scope = t_scope;
  if (!scope) return;
  // Not the thread's current task: it starts deep inside a graph run and ends with the scope.
  if (!scope->progress_)
    scope->progress_ = std::make_unique<kiln::detail::Progress>("autotuning (max_autotune)", "configurations timed",
                                                                /*make_current=*/false);
  scope->progress_->advance();
}

bool autotune_active() { return t_depth > 0; }

ConvAutotuneMode conv_autotune_mode() { return t_conv_mode; }

bool convolutions_autotuned() { return t_conv_mode != ConvAutotuneMode::off; }

}  // namespace kiln::kernels
