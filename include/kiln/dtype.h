// Element types, their properties and PyTorch's type-promotion lattice.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kiln/half.h"

namespace kiln {

enum class DType : uint8_t {
  bool_,
  uint8,
  int8,
  int32,
  int64,
  float16,
  bfloat16,
  float32,
  float64,
};
inline constexpr int kNumDTypes = 9;

inline constexpr DType kBool = DType::bool_;
inline constexpr DType kUInt8 = DType::uint8;
inline constexpr DType kInt8 = DType::int8;
inline constexpr DType kInt32 = DType::int32;
inline constexpr DType kInt64 = DType::int64;
inline constexpr DType kFloat16 = DType::float16;
inline constexpr DType kBFloat16 = DType::bfloat16;
inline constexpr DType kFloat32 = DType::float32;
inline constexpr DType kFloat64 = DType::float64;

// Bytes per element.
constexpr int64_t itemsize(DType t) {
  switch (t) {
    case DType::bool_: case DType::uint8: case DType::int8: return 1;
    case DType::float16: case DType::bfloat16: return 2;
    case DType::int32: case DType::float32: return 4;
    case DType::int64: case DType::float64: return 8;
  }
  return 0;
}
constexpr bool is_floating_point(DType t) {
  return t == DType::float16 || t == DType::bfloat16 || t == DType::float32 || t == DType::float64;
}
// Integral types; bool counts only when include_bool is set (PyTorch's isIntegralType).
constexpr bool is_integral(DType t, bool include_bool = false) {
  return t == DType::uint8 || t == DType::int8 || t == DType::int32 || t == DType::int64 ||
         (include_bool && t == DType::bool_);
}
constexpr bool is_signed(DType t) { return t != DType::bool_ && t != DType::uint8; }

// "float32", "int64", "bool", ...
std::string_view dtype_name(DType t);
// Parses the names dtype_name prints (and "float", "double", "half", "long", "int").
DType dtype_from_name(std::string_view name);

// PyTorch's promote_types: the smallest type both operands can be represented in, with the
// category order bool < integral < floating. float16 with bfloat16 gives float32;
// uint8 with int8 gives int16 in PyTorch, which Kiln lacks, so it gives int32.
DType promote_types(DType a, DType b);
// Whether a value of `from` may be written into `to` by an in-place op (same or higher category).
bool can_cast(DType from, DType to);

// The default dtype for floating-point factories and int/bool promotion to float (float32).
DType default_dtype();
void set_default_dtype(DType t);  // float32 or float64

// Maps C++ element types to DType.
template <class T> struct dtype_of;
template <> struct dtype_of<bool> { static constexpr DType value = DType::bool_; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::uint8; };
template <> struct dtype_of<int8_t> { static constexpr DType value = DType::int8; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::int32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::int64; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::float16; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::bfloat16; };
template <> struct dtype_of<float> { static constexpr DType value = DType::float32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::float64; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace kiln

// Calls BODY with `scalar_t` bound to the C++ type of DTYPE. Used by kernels:
//   KILN_DISPATCH_ALL(t.dtype(), "sum", [&] { sum_kernel<scalar_t>(...); });
#define KILN_DTYPE_CASE(ENUM, TYPE, ...) \
  case ::kiln::DType::ENUM: {            \
    using scalar_t = TYPE;               \
    return __VA_ARGS__();                \
  }

#define KILN_DISPATCH_SWITCH(DTYPE, NAME, ...)                                         \
  [&] {                                                                                \
    switch (DTYPE) {                                                                   \
      __VA_ARGS__                                                                      \
      default:                                                                         \
        ::kiln::detail::throw_error<::kiln::DTypeError>(                               \
            std::string("[kiln::") + (NAME) + "] not implemented for dtype " +         \
            std::string(::kiln::dtype_name(DTYPE)) + ". Convert the input with .to(...)."); \
    }                                                                                  \
  }()

#define KILN_DISPATCH_FLOATING(DTYPE, NAME, ...)                 \
  KILN_DISPATCH_SWITCH(DTYPE, NAME,                              \
                       KILN_DTYPE_CASE(float32, float, __VA_ARGS__)    \
                       KILN_DTYPE_CASE(float64, double, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(float16, ::kiln::Half, __VA_ARGS__) \
                       KILN_DTYPE_CASE(bfloat16, ::kiln::BFloat16, __VA_ARGS__))

#define KILN_DISPATCH_INTEGRAL(DTYPE, NAME, ...)                 \
  KILN_DISPATCH_SWITCH(DTYPE, NAME,                              \
                       KILN_DTYPE_CASE(uint8, uint8_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int8, int8_t, __VA_ARGS__)     \
                       KILN_DTYPE_CASE(int32, int32_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int64, int64_t, __VA_ARGS__))

// Integer and bool types (bitwise ops, any/all).
#define KILN_DISPATCH_INTEGRAL_AND_BOOL(DTYPE, NAME, ...)        \
  KILN_DISPATCH_SWITCH(DTYPE, NAME,                              \
                       KILN_DTYPE_CASE(bool_, bool, __VA_ARGS__)      \
                       KILN_DTYPE_CASE(uint8, uint8_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int8, int8_t, __VA_ARGS__)     \
                       KILN_DTYPE_CASE(int32, int32_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int64, int64_t, __VA_ARGS__))

#define KILN_DISPATCH_ALL(DTYPE, NAME, ...)                      \
  KILN_DISPATCH_SWITCH(DTYPE, NAME,                              \
                       KILN_DTYPE_CASE(bool_, bool, __VA_ARGS__)      \
                       KILN_DTYPE_CASE(uint8, uint8_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int8, int8_t, __VA_ARGS__)     \
                       KILN_DTYPE_CASE(int32, int32_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int64, int64_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(float16, ::kiln::Half, __VA_ARGS__) \
                       KILN_DTYPE_CASE(bfloat16, ::kiln::BFloat16, __VA_ARGS__) \
                       KILN_DTYPE_CASE(float32, float, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(float64, double, __VA_ARGS__))

// All numeric types (no bool).
#define KILN_DISPATCH_NUMERIC(DTYPE, NAME, ...)                  \
  KILN_DISPATCH_SWITCH(DTYPE, NAME,                              \
                       KILN_DTYPE_CASE(uint8, uint8_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int8, int8_t, __VA_ARGS__)     \
                       KILN_DTYPE_CASE(int32, int32_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(int64, int64_t, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(float16, ::kiln::Half, __VA_ARGS__) \
                       KILN_DTYPE_CASE(bfloat16, ::kiln::BFloat16, __VA_ARGS__) \
                       KILN_DTYPE_CASE(float32, float, __VA_ARGS__)   \
                       KILN_DTYPE_CASE(float64, double, __VA_ARGS__))
