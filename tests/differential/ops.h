// One entry per OpKind: its type rule (a model of Kiln's meta functions: shapes, dtype
// promotion, which dtypes it takes), how it runs, and how it is spelled in C++. Running and
// printing sit side by side so that a printed repro calls exactly what the harness called.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "program.h"

namespace kiln::differential {

struct RunContext {
  // The float64 reference: conversions to float32 convert to float64 instead.
  bool float64_reference = false;
};

struct OpRule {
  std::string_view name;
  int results = 1;
  bool in_place = false;  // writes args[0] and returns it
  // Sizes, dtype and requires_grad of the results from the arguments' types (nullptr for an
  // absent optional tensor), or why Kiln would refuse the op. Memory facts (storage, contiguity)
  // are filled in by infer() from the kind.
  std::function<std::string(const Op&, std::span<const ValueType* const>, std::vector<ValueType>&)>
      infer;
  std::function<std::vector<Tensor>(const Op&, std::span<const Tensor>, const RunContext&)> run;
  // A C++ expression (an in-place op: the call on its target) from the arguments' names.
  std::function<std::string(const Op&, std::span<const std::string>)> print;
};

const OpRule& rule(OpKind kind);

// PyTorch's result_type over tensors (their dims count) and host numbers (wrapped, lowest
// priority): a 0-dim tensor or a number changes the dtype only when of a higher category.
struct Operand {
  DType dtype;
  int64_t dim;
  bool wrapped = false;
};
DType result_type(std::initializer_list<Operand> operands);
Operand operand(const ValueType& v);
Operand operand(const HostScalar& s);

// The broadcast of two shapes, or false when they do not broadcast.
bool broadcast_sizes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                     std::vector<int64_t>& out);

}  // namespace kiln::differential
