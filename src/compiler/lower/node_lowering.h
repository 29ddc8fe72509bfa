// How each pointwise and reduction op of the op table becomes loop IR: the scalar expression of a
// pointwise op (written with the functors of kiln/math/functors.h, the same ones the eager kernels
// use, so compiled and eager results agree), and the parameters of a reduction.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "compiler/lower/loop_ir.h"

namespace kiln::compiler::lower {

// Builds expressions into a kernel under construction.
class ExprBuilder {
 public:
  ExprBuilder(Kernel& k, const Graph& g) : k_(k), g_(g) {}
  int add(Expr e);
  int cast(int e, DType to);
  int call(std::string code, std::vector<int> args, DType dtype);
  int constant(double v, DType dtype);
  // Attr `attr` of node `node` as an expression of type `dtype`: a run-time scalar when the graph
  // has a scalar slot for it, else its value.
  int attr(int node, int attr, DType dtype);
  const Expr& at(int e) const { return k_.exprs[e]; }

 private:
  Kernel& k_;
  const Graph& g_;
};

// Whether the code generator handles values of this dtype.
bool codegen_dtype(DType t);
// Whether a kernel on `device` can read value `v`: one on the same device, or (CUDA) a 0-dim CPU
// value, passed by value.
bool kernel_operand(const ValueInfo& v, const Device& device);
// The C++ type name of a dtype ("float", "int64_t", ...).
const char* ctype(DType t);

// Whether node `node` of `g` can be lowered into a pointwise kernel.
bool is_lowerable_pointwise(const Graph& g, int node);
// The expression of a lowerable pointwise node, given its tensor inputs' expressions (-1 for None).
int lower_pointwise(ExprBuilder& b, const Graph& g, int node, const std::vector<int>& inputs);

struct ReductionInfo {
  ReduceOp op = ReduceOp::sum;
  std::vector<bool> reduced;  // per input dim
  bool keepdim = false;
  bool mean = false;
  DType acc = DType::float32;
};
// Whether node `node` is a reduction the code generator handles, and how.
std::optional<ReductionInfo> lowerable_reduction(const Graph& g, int node);

}  // namespace kiln::compiler::lower
