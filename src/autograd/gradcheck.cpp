// Finite-difference checks of analytical gradients (torch.autograd.gradcheck / gradgradcheck).
#include <cmath>
#include <sstream>

#include "autograd/node.h"
#include "kiln/ops.h"

namespace kiln::autograd {

namespace {

// Element k (row-major) of t, by strides.
double* element(const Tensor& t, int64_t k) {
  int64_t off = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    off += (k % t.size(d)) * t.stride(d);
    k /= t.size(d);
  }
  return t.data_ptr<double>() + off;
}

TensorList outputs_of(const Function& fn, const TensorList& inputs) {
  TensorList outs = fn(inputs);
  for (auto& o : outs)
    KILN_CHECK(!o.defined() || o.dtype() == kFloat64, DTypeError,
               "[kiln::gradcheck] outputs must be float64 for a meaningful check, got " +
                   std::string(dtype_name(o.dtype())) + ".");
  return outs;
}

}  // namespace

bool gradcheck(const Function& fn, const TensorList& inputs, double eps, double atol, double rtol,
               std::string* report) {
  std::vector<size_t> diff;  // inputs being checked
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    KILN_CHECK(inputs[i].dtype() == kFloat64 && inputs[i].is_cpu(), DTypeError,
               "[kiln::gradcheck] inputs that require grad must be float64 CPU tensors; input " +
                   std::to_string(i) + " is " + std::string(dtype_name(inputs[i].dtype())) + ".");
    diff.push_back(i);
  }
  KILN_CHECK(!diff.empty(), ValueError, "[kiln::gradcheck] no input requires grad; nothing to check.");

  TensorList outs;
  {
    EnableGradGuard g;
    outs = outputs_of(fn, inputs);
  }
  std::ostringstream msg;
  bool ok = true;
  for (size_t j = 0; j < outs.size(); ++j) {
    const Tensor& out = outs[j];
    if (!out.defined()) continue;
    int64_t m = out.numel();
    // Analytical Jacobian rows: d out[j][r] / d inputs.
    std::vector<TensorList> rows(m);
    if (out.requires_grad()) {
      TensorList req;
      for (size_t i : diff) req.push_back(inputs[i]);
      for (int64_t r = 0; r < m; ++r) {
        Tensor onehot = zeros(out.sizes(), kFloat64);
        onehot.view({-1}).select(0, r).fill_(1.0);
        rows[r] = grad({out}, req, {onehot}, /*retain_graph=*/true, /*create_graph=*/false, /*allow_unused=*/true);
      }
    }
    for (size_t di = 0; di < diff.size(); ++di) {
      const Tensor& in = inputs[diff[di]];
      for (int64_t k = 0; k < in.numel(); ++k) {
        double* p = element(in, k);
        double orig = *p;
        // Read the values before the next perturbation: outputs may be views of the inputs.
        std::vector<double> vp, vm;
        {
          NoGradGuard ng;
          *p = orig + eps;
          vp = outputs_of(fn, inputs)[j].to_vector<double>();
          *p = orig - eps;
          vm = outputs_of(fn, inputs)[j].to_vector<double>();
          *p = orig;
        }
        for (int64_t r = 0; r < m; ++r) {
          double numerical = (vp[r] - vm[r]) / (2 * eps);
          double analytical = 0;
          if (rows[r].size() > di && rows[r][di].defined())
            analytical = rows[r][di].to_vector<double>()[k];
          if (std::abs(analytical - numerical) > atol + rtol * std::abs(numerical) ||
              std::isnan(analytical) != std::isnan(numerical)) {
            if (ok) {
              msg << "Jacobian mismatch for output " << j << " with respect to input " << diff[di]
                  << ": element (output " << r << ", input " << k << ") numerical " << numerical
                  << " analytical " << analytical << "\n";
            }
            ok = false;
          }
        }
      }
    }
  }
  if (report) *report = msg.str();
  return ok;
}

bool gradgradcheck(const Function& fn, const TensorList& inputs, double eps, double atol, double rtol,
                   std::string* report) {
  TensorList probe;
  {
    EnableGradGuard g;
    probe = fn(inputs);
  }
  TensorList vs;
  for (auto& o : probe) vs.push_back(o.defined() ? randn(o.sizes(), kFloat64) : Tensor());
  Function first_order = [&](const TensorList& xs) {
    EnableGradGuard g;
    TensorList outs = fn(xs);
    TensorList req;
    for (auto& x : xs)
      if (x.defined() && x.requires_grad()) req.push_back(x);
    TensorList used_outs, used_vs;
    for (size_t i = 0; i < outs.size(); ++i)
      if (outs[i].defined() && outs[i].requires_grad()) {
        used_outs.push_back(outs[i]);
        used_vs.push_back(vs[i]);
      }
    if (used_outs.empty()) return TensorList{};
    TensorList gs = grad(used_outs, req, used_vs, true, /*create_graph=*/true, /*allow_unused=*/true);
    TensorList result;
    for (size_t i = 0; i < gs.size(); ++i) result.push_back(gs[i].defined() ? gs[i] : zeros_like(req[i]));
    return result;
  };
  return gradcheck(first_order, inputs, eps, atol, rtol, report);
}

}  // namespace kiln::autograd
