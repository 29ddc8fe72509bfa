// Pointwise and reduction lowerings (see node_lowering.h).
#include "compiler/lower/node_lowering.h"

#include <variant>

#include "ops/pointwise_lowering.h"

namespace kiln::compiler::lower {

namespace {

const Attr* attr_of(const Node& n, size_t i) { return i < n.attrs.size() ? &n.attrs[i] : nullptr; }

// The op's view of one node while its lowering builds the expression (kiln/lowering.h).
// `inputs` holds the input expressions (-1 for None); empty while only asking whether the node
// lowers, when inputs are placeholders of their own dtypes.
class NodeExprBuilder final : public ScalarExprBuilder {
 public:
  NodeExprBuilder(ExprBuilder& b, const Graph& g, int node, const std::vector<int>* inputs)
      : b_(b), g_(g), node_(node), n_(g.nodes[node]), inputs_(inputs) {}

  DType output_dtype() const override { return g_.values[n_.outputs[0]].dtype; }
  size_t num_inputs() const override { return n_.inputs.size(); }
  bool has_input(size_t i) const override { return i < n_.inputs.size() && n_.inputs[i] >= 0; }
  DType input_dtype(size_t i) const override { return value(i).dtype; }
  bool input_is_host_scalar(size_t i) const override { return has_input(i) && value(i).is_wrapped_number; }
  const Attr& attr(size_t i) const override {
    static const Attr none;
    const Attr* a = attr_of(n_, i);
    return a ? *a : none;
  }
  int input(size_t i, DType as) override {
    int e = inputs_ ? inputs_->at(i) : b_.constant(0, value(i).dtype);
    return b_.cast(e, as);
  }
  int scalar_attr(size_t i, DType as) override { return b_.attr(node_, static_cast<int>(i), as); }
  int call(std::string code, std::vector<int> args, DType result) override {
    return b_.call(std::move(code), std::move(args), result);
  }
  int cast(int e, DType to) override { return b_.cast(e, to); }

 private:
  const ValueInfo& value(size_t i) const {
    KILN_CHECK(has_input(i), CompileError,
               "[kiln::compile] the lowering of '" + n_.op->name + "' read input " + std::to_string(i) +
                   ", which is None. This is a Kiln bug.");
    return g_.values[n_.inputs[i]];
  }

  ExprBuilder& b_;
  const Graph& g_;
  int node_;
  const Node& n_;
  const std::vector<int>* inputs_;
};

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

const char* ctype(DType t) { return kiln::detail::c_type_name(t); }

bool is_lowerable_pointwise(const Graph& g, int node) {
  const Node& n = g.nodes[node];
  if (!n.op || !n.op->is_fusible()) return false;
  const auto* pointwise = &std::get<lowering::Pointwise>(n.op->lowering);
  if (n.inplace || n.op->may_mutate_inputs() || n.outputs.size() != 1) return false;
  const ValueInfo& out = g.values[n.outputs[0]];
  if (!codegen_dtype(out.dtype) || !(out.device.is_cpu() || out.device.is_cuda())) return false;
  for (int v : n.inputs)
    if (v >= 0 && (!codegen_dtype(g.values[v].dtype) || !kernel_operand(g.values[v], out.device))) return false;
  // The op's lowering decides the rest (rounding modes, host-scalar exponents, dtypes it leaves to
  // eager): it builds the expression into a scratch kernel, and -1 means no.
  Kernel scratch;
  ExprBuilder b(scratch, g);
  NodeExprBuilder view(b, g, node, nullptr);
  return pointwise->expr(view) >= 0;
}

int lower_pointwise(ExprBuilder& b, const Graph& g, int node, const std::vector<int>& in) {
  const Node& n = g.nodes[node];
  NodeExprBuilder view(b, g, node, &in);
  const int e = std::get<lowering::Pointwise>(n.op->lowering).expr(view);
  KILN_CHECK(e >= 0, CompileError,
             "[kiln::compile] the pointwise lowering of '" + n.op->name +
                 "' refused a node is_lowerable_pointwise accepted. This is a Kiln bug.");
  return e;
}

std::optional<ReductionInfo> lowerable_reduction(const Graph& g, int node) {
  const Node& n = g.nodes[node];
  const auto* reduction = n.op ? std::get_if<lowering::Reduction>(&n.op->lowering) : nullptr;
  if (!reduction || n.inplace || n.outputs.size() != 1 || n.inputs.empty() || n.inputs[0] < 0) return std::nullopt;
  const ValueInfo& x = g.values[n.inputs[0]];
  const ValueInfo& y = g.values[n.outputs[0]];
  if (!codegen_dtype(x.dtype) || !codegen_dtype(y.dtype) || !(x.device.is_cpu() || x.device.is_cuda()) ||
      y.device != x.device || x.dtype == DType::bool_)
    return std::nullopt;
  ReductionInfo r;
  r.op = reduction->op;
  r.mean = reduction->mean;
  const int64_t rank = static_cast<int64_t>(x.sizes.size());
  r.reduced.assign(rank, false);
  const std::vector<int64_t>* dims = nullptr;  // read in place (a copy made GCC 12 warn of a bad free)
  if (const Attr* a = attr_of(n, 0); a && std::holds_alternative<std::vector<int64_t>>(*a)) dims = &std::get<std::vector<int64_t>>(*a);
  if (!dims || dims->empty()) {
    r.reduced.assign(rank, true);
  } else {
    for (int64_t d : *dims) {
      int64_t w = d < 0 ? d + rank : d;
      if (w < 0 || w >= rank) return std::nullopt;
      r.reduced[w] = true;
    }
  }
  if (const Attr* a = attr_of(n, 1); a && std::holds_alternative<bool>(*a)) r.keepdim = std::get<bool>(*a);
  if (r.op == ReduceOp::sum) {
    r.acc = is_floating_point(y.dtype) ? DType::float64 : DType::int64;
  } else {
    r.acc = y.dtype;
    if (x.dtype != y.dtype) return std::nullopt;
  }
  return r;
}

}  // namespace kiln::compiler::lower
