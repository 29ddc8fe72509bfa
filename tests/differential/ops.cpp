#include "ops.h"

#include <algorithm>
#include <array>
#include <numeric>
#include <set>

namespace kiln::differential {

// ================================ type rules ================================

namespace {

// Pytorch's combine_categories: the higher-priority group's dtype, unless a lower-priority group
// is of a higher category.
std::optional<DType> combine_categories(std::optional<DType> higher, std::optional<DType> lower) {
  if (!higher) return lower;
  if (is_float(*higher)) return higher;
  if (*higher == kBool || (lower && is_float(*lower)))
    return lower ? promote_types(*higher, *lower) : *higher;
  return higher;
}

std::optional<DType> promote(std::optional<DType> a, DType b) {
  return a ? promote_types(*a, b) : b;
}

}  // namespace

DType result_type(std::initializer_list<Operand> operands) {
  std::optional<DType> dims, zero_dim, wrapped;
  for (const Operand& o : operands) {
    if (o.wrapped) {
      wrapped = promote(wrapped, o.dtype);
    } else if (o.dim == 0) {
      zero_dim = promote(zero_dim, o.dtype);
    } else {
      dims = promote(dims, o.dtype);
    }
  }
  return *combine_categories(dims, combine_categories(zero_dim, wrapped));
}

Operand operand(const ValueType& v) {
  return {v.dtype, v.dim()};
}
// A float number counts as the default dtype, an integer as int64.
Operand operand(const HostScalar& s) {
  return {s.integral ? kInt64 : kFloat32, 0, true};
}

bool broadcast_sizes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                     std::vector<int64_t>& out) {
  size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> result(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (x != y && x != 1 && y != 1) return false;
    result[i] = x == 1 ? y : x;
  }
  out = std::move(result);
  return true;
}

namespace {

using Args = std::span<const ValueType* const>;
using Results = std::vector<ValueType>;
using Names = std::span<const std::string>;
using Tensors = std::span<const Tensor>;

// A result requires grad when it is floating and a floating argument requires grad.
bool grad_of(DType result, Args args) {
  if (!is_float(result)) return false;
  for (const ValueType* a : args)
    if (a && is_float(a->dtype) && a->requires_grad) return true;
  return false;
}

void set_result(Results& r, std::vector<int64_t> sizes, DType dtype, Args args) {
  r.resize(1);
  r[0].sizes = std::move(sizes);
  r[0].dtype = dtype;
  r[0].requires_grad = grad_of(dtype, args);
}

// A dim in [-rank, rank) as a non-negative index, or -1. A 0-dim tensor takes 0 and -1.
int64_t normalize_dim(int64_t dim, int64_t rank) {
  int64_t r = std::max<int64_t>(rank, 1);
  if (dim < -r || dim >= r) return -1;
  return dim < 0 ? dim + r : dim;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "}";
}

std::string guarded(const std::string& x, const char* offset) {
  return "abs(" + x + ") + " + offset;
}

// ---------------- rule builders ----------------

std::string require_float(const ValueType& x, std::string_view what) {
  return is_float(x.dtype) ? "" : std::string(what) + " needs a floating input";
}

OpRule unary_float(std::string_view name, Tensor (*fn)(const Tensor&),
                   const char* guard_offset = nullptr) {
  OpRule r{.name = name};
  r.infer = [](const Op&, Args a, Results& out) {
    if (auto e = require_float(*a[0], "unary op"); !e.empty()) return e;
    set_result(out, a[0]->sizes, a[0]->dtype, a);
    return std::string();
  };
  if (guard_offset) {
    double offset = std::stod(guard_offset);
    r.run = [fn, offset](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{fn(abs(t[0]) + offset)};
    };
    r.print = [name, guard_offset](const Op&, Names n) {
      return std::string(name) + "(" + guarded(n[0], guard_offset) + ")";
    };
  } else {
    r.run = [fn](const Op&, Tensors t, const RunContext&) { return std::vector<Tensor>{fn(t[0])}; };
    r.print = [name](const Op&, Names n) { return std::string(name) + "(" + n[0] + ")"; };
  }
  return r;
}

// neg, abs, relu: also on int64.
OpRule unary_numeric(std::string_view name, Tensor (*fn)(const Tensor&)) {
  OpRule r = unary_float(name, fn);
  r.infer = [](const Op&, Args a, Results& out) {
    if (a[0]->dtype == kBool) return std::string("unary op on bool");
    set_result(out, a[0]->sizes, a[0]->dtype, a);
    return std::string();
  };
  return r;
}

std::string infer_binary(Args a, Results& out, DType dtype) {
  std::vector<int64_t> sizes;
  if (!broadcast_sizes(a[0]->sizes, a[1]->sizes, sizes)) return "shapes do not broadcast";
  set_result(out, sizes, dtype, a);
  return "";
}

// add and sub: alpha (scalars[0]) when it is not 1.
OpRule add_or_sub(bool subtract) {
  OpRule r{.name = subtract ? "sub" : "add"};
  r.infer = [subtract](const Op& op, Args a, Results& out) {
    DType t = result_type({operand(*a[0]), operand(*a[1])});
    if (subtract && (a[0]->dtype == kBool || a[1]->dtype == kBool))
      return std::string("sub of bool");
    if (!is_float(t) && !op.scalars.empty() && !op.scalars[0].integral)
      return std::string("float alpha, integral result");
    return infer_binary(a, out, t);
  };
  r.run = [subtract](const Op& op, Tensors t, const RunContext&) {
    Scalar alpha = op.scalars.empty() ? Scalar(1) : op.scalars[0].scalar();
    return std::vector<Tensor>{subtract ? sub(t[0], t[1], alpha) : add(t[0], t[1], alpha)};
  };
  r.print = [subtract](const Op& op, Names n) {
    if (op.scalars.empty()) return n[0] + (subtract ? " - " : " + ") + n[1];
    return std::string(subtract ? "sub(" : "add(") + n[0] + ", " + n[1] + ", " +
           op.scalars[0].str() + ")";
  };
  return r;
}

OpRule binary_function(std::string_view name, Tensor (*fn)(const Tensor&, const Tensor&),
                       bool boolean_result, bool allow_bool = true) {
  OpRule r{.name = name};
  r.infer = [boolean_result, allow_bool](const Op&, Args a, Results& out) {
    if (!allow_bool && (a[0]->dtype == kBool || a[1]->dtype == kBool))
      return std::string("bool operand");
    DType t = boolean_result ? kBool : result_type({operand(*a[0]), operand(*a[1])});
    return infer_binary(a, out, t);
  };
  r.run = [fn](const Op&, Tensors t, const RunContext&) {
    return std::vector<Tensor>{fn(t[0], t[1])};
  };
  r.print = [name](const Op&, Names n) {
    return std::string(name) + "(" + n[0] + ", " + n[1] + ")";
  };
  return r;
}

// x (op) s with a host number; `reversed` puts the number first (s - x).
OpRule scalar_operator(std::string_view name, const char* symbol, bool reversed = false) {
  OpRule r{.name = name};
  std::string sym = symbol;
  r.infer = [sym](const Op& op, Args a, Results& out) {
    DType t = result_type({operand(*a[0]), operand(op.scalars[0])});
    if (sym == "-" && a[0]->dtype == kBool) return std::string("sub of bool");
    if (sym == "/") t = is_float(t) ? t : kFloat32;
    if (sym == "/" && op.scalars[0].value == 0) return std::string("division by zero");
    set_result(out, a[0]->sizes, t, a);
    return std::string();
  };
  r.run = [sym, reversed](const Op& op, Tensors t, const RunContext&) {
    Scalar s = op.scalars[0].scalar();
    Tensor result;
    if (sym == "+") result = t[0] + s;
    if (sym == "*") result = t[0] * s;
    if (sym == "/") result = t[0] / s;
    if (sym == "-") result = reversed ? s - t[0] : t[0] - s;
    return std::vector<Tensor>{result};
  };
  r.print = [sym, reversed](const Op& op, Names n) {
    std::string s = op.scalars[0].str();
    if (op.scalars[0].value < 0) s = "(" + s + ")";
    return reversed ? s + " " + sym + " " + n[0] : n[0] + " " + sym + " " + s;
  };
  return r;
}

OpRule scalar_comparison(std::string_view name, Tensor (*fn)(const Tensor&, Scalar)) {
  OpRule r{.name = name};
  r.infer = [](const Op&, Args a, Results& out) {
    set_result(out, a[0]->sizes, kBool, a);
    return std::string();
  };
  r.run = [fn](const Op& op, Tensors t, const RunContext&) {
    return std::vector<Tensor>{fn(t[0], op.scalars[0].scalar())};
  };
  r.print = [name](const Op& op, Names n) {
    return std::string(name) + "(" + n[0] + ", " + op.scalars[0].str() + ")";
  };
  return r;
}

// A non-negative integral exponent applies as is; any other takes abs(x) + 0.5 as the base.
bool plain_power(const HostScalar& e) {
  return e.integral && e.value >= 0;
}

std::optional<Scalar> bound(const Op& op, int k) {
  if (!op.ints[k]) return std::nullopt;
  return op.scalars[k].scalar();
}

std::string print_bounds(const Op& op) {
  std::string lo = op.ints[0] ? op.scalars[0].str() : "std::nullopt";
  if (!op.ints[1]) return lo;
  return lo + ", " + op.scalars[1].str();
}

std::string infer_clamp_bounds(const Op& op, DType target) {
  if (op.ints.size() != 2 || op.scalars.size() != 2) return "clamp needs two bound slots";
  if (!op.ints[0] && !op.ints[1]) return "clamp without bounds";
  if (target == kBool) return "clamp of bool";
  for (int k = 0; k < 2; ++k)
    if (op.ints[k] && !is_float(target) && !op.scalars[k].integral)
      return "float bound on an integral tensor";
  return "";
}

// ---------------- reductions ----------------

// dims from op.ints starting at `first`, normalized and checked; an empty list means all dims.
std::string reduction_dims(const Op& op, size_t first, const ValueType& x,
                           std::vector<int64_t>& dims) {
  dims.clear();
  for (size_t i = first; i < op.ints.size(); ++i) {
    int64_t d = normalize_dim(op.ints[i], x.dim());
    if (d < 0) return "reduction dim out of range";
    if (std::find(dims.begin(), dims.end(), d) != dims.end()) return "repeated reduction dim";
    dims.push_back(d);
  }
  return "";
}

std::vector<int64_t> dims_of(const Op& op, size_t first) {
  return {op.ints.begin() + first, op.ints.end()};
}

enum class ReductionDType { keep_or_int64, floating, numeric };

OpRule reduction(std::string_view name, Tensor (*fn)(const Tensor&, IntArrayRef, bool),
                 ReductionDType rule_dtype, bool needs_dims = false) {
  OpRule r{.name = name};
  r.infer = [rule_dtype, needs_dims](const Op& op, Args a, Results& out) {
    if (op.ints.empty()) return std::string("reduction without keepdim");
    std::vector<int64_t> dims;
    if (auto e = reduction_dims(op, 1, *a[0], dims); !e.empty()) return e;
    if (needs_dims && dims.empty()) return std::string("reduction needs dims");
    DType t = a[0]->dtype;
    if (rule_dtype == ReductionDType::floating && !is_float(t))
      return std::string("reduction needs a floating input");
    if (rule_dtype == ReductionDType::numeric && t == kBool)
      return std::string("reduction of bool");
    if (rule_dtype == ReductionDType::keep_or_int64 && !is_float(t)) t = kInt64;
    set_result(out, reduced_sizes(a[0]->sizes, dims, op.ints[0]), t, a);
    return std::string();
  };
  r.run = [fn](const Op& op, Tensors t, const RunContext&) {
    std::vector<int64_t> dims = dims_of(op, 1);
    return std::vector<Tensor>{fn(t[0], dims, op.ints[0] != 0)};
  };
  r.print = [name](const Op& op, Names n) {
    std::vector<int64_t> dims = dims_of(op, 1);
    if (dims.empty() && !op.ints[0]) return std::string(name) + "(" + n[0] + ")";
    return std::string(name) + "(" + n[0] + ", " + join(dims) + ", " +
           (op.ints[0] ? "true" : "false") + ")";
  };
  return r;
}

std::string infer_variance(const Op& op, Args a, Results& out, int results) {
  if (op.ints.size() < 2) return "variance without keepdim and correction";
  if (!is_float(a[0]->dtype)) return "variance needs a floating input";
  std::vector<int64_t> dims;
  if (auto e = reduction_dims(op, 2, *a[0], dims); !e.empty()) return e;
  if (op.ints[1] < 0) return "negative correction";
  set_result(out, reduced_sizes(a[0]->sizes, dims, op.ints[0]), a[0]->dtype, a);
  out.resize(results, out[0]);
  return "";
}

std::string print_variance(std::string_view name, const Op& op, Names n) {
  return std::string(name) + "(" + n[0] + ", " + join(dims_of(op, 2)) + ", " +
         std::to_string(op.ints[1]) + ", " + (op.ints[0] ? "true" : "false") + ")";
}

OpRule softmax_like(std::string_view name, bool log) {
  OpRule r{.name = name};
  r.infer = [](const Op& op, Args a, Results& out) {
    if (!is_float(a[0]->dtype)) return std::string("softmax needs a floating input");
    if (op.ints.size() != 1 || normalize_dim(op.ints[0], a[0]->dim()) < 0)
      return std::string("softmax dim out of range");
    set_result(out, a[0]->sizes, a[0]->dtype, a);
    return std::string();
  };
  r.run = [log](const Op& op, Tensors t, const RunContext&) {
    return std::vector<Tensor>{log ? log_softmax(t[0], op.ints[0]) : softmax(t[0], op.ints[0])};
  };
  r.print = [name](const Op& op, Names n) {
    return std::string(name) + "(" + n[0] + ", " + std::to_string(op.ints[0]) + ")";
  };
  return r;
}

// ---------------- views ----------------

OpRule view_rule(std::string_view name) {
  return OpRule{.name = name};
}

// ---------------- in place ----------------

// The checks every in-place write shares: the target can be written and `value` (the dtype of
// what is written) can be cast to it.
std::string check_in_place_target(const ValueType& target, DType value) {
  if (target.overlapping) return "in-place write into overlapping memory";
  if (target.grad_leaf) return "in-place write into a leaf that requires grad";
  if (target.view_of_grad) return "in-place write into a view of a tensor that requires grad";
  if (!can_cast(value, target.dtype)) return "in-place result cannot be cast to the target's dtype";
  return "";
}

// `other` must broadcast to the target's shape and not partly overlap it.
std::string check_in_place_operand(const ValueType& target, const ValueType& other) {
  std::vector<int64_t> sizes;
  if (!broadcast_sizes(target.sizes, other.sizes, sizes) || sizes != target.sizes)
    return "operand does not broadcast to the in-place target";
  if (&other != &target && other.storage == target.storage)
    return "operand aliases the in-place target";
  return "";
}

Results in_place_result(const ValueType& target, Args a) {
  ValueType r = target;
  r.requires_grad = target.requires_grad || grad_of(target.dtype, a);
  return {r};
}

// target.name_(other[, scalars...]).
OpRule in_place_binary(std::string_view name, Tensor& (Tensor::*fn)(const Tensor&),
                       bool float_only = false) {
  OpRule r{.name = name, .in_place = true};
  r.infer = [float_only](const Op&, Args a, Results& out) {
    if (a[0]->dtype == kBool || a[1]->dtype == kBool)
      return std::string("in-place arithmetic on bool");
    DType t = result_type({operand(*a[0]), operand(*a[1])});
    if (float_only) t = is_float(t) ? t : kFloat32;
    if (auto e = check_in_place_target(*a[0], t); !e.empty()) return e;
    if (auto e = check_in_place_operand(*a[0], *a[1]); !e.empty()) return e;
    out = in_place_result(*a[0], a);
    return std::string();
  };
  r.run = [fn](const Op&, Tensors t, const RunContext&) {
    Tensor target = t[0];
    (target.*fn)(t[1]);
    return std::vector<Tensor>{target};
  };
  r.print = [name](const Op&, Names n) {
    return n[0] + "." + std::string(name) + "(" + n[1] + ")";
  };
  return r;
}

// target.name_(s): add_, sub_, mul_, div_, fill_, pow_ with a host number.
OpRule in_place_scalar(std::string_view name, std::string_view method) {
  OpRule r{.name = name, .in_place = true};
  std::string m(method);
  r.infer = [m](const Op& op, Args a, Results& out) {
    const HostScalar& s = op.scalars.at(0);
    DType t = result_type({operand(*a[0]), operand(s)});
    if (m == "fill_") t = is_float(a[0]->dtype) || s.integral ? a[0]->dtype : kFloat32;
    if ((m == "sub_" || m == "add_" || m == "mul_" || m == "div_" || m == "pow_") &&
        a[0]->dtype == kBool)
      return std::string("in-place arithmetic on bool");
    if (m == "div_") t = is_float(t) ? t : kFloat32;
    if (m == "div_" && s.value == 0) return std::string("division by zero");
    if (m == "pow_" && !(is_float(a[0]->dtype) ? s.integral : plain_power(s)))
      return std::string("pow_ exponent");
    if (auto e = check_in_place_target(*a[0], t); !e.empty()) return e;
    out = in_place_result(*a[0], a);
    return std::string();
  };
  r.run = [m](const Op& op, Tensors t, const RunContext&) {
    Tensor target = t[0];
    Scalar s = op.scalars[0].scalar();
    if (m == "add_") target.add_(s);
    if (m == "sub_") target.sub_(s);
    if (m == "mul_") target.mul_(s);
    if (m == "div_") target.div_(s);
    if (m == "fill_") target.fill_(s);
    if (m == "pow_") target.pow_(s);
    return std::vector<Tensor>{target};
  };
  r.print = [m](const Op& op, Names n) { return n[0] + "." + m + "(" + op.scalars[0].str() + ")"; };
  return r;
}

OpRule in_place_unary(std::string_view name, Tensor& (Tensor::*fn)(), bool float_only) {
  OpRule r{.name = name, .in_place = true};
  std::string n(name);
  r.infer = [float_only, n](const Op&, Args a, Results& out) {
    if (float_only && !is_float(a[0]->dtype))
      return std::string("in-place op needs a floating target");
    if (n != "zero_" && a[0]->dtype == kBool) return std::string("in-place op on bool");
    if (auto e = check_in_place_target(*a[0], a[0]->dtype); !e.empty()) return e;
    out = in_place_result(*a[0], a);
    return std::string();
  };
  r.run = [fn](const Op&, Tensors t, const RunContext&) {
    Tensor target = t[0];
    (target.*fn)();
    return std::vector<Tensor>{target};
  };
  r.print = [name](const Op&, Names names) { return names[0] + "." + std::string(name) + "()"; };
  return r;
}

// ---------------- the table ----------------

std::array<OpRule, kNumOpKinds> make_rules() {
  std::array<OpRule, kNumOpKinds> t;
  auto at = [&](OpKind k) -> OpRule& { return t[static_cast<int>(k)]; };

  at(OpKind::neg) = unary_numeric("neg", kiln::neg);
  at(OpKind::abs) = unary_numeric("abs", kiln::abs);
  at(OpKind::relu) = unary_numeric("relu", kiln::relu);
  at(OpKind::exp) = unary_float("exp", kiln::exp);
  at(OpKind::log) = unary_float("log", kiln::log, "0.5");
  at(OpKind::sin) = unary_float("sin", kiln::sin);
  at(OpKind::cos) = unary_float("cos", kiln::cos);
  at(OpKind::tanh) = unary_float("tanh", kiln::tanh);
  at(OpKind::sigmoid) = unary_float("sigmoid", kiln::sigmoid);
  at(OpKind::silu) = unary_float("silu", kiln::silu);
  at(OpKind::sqrt) = unary_float("sqrt", kiln::sqrt, "0.1");
  at(OpKind::rsqrt) = unary_float("rsqrt", kiln::rsqrt, "0.5");
  at(OpKind::reciprocal) = unary_float("reciprocal", kiln::reciprocal, "0.5");
  at(OpKind::erf) = unary_float("erf", kiln::erf);
  {
    OpRule& r = at(OpKind::gelu) = unary_float("gelu", nullptr);
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{gelu(t[0], !op.ints.empty() && op.ints[0] ? "tanh" : "none")};
    };
    r.print = [](const Op& op, Names n) {
      return "gelu(" + n[0] + (!op.ints.empty() && op.ints[0] ? ", \"tanh\")" : ")");
    };
  }

  at(OpKind::add) = add_or_sub(false);
  at(OpKind::sub) = add_or_sub(true);
  {
    OpRule& r = at(OpKind::mul) = binary_function("mul", nullptr, false);
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0] * t[1]};
    };
    r.print = [](const Op&, Names n) { return n[0] + " * " + n[1]; };
  }
  {
    // a / (abs(b) + 0.5): the denominator stays away from zero.
    OpRule& r = at(OpKind::div) = binary_function("div", nullptr, false);
    r.infer = [](const Op&, Args a, Results& out) {
      if (a[1]->dtype == kBool) return std::string("abs of bool");
      DType denominator = is_float(a[1]->dtype) ? a[1]->dtype : kFloat32;
      DType t = result_type({operand(*a[0]), {denominator, a[1]->dim()}});
      return infer_binary(a, out, is_float(t) ? t : kFloat32);
    };
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0] / (abs(t[1]) + 0.5)};
    };
    r.print = [](const Op&, Names n) { return n[0] + " / (" + guarded(n[1], "0.5") + ")"; };
  }
  at(OpKind::maximum) = binary_function("maximum", kiln::maximum, false, false);
  at(OpKind::minimum) = binary_function("minimum", kiln::minimum, false, false);
  {
    // pow(abs(a) + 0.5, b): a positive base for any exponent.
    OpRule& r = at(OpKind::pow) = binary_function("pow", nullptr, false);
    r.infer = [](const Op&, Args a, Results& out) {
      if (a[0]->dtype == kBool || a[1]->dtype == kBool) return std::string("pow of bool");
      DType base = is_float(a[0]->dtype) ? a[0]->dtype : kFloat32;
      return infer_binary(a, out, result_type({{base, a[0]->dim()}, operand(*a[1])}));
    };
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{pow(abs(t[0]) + 0.5, t[1])};
    };
    r.print = [](const Op&, Names n) { return "pow(" + guarded(n[0], "0.5") + ", " + n[1] + ")"; };
  }
  at(OpKind::eq) = binary_function("eq", kiln::eq, true);
  at(OpKind::ne) = binary_function("ne", kiln::ne, true);
  at(OpKind::lt) = binary_function("lt", kiln::lt, true);
  at(OpKind::le) = binary_function("le", kiln::le, true);
  at(OpKind::gt) = binary_function("gt", kiln::gt, true);
  at(OpKind::ge) = binary_function("ge", kiln::ge, true);
  at(OpKind::logical_and) = binary_function("logical_and", kiln::logical_and, true);
  at(OpKind::logical_or) = binary_function("logical_or", kiln::logical_or, true);

  at(OpKind::add_scalar) = scalar_operator("add_scalar", "+");
  at(OpKind::sub_scalar) = scalar_operator("sub_scalar", "-");
  at(OpKind::rsub_scalar) = scalar_operator("rsub_scalar", "-", true);
  at(OpKind::mul_scalar) = scalar_operator("mul_scalar", "*");
  at(OpKind::div_scalar) = scalar_operator("div_scalar", "/");
  at(OpKind::gt_scalar) = scalar_comparison("gt", kiln::gt);
  at(OpKind::lt_scalar) = scalar_comparison("lt", kiln::lt);
  {
    OpRule& r = at(OpKind::pow_scalar);
    r.name = "pow_scalar";
    r.infer = [](const Op& op, Args a, Results& out) {
      const HostScalar& e = op.scalars.at(0);
      if (a[0]->dtype == kBool) return std::string("pow of bool");
      DType base = plain_power(e) || is_float(a[0]->dtype) ? a[0]->dtype : kFloat32;
      set_result(out, a[0]->sizes, result_type({{base, a[0]->dim()}, operand(e)}), a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      const HostScalar& e = op.scalars[0];
      return std::vector<Tensor>{plain_power(e) ? pow(t[0], e.scalar())
                                                : pow(abs(t[0]) + 0.5, e.scalar())};
    };
    r.print = [](const Op& op, Names n) {
      const HostScalar& e = op.scalars[0];
      return "pow(" + (plain_power(e) ? n[0] : guarded(n[0], "0.5")) + ", " + e.str() + ")";
    };
  }
  {
    OpRule& r = at(OpKind::clamp);
    r.name = "clamp";
    r.infer = [](const Op& op, Args a, Results& out) {
      if (auto e = infer_clamp_bounds(op, a[0]->dtype); !e.empty()) return e;
      set_result(out, a[0]->sizes, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{clamp(t[0], bound(op, 0), bound(op, 1))};
    };
    r.print = [](const Op& op, Names n) { return "clamp(" + n[0] + ", " + print_bounds(op) + ")"; };
  }
  {
    OpRule& r = at(OpKind::clamp_tensor);
    r.name = "clamp_tensor";
    r.infer = [](const Op&, Args a, Results& out) {
      std::vector<int64_t> s1, s2;
      if (!broadcast_sizes(a[0]->sizes, a[1]->sizes, s1) || !broadcast_sizes(s1, a[2]->sizes, s2))
        return std::string("clamp bounds do not broadcast");
      for (const ValueType* v : a)
        if (v->dtype == kBool) return std::string("clamp of bool");
      set_result(out, s2, result_type({operand(*a[0]), operand(*a[1]), operand(*a[2])}), a);
      return std::string();
    };
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{clamp(t[0], t[1], t[2])};
    };
    r.print = [](const Op&, Names n) { return "clamp(" + n[0] + ", " + n[1] + ", " + n[2] + ")"; };
  }
  {
    OpRule& r = at(OpKind::where);
    r.name = "where";
    r.infer = [](const Op&, Args a, Results& out) {
      if (a[0]->dtype != kBool) return std::string("where's condition must be bool");
      std::vector<int64_t> s1, s2;
      if (!broadcast_sizes(a[0]->sizes, a[1]->sizes, s1) || !broadcast_sizes(s1, a[2]->sizes, s2))
        return std::string("where's operands do not broadcast");
      set_result(out, s2, result_type({operand(*a[1]), operand(*a[2])}), a.subspan(1));
      return std::string();
    };
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{where(t[0], t[1], t[2])};
    };
    r.print = [](const Op&, Names n) { return "where(" + n[0] + ", " + n[1] + ", " + n[2] + ")"; };
  }
  {
    OpRule& r = at(OpKind::where_scalar);
    r.name = "where_scalar";
    r.infer = [](const Op& op, Args a, Results& out) {
      if (a[0]->dtype != kBool) return std::string("where's condition must be bool");
      std::vector<int64_t> s;
      if (!broadcast_sizes(a[0]->sizes, a[1]->sizes, s))
        return std::string("where's operands do not broadcast");
      set_result(out, s, result_type({operand(*a[1]), operand(op.scalars.at(0))}), a.subspan(1));
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{where(t[0], t[1], op.scalars[0].scalar())};
    };
    r.print = [](const Op& op, Names n) {
      return "where(" + n[0] + ", " + n[1] + ", " + op.scalars[0].str() + ")";
    };
  }
  {
    OpRule& r = at(OpKind::lerp);
    r.name = "lerp";
    r.infer = [](const Op&, Args a, Results& out) {
      if (!is_float(a[0]->dtype) || a[0]->dtype != a[1]->dtype)
        return std::string("lerp needs one floating dtype");
      return infer_binary(a, out, a[0]->dtype);
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{lerp(t[0], t[1], op.scalars.at(0).scalar())};
    };
    r.print = [](const Op& op, Names n) {
      return "lerp(" + n[0] + ", " + n[1] + ", " + op.scalars[0].str() + ")";
    };
  }
  {
    OpRule& r = at(OpKind::masked_fill);
    r.name = "masked_fill";
    r.infer = [](const Op& op, Args a, Results& out) {
      if (a[1]->dtype != kBool) return std::string("mask must be bool");
      std::vector<int64_t> s;
      if (!broadcast_sizes(a[0]->sizes, a[1]->sizes, s) || s != a[0]->sizes)
        return std::string("mask does not broadcast to the input");
      if (!is_float(a[0]->dtype) && !op.scalars.at(0).integral)
        return std::string("float fill of an integral tensor");
      set_result(out, a[0]->sizes, a[0]->dtype, a.first(1));
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{masked_fill(t[0], t[1], op.scalars[0].scalar())};
    };
    r.print = [](const Op& op, Names n) {
      return "masked_fill(" + n[0] + ", " + n[1] + ", " + op.scalars[0].str() + ")";
    };
  }

  at(OpKind::sum) = reduction(
      "sum", [](const Tensor& x, IntArrayRef d, bool k) { return sum(x, d, k); },
      ReductionDType::keep_or_int64);
  at(OpKind::mean) = reduction("mean", kiln::mean, ReductionDType::floating);
  at(OpKind::amax) = reduction("amax", kiln::amax, ReductionDType::numeric);
  at(OpKind::amin) = reduction("amin", kiln::amin, ReductionDType::numeric);
  at(OpKind::logsumexp) = reduction("logsumexp", kiln::logsumexp, ReductionDType::floating, true);
  {
    OpRule& r = at(OpKind::var);
    r.name = "var";
    r.infer = [](const Op& op, Args a, Results& out) { return infer_variance(op, a, out, 1); };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{var(t[0], dims_of(op, 2), op.ints[1], op.ints[0] != 0)};
    };
    r.print = [](const Op& op, Names n) { return print_variance("var", op, n); };
  }
  {
    OpRule& r = at(OpKind::var_mean);
    r.name = "var_mean";
    r.results = 2;
    r.infer = [](const Op& op, Args a, Results& out) { return infer_variance(op, a, out, 2); };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      auto [v, m] = var_mean(t[0], dims_of(op, 2), op.ints[1], op.ints[0] != 0);
      return std::vector<Tensor>{v, m};
    };
    r.print = [](const Op& op, Names n) { return print_variance("var_mean", op, n); };
  }
  at(OpKind::softmax) = softmax_like("softmax", false);
  at(OpKind::log_softmax) = softmax_like("log_softmax", true);

  // ---- views and copies ----
  {
    OpRule& r = at(OpKind::transpose) = view_rule("transpose");
    r.infer = [](const Op& op, Args a, Results& out) {
      int64_t d0 = normalize_dim(op.ints.at(0), a[0]->dim()),
              d1 = normalize_dim(op.ints.at(1), a[0]->dim());
      if (d0 < 0 || d1 < 0 || a[0]->dim() == 0) return std::string("transpose dim out of range");
      std::vector<int64_t> s = a[0]->sizes;
      std::swap(s[d0], s[d1]);
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].transpose(op.ints[0], op.ints[1])};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".transpose(" + std::to_string(op.ints[0]) + ", " + std::to_string(op.ints[1]) +
             ")";
    };
  }
  {
    OpRule& r = at(OpKind::permute) = view_rule("permute");
    r.infer = [](const Op& op, Args a, Results& out) {
      if (static_cast<int64_t>(op.ints.size()) != a[0]->dim())
        return std::string("permute needs one dim per dim");
      std::vector<int64_t> s;
      std::set<int64_t> seen;
      for (int64_t d : op.ints) {
        int64_t n = normalize_dim(d, a[0]->dim());
        if (n < 0 || !seen.insert(n).second)
          return std::string("permute dims are not a permutation");
        s.push_back(a[0]->sizes[n]);
      }
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].permute(op.ints)};
    };
    r.print = [](const Op& op, Names n) { return n[0] + ".permute(" + join(op.ints) + ")"; };
  }
  for (OpKind k : {OpKind::reshape, OpKind::view}) {
    bool is_view_op = k == OpKind::view;
    OpRule& r = at(k) = view_rule(is_view_op ? "view" : "reshape");
    r.infer = [is_view_op](const Op& op, Args a, Results& out) {
      if (is_view_op && !a[0]->contiguous)
        return std::string("view of a tensor that may not be contiguous");
      int64_t known = 1, inferred = -1;
      std::vector<int64_t> s = op.ints;
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == -1 && inferred < 0) {
          inferred = static_cast<int64_t>(i);
        } else if (s[i] < 1) {
          return std::string("bad size in reshape");
        } else {
          known *= s[i];
        }
      }
      if (inferred >= 0) {
        if (a[0]->numel() % known) return std::string("reshape sizes do not divide the numel");
        s[inferred] = a[0]->numel() / known;
      }
      int64_t numel = 1;
      for (int64_t v : s) numel *= v;
      if (numel != a[0]->numel()) return std::string("reshape changes the numel");
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [is_view_op](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{is_view_op ? t[0].view(op.ints) : t[0].reshape(op.ints)};
    };
    r.print = [is_view_op](const Op& op, Names n) {
      return n[0] + (is_view_op ? ".view(" : ".reshape(") + join(op.ints) + ")";
    };
  }
  {
    OpRule& r = at(OpKind::slice) = view_rule("slice");
    r.infer = [](const Op& op, Args a, Results& out) {
      if (op.ints.size() != 4 || a[0]->dim() == 0) return std::string("bad slice");
      int64_t d = normalize_dim(op.ints[0], a[0]->dim());
      if (d < 0) return std::string("slice dim out of range");
      int64_t size = a[0]->sizes[d], start = op.ints[1], stop = std::min(op.ints[2], size),
              step = op.ints[3];
      if (start < 0 || start >= stop || step < 1) return std::string("empty or reversed slice");
      std::vector<int64_t> s = a[0]->sizes;
      s[d] = (stop - start + step - 1) / step;
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].slice(op.ints[0], op.ints[1], op.ints[2], op.ints[3])};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".slice(" + std::to_string(op.ints[0]) + ", " + std::to_string(op.ints[1]) +
             ", " + std::to_string(op.ints[2]) + ", " + std::to_string(op.ints[3]) + ")";
    };
  }
  {
    OpRule& r = at(OpKind::select) = view_rule("select");
    r.infer = [](const Op& op, Args a, Results& out) {
      if (a[0]->dim() == 0) return std::string("select of a 0-dim tensor");
      int64_t d = normalize_dim(op.ints.at(0), a[0]->dim());
      if (d < 0) return std::string("select dim out of range");
      int64_t i = op.ints.at(1), size = a[0]->sizes[d];
      if (i < -size || i >= size) return std::string("select index out of range");
      std::vector<int64_t> s = a[0]->sizes;
      s.erase(s.begin() + d);
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].select(op.ints[0], op.ints[1])};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".select(" + std::to_string(op.ints[0]) + ", " + std::to_string(op.ints[1]) +
             ")";
    };
  }
  {
    OpRule& r = at(OpKind::unsqueeze) = view_rule("unsqueeze");
    r.infer = [](const Op& op, Args a, Results& out) {
      int64_t rank = a[0]->dim() + 1, d = op.ints.at(0);
      if (d < -rank || d >= rank) return std::string("unsqueeze dim out of range");
      if (d < 0) d += rank;
      std::vector<int64_t> s = a[0]->sizes;
      s.insert(s.begin() + d, 1);
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].unsqueeze(op.ints[0])};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".unsqueeze(" + std::to_string(op.ints[0]) + ")";
    };
  }
  {
    OpRule& r = at(OpKind::squeeze) = view_rule("squeeze");
    r.infer = [](const Op& op, Args a, Results& out) {
      if (a[0]->dim() == 0) return std::string("squeeze of a 0-dim tensor");
      int64_t d = normalize_dim(op.ints.at(0), a[0]->dim());
      if (d < 0) return std::string("squeeze dim out of range");
      std::vector<int64_t> s = a[0]->sizes;
      if (s[d] == 1) s.erase(s.begin() + d);
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].squeeze(op.ints[0])};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".squeeze(" + std::to_string(op.ints[0]) + ")";
    };
  }
  {
    OpRule& r = at(OpKind::expand) = view_rule("expand");
    r.infer = [](const Op& op, Args a, Results& out) {
      const std::vector<int64_t>& from = a[0]->sizes;
      if (op.ints.size() < from.size()) return std::string("expand to fewer dims");
      size_t lead = op.ints.size() - from.size();
      std::vector<int64_t> s(op.ints.size());
      for (size_t i = 0; i < s.size(); ++i) {
        int64_t want = op.ints[i];
        if (i < lead) {
          if (want < 1) return std::string("expand: a new dim needs a size");
          s[i] = want;
        } else {
          int64_t have = from[i - lead];
          if (want == -1) want = have;
          if (want < 1 || (have != 1 && want != have))
            return std::string("expand of a non-singleton dim");
          s[i] = want;
        }
      }
      set_result(out, s, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{t[0].expand(op.ints)};
    };
    r.print = [](const Op& op, Names n) { return n[0] + ".expand(" + join(op.ints) + ")"; };
  }
  for (OpKind k : {OpKind::contiguous, OpKind::clone}) {
    bool copy = k == OpKind::clone;
    OpRule& r = at(k) = view_rule(copy ? "clone" : "contiguous");
    r.infer = [](const Op&, Args a, Results& out) {
      set_result(out, a[0]->sizes, a[0]->dtype, a);
      return std::string();
    };
    r.run = [copy](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{copy ? t[0].clone() : t[0].contiguous()};
    };
    r.print = [copy](const Op&, Names n) { return n[0] + (copy ? ".clone()" : ".contiguous()"); };
  }
  {
    OpRule& r = at(OpKind::to_dtype) = view_rule("to_dtype");
    r.infer = [](const Op& op, Args a, Results& out) {
      DType t = static_cast<DType>(op.ints.at(0));
      if (!is_float(t) && a[0]->requires_grad)
        return std::string("conversion of a grad tensor to an integral dtype");
      set_result(out, a[0]->sizes, t, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext& context) {
      DType to = static_cast<DType>(op.ints[0]);
      if (context.float64_reference && is_float(to)) to = kFloat64;
      return std::vector<Tensor>{t[0].to(to)};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".to(" + dtype_cpp(static_cast<DType>(op.ints[0])) + ")";
    };
  }
  {
    OpRule& r = at(OpKind::cat);
    r.name = "cat";
    r.infer = [](const Op& op, Args a, Results& out) {
      if (a.empty()) return std::string("cat of nothing");
      int64_t rank = a[0]->dim();
      if (rank == 0) return std::string("cat of 0-dim tensors");
      int64_t d = normalize_dim(op.ints.at(0), rank);
      if (d < 0) return std::string("cat dim out of range");
      std::vector<int64_t> s = a[0]->sizes;
      s[d] = 0;
      DType t = a[0]->dtype;
      for (const ValueType* v : a) {
        if (v->dim() != rank) return std::string("cat of different ranks");
        for (int64_t i = 0; i < rank; ++i)
          if (i != d && v->sizes[i] != a[0]->sizes[i])
            return std::string("cat of mismatched sizes");
        s[d] += v->sizes[d];
        t = promote_types(t, v->dtype);
      }
      set_result(out, s, t, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{cat(std::vector<Tensor>(t.begin(), t.end()), op.ints[0])};
    };
    r.print = [](const Op& op, Names n) {
      std::string s = "cat({";
      for (size_t i = 0; i < n.size(); ++i) s += (i ? ", " : "") + n[i];
      return s + "}, " + std::to_string(op.ints[0]) + ")";
    };
  }

  // ---- GEMM, convolution, normalization ----
  auto same_float_dtype = [](Args a) {
    DType t = a[0]->dtype;
    if (!is_float(t)) return false;
    for (const ValueType* v : a)
      if (v && v->dtype != t) return false;
    return true;
  };
  {
    OpRule& r = at(OpKind::matmul);
    r.name = "matmul";
    r.infer = [same_float_dtype](const Op&, Args a, Results& out) {
      if (!same_float_dtype(a)) return std::string("matmul needs one floating dtype");
      std::vector<int64_t> x = a[0]->sizes, y = a[1]->sizes;
      if (x.empty() || y.empty()) return std::string("matmul of a 0-dim tensor");
      bool vector_x = x.size() == 1, vector_y = y.size() == 1;
      if (vector_x) x.insert(x.begin(), 1);
      if (vector_y) y.push_back(1);
      if (x.back() != y[y.size() - 2]) return std::string("matmul inner sizes differ");
      std::vector<int64_t> batch;
      if (!broadcast_sizes({x.begin(), x.end() - 2}, {y.begin(), y.end() - 2}, batch))
        return std::string("matmul batch dims do not broadcast");
      if (!vector_x) batch.push_back(x[x.size() - 2]);
      if (!vector_y) batch.push_back(y.back());
      set_result(out, batch, a[0]->dtype, a);
      return std::string();
    };
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{matmul(t[0], t[1])};
    };
    r.print = [](const Op&, Names n) { return "matmul(" + n[0] + ", " + n[1] + ")"; };
  }
  {
    OpRule& r = at(OpKind::linear);
    r.name = "linear";
    r.infer = [same_float_dtype](const Op&, Args a, Results& out) {
      if (!same_float_dtype(a)) return std::string("linear needs one floating dtype");
      const ValueType &x = *a[0], &w = *a[1];
      if (x.dim() < 1 || w.dim() != 2 || x.sizes.back() != w.sizes[1])
        return std::string("linear shapes");
      if (a[2] && (a[2]->dim() != 1 || a[2]->sizes[0] != w.sizes[0]))
        return std::string("linear bias shape");
      std::vector<int64_t> s = x.sizes;
      s.back() = w.sizes[0];
      set_result(out, s, x.dtype, a);
      return std::string();
    };
    r.run = [](const Op&, Tensors t, const RunContext&) {
      return std::vector<Tensor>{linear(t[0], t[1], t[2])};
    };
    r.print = [](const Op& op, Names n) {
      return "linear(" + n[0] + ", " + n[1] + (op.args[2] >= 0 ? ", " + n[2] : std::string()) + ")";
    };
  }
  {
    OpRule& r = at(OpKind::conv2d);
    r.name = "conv2d";
    r.infer = [same_float_dtype](const Op& op, Args a, Results& out) {
      if (!same_float_dtype(a)) return std::string("conv2d needs one floating dtype");
      if (op.ints.size() != 3) return std::string("conv2d needs stride, padding, groups");
      const ValueType &x = *a[0], &w = *a[1];
      int64_t stride = op.ints[0], padding = op.ints[1], groups = op.ints[2];
      if (x.dim() != 4 || w.dim() != 4 || stride < 1 || padding < 0 || groups < 1)
        return std::string("conv2d shapes");
      if (x.sizes[1] % groups || w.sizes[0] % groups || w.sizes[1] * groups != x.sizes[1])
        return std::string("conv2d channels");
      if (a[2] && (a[2]->dim() != 1 || a[2]->sizes[0] != w.sizes[0]))
        return std::string("conv2d bias shape");
      int64_t h = (x.sizes[2] + 2 * padding - w.sizes[2]) / stride + 1;
      int64_t wd = (x.sizes[3] + 2 * padding - w.sizes[3]) / stride + 1;
      if (x.sizes[2] + 2 * padding < w.sizes[2] || x.sizes[3] + 2 * padding < w.sizes[3])
        return std::string("conv2d kernel larger than the input");
      set_result(out, {x.sizes[0], w.sizes[0], h, wd}, x.dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      int64_t s = op.ints[0], p = op.ints[1];
      return std::vector<Tensor>{conv2d(t[0], t[1], t[2], {s, s}, {p, p}, {1, 1}, op.ints[2])};
    };
    r.print = [](const Op& op, Names n) {
      std::string s = std::to_string(op.ints[0]), p = std::to_string(op.ints[1]);
      return "conv2d(" + n[0] + ", " + n[1] + ", " + (op.args[2] >= 0 ? n[2] : "Tensor()") + ", {" +
             s + ", " + s + "}, {" + p + ", " + p + "}, {1, 1}, " + std::to_string(op.ints[2]) +
             ")";
    };
  }
  {
    OpRule& r = at(OpKind::batch_norm);
    r.name = "batch_norm";
    r.infer = [same_float_dtype](const Op& op, Args a, Results& out) {
      if (!same_float_dtype(a)) return std::string("batch_norm needs one floating dtype");
      const ValueType& x = *a[0];
      if (x.dim() < 2) return std::string("batch_norm needs (N, C, ...)");
      int64_t channels = x.sizes[1];
      for (size_t i = 1; i < a.size(); ++i)
        if (a[i] && (a[i]->dim() != 1 || a[i]->sizes[0] != channels))
          return std::string("batch_norm parameter shape");
      bool training = op.ints.at(0) != 0;
      if (training && x.numel() / channels < 2)
        return std::string("batch_norm training needs 2 values per channel");
      if (training) {
        // The running statistics are written in place.
        if (a[1]->storage == a[2]->storage) return std::string("running statistics share memory");
        for (int i : {1, 2}) {
          if (a[i]->requires_grad) return std::string("running statistics require grad");
          if (auto e = check_in_place_target(*a[i], a[i]->dtype); !e.empty()) return e;
        }
      }
      set_result(out, x.sizes, x.dtype, a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      return std::vector<Tensor>{batch_norm(t[0], t[1], t[2], t[3], t[4], op.ints[0] != 0,
                                            op.scalars[0].value, op.scalars[1].value)};
    };
    r.print = [](const Op& op, Names n) {
      auto optional = [&](int i) { return op.args[i] >= 0 ? n[i] : std::string("Tensor()"); };
      return "batch_norm(" + n[0] + ", " + n[1] + ", " + n[2] + ", " + optional(3) + ", " +
             optional(4) + ", " + (op.ints[0] ? "true" : "false") + ", " + op.scalars[0].str() +
             ", " + op.scalars[1].str() + ")";
    };
  }

  // ---- in place ----
  {
    for (bool subtract : {false, true}) {
      OpRule& r = at(subtract ? OpKind::sub_ : OpKind::add_);
      r = in_place_binary(subtract ? "sub_" : "add_", nullptr);
      r.infer = [](const Op& op, Args a, Results& out) {
        if (a[0]->dtype == kBool || a[1]->dtype == kBool)
          return std::string("in-place arithmetic on bool");
        DType t = result_type({operand(*a[0]), operand(*a[1])});
        if (!is_float(t) && !op.scalars.empty() && !op.scalars[0].integral)
          return std::string("float alpha, integral result");
        if (auto e = check_in_place_target(*a[0], t); !e.empty()) return e;
        if (auto e = check_in_place_operand(*a[0], *a[1]); !e.empty()) return e;
        out = in_place_result(*a[0], a);
        return std::string();
      };
      r.run = [subtract](const Op& op, Tensors t, const RunContext&) {
        Tensor target = t[0];
        Scalar alpha = op.scalars.empty() ? Scalar(1) : op.scalars[0].scalar();
        if (subtract) {
          target.sub_(t[1], alpha);
        } else {
          target.add_(t[1], alpha);
        }
        return std::vector<Tensor>{target};
      };
      r.print = [subtract](const Op& op, Names n) {
        std::string alpha = op.scalars.empty() ? "" : ", " + op.scalars[0].str();
        return n[0] + (subtract ? ".sub_(" : ".add_(") + n[1] + alpha + ")";
      };
    }
  }
  at(OpKind::mul_) =
      in_place_binary("mul_", static_cast<Tensor& (Tensor::*)(const Tensor&)>(&Tensor::mul_));
  at(OpKind::maximum_) = in_place_binary("maximum_", &Tensor::maximum_);
  {
    OpRule& r = at(OpKind::div_) = in_place_binary("div_", nullptr, true);
    r.run = [](const Op&, Tensors t, const RunContext&) {
      Tensor target = t[0];
      target.div_(abs(t[1]) + 0.5);
      return std::vector<Tensor>{target};
    };
    r.print = [](const Op&, Names n) { return n[0] + ".div_(" + guarded(n[1], "0.5") + ")"; };
  }
  {
    OpRule& r = at(OpKind::copy_) = in_place_binary("copy_", &Tensor::copy_);
    r.infer = [](const Op&, Args a, Results& out) {
      if (auto e = check_in_place_target(*a[0], a[0]->dtype); !e.empty()) return e;
      if (auto e = check_in_place_operand(*a[0], *a[1]); !e.empty()) return e;
      if (a[1]->requires_grad && !is_float(a[0]->dtype))
        return std::string("copy of a grad tensor into an integral one");
      out = in_place_result(*a[0], a);
      return std::string();
    };
  }
  {
    OpRule& r = at(OpKind::lerp_);
    r = in_place_binary("lerp_", nullptr);
    r.infer = [](const Op&, Args a, Results& out) {
      if (!is_float(a[0]->dtype) || a[0]->dtype != a[1]->dtype)
        return std::string("lerp_ needs one floating dtype");
      if (auto e = check_in_place_target(*a[0], a[0]->dtype); !e.empty()) return e;
      if (auto e = check_in_place_operand(*a[0], *a[1]); !e.empty()) return e;
      out = in_place_result(*a[0], a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      Tensor target = t[0];
      target.lerp_(t[1], op.scalars.at(0).scalar());
      return std::vector<Tensor>{target};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".lerp_(" + n[1] + ", " + op.scalars[0].str() + ")";
    };
  }
  {
    OpRule& r = at(OpKind::masked_fill_);
    r = in_place_binary("masked_fill_", nullptr);
    r.infer = [](const Op& op, Args a, Results& out) {
      if (a[1]->dtype != kBool) return std::string("mask must be bool");
      if (!is_float(a[0]->dtype) && !op.scalars.at(0).integral)
        return std::string("float fill of an integral tensor");
      if (auto e = check_in_place_target(*a[0], a[0]->dtype); !e.empty()) return e;
      if (auto e = check_in_place_operand(*a[0], *a[1]); !e.empty()) return e;
      out = in_place_result(*a[0], a.first(1));
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      Tensor target = t[0];
      target.masked_fill_(t[1], op.scalars.at(0).scalar());
      return std::vector<Tensor>{target};
    };
    r.print = [](const Op& op, Names n) {
      return n[0] + ".masked_fill_(" + n[1] + ", " + op.scalars[0].str() + ")";
    };
  }
  at(OpKind::add_scalar_) = in_place_scalar("add_scalar_", "add_");
  at(OpKind::sub_scalar_) = in_place_scalar("sub_scalar_", "sub_");
  at(OpKind::mul_scalar_) = in_place_scalar("mul_scalar_", "mul_");
  at(OpKind::div_scalar_) = in_place_scalar("div_scalar_", "div_");
  at(OpKind::fill_) = in_place_scalar("fill_", "fill_");
  at(OpKind::pow_) = in_place_scalar("pow_", "pow_");
  {
    OpRule& r = at(OpKind::clamp_);
    r.name = "clamp_";
    r.in_place = true;
    r.infer = [](const Op& op, Args a, Results& out) {
      if (auto e = infer_clamp_bounds(op, a[0]->dtype); !e.empty()) return e;
      if (auto e = check_in_place_target(*a[0], a[0]->dtype); !e.empty()) return e;
      out = in_place_result(*a[0], a);
      return std::string();
    };
    r.run = [](const Op& op, Tensors t, const RunContext&) {
      Tensor target = t[0];
      target.clamp_(bound(op, 0), bound(op, 1));
      return std::vector<Tensor>{target};
    };
    r.print = [](const Op& op, Names n) { return n[0] + ".clamp_(" + print_bounds(op) + ")"; };
  }
  at(OpKind::neg_) = in_place_unary("neg_", &Tensor::neg_, false);
  at(OpKind::relu_) = in_place_unary("relu_", &Tensor::relu_, false);
  at(OpKind::sigmoid_) = in_place_unary("sigmoid_", &Tensor::sigmoid_, true);
  at(OpKind::tanh_) = in_place_unary("tanh_", &Tensor::tanh_, true);
  at(OpKind::exp_) = in_place_unary("exp_", &Tensor::exp_, true);
  at(OpKind::zero_) = in_place_unary("zero_", &Tensor::zero_, false);
  return t;
}

}  // namespace

const OpRule& rule(OpKind kind) {
  static const std::array<OpRule, kNumOpKinds> rules = make_rules();
  return rules[static_cast<int>(kind)];
}

}  // namespace kiln::differential
