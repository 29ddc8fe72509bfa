// CPU kernel for nll_loss_backward.
//
// The gradient is read as (N, C, S) like the forward's input. Each sample's C x S block is zeroed
// and then gets one value per position, -weight[t] * g, at its target class t: O(N * C) for the
// dense zeroing (the gradient is dense) plus O(N * S) for the values, in parallel over samples
// (every block is written by one thread). Target values are checked first, outside any OpenMP
// region.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/loss_targets.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

template <class T>
void nll_loss_backward_typed(const Tensor& grad, const Tensor& target, const Tensor& weight, int64_t reduction,
                             int64_t ignore_index, double total_weight, Tensor& out) {
  using acc_t = opmath_t<T>;
  const int64_t n = out.dim() == 1 ? 1 : out.sizes()[0];
  const int64_t classes = out.dim() == 1 ? out.sizes()[0] : out.sizes()[1];
  const int64_t spatial = out.numel() / std::max<int64_t>(n * classes, 1);
  const int64_t* tp = target.numel() ? static_cast<const int64_t*>(target.impl().data()) : nullptr;
  const T* wp = weight.defined() ? static_cast<const T*>(weight.impl().data()) : nullptr;
  const T* gp = static_cast<const T*>(grad.impl().data());
  T* op = static_cast<T*>(out.impl().data());
  // The value per position for the reduced forms (mean divides by the total weight; 0/0 is NaN
  // where a target is not ignored, as in PyTorch).
  acc_t scalar = 0;
  if (reduction != 0) {
    double g = static_cast<double>(static_cast<acc_t>(gp[0]));
    scalar = static_cast<acc_t>(reduction == 1 ? g / total_weight : g);
  }
  const int64_t block = classes * spatial;
  parallel_for(n, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(block, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* o = op + i * block;
      std::memset(static_cast<void*>(o), 0, static_cast<size_t>(block) * sizeof(T));
      for (int64_t s = 0; s < spatial; ++s) {
        const int64_t p = i * spatial + s;
        const int64_t t = tp[p];
        if (t == ignore_index) continue;
        const acc_t w = wp ? static_cast<acc_t>(wp[t]) : acc_t(1);
        const acc_t g = reduction == 0 ? static_cast<acc_t>(gp[p]) : scalar;
        o[t * spatial + s] = static_cast<T>(-w * g);
      }
    }
  });
}

void nll_loss_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& result = outs[0];
  const DType dt = result.dtype();
  const Tensor grad = as_dtype(call.input(0), dt).contiguous();
  const Tensor target = call.input(1).contiguous();
  const Tensor weight = call.input(2).defined() ? as_dtype(call.input(2), dt).contiguous() : Tensor();
  const double total_weight = call.input(3).item<double>();
  const int64_t reduction = call.int_attr(1);
  const int64_t ignore_index = call.int_attr(2);
  const int64_t classes = result.dim() == 1 ? result.sizes()[0] : result.sizes()[1];
  const int64_t positions = target.numel();
  const int64_t* tp = positions ? static_cast<const int64_t*>(target.impl().data()) : nullptr;
  check_targets(tp, positions, classes, ignore_index, "nll_loss_backward");
  if (result.numel() == 0) return;
  Tensor out = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), dt, kCPU);
  KILN_DISPATCH_FLOATING(dt, "nll_loss_backward", [&] {
    nll_loss_backward_typed<scalar_t>(grad, target, weight, reduction, ignore_index, total_weight, out);
  });
  if (!out.same(result)) result.copy_(out);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("nll_loss_backward", DeviceType::cpu, nll_loss_backward_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
