// Building blocks of the ops' pointwise lowerings (kiln/lowering.h): the common shapes of a
// scalar expression, shared by the op definitions in src/ops.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kiln/lowering.h"

namespace kiln::detail {

// "kiln::math::Exp{}($0)": a call of functor `name` of kiln/math/functors.h on `arity` arguments.
std::string functor_call(std::string_view name, size_t arity);

// The C++ type of a dtype in generated code ("float", "int64_t", ...; "void" for dtypes the code
// generators do not handle).
const char* c_type_name(DType t);

// out = F(inputs...), every input converted to the output dtype first.
lowering::Pointwise functor_in_output_dtype(std::string name, size_t arity);
// out = F(a, b) computed in the operands' promoted dtype (comparisons, logical ops), whose bool
// result is converted to the output dtype.
lowering::Pointwise functor_in_common_dtype(std::string name);
// out = F(x) computed in x's own dtype (predicates: isnan, ...).
lowering::Pointwise functor_in_input_dtype(std::string name);

// The dtype the operands of a comparison promote to, where that is simple: every input that is
// not a host scalar has one dtype, and host scalars are of no higher category (bool < integer <
// floating). Otherwise nullopt: the node runs its eager kernel, which promotes in full.
std::optional<DType> simple_common_dtype(const ScalarExprBuilder& b);

}  // namespace kiln::detail
