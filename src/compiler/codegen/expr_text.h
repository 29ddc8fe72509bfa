// Text helpers both code generators (cpp/, cuda/) use to spell loop-IR expressions.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/lowering.h"

namespace kiln::compiler::codegen {

// How an integer of the iteration space (an extent, a stride, an offset, a mean's count) is
// printed: a literal in a static graph. In a dynamic graph (lower::Program::dynamic_sizes) every
// value other than 0 and 1 becomes the kernel's run-time argument z[k] (its value appended to
// `args`, in print order), so that the same graph at another size prints the same source and the
// kernel cache serves it. 0 and 1 stay literal: they decide the loop structure (a broadcast, a
// contiguous access, an empty space), and the frame guards specialize sizes 0 and 1.
// The C++ generator prints z3 instead of z[3]: a local copy its kernel declares on entry
// (`locals`), because the array's loads cannot be hoisted out of loops whose stores might alias it
// (GCC's OpenMP outlining drops the buffers' __restrict), and reloading the sizes on every
// iteration kept the inner loops from vectorizing.
struct IntText {
  std::vector<int64_t>* args = nullptr;  // null: a static graph (literals)
  const char* array = "z";               // how the kernel names its size arguments ("p.z" on CUDA)
  bool locals = false;                   // print array + k (a local copy) instead of array[k]
  bool dynamic() const { return args != nullptr; }
  std::string operator()(int64_t v) const {
    if (!args || v == 0 || v == 1) return std::to_string(v);
    return raw(v);
  }
  // Always an argument (a dynamic graph only): a value derived from sizes, such as a divisor's
  // magic number, whatever it is.
  std::string raw(int64_t v) const {
    args->push_back(v);
    const std::string k = std::to_string(args->size() - 1);
    return locals ? array + k : std::string(array) + "[" + k + "]";
  }
};

// A reduction's result from its accumulator `acc`: for a mean (scale != 1) times 1 / count. A
// dynamic graph's kernel computes that factor from its count argument as the literal was computed
// (1.0 / count in double), then converts it with `convert` ("static_cast<float>" on the CPU,
// "kg::convert<float>" on CUDA); a static one prints the literal.
template <class Literal>
std::string reduction_result(double scale, int64_t mean_count, DType acc, const IntText& ints, Literal literal,
                             const std::string& convert) {
  if (scale == 1) return "acc";
  if (ints.dynamic() && mean_count > 1)
    return "acc * " + convert + "(1.0 / static_cast<double>(" + ints(mean_count) + "))";
  return "acc * " + literal(scale, acc);
}

// prefix + n, built with += (GCC 12 warns falsely (-Wrestrict) on `"e" + std::to_string(n)`).
inline std::string numbered(const char* prefix, int64_t n) {
  std::string s = prefix;
  s += std::to_string(n);
  return s;
}

// An Expr::call's code with each $k replaced by the variable of its k-th argument (e<id>).
inline std::string substitute(const std::string& code, const std::vector<int>& args) {
  std::string out;
  for (size_t i = 0; i < code.size(); ++i) {
    if (code[i] == '$' && i + 1 < code.size() && std::isdigit(static_cast<unsigned char>(code[i + 1]))) {
      size_t j = i + 1;
      int n = 0;
      while (j < code.size() && std::isdigit(static_cast<unsigned char>(code[j]))) n = n * 10 + (code[j++] - '0');
      out += numbered("e", args.at(n));
      i = j - 1;
    } else {
      out += code[i];
    }
  }
  return out;
}

// ---- the one table of reductions (ReduceOp) both generators print ----

// The identity of `op` in type t, through the generator's `literal` (which spells infinities for
// its compiler); integer bounds are written out (NVRTC has no <limits>).
template <class Literal>
std::string reduce_identity(ReduceOp op, DType t, Literal literal) {
  if (op == ReduceOp::sum) return literal(0.0, t);
  const bool max = op == ReduceOp::max;
  if (is_floating_point(t)) return literal(max ? -INFINITY : INFINITY, t);
  switch (t) {
    case DType::int64: return max ? "(-9223372036854775807LL - 1)" : "9223372036854775807LL";
    case DType::int32: return max ? "(-2147483647 - 1)" : "2147483647";
    case DType::int8: return max ? "static_cast<int8_t>(-128)" : "static_cast<int8_t>(127)";
    case DType::uint8: return max ? "static_cast<uint8_t>(0)" : "static_cast<uint8_t>(255)";
    default: return literal(0.0, t);
  }
}

// `a` combined with `b`: a sum, or the NaN-propagating kiln::math::Maximum / Minimum (the
// functors eager's amax/amin kernels use).
inline std::string reduce_combine(ReduceOp op, const std::string& a, const std::string& b) {
  if (op == ReduceOp::sum) return a + " + " + b;
  return std::string("kiln::math::") + (op == ReduceOp::max ? "Maximum" : "Minimum") + "{}(" + a + ", " + b + ")";
}

}  // namespace kiln::compiler::codegen
