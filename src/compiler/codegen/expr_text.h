// Text helpers both code generators (cpp/, cuda/) use to spell loop-IR expressions.
#pragma once

#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::compiler::lower {

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

}  // namespace kiln::compiler::lower
