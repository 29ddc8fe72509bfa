// The common shapes of pointwise lowerings (see pointwise_lowering.h).
#include "ops/pointwise_lowering.h"

#include <algorithm>

namespace kiln::detail {

namespace {

int category(DType t) { return t == DType::bool_ ? 0 : is_floating_point(t) ? 2 : 1; }

}  // namespace

const char* c_type_name(DType t) {
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

std::string functor_call(std::string_view name, size_t arity) {
  std::string code = "kiln::math::" + std::string(name) + "{}(";
  for (size_t i = 0; i < arity; ++i) code += (i ? ", $" : "$") + std::to_string(i);
  return code + ")";
}

lowering::Pointwise functor_in_output_dtype(std::string name, size_t arity) {
  return {[code = functor_call(name, arity), arity](ScalarExprBuilder& b) {
    const DType out = b.output_dtype();
    std::vector<int> args;
    for (size_t i = 0; i < arity; ++i) args.push_back(b.input(i, out));
    return b.call(code, std::move(args), out);
  }};
}

lowering::Pointwise functor_in_common_dtype(std::string name) {
  return {[code = functor_call(name, 2)](ScalarExprBuilder& b) {
    std::optional<DType> common = simple_common_dtype(b);
    if (!common) return -1;
    return b.cast(b.call(code, {b.input(0, *common), b.input(1, *common)}, DType::bool_), b.output_dtype());
  }};
}

lowering::Pointwise functor_in_input_dtype(std::string name) {
  return {[code = functor_call(name, 1)](ScalarExprBuilder& b) {
    return b.cast(b.call(code, {b.input(0, b.input_dtype(0))}, DType::bool_), b.output_dtype());
  }};
}

std::optional<DType> simple_common_dtype(const ScalarExprBuilder& b) {
  std::optional<DType> d;
  int host_category = -1;
  for (size_t i = 0; i < b.num_inputs(); ++i) {
    if (!b.has_input(i)) continue;
    if (b.input_is_host_scalar(i)) {
      host_category = std::max(host_category, category(b.input_dtype(i)));
      continue;
    }
    if (d && *d != b.input_dtype(i)) return std::nullopt;
    d = b.input_dtype(i);
  }
  if (!d || host_category > category(*d)) return std::nullopt;
  return d;
}

}  // namespace kiln::detail
