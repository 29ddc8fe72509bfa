// A host number passed to ops (alpha, fill values, clamp bounds): bool, integer or floating.
#pragma once

#include <cstdint>
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

}  // namespace kiln
