// Philox4x32-10 and the mapping from Kiln's random stream to values (docs/random.md).
//
// Philox (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC'11) is counter-based:
// block(seed, counter) is a pure function, so element i of a random tensor is computed from
// (seed, offset, i) alone, whatever the thread count, chunking or device. Header-only and KILN_HD
// so eager CPU kernels and generated CPU/CUDA code compute the same streams.
//
// The stream of one op call with (seed, offset):
//   32-bit draw d = lane d % 4 of block(seed, offset + d / 4)
//   64-bit draw d = lanes 2(d % 2) (low word) and 2(d % 2) + 1 (high word) of block(seed, offset + d / 2)
// where block(seed, c) = philox4x32_10(counter = {lo32(c), hi32(c), 0, 0}, key = {lo32(seed), hi32(seed)}).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kiln/half.h"

namespace kiln::math {

struct PhiloxBlock {
  uint32_t x[4];
};

inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

// Philox4x32 with 10 rounds on counter (c0..c3) and key (k0, k1), as in Random123.
KILN_HD inline PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                         uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// The four 32-bit words of counter `counter` in the stream keyed by `seed`.
KILN_HD inline PhiloxBlock philox_block(uint64_t seed, uint64_t counter) {
  return philox4x32_10(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// 32-bit draw d of the stream (seed, offset).
KILN_HD inline uint32_t philox_draw32(uint64_t seed, uint64_t offset, uint64_t d) {
  return philox_block(seed, offset + d / 4).x[d % 4];
}

// 64-bit draw d of the stream (seed, offset).
KILN_HD inline uint64_t philox_draw64(uint64_t seed, uint64_t offset, uint64_t d) {
  PhiloxBlock b = philox_block(seed, offset + d / 2);
  unsigned lane = static_cast<unsigned>(d % 2) * 2;
  return static_cast<uint64_t>(b.x[lane]) | (static_cast<uint64_t>(b.x[lane + 1]) << 32);
}

// Counters consumed by `draws` draws of `bits` (32 or 64) bits: 4 or 2 draws per counter.
KILN_HD constexpr uint64_t philox_counters(uint64_t draws, int bits) {
  return bits == 64 ? (draws + 1) / 2 : (draws + 3) / 4;
}

// randint draws 32 bits per element when high - low <= 2^32, else 64 bits.
KILN_HD constexpr int randint_draw_bits(uint64_t range) { return range <= (uint64_t{1} << 32) ? 32 : 64; }

// ---- values from draws ----

// Uniform in [0, 1) with `digits` (<= 24) bits: the top `digits` bits of w, times 2^-digits.
// digits is the significand width of the output type (float 24, float16 11, bfloat16 8), so the
// value and from + (to - from) * value stay below 1 after rounding to that type.
KILN_HD inline float uniform_float(uint32_t w, int digits) {
  return static_cast<float>(static_cast<int32_t>(w >> (32 - digits))) * (1.0f / static_cast<float>(1u << digits));
}

// Uniform in [0, 1) with 53 bits: the top 53 bits of w, times 2^-53.
KILN_HD inline double uniform_double(uint64_t w) {
  return static_cast<double>(w >> 11) * (1.0 / 9007199254740992.0);
}

// Significand bits used for uniform values of each floating type (see uniform_float).
template <class T>
KILN_HD constexpr int uniform_digits() {
  if constexpr (std::is_same_v<T, Half>) return 11;
  else if constexpr (std::is_same_v<T, BFloat16>) return 8;
  else return sizeof(T) == 8 ? 53 : 24;
}

// Bernoulli trial: u = w * 2^-32 (exact in double), success iff u < p. Equivalently
// w < threshold with threshold = ceil(p * 2^32), which bernoulli_threshold computes.
KILN_HD inline uint64_t bernoulli_threshold(double p) {
  if (!(p > 0.0)) return 0;
  if (p >= 1.0) return uint64_t{1} << 32;
  return static_cast<uint64_t>(std::ceil(p * 4294967296.0));
}
KILN_HD inline bool bernoulli_trial(uint32_t w, double p) {
  return static_cast<double>(w) * (1.0 / 4294967296.0) < p;
}

// An integer in [0, range) from a 32-bit draw (range <= 2^32): floor(w * range / 2^32)
// (multiply-shift, no division; each value has probability within range / 2^32 of 1 / range).
KILN_HD inline uint64_t bounded32(uint32_t w, uint64_t range) {
  return (static_cast<uint64_t>(w) * range) >> 32;
}

// An integer in [0, range) from a 64-bit draw: floor(w * range / 2^64).
KILN_HD inline uint64_t bounded64(uint64_t w, uint64_t range) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(w, range);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(w) * range) >> 64);
#endif
}

// ---- float math for Box-Muller ----
// Branch-free forms (Cephes' logf, sinf and cosf polynomials; a Newton square root) written with
// explicit fma and no libm calls, so CPU loops vectorize and CPU and CUDA code produce the same
// bits for float normals.

KILN_HD inline float fma_f(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// log(x) for a normal float x in (0, 1]; within 1 ulp of the exact value.
KILN_HD inline float log_unit(float x) {
  const uint32_t bits = detail::f32_bits(x);
  int e = static_cast<int>(bits >> 23) - 126;                        // x = m * 2^e, m in [0.5, 1)
  float m = detail::bits_f32((bits & 0x007fffffu) | 0x3f000000u);
  const bool low = m < 0.70710678118654752f;                          // keep m - 1 in [-0.29, 0.41]
  e -= low ? 1 : 0;
  m = low ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = fma_f(y, m, -1.1514610310e-1f);
  y = fma_f(y, m, 1.1676998740e-1f);
  y = fma_f(y, m, -1.2420140846e-1f);
  y = fma_f(y, m, 1.4249322787e-1f);
  y = fma_f(y, m, -1.6668057665e-1f);
  y = fma_f(y, m, 2.0000714765e-1f);
  y = fma_f(y, m, -2.4999993993e-1f);
  y = fma_f(y, m, 3.3333331174e-1f);
  y = y * m * z;
  const float fe = static_cast<float>(e);
  y = fma_f(fe, -2.12194440e-4f, y);
  y = fma_f(z, -0.5f, y);
  return fma_f(fe, 0.693359375f, m + y);
}

// sqrt(x) for x >= 0: a bit-trick reciprocal square root, three Newton steps and a final
// fma correction (Markstein), so no libm call (whose errno path stops CPU loops vectorizing).
KILN_HD inline float sqrt_nonneg(float x) {
  float y = detail::bits_f32(0x5f375a86u - (detail::f32_bits(x) >> 1));  // ~1/sqrt(x)
  const float half_x = 0.5f * x;
  y = y * fma_f(-half_x * y, y, 1.5f);
  y = y * fma_f(-half_x * y, y, 1.5f);
  y = y * fma_f(-half_x * y, y, 1.5f);
  const float s = x * y;
  return fma_f(0.5f * y, fma_f(-s, s, x), s);
}

// sin(2 pi t) and cos(2 pi t) for t = k * 2^-24, k in [0, 2^24). With q the nearest quarter
// turn, k - q * 2^22 is exact, leaving an angle in [-pi/4, pi/4] for the polynomials.
struct SinCos {
  float sin, cos;
};
KILN_HD inline SinCos sincos_turns24(uint32_t k) {
  const uint32_t quadrant_raw = (k + (1u << 21)) >> 22;                        // 0..4
  const int32_t r = static_cast<int32_t>(k) - static_cast<int32_t>(quadrant_raw << 22);  // |r| <= 2^21
  const float x = static_cast<float>(r) * (6.28318530717958647692f / 16777216.0f);
  const float z = x * x;
  const float sp = fma_f(fma_f(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f);
  const float sn = fma_f(x * z, sp, x);
  const float cp = fma_f(fma_f(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f);
  const float cs = fma_f(z * z, cp, fma_f(-0.5f, z, 1.0f));
  // Rotate by the quadrant with bit operations (selects and sign flips vectorize as masks).
  const uint32_t quadrant = quadrant_raw & 3u;
  const uint32_t swap = 0u - (quadrant & 1u);                 // all ones in quadrants 1 and 3
  const uint32_t sb = detail::f32_bits(sn), cb = detail::f32_bits(cs);
  const uint32_t rs = (cb & swap) | (sb & ~swap), rc = (sb & swap) | (cb & ~swap);
  const uint32_t sin_sign = (quadrant & 2u) << 30;            // sin: sn, cs, -sn, -cs
  const uint32_t cos_sign = ((quadrant + 1u) & 2u) << 30;     // cos: cs, -sn, -cs, sn
  return SinCos{detail::bits_f32(rs ^ sin_sign), detail::bits_f32(rc ^ cos_sign)};
}

// Box-Muller: two independent standard normals from two draws. With uniforms u1, u2 in [0, 1)
// (1 - u1 is in (0, 1], so the logarithm is finite): r = sqrt(-2 log(1 - u1)),
// z0 = r cos(2 pi u2), z1 = r sin(2 pi u2).
template <class T>
struct NormalPair {
  T z0, z1;
};

// float: 24-bit uniforms (the top 24 bits of each 32-bit draw) and the forms above.
KILN_HD inline NormalPair<float> box_muller32(uint32_t w1, uint32_t w2) {
  const float one_minus_u1 = static_cast<float>(static_cast<int32_t>((1u << 24) - (w1 >> 8))) * (1.0f / 16777216.0f);
  const float r = sqrt_nonneg(-2.0f * log_unit(one_minus_u1));
  const SinCos sc = sincos_turns24(w2 >> 8);
  return {r * sc.cos, r * sc.sin};
}

// double: 53-bit uniforms (uniform_double of each 64-bit draw) and libm.
KILN_HD inline NormalPair<double> box_muller64(uint64_t w1, uint64_t w2) {
  const double u1 = uniform_double(w1), u2 = uniform_double(w2);
  const double r = std::sqrt(-2.0 * std::log(1.0 - u1));
  const double theta = 6.283185307179586476925286766559 * u2;
  return {r * std::cos(theta), r * std::sin(theta)};
}

}  // namespace kiln::math
