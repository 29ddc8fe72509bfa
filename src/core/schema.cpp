#include "core/schema.h"

namespace kiln::detail {

std::vector<SchemaParam> parse_schema_params(std::string_view schema) {
  size_t open = schema.find('(');
  if (open == std::string_view::npos) return {};
  std::vector<SchemaParam> params;
  int depth = 0;
  size_t start = open + 1;
  for (size_t i = start; i < schema.size(); ++i) {
    char c = schema[i];
    if (c == '(' || c == '[') ++depth;
    if ((c == ')' || c == ']') && depth > 0) {
      --depth;
      continue;
    }
    if ((c == ',' && depth == 0) || (c == ')' && depth == 0)) {
      std::string_view p = schema.substr(start, i - start);
      while (!p.empty() && p.front() == ' ') p.remove_prefix(1);
      while (!p.empty() && p.back() == ' ') p.remove_suffix(1);
      if (!p.empty() && p != "*") {
        size_t eq = p.find('=');
        std::string_view decl = p.substr(0, eq);
        while (!decl.empty() && decl.back() == ' ') decl.remove_suffix(1);
        size_t space = decl.rfind(' ');
        if (space == std::string_view::npos) return {};
        params.push_back({std::string(decl.substr(0, space)), std::string(decl.substr(space + 1)), eq != std::string_view::npos});
      }
      start = i + 1;
      if (c == ')') return params;
    }
  }
  return {};  // no closing parenthesis
}

}  // namespace kiln::detail
