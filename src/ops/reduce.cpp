// Reductions: sum, mean, prod, max/min (all elements and over a dim), amax/amin, argmax/argmin,
// var/std/var_mean, norm, logsumexp, any/all, and the dim-preserving cumsum, softmax, log_softmax.
//
// Shapes, dtypes and errors follow PyTorch: `dims` empty means every dim, negative dims count
// from the end, repeated dims are rejected, keepdim leaves size-1 dims; integer and bool inputs
// sum/prod/cumsum to int64; mean/var/std/norm/softmax need floating inputs; logsumexp of integers
// gives the default float dtype; max/min/argmax/argmin refuse empty reductions.
#include <cmath>
#include <limits>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "ops/decompositions.h"
#include "kiln/ops.h"

namespace kiln {

using detail::wrap_dim;

namespace {

// PyTorch's ScalarType names, used where its messages print them ("Got: Long").
std::string torch_name(DType t) {
  switch (t) {
    case DType::bool_:
      return "Bool";
    case DType::uint8:
      return "Byte";
    case DType::int8:
      return "Char";
    case DType::int32:
      return "Int";
    case DType::int64:
      return "Long";
    case DType::float16:
      return "Half";
    case DType::bfloat16:
      return "BFloat16";
    case DType::float32:
      return "Float";
    case DType::float64:
      return "Double";
  }
  return std::string(dtype_name(t));
}

// Output sizes of a reduction over the dims set in mask.
std::vector<int64_t> reduced_sizes(const Tensor& x, const std::vector<bool>& mask, bool keepdim) {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!mask[d])
      out.push_back(x.sizes()[d]);
    else if (keepdim)
      out.push_back(1);
  }
  return out;
}

std::vector<bool> single_dim_mask(const Tensor& x, int64_t dim, const std::string& op) {
  std::vector<bool> mask(x.dim(), false);
  int64_t d = wrap_dim(dim, x.dim(), op);
  if (x.dim() > 0) mask[d] = true;
  return mask;
}

TensorMeta out_meta(const Tensor& x, std::vector<int64_t> sizes, DType dtype) {
  return TensorMeta{std::move(sizes), {}, dtype, x.device()};
}

DType integral_to_long(DType t) {
  return is_integral(t, /*include_bool=*/true) ? kInt64 : t;
}

// max/min/amax/amin/argmax/argmin have no identity: every reduced dim must be non-empty.
void check_reduced_dims_nonempty(const Tensor& x, const std::vector<bool>& mask,
                                 const std::string& op) {
  for (int64_t d = 0; d < x.dim(); ++d) {
    KILN_CHECK(!mask[d] || x.sizes()[d] != 0, IndexError,
               "[kiln::" + op + "] Expected reduction dim " + std::to_string(d) +
                   " to have non-zero size. The op has no identity; reduce over non-empty dims.");
  }
}

void check_nonempty_all(const Tensor& x, const std::string& op) {
  KILN_CHECK(x.numel() != 0, ValueError,
             "[kiln::" + op +
                 "] Expected reduction dim to be specified for input.numel() == 0. Specify "
                 "the reduction dim with the 'dim' argument.");
}

void check_floating(const Tensor& x, const std::string& op, const std::string& what) {
  KILN_CHECK(x.is_floating_point(), DTypeError,
             "[kiln::" + op + "] " + what + torch_name(x.dtype()) +
                 ". Convert the input to a floating dtype first, e.g. x.to(kFloat32).");
}

// ---------------- derivative helpers ----------------
//
// The formulas are PyTorch's (tools/autograd/derivatives.yaml, FunctionsManual.cpp), written in
// Kiln ops so that a create_graph backward records them.

int64_t ndim_of(const BackwardContext& c) {
  return static_cast<int64_t>(c.input_info[0].sizes.size());
}

// g with the reduced dims (set in mask) put back as size 1 unless keepdim left them there
// (PyTorch's unsqueeze_multiple), so that it broadcasts against the input.
Tensor restore_reduced(Tensor g, const std::vector<bool>& mask, bool keepdim) {
  if (keepdim) return g;
  for (size_t d = 0; d < mask.size(); ++d)
    if (mask[d]) g = g.unsqueeze(static_cast<int64_t>(d));
  return g;
}

int64_t reduced_count(IntArrayRef sizes, const std::vector<bool>& mask) {
  int64_t n = 1;
  for (size_t d = 0; d < mask.size(); ++d)
    if (mask[d]) n *= sizes[d];
  return n;
}

// sum: the gradient expanded back over the reduced dims.
Tensor sum_backward(const Tensor& g, IntArrayRef sizes, IntArrayRef dims, bool keepdim) {
  auto mask = detail::dim_mask(dims, static_cast<int64_t>(sizes.size()), "sum");
  return restore_reduced(g, mask, keepdim).expand(sizes);
}

Tensor mean_backward(const Tensor& g, IntArrayRef sizes, IntArrayRef dims, bool keepdim) {
  auto mask = detail::dim_mask(dims, static_cast<int64_t>(sizes.size()), "mean");
  return sum_backward(g, sizes, dims, keepdim) / Scalar(reduced_count(sizes, mask));
}

// var (PyTorch's var_backward): 2 / (N - correction) * grad * (x - mean). Over all elements with
// N <= correction the factor is infinite: NaN where x == mean, inf elsewhere.
Tensor var_backward(Tensor g, const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim) {
  if (x.dim() == 0 || dims.empty()) {
    double dof = static_cast<double>(x.numel()) - static_cast<double>(correction);
    if (dof <= 0) {
      return g * where(eq(x, x.mean()), full_like(x, std::numeric_limits<double>::quiet_NaN()),
                       std::numeric_limits<double>::infinity());
    }
    return Scalar(2.0 / dof) * g * (x - x.mean());
  }
  auto mask = detail::dim_mask(dims, x.dim(), "var");
  g = restore_reduced(g, mask, keepdim);
  double dof = static_cast<double>(reduced_count(x.sizes(), mask)) - static_cast<double>(correction);
  return Scalar(2.0 / dof) * g * (x - x.mean(dims, true));
}

// The sum over `dim`, kept as a size-1 dim (a 0-dim tensor is its own sum).
Tensor sum_keep(const Tensor& t, int64_t dim) {
  return t.dim() == 0 ? t : t.sum({dim}, true);
}

int64_t softmax_dim(const BackwardContext& c, int64_t ndim, const std::string& op) {
  return ndim == 0 ? 0 : wrap_dim(c.int_attr(0), ndim, op);
}

// The backward table ops of softmax and log_softmax (defined below).
const OpDef& softmax_backward_op();
const OpDef& log_softmax_backward_op();

// prod: grad * (product of the other elements of the slice). Without zeros that is
// result / x (PyTorch's fast path). With zeros the product of the others is built from the
// product of the non-zero elements `p` and the zero count of the slice: for one zero, p at the
// zero and 0 elsewhere; for two or more, 0 everywhere (PyTorch's prod_safe_zeros_backward gives
// the same values through exclusive cumprods). Written so that its own derivative is also right:
// the zeros enter through `zsum` (their sum: 0, but carrying their gradient).
Tensor prod_backward(const BackwardContext& c) {
  const Tensor& x = c.input(0);
  Tensor g = c.grad(), result = c.output(0);
  if (x.dim() == 0) return g;
  const bool has_dim = c.has_attr(0);
  auto mask = has_dim ? single_dim_mask(x, c.int_attr(0), "prod") : std::vector<bool>(x.dim(), true);
  const bool keepdim = c.bool_attr(1);
  g = restore_reduced(g, mask, keepdim);
  result = restore_reduced(result, mask, keepdim);
  Tensor zero = eq(x, 0);
  if (!any(zero).item<bool>()) return g * (result / x);
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (mask[d]) dims.push_back(d);
  Tensor safe = where(zero, Scalar(1.0), x);
  Tensor p = has_dim ? safe.prod(dims[0], true) : restore_reduced(safe.prod(), mask, false);
  Tensor count = zero.sum(dims, true);
  Tensor zsum = where(zero, x, Scalar(0.0)).sum(dims, true);  // 0, with the zeros' gradient
  // Product of the zeros of the slice, and of its zeros other than this one.
  Tensor zeros_prod = where(eq(count, 0), ones_like(zsum), where(eq(count, 1), zsum, Scalar(0.0)));
  Tensor zeros_prod_others =
      where(eq(count, 1), ones_like(x), where(eq(count, 2), zsum - x, Scalar(0.0)));
  return g * where(zero, p * zeros_prod_others, p * zeros_prod / safe);
}

// ---------------- sum, mean, prod ----------------

const OpDef& kSum = register_op({
    .name = "sum",
    .schema = "sum(Tensor self, int[]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> "
              "Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), "sum");
      DType t = c.has_attr(2) ? c.dtype_attr(2) : integral_to_long(x.dtype());
      return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(1)), t)};
    },
    .derivative = {.formula = "self: grad.unsqueeze(dims unless keepdim).expand(self.sizes())",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {sum_backward(c.grad(), c.input_info[0].sizes, c.ints_attr(0), c.bool_attr(1))};
                   }},
    .lowering = lowering::Reduction{ReduceOp::sum},
});

const OpDef& kMean = register_op({
    .name = "mean",
    .schema = "mean(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_floating(
          x, "mean",
          "could not infer output dtype. Input dtype must be either a floating point or complex "
          "dtype. Got: ");
      auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), "mean");
      return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(1)), x.dtype())};
    },
    .derivative = {.formula = "self: grad.unsqueeze(dims unless keepdim).expand(self.sizes()) / N",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {mean_backward(c.grad(), c.input_info[0].sizes, c.ints_attr(0), c.bool_attr(1))};
                   }},
    .lowering = lowering::Reduction{ReduceOp::sum, /*mean=*/true},
});

const OpDef& kProd = register_op({
    .name = "prod",
    .schema = "prod(Tensor self, int? dim=None, bool keepdim=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      auto mask = c.has_attr(0) ? single_dim_mask(x, c.int_attr(0), "prod")
                                : std::vector<bool>(x.dim(), true);
      return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(1)), integral_to_long(x.dtype()))};
    },
    .derivative = {.formula = "self: prod_backward(grad, self, result, dim, keepdim)",
                   .save_inputs = {0},
                   .save_outputs = {0},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {prod_backward(c)};
                   }},
    .lowering = lowering::Extern{},
});

// ---------------- max, min, amax, amin ----------------

OpDef extremum_all_def(const std::string& name) {
  return OpDef{
      .name = name,
      .schema = name + "(Tensor self) -> Tensor",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        check_nonempty_all(x, name);
        return {out_meta(x, {}, x.dtype())};
      },
      .derivative = {.formula = "self: evenly_distribute_backward(grad, self, result)",
                     .save_inputs = {0},
                     .save_outputs = {0},
                     .fn = [](const BackwardContext& c) -> TensorList {
                       // PyTorch's evenly_distribute_backward: the gradient split among the
                       // elements equal to the result (NaN ones when it is NaN).
                       const Tensor& x = c.input(0);
                       const Tensor& value = c.output(0);
                       Tensor mask = isnan(value).item<bool>() ? isnan(x) : eq(x, value);
                       return {where(mask, c.grad() / mask.sum(), Scalar(0.0))};
                     }},
      .lowering = lowering::Extern{},
  };
}

OpDef extremum_dim_def(const std::string& name) {
  return OpDef{
      .name = name + ".dim",
      .schema = name +
                ".dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        auto mask = single_dim_mask(x, c.int_attr(0), name);
        check_reduced_dims_nonempty(x, mask, name);
        auto sizes = reduced_sizes(x, mask, c.bool_attr(1));
        return {out_meta(x, sizes, x.dtype()), out_meta(x, sizes, kInt64)};
      },
      .derivative = {.formula = "self: value_selecting_reduction_backward(grad, dim, indices, self.sizes(), keepdim)",
                     .save_outputs = {1},
                     .fn = [name](const BackwardContext& c) -> TensorList {
                       // zeros(self.sizes()).scatter(dim, indices, grad)
                       Tensor g = c.grad();
                       int64_t ndim = ndim_of(c);
                       if (ndim == 0) return {g};
                       int64_t dim = wrap_dim(c.int_attr(0), ndim, name);
                       Tensor indices = c.output(1);
                       if (!c.bool_attr(1)) {
                         g = g.unsqueeze(dim);
                         indices = indices.unsqueeze(dim);
                       }
                       Tensor z = zeros(c.input_info[0].sizes, TensorOptions(g.dtype(), g.device()));
                       return {scatter(z, dim, indices, g)};
                     }},
      .lowering = lowering::Extern{},
  };
}

OpDef amax_like_def(const std::string& name) {
  return OpDef{
      .name = name,
      .schema = name + "(Tensor self, int[] dim=[], bool keepdim=False) -> Tensor",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), name);
        check_reduced_dims_nonempty(x, mask, name);
        return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(1)), x.dtype())};
      },
      .derivative = {.formula = "self: scale_grad_by_count(restore_reduced_dims(grad), "
                                "restore_reduced_dims(result) == self, dim)",
                     .save_inputs = {0},
                     .save_outputs = {0},
                     .fn = [name](const BackwardContext& c) -> TensorList {
                       // The gradient split evenly among the elements equal to the result.
                       const Tensor& x = c.input(0);
                       auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), name);
                       bool keepdim = c.bool_attr(1);
                       Tensor g = restore_reduced(c.grad(), mask, keepdim);
                       Tensor hit = eq(restore_reduced(c.output(0), mask, keepdim), x);
                       return {(g / hit.sum(c.ints_attr(0), true)) * hit.to(g.dtype())};
                     }},
      .lowering = lowering::Reduction{name == "amax" ? ReduceOp::max : ReduceOp::min},
  };
}

OpDef argmax_like_def(const std::string& name) {
  return OpDef{
      .name = name,
      .schema = name + "(Tensor self, int? dim=None, bool keepdim=False) -> Tensor",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        KILN_CHECK(x.dtype() != kBool, DTypeError,
                   "[kiln::" + name + "] " + name +
                       " is not implemented for dtype Bool. Convert the input "
                       "with .to(kUInt8) first.");
        bool keepdim = c.bool_attr(1);
        if (!c.has_attr(0)) {
          check_nonempty_all(x, name);
          return {out_meta(x, std::vector<int64_t>(keepdim ? x.dim() : 0, 1), kInt64)};
        }
        auto mask = single_dim_mask(x, c.int_attr(0), name);
        check_reduced_dims_nonempty(x, mask, name);
        return {out_meta(x, reduced_sizes(x, mask, keepdim), kInt64)};
      },
      .lowering = lowering::Extern{},
  };
}

const OpDef& kMax = register_op(extremum_all_def("max"));
const OpDef& kMin = register_op(extremum_all_def("min"));
const OpDef& kMaxDim = register_op(extremum_dim_def("max"));
const OpDef& kMinDim = register_op(extremum_dim_def("min"));
const OpDef& kAmax = register_op(amax_like_def("amax"));
const OpDef& kAmin = register_op(amax_like_def("amin"));
const OpDef& kArgmax = register_op(argmax_like_def("argmax"));
const OpDef& kArgmin = register_op(argmax_like_def("argmin"));

// ---------------- var, std, var_mean ----------------

Derivative moments_derivative(const std::string& name) {
  if (name == "var") {
    return {.formula = "self: var_backward(grad, self, dim, correction, keepdim)",
            .save_inputs = {0},
            .fn = [](const BackwardContext& c) -> TensorList {
              return {var_backward(c.grad(), c.input(0), c.ints_attr(0), c.int_attr(1), c.bool_attr(2))};
            }};
  }
  if (name == "std") {
    return {.formula = "self: var_backward((grad / (result * 2)).masked_fill(result == 0, 0), self, dim, "
                       "correction, keepdim)",
            .save_inputs = {0},
            .save_outputs = {0},
            .fn = [](const BackwardContext& c) -> TensorList {
              const Tensor& result = c.output(0);
              Tensor grad_var = masked_fill(c.grad() / (result * Scalar(2)), eq(result, 0), Scalar(0));
              return {var_backward(grad_var, c.input(0), c.ints_attr(0), c.int_attr(1), c.bool_attr(2))};
            }};
  }
  // Each term only where its output received a gradient, as PyTorch's var_mean_backward: with
  // correction >= N the variance's factor is infinite, and inf * 0 would poison the mean's term.
  return {.formula = "self: var_backward(grads[0], ...) + mean_backward(grads[1], ...), each term only where "
                     "that output received a gradient",
          .save_inputs = {0},
          .fn = [](const BackwardContext& c) -> TensorList {
            const Tensor& x = c.input(0);
            Tensor g;
            if (c.has_grad(0)) g = var_backward(c.grad(0), x, c.ints_attr(0), c.int_attr(1), c.bool_attr(2));
            if (c.has_grad(1)) {
              Tensor m = mean_backward(c.grad(1), x.sizes(), c.ints_attr(0), c.bool_attr(2));
              g = g.defined() ? g + m : m;
            }
            return {g};
          }};
}

OpDef moments_def(const std::string& name, bool with_mean) {
  return OpDef{
      .name = name,
      .schema = name +
                "(Tensor self, int[]? dim=None, *, int correction=1, bool keepdim=False) -> " +
                (with_mean ? "(Tensor, Tensor)" : "Tensor"),
      .meta = [name, with_mean](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        check_floating(x, name, "std and var only support floating point and complex dtypes, got ");
        auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), name);
        auto sizes = reduced_sizes(x, mask, c.bool_attr(2));
        std::vector<TensorMeta> out{out_meta(x, sizes, x.dtype())};
        if (with_mean) out.push_back(out_meta(x, sizes, x.dtype()));
        return out;
      },
      .derivative = moments_derivative(name),
      .lowering = lowering::Extern{},
  };
}

const OpDef& kVar = register_op(moments_def("var", false));
const OpDef& kStd = register_op(moments_def("std", false));
const OpDef& kVarMean = register_op(moments_def("var_mean", true));

// ---------------- norm, logsumexp ----------------

std::string ord_str(double p) {
  if (std::isinf(p)) return p > 0 ? "inf" : "-inf";
  std::string s = std::to_string(p);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// PyTorch's norm_backward: p = 1 sign; p = 2 x / norm (0 where the norm is 0); +-inf the
// gradient split among the elements whose |x| equals the norm; other p the general formula,
// with the norm == 0 (p > 1) and x == 0 (p < 1) subgradients 0. p = 0 has zero gradient.
Tensor norm_backward(const BackwardContext& c) {
  const Tensor& x = c.input(0);
  double p = c.scalar_attr(0).to_double();
  IntArrayRef dims = c.ints_attr(1);
  auto mask = detail::dim_mask(dims, x.dim(), "norm");
  Tensor g = restore_reduced(c.grad(), mask, c.bool_attr(2));
  Tensor n = restore_reduced(c.output(0), mask, c.bool_attr(2));
  if (p == 0.0) return zeros_like(x, TensorOptions(g.dtype(), x.device()));
  if (p == 1.0) return sign(x) * g;
  if (p == 2.0) return g * masked_fill(x / n, eq(n, 0), Scalar(0));
  if (std::isinf(p)) {
    Tensor a = abs(x);
    Tensor hit = logical_or(eq(a, n), isnan(a));
    return sign(x) * ((g / hit.sum(dims, true)) * hit.to(g.dtype()));
  }
  if (p < 1.0) {
    Tensor scaled = sign(x) * masked_fill(pow(abs(x), Scalar(p - 1)), eq(x, 0), Scalar(0));
    return scaled * g * pow(n, Scalar(1 - p));
  }
  Tensor scaled = p < 2.0 ? sign(x) * pow(abs(x), Scalar(p - 1)) : x * pow(abs(x), Scalar(p - 2));
  Tensor scale = masked_fill(g / pow(n, Scalar(p - 1)), eq(n, 0), Scalar(0));
  return scaled * scale;
}

const OpDef& kNorm = register_op({
    .name = "norm",
    .schema = "norm(Tensor self, Scalar p=2, int[] dim=[], bool keepdim=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      check_floating(x, "norm", "Expected a floating point or complex tensor as input. Got ");
      double p = c.scalar_attr(0).to_double();
      KILN_CHECK(!std::isnan(p), ValueError, "[kiln::norm] the order p must be a number, got nan.");
      auto mask = detail::dim_mask(c.ints_attr(1), x.dim(), "norm");
      if (p < 0 || (std::isinf(p) && p > 0)) {
        for (int64_t d = 0; d < x.dim(); ++d) {
          KILN_CHECK(
              !mask[d] || x.sizes()[d] != 0, ValueError,
              "[kiln::norm] cannot compute the " + ord_str(p) + " norm over dimension " +
                  std::to_string(d) +
                  " because it is empty and the operation does not have an identity. Reduce over "
                  "non-empty dims or use p >= 0.");
        }
      }
      return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(2)), x.dtype())};
    },
    .derivative = {.formula = "self: norm_backward(grad, self, p, result, dim, keepdim)",
                   .save_inputs = {0},
                   .save_outputs = {0},
                   .fn = [](const BackwardContext& c) -> TensorList { return {norm_backward(c)}; }},
    .lowering = lowering::Extern{},
});

const OpDef& kLogsumexp = register_op({
    .name = "logsumexp",
    .schema = "logsumexp(Tensor self, int[1] dim, bool keepdim=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), "logsumexp");
      // Even for integral inputs the result is floating (the default dtype), as in PyTorch.
      DType t = x.is_floating_point() ? x.dtype() : default_dtype();
      return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(1)), t)};
    },
    .derivative = {.formula = "self: grad * (self - result).exp() (reduced dims restored unless keepdim)",
                   .save_inputs = {0},
                   .save_outputs = {0},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Tensor& x = c.input(0);
                     auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), "logsumexp");
                     bool keepdim = c.bool_attr(1);
                     Tensor g = restore_reduced(c.grad(), mask, keepdim);
                     Tensor r = restore_reduced(c.output(0), mask, keepdim);
                     return {g * exp(x - r)};
                   }},
    .lowering = detail::logsumexp_decomposition(),
});

// ---------------- any, all ----------------

OpDef any_all_def(const std::string& name) {
  return OpDef{
      .name = name,
      .schema = name + "(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), name);
        // uint8 inputs give uint8, as in PyTorch (kept for backward compatibility there).
        DType t = x.dtype() == kUInt8 ? kUInt8 : kBool;
        return {out_meta(x, reduced_sizes(x, mask, c.bool_attr(1)), t)};
      },
      .lowering = lowering::Extern{},
  };
}

const OpDef& kAny = register_op(any_all_def("any"));
const OpDef& kAll = register_op(any_all_def("all"));

// ---------------- cumsum, softmax, log_softmax ----------------

const OpDef& kCumsum = register_op({
    .name = "cumsum",
    .schema = "cumsum(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      wrap_dim(c.int_attr(0), x.dim(), "cumsum");
      DType t = c.has_attr(1) ? c.dtype_attr(1) : integral_to_long(x.dtype());
      return {out_meta(x, x.sizes().vec(), t)};
    },
    .derivative = {.formula = "self: grad.flip(dim).cumsum(dim).flip(dim)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     // The reversed cumsum, the flips done with index_select.
                     const Tensor& g = c.grad();
                     int64_t ndim = ndim_of(c);
                     if (ndim == 0 || g.numel() <= 1) return {g};
                     int64_t dim = wrap_dim(c.int_attr(0), ndim, "cumsum");
                     int64_t n = g.sizes()[dim];
                     if (n == 1) return {g};
                     Tensor rev = arange(n - 1, -1, -1, TensorOptions(kInt64, g.device()));
                     return {index_select(cumsum(index_select(g, dim, rev), dim), dim, rev)};
                   }},
    .lowering = lowering::Extern{},
});

OpDef softmax_def(const std::string& name) {
  return OpDef{
      .name = name,
      .schema = name + "(Tensor self, int dim, ScalarType? dtype=None) -> Tensor",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& x = c.input(0);
        wrap_dim(c.int_attr(0), x.dim(), name);
        DType t = c.has_attr(1) ? c.dtype_attr(1) : x.dtype();
        KILN_CHECK(is_floating_point(t), DTypeError,
                   "[kiln::" + name + "] " + name + " is not implemented for dtype " +
                       torch_name(t) + ". Pass a floating dtype (" + name +
                       "(x, dim, kFloat32)) or convert the input first.");
        return {out_meta(x, x.sizes().vec(), t)};
      },
      .derivative = {.formula = "self: _" + name + "_backward_data(grad, result, dim, self.scalar_type())",
                     .save_outputs = {0},
                     .fn = [name](const BackwardContext& c) -> TensorList {
                       if (!c.needs_grad(0)) return {Tensor()};
                       const OpDef& op = name == "softmax" ? softmax_backward_op() : log_softmax_backward_op();
                       return {call_op1(op, {c.grad(), c.output(0)}, {c.attrs[0], c.input_info[0].dtype})};
                     }},
      .lowering = detail::softmax_decomposition(name == "log_softmax"),
  };
}

const OpDef& kSoftmax = register_op(softmax_def("softmax"));
const OpDef& kLogSoftmax = register_op(softmax_def("log_softmax"));

// _softmax_backward_data(grad_output, output, dim, input_dtype) = output * (grad_output -
// sum(grad_output * output, dim)); _log_softmax_backward_data(...) = grad_output -
// exp(output) * sum(grad_output, dim). Fused CPU kernels in softmax_backward_kernels.cpp; the
// result has the forward input's dtype. Their own derivatives (PyTorch's) make double backward
// through softmax and log_softmax work.
OpDef softmax_backward_def(const std::string& name) {
  const bool log = name == "_log_softmax_backward_data";
  Derivative d;
  if (log) {
    d = {.formula = "grad_output: grad - (grad * output.exp()).sum(dim, true); "
                    "output: -grad_output.sum(dim, true) * output.exp() * grad",
         .save_inputs = {0, 1},
         .fn = [name](const BackwardContext& c) -> TensorList {
           const Tensor& go = c.input(0);
           const Tensor& y = c.input(1);
           int64_t dim = softmax_dim(c, y.dim(), name);
           Tensor G = c.grad().to(y.dtype());
           Tensor ey = exp(y);
           Tensor d_go = c.needs_grad(0) ? G - sum_keep(G * ey, dim) : Tensor();
           Tensor d_y = c.needs_grad(1) ? -sum_keep(go, dim) * ey * G : Tensor();
           return {d_go, d_y};
         }};
  } else {
    d = {.formula = "grad_output: _softmax_backward_data(grad, output, dim, output.scalar_type()); "
                    "output: grad_output * grad - (output * grad_output).sum(dim, true) * grad - "
                    "grad_output * (output * grad).sum(dim, true)",
         .save_inputs = {0, 1},
         .fn = [name](const BackwardContext& c) -> TensorList {
           const Tensor& go = c.input(0);
           const Tensor& y = c.input(1);
           int64_t dim = softmax_dim(c, y.dim(), name);
           Tensor G = c.grad().to(y.dtype());
           Tensor d_go = c.needs_grad(0)
                             ? call_op1(softmax_backward_op(), {G, y}, {c.attrs[0], y.dtype()})
                             : Tensor();
           Tensor d_y = c.needs_grad(1)
                            ? go * G - sum_keep(y * go, dim) * G - go * sum_keep(y * G, dim)
                            : Tensor();
           return {d_go, d_y};
         }};
  }
  return OpDef{
      .name = name,
      .schema = name + "(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype) -> Tensor",
      .meta = [name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& g = c.input(0);
        const Tensor& y = c.input(1);
        KILN_CHECK(g.sizes() == y.sizes(), ShapeError,
                   "[kiln::" + name + "] grad_output of size " + shape_str(g.sizes()) +
                       " does not match output of size " + shape_str(y.sizes()) +
                       ". Pass the gradient of the forward output.");
        KILN_CHECK(g.device() == y.device(), DeviceError,
                   "[kiln::" + name + "] expected grad_output to be on the same device as output (" +
                       y.device().str() + "), but it is on " + g.device().str() + ". Move it with .to(...).");
        KILN_CHECK(y.is_floating_point() && g.dtype() == y.dtype(), DTypeError,
                   "[kiln::" + name + "] expected grad_output and output of one floating dtype, got " +
                       torch_name(g.dtype()) + " and " + torch_name(y.dtype()) +
                       ". Convert grad_output to the output's dtype.");
        KILN_CHECK(is_floating_point(c.dtype_attr(1)), DTypeError,
                   "[kiln::" + name + "] input_dtype must be floating, got " +
                       torch_name(c.dtype_attr(1)) + ".");
        wrap_dim(c.int_attr(0), y.dim(), name);
        return {out_meta(y, y.sizes().vec(), c.dtype_attr(1))};
      },
      .derivative = std::move(d),
      .lowering = lowering::Extern{},
  };
}

const OpDef& kSoftmaxBackward = register_op(softmax_backward_def("_softmax_backward_data"));
const OpDef& kLogSoftmaxBackward = register_op(softmax_backward_def("_log_softmax_backward_data"));

const OpDef& softmax_backward_op() {
  return kSoftmaxBackward;
}
const OpDef& log_softmax_backward_op() {
  return kLogSoftmaxBackward;
}

Attr optional_dtype(std::optional<DType> t) {
  return t ? Attr(*t) : Attr();
}
Attr optional_int(std::optional<int64_t> v) {
  return v ? Attr(*v) : Attr();
}

std::tuple<Tensor, Tensor> pair(std::vector<Tensor> r) {
  return {std::move(r[0]), std::move(r[1])};
}

}  // namespace

// ---------------- front-ends ----------------

Tensor sum(const Tensor& x, IntArrayRef dims, bool keepdim, std::optional<DType> dtype) {
  return call_op1(kSum, {x}, {dims.vec(), keepdim, optional_dtype(dtype)});
}
Tensor mean(const Tensor& x, IntArrayRef dims, bool keepdim) {
  return call_op1(kMean, {x}, {dims.vec(), keepdim});
}
Tensor prod(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return call_op1(kProd, {x}, {optional_int(dim), keepdim});
}
Tensor max(const Tensor& x) {
  return call_op1(kMax, {x});
}
Tensor min(const Tensor& x) {
  return call_op1(kMin, {x});
}
std::tuple<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) {
  return pair(call_op(kMaxDim, {x}, {dim, keepdim}));
}
std::tuple<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim) {
  return pair(call_op(kMinDim, {x}, {dim, keepdim}));
}
Tensor amax(const Tensor& x, IntArrayRef dims, bool keepdim) {
  return call_op1(kAmax, {x}, {dims.vec(), keepdim});
}
Tensor amin(const Tensor& x, IntArrayRef dims, bool keepdim) {
  return call_op1(kAmin, {x}, {dims.vec(), keepdim});
}
Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return call_op1(kArgmax, {x}, {optional_int(dim), keepdim});
}
Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return call_op1(kArgmin, {x}, {optional_int(dim), keepdim});
}
Tensor var(const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim) {
  return call_op1(kVar, {x}, {dims.vec(), correction, keepdim});
}
Tensor std(const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim) {
  return call_op1(kStd, {x}, {dims.vec(), correction, keepdim});
}
std::tuple<Tensor, Tensor> var_mean(const Tensor& x, IntArrayRef dims, int64_t correction,
                                    bool keepdim) {
  return pair(call_op(kVarMean, {x}, {dims.vec(), correction, keepdim}));
}
Tensor norm(const Tensor& x, Scalar p, IntArrayRef dims, bool keepdim) {
  return call_op1(kNorm, {x}, {p, dims.vec(), keepdim});
}
Tensor logsumexp(const Tensor& x, IntArrayRef dims, bool keepdim) {
  return call_op1(kLogsumexp, {x}, {dims.vec(), keepdim});
}
Tensor any(const Tensor& x) {
  return call_op1(kAny, {x}, {std::vector<int64_t>{}, false});
}
Tensor any(const Tensor& x, int64_t dim, bool keepdim) {
  return call_op1(kAny, {x}, {std::vector<int64_t>{dim}, keepdim});
}
Tensor all(const Tensor& x) {
  return call_op1(kAll, {x}, {std::vector<int64_t>{}, false});
}
Tensor all(const Tensor& x, int64_t dim, bool keepdim) {
  return call_op1(kAll, {x}, {std::vector<int64_t>{dim}, keepdim});
}
Tensor cumsum(const Tensor& x, int64_t dim, std::optional<DType> dtype) {
  return call_op1(kCumsum, {x}, {dim, optional_dtype(dtype)});
}
Tensor softmax(const Tensor& x, int64_t dim, std::optional<DType> dtype) {
  return call_op1(kSoftmax, {x}, {dim, optional_dtype(dtype)});
}
Tensor log_softmax(const Tensor& x, int64_t dim, std::optional<DType> dtype) {
  return call_op1(kLogSoftmax, {x}, {dim, optional_dtype(dtype)});
}

// ---------------- Tensor methods ----------------

Tensor Tensor::sum(IntArrayRef dims, bool keepdim, std::optional<DType> dtype) const {
  return kiln::sum(*this, dims, keepdim, dtype);
}
Tensor Tensor::mean(IntArrayRef dims, bool keepdim) const {
  return kiln::mean(*this, dims, keepdim);
}
Tensor Tensor::prod(std::optional<int64_t> dim, bool keepdim) const {
  return kiln::prod(*this, dim, keepdim);
}
Tensor Tensor::max() const {
  return kiln::max(*this);
}
std::tuple<Tensor, Tensor> Tensor::max(int64_t dim, bool keepdim) const {
  return kiln::max(*this, dim, keepdim);
}
Tensor Tensor::min() const {
  return kiln::min(*this);
}
std::tuple<Tensor, Tensor> Tensor::min(int64_t dim, bool keepdim) const {
  return kiln::min(*this, dim, keepdim);
}
Tensor Tensor::amax(IntArrayRef dims, bool keepdim) const {
  return kiln::amax(*this, dims, keepdim);
}
Tensor Tensor::amin(IntArrayRef dims, bool keepdim) const {
  return kiln::amin(*this, dims, keepdim);
}
Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const {
  return kiln::argmax(*this, dim, keepdim);
}
Tensor Tensor::argmin(std::optional<int64_t> dim, bool keepdim) const {
  return kiln::argmin(*this, dim, keepdim);
}
Tensor Tensor::var(IntArrayRef dims, int64_t correction, bool keepdim) const {
  return kiln::var(*this, dims, correction, keepdim);
}
Tensor Tensor::std(IntArrayRef dims, int64_t correction, bool keepdim) const {
  return kiln::std(*this, dims, correction, keepdim);
}
Tensor Tensor::norm(Scalar p, IntArrayRef dims, bool keepdim) const {
  return kiln::norm(*this, p, dims, keepdim);
}
Tensor Tensor::logsumexp(IntArrayRef dims, bool keepdim) const {
  return kiln::logsumexp(*this, dims, keepdim);
}
Tensor Tensor::any() const {
  return kiln::any(*this);
}
Tensor Tensor::all() const {
  return kiln::all(*this);
}
Tensor Tensor::cumsum(int64_t dim) const {
  return kiln::cumsum(*this, dim);
}
Tensor Tensor::softmax(int64_t dim) const {
  return kiln::softmax(*this, dim);
}
Tensor Tensor::log_softmax(int64_t dim) const {
  return kiln::log_softmax(*this, dim);
}

}  // namespace kiln
