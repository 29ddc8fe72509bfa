// CPU kernel for nll_loss_forward.
//
// The input is read as (N, C, S) (S = product of the spatial dims), the target as (N, S). Target
// values are checked in a parallel pass that only records a flag; the IndexError is thrown after
// it, outside the OpenMP region. Sums are taken in double over fixed chunks of positions, so the
// result does not depend on the thread count.
#include <algorithm>
#include <atomic>

#include "kernels/kernel_args.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/loss_targets.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

constexpr int64_t kChunk = 4096;  // positions per partial sum

template <class T>
void nll_loss_typed(const Tensor& x, const Tensor& target, const Tensor& weight, int64_t reduction,
                    int64_t ignore_index, Tensor& out, Tensor& total_weight) {
  const int64_t n = x.dim() == 1 ? 1 : x.sizes()[0];
  const int64_t classes = x.dim() == 1 ? x.sizes()[0] : x.sizes()[1];
  const int64_t spatial = x.numel() / std::max<int64_t>(n * classes, 1);
  const int64_t positions = target.numel();
  const T* xp = static_cast<const T*>(x.impl().data());
  const int64_t* tp = positions ? static_cast<const int64_t*>(target.impl().data()) : nullptr;
  const T* wp = weight.defined() ? static_cast<const T*>(weight.impl().data()) : nullptr;

  check_targets(tp, positions, classes, ignore_index, "nll_loss");

  // -w[t] * x[i, t, s] and w[t] for position p = i * spatial + s; zero for ignored targets.
  auto term = [&](int64_t p, double& w) -> double {
    int64_t t = tp[p];
    if (t == ignore_index) {
      w = 0;
      return 0;
    }
    w = wp ? static_cast<double>(static_cast<opmath_t<T>>(wp[t])) : 1.0;
    int64_t i = p / spatial, s = p % spatial;
    return -w * static_cast<double>(static_cast<opmath_t<T>>(xp[(i * classes + t) * spatial + s]));
  };

  const int64_t chunks = (positions + kChunk - 1) / kChunk;
  std::vector<double> loss_parts(chunks, 0.0), weight_parts(chunks, 0.0);
  T* op = reduction == 0 ? static_cast<T*>(out.impl().data()) : nullptr;
  parallel_for(chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      double ls = 0, ws = 0;
      for (int64_t p = c * kChunk, end = std::min(positions, p + kChunk); p < end; ++p) {
        double w;
        double v = term(p, w);
        if (op) op[p] = static_cast<T>(v);
        ls += v;
        ws += w;
      }
      loss_parts[c] = ls;
      weight_parts[c] = ws;
    }
  });
  double loss_sum = 0, weight_sum = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    loss_sum += loss_parts[c];
    weight_sum += weight_parts[c];
  }
  *static_cast<T*>(total_weight.impl().data()) = static_cast<T>(weight_sum);
  if (reduction == 1) *static_cast<T*>(out.impl().data()) = static_cast<T>(loss_sum / weight_sum);  // 0/0: NaN
  if (reduction == 2) *static_cast<T*>(out.impl().data()) = static_cast<T>(loss_sum);
}

void nll_loss_kernel(const OpCall& call, std::span<Tensor> outs) {
  const kiln::detail::NllLossArgs args(call);
  const Tensor &x = args.x, &target = args.target, &weight = args.weight;
  const int64_t reduction = args.reduction, ignore_index = args.ignore_index;
  Tensor out = outs[0].is_contiguous() ? outs[0] : detail::make_empty(outs[0].sizes().vec(), outs[0].dtype(), kCPU);
  Tensor total = outs[1];
  KILN_DISPATCH_FLOATING(x.dtype(), "nll_loss", [&] {
    nll_loss_typed<scalar_t>(x, target, weight, reduction, ignore_index, out, total);
  });
  if (!out.same(outs[0])) outs[0].copy_(out);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("nll_loss_forward", DeviceType::cpu, nll_loss_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
