// Pointwise and reduction lowerings (see pointwise_rules.h).
#include "compiler/lower/pointwise_rules.h"

#include <map>
#include <variant>

namespace kiln::compiler::lower {

namespace {

enum class Rule : uint8_t {
  unary,       // out = F(cast<out>(x))
  binary,      // out = F(cast<out>(a), cast<out>(b))
  compare,     // out (bool) = F(cast<common>(a), cast<common>(b))
  predicate,   // out (bool) = F(x) in x's dtype
  special,     // handled case by case below
};

struct Lowering {
  Rule rule;
  const char* functor;  // "kiln::math::Exp{}"
};

const std::map<std::string, Lowering, std::less<>>& table() {
  static const std::map<std::string, Lowering, std::less<>> t = {
      {"abs", {Rule::unary, "kiln::math::Abs{}"}},
      {"neg", {Rule::unary, "kiln::math::Neg{}"}},
      {"exp", {Rule::unary, "kiln::math::Exp{}"}},
      {"log", {Rule::unary, "kiln::math::Log{}"}},
      {"log1p", {Rule::unary, "kiln::math::Log1p{}"}},
      {"expm1", {Rule::unary, "kiln::math::Expm1{}"}},
      {"sin", {Rule::unary, "kiln::math::Sin{}"}},
      {"cos", {Rule::unary, "kiln::math::Cos{}"}},
      {"tan", {Rule::unary, "kiln::math::Tan{}"}},
      {"tanh", {Rule::unary, "kiln::math::Tanh{}"}},
      {"sigmoid", {Rule::unary, "kiln::math::Sigmoid{}"}},
      {"erf", {Rule::unary, "kiln::math::Erf{}"}},
      {"relu", {Rule::unary, "kiln::math::Relu{}"}},
      {"silu", {Rule::unary, "kiln::math::Silu{}"}},
      {"sqrt", {Rule::unary, "kiln::math::Sqrt{}"}},
      {"rsqrt", {Rule::unary, "kiln::math::Rsqrt{}"}},
      {"reciprocal", {Rule::unary, "kiln::math::Reciprocal{}"}},
      {"sign", {Rule::unary, "kiln::math::Sign{}"}},
      {"floor", {Rule::unary, "kiln::math::Floor{}"}},
      {"ceil", {Rule::unary, "kiln::math::Ceil{}"}},
      {"round", {Rule::unary, "kiln::math::Round{}"}},
      {"mul", {Rule::binary, "kiln::math::Mul{}"}},
      {"maximum", {Rule::binary, "kiln::math::Maximum{}"}},
      {"minimum", {Rule::binary, "kiln::math::Minimum{}"}},
      {"atan2", {Rule::binary, "kiln::math::Atan2{}"}},
      {"pow", {Rule::binary, "kiln::math::Pow{}"}},
      {"eq", {Rule::compare, "kiln::math::Eq{}"}},
      {"ne", {Rule::compare, "kiln::math::Ne{}"}},
      {"lt", {Rule::compare, "kiln::math::Lt{}"}},
      {"le", {Rule::compare, "kiln::math::Le{}"}},
      {"gt", {Rule::compare, "kiln::math::Gt{}"}},
      {"ge", {Rule::compare, "kiln::math::Ge{}"}},
      {"logical_and", {Rule::compare, "kiln::math::LogicalAnd{}"}},
      {"logical_or", {Rule::compare, "kiln::math::LogicalOr{}"}},
      {"logical_xor", {Rule::compare, "kiln::math::LogicalXor{}"}},
      {"logical_not", {Rule::predicate, "kiln::math::LogicalNot{}"}},
      {"isnan", {Rule::predicate, "kiln::math::IsNan{}"}},
      {"isfinite", {Rule::predicate, "kiln::math::IsFinite{}"}},
      {"add", {Rule::special, nullptr}},
      {"sub", {Rule::special, nullptr}},
      {"div", {Rule::special, nullptr}},
      {"gelu", {Rule::special, nullptr}},
      {"where", {Rule::special, nullptr}},
      {"clamp", {Rule::special, nullptr}},
      {"lerp", {Rule::special, nullptr}},
      {"addcmul", {Rule::special, nullptr}},
      {"addcdiv", {Rule::special, nullptr}},
      {"masked_fill", {Rule::special, nullptr}},
      {"copy", {Rule::special, nullptr}},
  };
  return t;
}

int category(DType t) { return t == DType::bool_ ? 0 : is_floating_point(t) ? 2 : 1; }

// The dtype a comparison computes in: PyTorch's promotion, for the cases where it is simple (all
// dimensioned operands share a dtype; wrapped host scalars of no higher category).
std::optional<DType> common_dtype(const Graph& g, const Node& n) {
  std::optional<DType> d;
  int wrapped_category = -1;
  for (int v : n.inputs) {
    if (v < 0) continue;
    const ValueInfo& vi = g.values[v];
    if (vi.is_wrapped_number) {
      wrapped_category = std::max(wrapped_category, category(vi.dtype));
      continue;
    }
    if (d && *d != vi.dtype) return std::nullopt;
    d = vi.dtype;
  }
  if (!d || wrapped_category > category(*d)) return std::nullopt;
  return d;
}

const Attr* attr_of(const Node& n, size_t i) { return i < n.attrs.size() ? &n.attrs[i] : nullptr; }

}  // namespace

bool codegen_dtype(DType t) {
  switch (t) {
    case DType::float32:
    case DType::float64:
    case DType::int64:
    case DType::int32:
    case DType::int8:
    case DType::uint8:
    case DType::bool_: return true;
    default: return false;
  }
}

bool kernel_operand(const ValueInfo& v, const Device& device) {
  // A CUDA kernel takes a 0-dim CPU tensor (a wrapped host scalar) by value, as eager CUDA does.
  return v.device == device || (device.is_cuda() && v.device.is_cpu() && v.sizes.empty());
}

const char* ctype(DType t) {
  switch (t) {
    case DType::float32: return "float";
    case DType::float64: return "double";
    case DType::int64: return "int64_t";
    case DType::int32: return "int32_t";
    case DType::int8: return "int8_t";
    case DType::uint8: return "uint8_t";
    case DType::bool_: return "bool";
    default: return "void";
  }
}

int ExprBuilder::add(Expr e) {
  k_.exprs.push_back(std::move(e));
  return static_cast<int>(k_.exprs.size()) - 1;
}

int ExprBuilder::cast(int e, DType to) {
  if (k_.exprs[e].dtype == to) return e;
  return call(std::string("static_cast<") + ctype(to) + ">($0)", {e}, to);
}

int ExprBuilder::call(std::string code, std::vector<int> args, DType dtype) {
  Expr e;
  e.kind = Expr::call;
  e.code = std::move(code);
  e.args = std::move(args);
  e.dtype = dtype;
  return add(std::move(e));
}

int ExprBuilder::constant(double v, DType dtype) {
  Expr e;
  e.kind = Expr::constant;
  e.value = v;
  e.dtype = dtype;
  return add(std::move(e));
}

int ExprBuilder::attr(int node, int attr_index, DType dtype) {
  for (size_t k = 0; k < g_.scalars.size(); ++k) {
    if (g_.scalars[k].node == node && g_.scalars[k].attr == attr_index) {
      // Integer scalars travel as int64 (a double would lose bits above 2^53).
      const Attr& example = g_.nodes[node].attrs[attr_index];
      bool integral = std::holds_alternative<int64_t>(example) || std::holds_alternative<bool>(example) ||
                      (std::holds_alternative<Scalar>(example) && !std::get<Scalar>(example).is_floating_point());
      Expr e;
      e.kind = Expr::scalar;
      e.scalar_index = static_cast<int>(k);
      e.dtype = integral && !is_floating_point(dtype) ? DType::int64 : DType::float64;
      return cast(add(std::move(e)), dtype);
    }
  }
  const Attr& a = g_.nodes[node].attrs[attr_index];
  double v = 0;
  if (auto* s = std::get_if<Scalar>(&a)) v = s->to_double();
  else if (auto* d = std::get_if<double>(&a)) v = *d;
  else if (auto* i = std::get_if<int64_t>(&a)) v = static_cast<double>(*i);
  else if (auto* b = std::get_if<bool>(&a)) v = *b;
  return constant(v, dtype);
}

bool is_lowerable_pointwise(const Graph& g, int node) {
  const Node& n = g.nodes[node];
  if (n.inplace || !n.op->mutated_inputs.empty() || n.outputs.size() != 1) return false;
  auto it = table().find(n.op->name);
  if (it == table().end()) return false;
  const ValueInfo& out = g.values[n.outputs[0]];
  if (!codegen_dtype(out.dtype) || !(out.device.is_cpu() || out.device.is_cuda())) return false;
  for (int v : n.inputs)
    if (v >= 0 && (!codegen_dtype(g.values[v].dtype) || !kernel_operand(g.values[v], out.device))) return false;
  const std::string& name = n.op->name;
  if (it->second.rule == Rule::compare && !common_dtype(g, n)) return false;
  if (name == "div") {
    const Attr* mode = attr_of(n, 0);
    if (mode && std::holds_alternative<std::string>(*mode)) {
      const auto& m = std::get<std::string>(*mode);
      if (m != "trunc" && m != "floor") return false;
    }
    // Integer division checks for a zero divisor first (a ValueError, not SIGFPE): eager does it.
    if (!is_floating_point(out.dtype)) return false;
  }
  // pow by a host scalar takes eager's shortcuts (0.5 → sqrt, -1 → reciprocal, ...), whose
  // special values differ from std::pow's: eager runs it.
  if (name == "pow" && n.inputs.size() > 1 && n.inputs[1] >= 0 && g.values[n.inputs[1]].is_wrapped_number)
    return false;
  if (name == "gelu" && !std::holds_alternative<std::string>(n.attrs.at(0))) return false;
  if (name == "copy" && out.dtype == DType::bool_ && n.inputs[0] >= 0 &&
      is_floating_point(g.values[n.inputs[0]].dtype))
    return true;  // static_cast<bool> is x != 0, as in eager
  return true;
}

int lower_pointwise(ExprBuilder& b, const Graph& g, int node, const std::vector<int>& in) {
  const Node& n = g.nodes[node];
  const std::string& name = n.op->name;
  const DType out = g.values[n.outputs[0]].dtype;
  const Lowering& low = table().at(name);
  auto fn = [&](const char* f, std::vector<int> args, DType dt) {
    std::string code = std::string(f) + "(";
    for (size_t i = 0; i < args.size(); ++i) code += (i ? ", $" : "$") + std::to_string(i);
    return b.call(code + ")", std::move(args), dt);
  };
  switch (low.rule) {
    case Rule::unary: return fn(low.functor, {b.cast(in[0], out)}, out);
    case Rule::binary: return fn(low.functor, {b.cast(in[0], out), b.cast(in[1], out)}, out);
    case Rule::compare: {
      DType c = *common_dtype(g, n);
      return b.cast(fn(low.functor, {b.cast(in[0], c), b.cast(in[1], c)}, DType::bool_), out);
    }
    case Rule::predicate: return b.cast(fn(low.functor, {in[0]}, DType::bool_), out);
    case Rule::special: break;
  }
  if (name == "add" || name == "sub") {
    // Eager: a + alpha * b (sub: a - alpha * b); alpha is 1 in most graphs, and 1 * b is exact.
    int alpha = b.attr(node, 0, out);
    int scaled = fn("kiln::math::Mul{}", {alpha, b.cast(in[1], out)}, out);
    return fn(name == "add" ? "kiln::math::Add{}" : "kiln::math::Sub{}", {b.cast(in[0], out), scaled}, out);
  }
  if (name == "div") {
    const char* f = "kiln::math::Div{}";
    if (const Attr* mode = attr_of(n, 0); mode && std::holds_alternative<std::string>(*mode))
      f = std::get<std::string>(*mode) == "trunc" ? "kiln::math::TruncDiv{}" : "kiln::math::FloorDiv{}";
    return fn(f, {b.cast(in[0], out), b.cast(in[1], out)}, out);
  }
  if (name == "gelu") {
    bool tanh = std::get<std::string>(n.attrs[0]) == "tanh";
    return fn(tanh ? "kiln::math::GeluTanh{}" : "kiln::math::Gelu{}", {b.cast(in[0], out)}, out);
  }
  if (name == "where") {
    return fn("kiln::math::Where{}", {b.cast(in[0], DType::bool_), b.cast(in[1], out), b.cast(in[2], out)}, out);
  }
  if (name == "clamp") {
    int x = b.cast(in[0], out);
    bool lo = in.size() > 1 && in[1] >= 0, hi = in.size() > 2 && in[2] >= 0;
    if (lo && hi) return fn("kiln::math::Clamp{}", {x, b.cast(in[1], out), b.cast(in[2], out)}, out);
    if (lo) return fn("kiln::math::ClampMin{}", {x, b.cast(in[1], out)}, out);
    if (hi) return fn("kiln::math::ClampMax{}", {x, b.cast(in[2], out)}, out);
    return x;
  }
  if (name == "lerp") {
    return fn("kiln::math::Lerp{}", {b.cast(in[0], out), b.cast(in[1], out), b.cast(in[2], out)}, out);
  }
  if (name == "addcmul" || name == "addcdiv") {
    int value = b.attr(node, 0, out);
    std::string f = std::string(name == "addcmul" ? "kiln::math::Addcmul<" : "kiln::math::Addcdiv<") + ctype(out) +
                    ">{$0}($1, $2, $3)";
    return b.call(f, {value, b.cast(in[0], out), b.cast(in[1], out), b.cast(in[2], out)}, out);
  }
  if (name == "masked_fill") {
    return fn("kiln::math::Where{}", {b.cast(in[1], DType::bool_), b.cast(in[2], out), b.cast(in[0], out)}, out);
  }
  if (name == "copy") return b.cast(in[0], out);
  throw CompileError("[kiln::compile] no pointwise lowering for '" + name + "'. This is a Kiln bug.");
}

std::optional<ReductionInfo> lowerable_reduction(const Graph& g, int node) {
  const Node& n = g.nodes[node];
  const std::string& name = n.op->name;
  if (n.inplace || n.outputs.size() != 1 || n.inputs.empty() || n.inputs[0] < 0) return std::nullopt;
  if (name != "sum" && name != "mean" && name != "amax" && name != "amin") return std::nullopt;
  const ValueInfo& x = g.values[n.inputs[0]];
  const ValueInfo& y = g.values[n.outputs[0]];
  if (!codegen_dtype(x.dtype) || !codegen_dtype(y.dtype) || !(x.device.is_cpu() || x.device.is_cuda()) ||
      y.device != x.device || x.dtype == DType::bool_)
    return std::nullopt;
  ReductionInfo r;
  r.op = name == "amax" ? "max" : name == "amin" ? "min" : "sum";
  r.mean = name == "mean";
  const int64_t rank = static_cast<int64_t>(x.sizes.size());
  r.reduced.assign(rank, false);
  std::vector<int64_t> dims;
  if (const Attr* a = attr_of(n, 0); a && std::holds_alternative<std::vector<int64_t>>(*a)) dims = std::get<std::vector<int64_t>>(*a);
  if (dims.empty()) {
    r.reduced.assign(rank, true);
  } else {
    for (int64_t d : dims) {
      int64_t w = d < 0 ? d + rank : d;
      if (w < 0 || w >= rank) return std::nullopt;
      r.reduced[w] = true;
    }
  }
  if (const Attr* a = attr_of(n, 1); a && std::holds_alternative<bool>(*a)) r.keepdim = std::get<bool>(*a);
  if (r.op == "sum") {
    r.acc = is_floating_point(y.dtype) ? DType::float64 : DType::int64;
  } else {
    r.acc = y.dtype;
    if (x.dtype != y.dtype) return std::nullopt;
  }
  return r;
}

}  // namespace kiln::compiler::lower
