// One definition of the math: a functor per pointwise op, shared by the eager CPU kernels and
// the C++/CUDA source the compiler generates.
//
// Each functor's operator() takes "opmath" values — float for float16/bfloat16 storage, the
// storage type itself otherwise (double, float, integers, bool) — and returns the op's value in
// that type (comparisons and predicates return bool). Dtype rules (which inputs are allowed, what
// promotes to what) are the op table's business, not this header's: a functor is only ever
// instantiated for the types its op accepts.
//
// float32 transcendentals (exp, log, tanh, sigmoid, erf, gelu, silu) use the branch-free
// polynomial code in kiln::math::fast, on the CPU and on the GPU alike (so eager CUDA, eager CPU and
// generated code give the same bits), and a `#pragma omp simd` loop over them vectorizes; they are
// accurate to a few ulp (gelu's far left tail, where 1 + erf cancels, to 1e-7 absolute, as in
// PyTorch) and handle inf/nan/overflow/underflow like libm. float64 calls std::. floor/ceil are
// built on nearbyint for the same reason (std::floor is a libm call under -ftrapping-math).
// Header-only on purpose: it depends on nothing but <cmath>, <cstdint> and kiln/half.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kiln/half.h"

// Forced inlining: the vectorizer only sees through calls that are inlined, and GCC's heuristics
// give up on the polynomial bodies when they sit a few templates deep inside a kernel loop.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KILN_MATH_INLINE __forceinline__
#elif defined(__GNUC__)
#define KILN_MATH_INLINE inline __attribute__((always_inline))
#else
#define KILN_MATH_INLINE inline
#endif

namespace kiln::math {

// ---------------------------------------------------------------------------------------------
// float32 building blocks (branch-free; every select is a ternary the vectorizer turns into a
// blend). Constants and polynomials are Cephes' (exp, log, tanh) and Eigen's (erf).
// ---------------------------------------------------------------------------------------------
namespace fast {

inline constexpr float kInf = INFINITY;  // the <cmath> macros also work in CUDA device code
inline constexpr float kNaN = NAN;

KILN_HD KILN_MATH_INLINE float with_sign_of(float magnitude, float sign_source) {
  uint32_t m = ::kiln::detail::f32_bits(magnitude) & 0x7fffffffu;
  uint32_t s = ::kiln::detail::f32_bits(sign_source) & 0x80000000u;
  return ::kiln::detail::bits_f32(m | s);
}

// Rounds to the nearest integer (ties to even) for |v| < 2^22, without calling libm.
KILN_HD KILN_MATH_INLINE float round_small(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// exp(x): x = n ln2 + r, |r| <= ln2/2; exp(r) by a degree-7 polynomial; 2^n applied in two steps
// so that results down in the subnormal range round once.
KILN_HD KILN_MATH_INLINE float exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;       // few bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  float xc = x < -104.0f ? -104.0f : x;        // below: 0 after rounding; nan passes
  xc = xc > 89.0f ? 89.0f : xc;                // above: inf
  float n = round_small(xc * kLog2e);
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r) + r + 1.0f;
  int32_t ni = static_cast<int32_t>(n == n ? n : 0.0f);  // n in [-150, 128]
  int32_t n1 = ni >> 1;
  int32_t n2 = ni - n1;
  float s1 = ::kiln::detail::bits_f32(static_cast<uint32_t>(n1 + 127) << 23);
  float s2 = ::kiln::detail::bits_f32(static_cast<uint32_t>(n2 + 127) << 23);
  return y * s1 * s2;
}

// log(x): x = m 2^e with m in [sqrt(1/2), sqrt(2)); log(m) by Cephes' degree-9 polynomial.
// (Selects are on floats: GCC does not if-convert the integer ones.)
KILN_HD KILN_MATH_INLINE float log(float x) {
  constexpr float kMinNormal = 1.17549435e-38f;
  bool subnormal = x < kMinNormal;
  float xs = subnormal ? x * 8388608.0f : x;     // 2^23
  float bias = subnormal ? 149.0f : 126.0f;      // xs = m * 2^(biased exponent - bias)
  uint32_t bits = ::kiln::detail::f32_bits(xs);
  float e = static_cast<float>(static_cast<int32_t>((bits >> 23) & 0xffu)) - bias;
  float m = ::kiln::detail::bits_f32((bits & 0x007fffffu) | 0x3f000000u);  // [0.5, 1)
  bool below = m < 0.707106781186547524f;
  float f = (below ? m : 0.0f) + m - 1.0f;
  e = below ? e - 1.0f : e;
  float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y = y + -2.12194440e-4f * e;
  y = y - 0.5f * z;
  float r = f + y;
  r = r + 0.693359375f * e;
  r = x == kInf ? kInf : r;
  r = x == 0.0f ? -kInf : r;
  r = x < 0.0f ? kNaN : r;
  r = x != x ? x : r;
  return r;
}

// tanh(x): an odd polynomial for |x| < 0.625, 1 - 2 / (exp(2|x|) + 1) above (saturates to ±1).
KILN_HD KILN_MATH_INLINE float tanh(float x) {
  float ax = with_sign_of(x, 0.0f);
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = x + x * z * p;
  float large = with_sign_of(1.0f - 2.0f / (exp(ax + ax) + 1.0f), x);
  return ax < 0.625f ? small : large;
}

KILN_HD KILN_MATH_INLINE float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

// erf(x): Eigen's rational approximation x P(x^2) / Q(x^2) on [-4, 4]; ±1 beyond.
KILN_HD KILN_MATH_INLINE float erf(float a) {
  float x = a > 4.0f ? 4.0f : a;
  x = x < -4.0f ? -4.0f : x;
  float x2 = x * x;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  p = p * x;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return p / q;
}

}  // namespace fast

// ---------------------------------------------------------------------------------------------
// Integer helpers: wrapping arithmetic (two's complement, no UB on overflow), like PyTorch.
// ---------------------------------------------------------------------------------------------
namespace util {

template <class T> struct unsigned_of_impl { using type = std::make_unsigned_t<T>; };
template <> struct unsigned_of_impl<bool> { using type = unsigned; };
template <class T> using unsigned_of = typename unsigned_of_impl<T>::type;

template <class T> KILN_HD KILN_MATH_INLINE T wrapping_add(T a, T b) {
  if constexpr (std::is_same_v<T, bool>) return a || b;
  else return static_cast<T>(static_cast<unsigned_of<T>>(a) + static_cast<unsigned_of<T>>(b));
}
template <class T> KILN_HD KILN_MATH_INLINE T wrapping_sub(T a, T b) {
  return static_cast<T>(static_cast<unsigned_of<T>>(a) - static_cast<unsigned_of<T>>(b));
}
template <class T> KILN_HD KILN_MATH_INLINE T wrapping_mul(T a, T b) {
  if constexpr (std::is_same_v<T, bool>) return a && b;
  else return static_cast<T>(static_cast<unsigned_of<T>>(a) * static_cast<unsigned_of<T>>(b));
}
template <class T> KILN_HD KILN_MATH_INLINE T wrapping_neg(T a) {
  return static_cast<T>(unsigned_of<T>(0) - static_cast<unsigned_of<T>>(a));
}

template <class T> inline constexpr bool is_float_v = std::is_floating_point_v<T>;
template <class T> inline constexpr bool is_signed_int_v = std::is_integral_v<T> && std::is_signed_v<T>;

template <class T> KILN_HD KILN_MATH_INLINE bool is_negative(T a) {
  if constexpr (std::is_unsigned_v<T>) return false;  // includes bool
  else return a < T(0);
}

}  // namespace util

// ---------------------------------------------------------------------------------------------
// Unary
// ---------------------------------------------------------------------------------------------
struct Identity {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return a; }
};

struct Neg {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) return -a;
    else return util::wrapping_neg(a);
  }
};

struct Abs {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) return std::fabs(a);
    else if constexpr (std::is_unsigned_v<T>) return a;
    else return a < T(0) ? util::wrapping_neg(a) : a;  // abs(INT_MIN) wraps to INT_MIN
  }
};

struct Exp {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_same_v<T, float>) {
      return fast::exp(a);
    } else {
      return std::exp(a);
    }
  }
};

struct Log {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_same_v<T, float>) {
      return fast::log(a);
    } else {
      return std::log(a);
    }
  }
};

struct Log1p {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return std::log1p(a); }
};

struct Expm1 {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return std::expm1(a); }
};

struct Sin {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return std::sin(a); }
};

struct Cos {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return std::cos(a); }
};

struct Tan {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return std::tan(a); }
};

struct Tanh {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_same_v<T, float>) {
      return fast::tanh(a);
    } else {
      return std::tanh(a);
    }
  }
};

struct Sigmoid {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return T(1) / (T(1) + Exp{}(-a)); }
};

struct Erf {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_same_v<T, float>) {
      return fast::erf(a);
    } else {
      return std::erf(a);
    }
  }
};

// gelu(x) = x Φ(x) = x/2 (1 + erf(x/√2)). gelu(-inf) is -0 (the limit), not nan.
struct Gelu {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    constexpr T kSqrtHalf = T(0.707106781186547524400844362104849039);
    T r = T(0.5) * a * (T(1) + Erf{}(a * kSqrtHalf));
    return a == -static_cast<T>(INFINITY) ? T(-0.0) : r;
  }
};

// The tanh approximation: x/2 (1 + tanh(u)), u = √(2/π)(x + 0.044715 x³), written as
// x / (1 + exp(-2u)) — the same value without the cancellation for negative x.
struct GeluTanh {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    constexpr T kBeta = T(0.797884560802865355879892119868763737);  // √(2/π)
    constexpr T kKappa = T(0.044715);
    T u = kBeta * (a + kKappa * a * a * a);
    T r = a / (T(1) + Exp{}(-(u + u)));
    return a == -static_cast<T>(INFINITY) ? T(-0.0) : r;
  }
};

// silu(x) = x sigmoid(x); silu(-inf) is -0 (the limit), not nan.
struct Silu {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    T r = a / (T(1) + Exp{}(-a));
    return a == -static_cast<T>(INFINITY) ? T(-0.0) : r;
  }
};

struct Relu {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_unsigned_v<T>) return a;
    else return a < T(0) ? T(0) : a;  // nan stays nan
  }
};

struct Square {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) return a * a;
    else return util::wrapping_mul(a, a);
  }
};

struct Sqrt {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return std::sqrt(a); }
};

struct Rsqrt {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return T(1) / std::sqrt(a); }
};

struct Reciprocal {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const { return T(1) / a; }
};

// -1, 0 or 1 (0 for nan and ±0, like torch.sign); bool stays bool.
struct Sign {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_same_v<T, bool>) return a;
    else if constexpr (std::is_unsigned_v<T>) return static_cast<T>(a != T(0));
    else return static_cast<T>((T(0) < a) - (a < T(0)));
  }
};

// floor and ceil from nearbyint (std::floor is a libm call unless -fno-trapping-math, so it
// would not vectorize): the nearest integer, moved by one when it lies on the wrong side.
struct Floor {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) {
      T r = std::nearbyint(a);
      return r > a ? r - T(1) : r;
    } else {
      return a;
    }
  }
};

struct Ceil {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) {
      T r = std::nearbyint(a);
      return r < a ? r + T(1) : r;
    } else {
      return a;
    }
  }
};

// Half to even, like torch.round (the default rounding mode).
struct Round {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) return std::nearbyint(a);
    else return a;
  }
};

struct Trunc {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (util::is_float_v<T>) return a < T(0) ? Ceil{}(a) : Floor{}(a);
    else return a;
  }
};

struct LogicalNot {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a) const { return a == T(0); }
};

struct IsNan {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a) const {
    if constexpr (util::is_float_v<T>) return a != a;
    else return false;
  }
};

struct IsFinite {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a) const {
    if constexpr (util::is_float_v<T>) return a - a == T(0);  // inf - inf and nan are nan
    else return true;
  }
};

struct BitwiseNot {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a) const {
    if constexpr (std::is_same_v<T, bool>) return !a;
    else return static_cast<T>(~a);
  }
};

// ---------------------------------------------------------------------------------------------
// Binary
// ---------------------------------------------------------------------------------------------
struct Add {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return a + b;
    else return util::wrapping_add(a, b);
  }
};

struct Sub {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return a - b;
    else return util::wrapping_sub(a, b);
  }
};

struct Mul {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return a * b;
    else return util::wrapping_mul(a, b);
  }
};

// a + alpha * b (add with alpha != 1); sub is add with -alpha.
template <class T>
struct AddScaled {
  T alpha;
  KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const { return Add{}(a, Mul{}(alpha, b)); }
};

// True division for floats. For integers: truncation toward zero; the caller rules out b == 0,
// and b == -1 is a negation so INT_MIN / -1 wraps instead of trapping.
struct Div {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return a / b;
    else if constexpr (std::is_unsigned_v<T>) return static_cast<T>(a / b);
    else return b == T(-1) ? util::wrapping_neg(a) : static_cast<T>(a / b);
  }
};

struct TruncDiv {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return Trunc{}(a / b);
    else return Div{}(a, b);
  }
};

// Division rounded toward -inf (Python's //), computed like PyTorch's div_floor.
struct FloorDiv {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) {
      if (b == T(0)) return a / b;
      T mod = std::fmod(a, b);
      T div = (a - mod) / b;
      if (mod != T(0) && (b < T(0)) != (mod < T(0))) div -= T(1);
      if (div == T(0)) return std::copysign(T(0), a / b);
      T floordiv = std::floor(div);
      if (div - floordiv > T(0.5)) floordiv += T(1);
      return floordiv;
    } else if constexpr (std::is_unsigned_v<T>) {
      return static_cast<T>(a / b);
    } else {
      if (b == T(-1)) return util::wrapping_neg(a);
      T q = static_cast<T>(a / b);
      T r = static_cast<T>(a % b);
      return (r != T(0) && ((a < T(0)) != (b < T(0)))) ? static_cast<T>(q - 1) : q;
    }
  }
};

// Remainder with the sign of the divisor (Python's %).
struct Remainder {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) {
      T mod = std::fmod(a, b);
      if (mod != T(0) && (b < T(0)) != (mod < T(0))) mod += b;
      return mod;
    } else if constexpr (std::is_unsigned_v<T>) {
      return static_cast<T>(a % b);
    } else {
      if (b == T(-1)) return T(0);
      T r = static_cast<T>(a % b);
      return (r != T(0) && ((r < T(0)) != (b < T(0)))) ? static_cast<T>(r + b) : r;
    }
  }
};

// Integer powers by squaring (wrapping); negative exponents give 0 except for bases ±1.
struct Pow {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) {
      return std::pow(a, b);
    } else {
      if (util::is_negative(b)) {
        if (a == T(1)) return T(1);
        if (util::is_negative(a) && a == static_cast<T>(-1)) return (b & T(1)) ? a : T(1);
        return T(0);
      }
      T result = T(1);
      T base = a;
      auto e = static_cast<util::unsigned_of<T>>(b);
      while (e) {
        if (e & 1u) result = util::wrapping_mul(result, base);
        base = util::wrapping_mul(base, base);
        e >>= 1;
      }
      return result;
    }
  }
};

// NaN-propagating maximum and minimum (torch.maximum / torch.minimum).
struct Maximum {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return (a > b || a != a) ? a : b;  // b when b is nan
    else return a > b ? a : b;
  }
};

struct Minimum {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    if constexpr (util::is_float_v<T>) return (a < b || a != a) ? a : b;
    else return a < b ? a : b;
  }
};

struct Atan2 {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const { return std::atan2(a, b); }
};

// sqrt(a² + b²) without overflow or underflow in the squares (C's hypot; inf if either is inf).
struct Hypot {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const { return std::hypot(a, b); }
};

struct Eq {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return a == b; }
};
struct Ne {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return a != b; }
};
struct Lt {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return a < b; }
};
struct Le {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return a <= b; }
};
struct Gt {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return a > b; }
};
struct Ge {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return a >= b; }
};

struct LogicalAnd {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return (a != T(0)) && (b != T(0)); }
};
struct LogicalOr {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return (a != T(0)) || (b != T(0)); }
};
struct LogicalXor {
  template <class T> KILN_HD KILN_MATH_INLINE bool operator()(T a, T b) const { return (a != T(0)) != (b != T(0)); }
};

struct BitwiseAnd {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const { return static_cast<T>(a & b); }
};
struct BitwiseOr {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const { return static_cast<T>(a | b); }
};
struct BitwiseXor {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const { return static_cast<T>(a ^ b); }
};

// Shifts by a negative amount or by the bit width or more give 0 (right shifts of negative
// signed values give -1), as in PyTorch.
struct LeftShift {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    constexpr T kBits = static_cast<T>(sizeof(T) * 8);
    if (util::is_negative(b) || b >= kBits) return T(0);
    return static_cast<T>(static_cast<util::unsigned_of<T>>(a) << b);
  }
};
struct RightShift {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T a, T b) const {
    constexpr T kBits = static_cast<T>(sizeof(T) * 8);
    if (util::is_negative(b) || b >= kBits) {
      if constexpr (std::is_signed_v<T>) return util::is_negative(a) ? T(-1) : T(0);
      else return T(0);
    }
    return static_cast<T>(a >> b);
  }
};

// ---------------------------------------------------------------------------------------------
// Ternary
// ---------------------------------------------------------------------------------------------
struct Where {
  template <class C, class T> KILN_HD KILN_MATH_INLINE T operator()(C condition, T a, T b) const {
    return condition ? a : b;
  }
};

// min(max(x, lo), hi) with NaN propagation from every operand; lo > hi gives hi, like torch.clamp.
struct Clamp {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T x, T lo, T hi) const {
    return Minimum{}(Maximum{}(x, lo), hi);
  }
};
struct ClampMin {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T x, T lo) const { return Maximum{}(x, lo); }
};
struct ClampMax {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T x, T hi) const { return Minimum{}(x, hi); }
};

// start + weight (end - start), evaluated from the nearer end for accuracy (PyTorch's lerp).
struct Lerp {
  template <class T> KILN_HD KILN_MATH_INLINE T operator()(T start, T end, T weight) const {
    T w = weight < T(0) ? -weight : weight;
    return w < T(0.5) ? start + weight * (end - start) : end - (end - start) * (T(1) - weight);
  }
};

// self + value * t1 * t2
template <class T>
struct Addcmul {
  T value;
  KILN_HD KILN_MATH_INLINE T operator()(T self, T t1, T t2) const { return Add{}(self, Mul{}(Mul{}(value, t1), t2)); }
};

// self + value * t1 / t2 (floating point only)
template <class T>
struct Addcdiv {
  T value;
  KILN_HD KILN_MATH_INLINE T operator()(T self, T t1, T t2) const { return self + value * (t1 / t2); }
};

}  // namespace kiln::math
