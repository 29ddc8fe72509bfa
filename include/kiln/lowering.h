// How compile() lowers an op: the typed `OpDef::lowering` (docs/op_table.md).
//
// The op table is the one place that says how an op becomes generated code. The scheduler, the
// C++ and CUDA code generators and the decomposition pass read an op's Lowering; none of them
// keeps its own list of op names. An op is one of:
//   - Pointwise: one scalar expression per element, built by the op (usually one functor of
//     kiln/math/functors.h, the same functor its eager kernels run) through ScalarExprBuilder;
//   - Reduction: a sum, max or min (optionally a mean) over some dims, with one identity and
//     combiner per ReduceOp (ReduceOp's table in src/compiler/codegen/reduce_ops.h);
//   - Decomposition: a function written in Kiln ops that compile() traces in the op's place;
//   - View, Buffer: no computation (views alias, `empty` only allocates);
//   - Extern (the default): the op's eager kernel runs as a call from the compiled program.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kiln/tensor.h"

namespace kiln {

struct OpCall;

// A non-tensor argument. monostate is None.
using Attr = std::variant<std::monostate, bool, int64_t, double, Scalar, std::vector<int64_t>,
                          std::string, DType, Device>;

// Builds the scalar expression of one element of a pointwise op (the code generators implement
// it). Expressions are handles; every value has a dtype.
class ScalarExprBuilder {
 public:
  virtual ~ScalarExprBuilder() = default;
  // The node's output dtype, and what is known about its inputs and attrs.
  virtual DType output_dtype() const = 0;
  virtual size_t num_inputs() const = 0;
  virtual bool has_input(size_t i) const = 0;  // false for None
  virtual DType input_dtype(size_t i) const = 0;
  // A host scalar wrapped as a 0-dim tensor (`x + 2`): it does not take part in promotion as a
  // tensor does, and eager kernels may specialize on its value.
  virtual bool input_is_host_scalar(size_t i) const = 0;
  virtual const Attr& attr(size_t i) const = 0;  // monostate when absent
  // Input i, converted to `as` as eager's kernels convert.
  virtual int input(size_t i, DType as) = 0;
  // Attr i (a Scalar, double, int or bool) as a value of dtype `as`: a run-time scalar where the
  // compiled graph passes it on each call, else a constant.
  virtual int scalar_attr(size_t i, DType as) = 0;
  // `code` with $0, $1, ... replaced by `args`, of dtype `result`. Functors are called as
  // "kiln::math::Exp{}($0)".
  virtual int call(std::string code, std::vector<int> args, DType result) = 0;
  virtual int cast(int expr, DType to) = 0;
};

// Builds the expression, or returns -1 where the lowering does not cover this call (its dtypes,
// a rounding mode, a host-scalar exponent with its own eager shortcuts, ...): that node then runs
// its eager kernel.
using PointwiseExprFn = std::function<int(ScalarExprBuilder&)>;

// A decomposition, traced with capture on: `call` holds the node's inputs (undefined for None)
// and attrs; `scalars` one 0-dim float64 tensor per Decomposition::scalar_attrs entry. Returns one
// tensor per op output, each a new value (not an input, not a view of one), or {} to leave the
// node as it is (inputs the formula does not cover).
using DecompositionFn = std::function<std::vector<Tensor>(const OpCall& call, std::span<const Tensor> scalars)>;

enum class ReduceOp : uint8_t { sum, max, min };

namespace lowering {

// Runs the op's eager kernel, as an extern call from the compiled program.
struct Extern {};
// A view of input 0: moves no data.
struct View {};
// Allocates an output and computes nothing (`empty`).
struct Buffer {};

struct Pointwise {
  PointwiseExprFn expr;
};

// Reduces input 0 over attr 0 (dims; empty or None: all) keeping dims when attr 1 is true.
struct Reduction {
  ReduceOp op = ReduceOp::sum;
  bool mean = false;  // divides the sum by the number of reduced elements
};

struct Decomposition {
  // Attrs the function reads as 0-dim float64 tensors (after the op's tensor inputs) instead of
  // C++ values: the float attrs that compile() turns into run-time scalars.
  std::vector<int> scalar_attrs;
  DecompositionFn fn;
  // When set, which calls the kiln backend decomposes, by their attrs (training batch norm keeps
  // its fused kernel); unset: every call. Tests may decompose any call.
  std::function<bool(std::span<const Attr> attrs)> applies;
};

}  // namespace lowering

using Lowering = std::variant<lowering::Extern, lowering::View, lowering::Buffer, lowering::Pointwise,
                              lowering::Reduction, lowering::Decomposition>;

// "extern", "view", "buffer", "pointwise", "reduction", "decomposition" (`kiln ops`).
const char* lowering_name(const Lowering& l);

}  // namespace kiln
