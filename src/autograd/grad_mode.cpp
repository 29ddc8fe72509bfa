#include "kiln/autograd.h"

namespace kiln {

namespace {
thread_local bool t_grad_enabled = true;
thread_local bool t_inference_mode = false;
}  // namespace

bool is_grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool enabled) { t_grad_enabled = enabled; }
bool is_inference_mode_enabled() { return t_inference_mode; }

InferenceMode::InferenceMode(bool enabled) : prev_grad_(t_grad_enabled), prev_inference_(t_inference_mode) {
  if (enabled) {
    t_grad_enabled = false;
    t_inference_mode = true;
  }
}
InferenceMode::~InferenceMode() {
  t_grad_enabled = prev_grad_;
  t_inference_mode = prev_inference_;
}

}  // namespace kiln
