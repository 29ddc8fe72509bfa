// Reverse-mode automatic differentiation.
//
// Ops record a graph node when grad mode is on and an input requires grad; `backward()` walks
// the graph from the outputs, calling each op's derivative (written in Kiln ops, so that a
// `create_graph` backward is itself differentiable and later capturable) and accumulating into
// the `.grad()` of leaf tensors. Semantics follow torch.autograd.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/tensor.h"

namespace kiln {

// ---- grad mode (per thread) ----
bool is_grad_enabled();
void set_grad_enabled(bool enabled);

// Disables gradient recording in its scope (torch.no_grad()).
class NoGradGuard {
 public:
  NoGradGuard() : prev_(is_grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Enables gradient recording in its scope (torch.enable_grad()).
class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(is_grad_enabled()) { set_grad_enabled(true); }
  ~EnableGradGuard() { set_grad_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

// Inference mode: no recording and no saved-tensor bookkeeping (torch.inference_mode()).
// In Kiln it is a no-grad scope that is also visible through is_inference_mode_enabled().
class InferenceMode {
 public:
  explicit InferenceMode(bool enabled = true);
  ~InferenceMode();
  InferenceMode(const InferenceMode&) = delete;
  InferenceMode& operator=(const InferenceMode&) = delete;

 private:
  bool prev_grad_, prev_inference_;
};
bool is_inference_mode_enabled();

namespace autograd {

struct Node;

// Computes the gradients of `tensors` with respect to the graph leaves and accumulates them into
// the leaves' .grad(). grad_tensors: one per tensor (may be omitted for one-element tensors).
// retain_graph defaults to create_graph; without it saved values are freed after the pass.
void backward(const TensorList& tensors, const TensorList& grad_tensors = {},
              std::optional<bool> retain_graph = std::nullopt, bool create_graph = false);

// Returns d(outputs)/d(inputs) without touching .grad(). allow_unused: an input the outputs do
// not depend on yields an undefined tensor instead of an error.
TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs = {},
                std::optional<bool> retain_graph = std::nullopt, bool create_graph = false,
                bool allow_unused = false);

// Anomaly mode: after every backward node, check its results for NaN and throw an Error naming
// the forward op whose derivative produced it.
void set_detect_anomaly(bool enabled);
bool is_anomaly_enabled();
class DetectAnomalyGuard {
 public:
  DetectAnomalyGuard() : prev_(is_anomaly_enabled()) { set_detect_anomaly(true); }
  ~DetectAnomalyGuard() { set_detect_anomaly(prev_); }

 private:
  bool prev_;
};

// A graph node as users see it: grad_fn of a non-leaf tensor.
std::string node_name(const Node& node);  // "MulBackward0"

using Function = std::function<TensorList(const TensorList&)>;

// Checks the analytical gradients of fn at `inputs` (float64 tensors; those with requires_grad
// are checked) against central finite differences, like torch.autograd.gradcheck. Returns true
// when every entry of every Jacobian matches within atol + rtol * |numerical|; otherwise false
// and `report` (if given) says which input, output and element differ.
bool gradcheck(const Function& fn, const TensorList& inputs, double eps = 1e-6, double atol = 1e-5,
               double rtol = 1e-3, std::string* report = nullptr);
// Second-order check: gradcheck of the function inputs -> grad(fn(inputs), inputs, v) with
// random v, through a create_graph backward.
bool gradgradcheck(const Function& fn, const TensorList& inputs, double eps = 1e-6, double atol = 1e-5,
                   double rtol = 1e-3, std::string* report = nullptr);

}  // namespace autograd
}  // namespace kiln
