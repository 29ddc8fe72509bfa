// 16-bit floating-point storage types. Arithmetic converts to float, as PyTorch's CPU kernels do.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KILN_HD __host__ __device__
#else
#define KILN_HD
#endif

namespace kiln {

namespace detail {
KILN_HD inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
KILN_HD inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

// IEEE 754 binary16.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  KILN_HD Half(float f) : bits(from_float(f)) {}  // NOLINT: implicit like c10::Half
  KILN_HD operator float() const { return to_float(bits); }  // NOLINT

  static constexpr Half from_bits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }

  // Round-to-nearest-even conversion (handles subnormals, inf and nan).
  KILN_HD static uint16_t from_float(float f) {
    uint32_t x = detail::f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // inf or nan
      return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    }
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
    if (abs < 0x38800000u) {  // subnormal or zero in half
      float a = detail::bits_f32(abs);
      // Scale so that the subnormal lsb is 1, and let float rounding do the work.
      float scaled = a * 16777216.0f;  // 2^24
      uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));
      return static_cast<uint16_t>(sign | m);
    }
    uint32_t mant_odd = (abs >> 13) & 1u;
    abs += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
    return static_cast<uint16_t>(sign | (abs >> 13));
  }

  KILN_HD static float to_float(uint16_t h) {
    uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
      float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
      return sign ? -v : v;
    }
    if (exp == 31) return detail::bits_f32(sign | 0x7f800000u | (mant << 13));
    return detail::bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
  }
};

// bfloat16: the top half of a float32, rounded to nearest even.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  KILN_HD BFloat16(float f) : bits(from_float(f)) {}  // NOLINT
  KILN_HD operator float() const { return detail::bits_f32(static_cast<uint32_t>(bits) << 16); }  // NOLINT

  static constexpr BFloat16 from_bits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
  KILN_HD static uint16_t from_float(float f) {
    uint32_t x = detail::f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
    uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>((x + rounding) >> 16);
  }
};

}  // namespace kiln
