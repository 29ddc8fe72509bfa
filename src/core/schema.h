// The parameters of an op schema string, parsed for the dispatcher's arity check (op_table.cpp)
// and for the compiler's printers, passes and graph loader (compiler/graph/format.h).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kiln::detail {

// One parameter of an op schema, "Tensor(a!)? running_mean=None" -> {type, name, has_default}.
struct SchemaParam {
  std::string type;
  std::string name;
  bool has_default = false;  // a call may leave it out when every parameter after it is left out too
  bool is_tensor() const { return type.starts_with("Tensor"); }
};
// The parameters of a schema string, in order ("*" dropped). Empty when it does not parse.
std::vector<SchemaParam> parse_schema_params(std::string_view schema);

}  // namespace kiln::detail
