// Kiln's exception hierarchy. Every public entry point validates its input and throws one of
// these with a message of the form "[kiln::op] what went wrong. What to do."
#pragma once

#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Incompatible or invalid sizes, strides, dims.
class ShapeError : public Error { using Error::Error; };
// An operation is not defined for a dtype, or a result cannot be cast to the output dtype.
class DTypeError : public Error { using Error::Error; };
// Tensors on different devices, or a device without a kernel / not available.
class DeviceError : public Error { using Error::Error; };
// An index or dim is out of range.
class IndexError : public Error { using Error::Error; };
// An argument value is invalid (negative size, bad option string, ...).
class ValueError : public Error { using Error::Error; };
// The backend failed to compile a graph.
class CompileError : public Error { using Error::Error; };
// A graph break happened under fullgraph=true.
class GraphBreakError : public Error { using Error::Error; };
// A recompile was refused (fail_on_recompile, recompile limit under fullgraph).
class RecompileError : public Error { using Error::Error; };

namespace detail {
template <class E>
[[noreturn]] void throw_error(std::string msg) {
  throw E(std::move(msg));
}
}  // namespace detail

}  // namespace kiln

// KILN_CHECK(cond, ErrorType, message-expression): throws ErrorType(message) when cond is false.
// The message expression is evaluated only on failure.
#define KILN_CHECK(cond, ErrorType, ...)                                   \
  do {                                                                     \
    if (!(cond)) [[unlikely]]                                              \
      ::kiln::detail::throw_error<::kiln::ErrorType>(std::string(__VA_ARGS__)); \
  } while (0)
