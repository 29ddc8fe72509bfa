// A host number passed to ops (alpha, fill values, clamp bounds): bool, integer or floating.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "kiln/dtype.h"

namespace kiln {

class Scalar {
 public:
  enum class Kind : uint8_t { boolean, integral, floating };

  Scalar() : kind_(Kind::integral), i_(0) {}
  Scalar(bool v) : kind_(Kind::boolean), i_(v) {}  // NOLINT
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Scalar(T v) : kind_(Kind::integral), i_(static_cast<int64_t>(v)) {}  // NOLINT
  template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  Scalar(T v) : kind_(Kind::floating), d_(static_cast<double>(v)) {}  // NOLINT
  Scalar(Half v) : kind_(Kind::floating), d_(static_cast<float>(v)) {}  // NOLINT
  Scalar(BFloat16 v) : kind_(Kind::floating), d_(static_cast<float>(v)) {}  // NOLINT

  Kind kind() const { return kind_; }
  bool is_boolean() const { return kind_ == Kind::boolean; }
  bool is_integral() const { return kind_ == Kind::integral; }
  bool is_floating_point() const { return kind_ == Kind::floating; }

  double to_double() const { return kind_ == Kind::floating ? d_ : static_cast<double>(i_); }
  int64_t to_int() const { return kind_ == Kind::floating ? static_cast<int64_t>(d_) : i_; }
  bool to_bool() const { return kind_ == Kind::floating ? d_ != 0.0 : i_ != 0; }
  template <class T> T to() const {
    if constexpr (std::is_same_v<T, bool>) return to_bool();
    else if constexpr (std::is_integral_v<T>) return static_cast<T>(to_int());
    else if constexpr (std::is_floating_point_v<T>) return static_cast<T>(to_double());
    else return T(static_cast<float>(to_double()));  // Half, BFloat16
  }

  // to<T>() for a value that must be representable in T, as PyTorch's checked conversion of a
  // Scalar: throws ValueError "value cannot be converted to type uint8_t without overflow"
  // otherwise (300 or NaN into uint8, 1e30 into int32, 1e300 into float). A bool target never
  // overflows; an unsigned target takes integers down to -max (they wrap, as in PyTorch);
  // floating targets take inf and NaN. Used wherever a scalar becomes a tensor of a given dtype
  // (full, fill_, scalar index assignment).
  template <class T> T checked_to() const;

  // The dtype a tensor made from this scalar gets: bool, int64, or the default float dtype.
  DType dtype() const;
  std::string str() const;

  friend bool operator==(const Scalar& a, const Scalar& b) {
    return a.kind_ == b.kind_ && (a.kind_ == Kind::floating ? a.d_ == b.d_ : a.i_ == b.i_);
  }

 private:
  Kind kind_;
  union {
    int64_t i_;
    double d_;
  };
};

namespace detail {
[[noreturn]] void throw_scalar_overflow(const Scalar& value, const char* type_name);

template <class T> constexpr const char* c_type_name() {
  if constexpr (std::is_same_v<T, uint8_t>) return "uint8_t";
  else if constexpr (std::is_same_v<T, int8_t>) return "int8_t";
  else if constexpr (std::is_same_v<T, int16_t>) return "int16_t";
  else if constexpr (std::is_same_v<T, int32_t>) return "int";
  else if constexpr (std::is_same_v<T, int64_t>) return "int64_t";
  else if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, Half>) return "kiln::Half";
  else return "kiln::BFloat16";
}

// The largest finite value of T, as a double.
template <class T> constexpr double max_finite() {
  if constexpr (std::is_same_v<T, Half>) return 65504.0;
  else if constexpr (std::is_same_v<T, BFloat16>) return 3.3895313892515355e38;
  else return static_cast<double>(std::numeric_limits<T>::max());
}
}  // namespace detail

template <class T> T Scalar::checked_to() const {
  if constexpr (std::is_same_v<T, bool>) {
    return to_bool();
  } else {
    bool overflow = false;
    if constexpr (std::is_integral_v<T>) {
      constexpr int64_t lo = static_cast<int64_t>(std::numeric_limits<T>::min());
      constexpr int64_t hi = static_cast<int64_t>(std::numeric_limits<T>::max());
      if (kind_ == Kind::integral) {
        overflow = std::is_unsigned_v<T> ? (i_ > hi || i_ < -hi) : (i_ < lo || i_ > hi);
      } else if (kind_ == Kind::floating) {
        // [lo, hi + 1) in doubles, exactly (both ends are powers of two or nearly); NaN fails.
        const double upper = static_cast<double>(hi / 2 + 1) * 2.0;
        overflow = !(d_ >= static_cast<double>(lo) && d_ < upper);
        if (!overflow) return static_cast<T>(d_);
      }
    } else {
      const double v = to_double();  // inf and NaN are representable
      overflow = std::isfinite(v) && (v < -detail::max_finite<T>() || v > detail::max_finite<T>());
    }
    if (overflow) detail::throw_scalar_overflow(*this, detail::c_type_name<T>());
    return to<T>();
  }
}

}  // namespace kiln
