// Kiln's headers that generated kernels include (kiln/half.h, kiln/math/functors.h,
// kiln/math/philox.h), embedded in the library at build time by cmake/embed_headers.cmake.
//
// Generated C++ kernels are built against copies of these written into a private build directory
// of the kernel cache, and NVRTC receives them as in-memory headers. Nothing is included from the
// source tree or the install prefix: whoever could write there could otherwise inject code into
// every kernel (DESIGN §2.5), and an installed Kiln stays relocatable.
#pragma once

#include <string_view>
#include <vector>

namespace kiln::detail {

struct EmbeddedHeader {
  std::string_view name;  // as included: "kiln/math/functors.h"
  std::string_view text;  // NUL-terminated (a string literal)
};

// Every embedded header, in a fixed order.
const std::vector<EmbeddedHeader>& embedded_headers();

}  // namespace kiln::detail
