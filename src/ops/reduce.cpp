// Reductions: sum, mean, prod, max/min (all elements and over a dim), amax/amin, argmax/argmin,
// var/std/var_mean, norm, logsumexp, any/all, and the dim-preserving cumsum, softmax, log_softmax.
//
// Shapes, dtypes and errors follow PyTorch: `dims` empty means every dim, negative dims count
// from the end, repeated dims are rejected, keepdim leaves size-1 dims; integer and bool inputs
// sum/prod/cumsum to int64; mean/var/std/norm/softmax need floating inputs; logsumexp of integers
// gives the default float dtype; max/min/argmax/argmin refuse empty reductions.
#include <cmath>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
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
    .lowering = "reduction",
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
    .lowering = "reduction",
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
    .lowering = "reduction",
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
      .lowering = "reduction",
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
      .lowering = "reduction",
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
      .lowering = "reduction",
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
      .lowering = "reduction",
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
      .lowering = "reduction",
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
    .lowering = "reduction",
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
    .lowering = "decomposition",
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
      .lowering = "reduction",
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
    .lowering = "extern",
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
      .lowering = "decomposition",
  };
}

const OpDef& kSoftmax = register_op(softmax_def("softmax"));
const OpDef& kLogSoftmax = register_op(softmax_def("log_softmax"));

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
