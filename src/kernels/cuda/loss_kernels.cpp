// Eager CUDA kernels of nll_loss_forward and nll_loss_backward, with the CPU kernels'
// (src/kernels/cpu/loss_kernels.cpp, loss_backward_kernels.cpp) arithmetic: the input is read
// as (N, C, S) and the target as (N, S); terms and weights are taken in double from the opmath
// values, the gradient in opmath.
//
// Targets are checked first (a check kernel and a one-word read-back), so an out-of-range target
// throws IndexError with the CPU's message before anything is written. The forward sums in
// double in two fixed passes (per-block tree sums, then one thread adding the blocks in order):
// deterministic, but not the CPU's order, so reduced losses may differ from the CPU's in the
// last bits. The backward reads total_weight on the device (the CPU reads it on the host).
#include <algorithm>

#include <fmt/format.h>

#include "kernels/kernel_args.h"
#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/misc_kernels.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

using kiln::detail::make_empty;

constexpr int64_t kMaxPartials = 1024;

std::string nll_forward_source(DType t) {
  return misc_preamble() + fmt::format(R"(
typedef {t} scalar_t;
typedef kj::opmath<scalar_t> acc_t;
struct Params {{
  const scalar_t* x;
  const long long* target;
  const scalar_t* weight;
  scalar_t* out_none;
  double* partial;
  long long positions, classes, spatial, ignore;
}};
// Per block: the sums of -w[t] * x[i, t, s] and of w[t] over its positions (zero for ignored
// targets); with reduction none, also each position's loss.
extern "C" __global__ void __launch_bounds__({block}) kiln_nll_loss_partial(Params p) {{
  __shared__ double loss[{block}], weight[{block}];
  double ls = 0, ws = 0;
  for (long long q = blockIdx.x * (long long){block} + threadIdx.x; q < p.positions; q += (long long)gridDim.x * {block}) {{
    const long long t = p.target[q];
    double v = 0, w = 0;
    if (t != p.ignore) {{
      w = p.weight ? static_cast<double>(static_cast<acc_t>(p.weight[t])) : 1.0;
      const long long i = q / p.spatial, s = q - i * p.spatial;
      v = -w * static_cast<double>(static_cast<acc_t>(p.x[(i * p.classes + t) * p.spatial + s]));
    }}
    if (p.out_none) p.out_none[q] = static_cast<scalar_t>(v);
    ls += v;
    ws += w;
  }}
  loss[threadIdx.x] = ls;
  weight[threadIdx.x] = ws;
  __syncthreads();
  for (int stride = {block} / 2; stride > 0; stride >>= 1) {{
    if (threadIdx.x < stride) {{
      loss[threadIdx.x] += loss[threadIdx.x + stride];
      weight[threadIdx.x] += weight[threadIdx.x + stride];
    }}
    __syncthreads();
  }}
  if (threadIdx.x == 0) {{
    p.partial[2 * blockIdx.x] = loss[0];
    p.partial[2 * blockIdx.x + 1] = weight[0];
  }}
}}
struct FinalParams {{
  const double* partial;
  scalar_t* out;
  scalar_t* total_weight;
  long long blocks, reduction;
}};
// One thread: the block sums in order, then total_weight and the reduced loss (mean: 0/0 is NaN).
extern "C" __global__ void kiln_nll_loss_final(FinalParams p) {{
  double ls = 0, ws = 0;
  for (long long b = 0; b < p.blocks; ++b) {{
    ls += p.partial[2 * b];
    ws += p.partial[2 * b + 1];
  }}
  *p.total_weight = static_cast<scalar_t>(ws);
  if (p.reduction == 1) *p.out = static_cast<scalar_t>(ls / ws);
  if (p.reduction == 2) *p.out = static_cast<scalar_t>(ls);
}}
)",
                                                  fmt::arg("t", cuda_type(t)), fmt::arg("block", kMiscBlock));
}

std::string nll_backward_source(DType t, DType total_weight) {
  return misc_preamble() + fmt::format(R"(
typedef {t} scalar_t;
typedef {tw} tw_t;
typedef kj::opmath<scalar_t> acc_t;
struct Params {{
  const scalar_t* grad;
  const long long* target;
  const scalar_t* weight;
  const tw_t* total_weight;
  scalar_t* out;
  long long positions, classes, spatial, ignore, reduction;
}};
// out (zeroed) gets -w[t] * g at (i, t, s) for each position whose target t is not ignored.
extern "C" __global__ void __launch_bounds__({block}) kiln_nll_loss_backward(Params p) {{
  acc_t scalar = 0;
  if (p.reduction != 0) {{
    const double g = static_cast<double>(static_cast<acc_t>(p.grad[0]));
    const double tw = static_cast<double>(static_cast<kj::opmath<tw_t>>(*p.total_weight));
    scalar = static_cast<acc_t>(p.reduction == 1 ? g / tw : g);
  }}
  for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < p.positions; q += (long long)gridDim.x * blockDim.x) {{
    const long long t = p.target[q];
    if (t == p.ignore) continue;
    const acc_t w = p.weight ? static_cast<acc_t>(p.weight[t]) : acc_t(1);
    const acc_t g = p.reduction == 0 ? static_cast<acc_t>(p.grad[q]) : scalar;
    const long long i = q / p.spatial, s = q - i * p.spatial;
    p.out[(i * p.classes + t) * p.spatial + s] = static_cast<scalar_t>(-w * g);
  }}
}}
)",
                                                  fmt::arg("t", cuda_type(t)), fmt::arg("tw", cuda_type(total_weight)),
                                                  fmt::arg("block", kMiscBlock));
}

// Throws the CPU's IndexError for the first target outside [0, classes) that is not ignore_index.
void check_targets(const Tensor& target, int64_t classes, int64_t ignore_index, const std::string& op) {
  const int64_t bad = first_bad_index(target, 0, classes, &ignore_index, nullptr, op.c_str());
  if (bad < 0) return;
  const int64_t v = host_element(target, bad).item<int64_t>();
  throw IndexError("[kiln::" + op + "] Target " + std::to_string(v) + " is out of bounds (" + std::to_string(classes) +
                   " classes).");
}

void nll_loss_kernel(const OpCall& call, std::span<Tensor> outs) {
  const kiln::detail::NllLossArgs args(call);
  const Tensor &x = args.x, &target = args.target, &weight = args.weight;
  const int64_t reduction = args.reduction, ignore_index = args.ignore_index;
  const int64_t n = x.dim() == 1 ? 1 : x.sizes()[0];
  const int64_t classes = x.dim() == 1 ? x.sizes()[0] : x.sizes()[1];
  const int64_t spatial = x.numel() / std::max<int64_t>(n * classes, 1);
  const int64_t positions = target.numel();
  check_targets(target, classes, ignore_index, "nll_loss");

  Tensor& result = outs[0];
  Tensor out = result.is_contiguous() ? result : make_empty(result.sizes().vec(), result.dtype(), result.device());
  Tensor& total = outs[1];
  const DType t = x.dtype();
  const int device = x.device().index;
  const int64_t blocks = std::clamp<int64_t>((positions + kMiscBlock - 1) / kMiscBlock, 1, kMaxPartials);
  Tensor partial = make_empty({2 * blocks}, kFloat64, x.device());
  JitFunction partial_fn =
      jit_function(device, cuda_type(t), "kiln_nll_loss_partial", [&] { return nll_forward_source(t); });
  JitFunction final_fn = jit_function(device, cuda_type(t), "kiln_nll_loss_final", [&] { return nll_forward_source(t); });
  MiscParams p;
  p.add(x.impl().data());
  p.add(target.impl().data());
  p.add(weight.defined() ? weight.impl().data() : static_cast<void*>(nullptr));
  p.add(reduction == 0 ? out.impl().data() : static_cast<void*>(nullptr));
  p.add(partial.impl().data());
  p.add(positions);
  p.add(classes);
  p.add(std::max<int64_t>(spatial, 1));  // ignored targets only when classes or spatial is 0
  p.add(ignore_index);
  DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  {
    void* args[] = {p.data()};
    launch(partial_fn, static_cast<unsigned>(blocks), kMiscBlock, 0, stream, args);
    check_launch("nll_loss");
  }
  MiscParams f;
  f.add(static_cast<const void*>(partial.impl().data()));
  f.add(reduction == 0 ? static_cast<void*>(nullptr) : out.impl().data());
  f.add(total.impl().data());
  f.add(blocks);
  f.add(reduction);
  {
    void* args[] = {f.data()};
    launch(final_fn, 1, 1, 0, stream, args);
    check_launch("nll_loss");
  }
  if (!out.same(result)) result.copy_(out);
}

void nll_loss_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& result = outs[0];
  const DType dt = result.dtype();
  const Tensor grad = (call.input(0).dtype() == dt ? call.input(0) : call.input(0).to(dt)).contiguous();
  const Tensor target = call.input(1).contiguous();
  const Tensor weight =
      call.input(2).defined() ? (call.input(2).dtype() == dt ? call.input(2) : call.input(2).to(dt)).contiguous() : Tensor();
  const Tensor total_weight = call.input(3).contiguous();
  const int64_t reduction = call.int_attr(1);
  const int64_t ignore_index = call.int_attr(2);
  const int64_t n = result.dim() == 1 ? 1 : result.sizes()[0];
  const int64_t classes = result.dim() == 1 ? result.sizes()[0] : result.sizes()[1];
  const int64_t spatial = result.numel() / std::max<int64_t>(n * classes, 1);
  const int64_t positions = target.numel();
  check_targets(target, classes, ignore_index, "nll_loss_backward");
  if (result.numel() == 0) return;
  Tensor out = result.is_contiguous() ? result : make_empty(result.sizes().vec(), dt, result.device());
  const int device = out.device().index;
  {
    DeviceGuard guard(device);
    check(cudaMemsetAsync(out.impl().data(), 0, static_cast<size_t>(out.numel() * out.element_size()),
                          current_stream(device)),
          "nll_loss_backward");
  }
  if (positions > 0) {
    const DType tw = total_weight.dtype();
    JitFunction f = jit_function(device, std::string(cuda_type(dt)) + "|" + cuda_type(tw), "kiln_nll_loss_backward",
                                 [&] { return nll_backward_source(dt, tw); });
    MiscParams p;
    p.add(grad.impl().data());
    p.add(target.impl().data());
    p.add(weight.defined() ? weight.impl().data() : static_cast<void*>(nullptr));
    p.add(total_weight.impl().data());
    p.add(out.impl().data());
    p.add(positions);
    p.add(classes);
    p.add(std::max<int64_t>(spatial, 1));
    p.add(ignore_index);
    p.add(reduction);
    launch_misc(f, positions, device, p, "nll_loss_backward");
  }
  if (!out.same(result)) result.copy_(out);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("nll_loss_forward", DeviceType::cuda, nll_loss_kernel);
  register_kernel("nll_loss_backward", DeviceType::cuda, nll_loss_backward_kernel);
  return true;
}();

}  // namespace

std::vector<std::pair<std::string, std::string>> loss_sources_for_test() {
  std::vector<std::pair<std::string, std::string>> out;
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    out.emplace_back(std::string("nll_loss_forward_") + cuda_type(t), nll_forward_source(t));
    out.emplace_back(std::string("nll_loss_backward_") + cuda_type(t), nll_backward_source(t, t));
  }
  out.emplace_back("nll_loss_backward_mixed", nll_backward_source(kFloat16, kFloat32));
  return out;
}

}  // namespace kiln::cuda::detail
