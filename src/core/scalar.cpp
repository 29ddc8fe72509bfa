#include "kiln/scalar.h"

#include "kiln/error.h"

#include <cstdio>

namespace kiln {

DType Scalar::dtype() const {
  switch (kind_) {
    case Kind::boolean: return DType::bool_;
    case Kind::integral: return DType::int64;
    case Kind::floating: return default_dtype();
  }
  return DType::int64;
}

std::string Scalar::str() const {
  switch (kind_) {
    case Kind::boolean: return i_ ? "True" : "False";
    case Kind::integral: return std::to_string(i_);
    case Kind::floating: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", d_);
      return buf;
    }
  }
  return "";
}

namespace detail {

void throw_scalar_overflow(const Scalar& value, const char* type_name) {
  throw ValueError("[kiln::Scalar] value cannot be converted to type " + std::string(type_name) +
                   " without overflow: " + value.str() + ". Use a dtype that can hold it.");
}

}  // namespace detail
}  // namespace kiln
