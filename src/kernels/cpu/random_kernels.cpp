// CPU kernels for the random ops. Each is a pure function of (seed, offset, shape, parameters):
// element i (row-major) takes its draws from the Philox stream by index (kiln/math/philox.h),
// so the result does not depend on the thread count or on how the work is chunked.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/math/philox.h"
#include "kiln/op_table.h"
#include "kernels/random_ops.h"

namespace kiln::cpu {

namespace {

using math::PhiloxBlock;

// Elements per tile: draws are generated into a stack buffer of this many words, then mapped.
constexpr int64_t kTile = 1024;
// Elements per thread below which a random fill stays single-threaded (Philox is ~10 ns/block).
constexpr int64_t kRandomGrain = 16384;

uint64_t u64_attr(const OpCall& c, size_t i) { return static_cast<uint64_t>(c.int_attr(i)); }

// 32-bit draws [d0, d0 + n) of the stream (seed, offset) into w[0, n).
void draws32(uint64_t seed, uint64_t offset, int64_t d0, int64_t n, uint32_t* w) {
  int64_t d = d0, end = d0 + n;
  for (; d < end && d % 4 != 0; ++d) w[d - d0] = math::philox_draw32(seed, offset, d);
  const int64_t blocks = (end - d) / 4;
  const uint64_t c0 = offset + static_cast<uint64_t>(d) / 4;
  uint32_t* __restrict o = w + (d - d0);
#pragma omp simd
  for (int64_t j = 0; j < blocks; ++j) {
    PhiloxBlock b = math::philox_block(seed, c0 + static_cast<uint64_t>(j));
    o[4 * j] = b.x[0];
    o[4 * j + 1] = b.x[1];
    o[4 * j + 2] = b.x[2];
    o[4 * j + 3] = b.x[3];
  }
  for (d += 4 * blocks; d < end; ++d) w[d - d0] = math::philox_draw32(seed, offset, d);
}

// 64-bit draws [d0, d0 + n) of the stream (seed, offset) into w[0, n).
void draws64(uint64_t seed, uint64_t offset, int64_t d0, int64_t n, uint64_t* w) {
  int64_t d = d0, end = d0 + n;
  for (; d < end && d % 2 != 0; ++d) w[d - d0] = math::philox_draw64(seed, offset, d);
  const int64_t blocks = (end - d) / 2;
  const uint64_t c0 = offset + static_cast<uint64_t>(d) / 2;
  uint64_t* __restrict o = w + (d - d0);
#pragma omp simd
  for (int64_t j = 0; j < blocks; ++j) {
    PhiloxBlock b = math::philox_block(seed, c0 + static_cast<uint64_t>(j));
    o[2 * j] = static_cast<uint64_t>(b.x[0]) | (static_cast<uint64_t>(b.x[1]) << 32);
    o[2 * j + 1] = static_cast<uint64_t>(b.x[2]) | (static_cast<uint64_t>(b.x[3]) << 32);
  }
  for (d += 2 * blocks; d < end; ++d) w[d - d0] = math::philox_draw64(seed, offset, d);
}

// A contiguous buffer holding `out`'s row-major elements: `out` itself when it is contiguous,
// else a temporary that commit() copies back (in-place calls on strided views).
class RowMajorTarget {
 public:
  explicit RowMajorTarget(Tensor& out)
      : out_(out),
        buf_(out.is_contiguous() ? out : detail::make_empty(out.sizes().vec(), out.dtype(), out.device())) {}
  template <class T>
  T* data() const {
    return static_cast<T*>(buf_.impl().data());
  }
  void commit() {
    if (!buf_.same(out_)) out_.copy_(buf_);
  }

 private:
  Tensor& out_;
  Tensor buf_;
};

// Calls f(begin, end) over tiles of at most kTile elements of [0, n), in parallel.
template <class F>
void for_each_tile(int64_t n, F&& f) {
  parallel_for(n, kRandomGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t += kTile) f(t, std::min(e, t + kTile));
  });
}

// ---------------- uniform ----------------

template <class T>
void uniform_typed(Tensor& out, uint64_t seed, uint64_t offset, double from_d, double to_d) {
  RowMajorTarget target(out);
  T* data = target.data<T>();
  using M = opmath_t<T>;
  const M from = static_cast<M>(static_cast<T>(from_d));
  const M range = static_cast<M>(static_cast<T>(to_d)) - from;
  for_each_tile(out.numel(), [&](int64_t b, int64_t e) {
    if constexpr (std::is_same_v<T, double>) {
      uint64_t w[kTile];
      draws64(seed, offset, b, e - b, w);
#pragma omp simd
      for (int64_t i = 0; i < e - b; ++i) data[b + i] = math::uniform_double(w[i]) * range + from;
    } else {
      constexpr int digits = math::uniform_digits<T>();
      uint32_t w[kTile];
      draws32(seed, offset, b, e - b, w);
#pragma omp simd
      for (int64_t i = 0; i < e - b; ++i)
        data[b + i] = static_cast<T>(math::uniform_float(w[i], digits) * range + from);
    }
  });
  target.commit();
}

void uniform_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(outs[0].dtype(), "uniform_", [&] {
    uniform_typed<scalar_t>(outs[0], u64_attr(c, 3), u64_attr(c, 4), c.double_attr(1), c.double_attr(2));
  });
}

// ---------------- normal ----------------

// Element i takes the Box-Muller pair made of draws 2*(i/2) and 2*(i/2)+1: the cosine branch
// when i is even, the sine branch when i is odd.
template <class T>
void normal_typed(Tensor& out, uint64_t seed, uint64_t offset, double mean_d, double std_d) {
  RowMajorTarget target(out);
  T* data = target.data<T>();
  using M = opmath_t<T>;
  const M mean = static_cast<M>(mean_d), std_dev = static_cast<M>(std_d);
  for_each_tile(out.numel(), [&](int64_t b, int64_t e) {
    const int64_t d0 = b & ~int64_t{1};              // first draw of the first pair
    const int64_t d1 = ((e - 1) | int64_t{1}) + 1;   // one past the last draw of the last pair
    M z[kTile + 2];
    const int64_t pairs = (d1 - d0) / 2;
    if constexpr (std::is_same_v<T, double>) {
      uint64_t w[kTile + 2];
      draws64(seed, offset, d0, d1 - d0, w);
      for (int64_t j = 0; j < pairs; ++j) {
        math::NormalPair<double> p = math::box_muller64(w[2 * j], w[2 * j + 1]);
        z[2 * j] = p.z0;
        z[2 * j + 1] = p.z1;
      }
    } else {
      uint32_t w[kTile + 2];
      draws32(seed, offset, d0, d1 - d0, w);
#pragma omp simd
      for (int64_t j = 0; j < pairs; ++j) {
        math::NormalPair<float> p = math::box_muller32(w[2 * j], w[2 * j + 1]);
        z[2 * j] = p.z0;
        z[2 * j + 1] = p.z1;
      }
    }
    const M* zb = z + (b - d0);
#pragma omp simd
    for (int64_t i = 0; i < e - b; ++i) data[b + i] = static_cast<T>(zb[i] * std_dev + mean);
  });
  target.commit();
}

void normal_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(outs[0].dtype(), "normal_", [&] {
    normal_typed<scalar_t>(outs[0], u64_attr(c, 3), u64_attr(c, 4), c.double_attr(1), c.double_attr(2));
  });
}

// ---------------- randint ----------------

template <class T>
inline T from_int64(int64_t v) {
  if constexpr (std::is_same_v<T, bool>) return v != 0;
  else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

template <class T>
void randint_typed(Tensor& out, uint64_t seed, uint64_t offset, int64_t low, int64_t high) {
  RowMajorTarget target(out);
  T* data = target.data<T>();
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  const uint64_t base = static_cast<uint64_t>(low);
  const bool wide = math::randint_draw_bits(range) == 64;
  for_each_tile(out.numel(), [&](int64_t b, int64_t e) {
    if (wide) {
      uint64_t w[kTile];
      draws64(seed, offset, b, e - b, w);
      for (int64_t i = 0; i < e - b; ++i)
        data[b + i] = from_int64<T>(static_cast<int64_t>(base + math::bounded64(w[i], range)));
    } else {
      uint32_t w[kTile];
      draws32(seed, offset, b, e - b, w);
#pragma omp simd
      for (int64_t i = 0; i < e - b; ++i)
        data[b + i] = from_int64<T>(static_cast<int64_t>(base + math::bounded32(w[i], range)));
    }
  });
  target.commit();
}

void randint_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_ALL(outs[0].dtype(), "randint", [&] {
    randint_typed<scalar_t>(outs[0], u64_attr(c, 3), u64_attr(c, 4), c.int_attr(1), c.int_attr(2));
  });
}

// ---------------- bernoulli ----------------

template <class T>
inline T zero_or_one(bool v) {
  if constexpr (std::is_same_v<T, bool>) return v;
  else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) return T(v ? 1.0f : 0.0f);
  else return static_cast<T>(v ? 1 : 0);
}

// bernoulli(p): element i is 1 iff draw i * 2^-32 < p[i].
template <class T>
void bernoulli_tensor_typed(const Tensor& p_in, Tensor& out, uint64_t seed, uint64_t offset) {
  const Tensor p = p_in.contiguous();
  const T* pd = static_cast<const T*>(p.impl().data());
  const int64_t n = p.numel();
  // Validate every probability before anything is written (serial: no throw inside OpenMP).
  for (int64_t i = 0; i < n; ++i) {
    double v = static_cast<double>(static_cast<opmath_t<T>>(pd[i]));
    KILN_CHECK(v >= 0.0 && v <= 1.0, ValueError,
               "[kiln::bernoulli] bernoulli expects all p to be in [0, 1], but p[" + std::to_string(i) +
                   "] = " + std::to_string(v) + ". Clamp the probabilities first.");
  }
  RowMajorTarget target(out);
  T* data = target.data<T>();
  for_each_tile(n, [&](int64_t b, int64_t e) {
    uint32_t w[kTile];
    draws32(seed, offset, b, e - b, w);
    for (int64_t i = 0; i < e - b; ++i) {
      double prob = static_cast<double>(static_cast<opmath_t<T>>(pd[b + i]));
      data[b + i] = zero_or_one<T>(math::bernoulli_trial(w[i], prob));
    }
  });
  target.commit();
}

void bernoulli_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_FLOATING(outs[0].dtype(), "bernoulli", [&] {
    bernoulli_tensor_typed<scalar_t>(as_dtype(c.input(0), outs[0].dtype()), outs[0], u64_attr(c, 0),
                                     u64_attr(c, 1));
  });
}

// bernoulli.p: element i is 1 iff draw i < ceil(p * 2^32), i.e. draw i * 2^-32 < p.
template <class T>
void bernoulli_scalar_typed(Tensor& out, double p, uint64_t seed, uint64_t offset) {
  RowMajorTarget target(out);
  T* data = target.data<T>();
  const uint64_t threshold = math::bernoulli_threshold(p);
  for_each_tile(out.numel(), [&](int64_t b, int64_t e) {
    uint32_t w[kTile];
    draws32(seed, offset, b, e - b, w);
#pragma omp simd
    for (int64_t i = 0; i < e - b; ++i) data[b + i] = zero_or_one<T>(static_cast<uint64_t>(w[i]) < threshold);
  });
  target.commit();
}

void bernoulli_scalar_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_ALL(outs[0].dtype(), "bernoulli_", [&] {
    bernoulli_scalar_typed<scalar_t>(outs[0], c.double_attr(0), u64_attr(c, 1), u64_attr(c, 2));
  });
}

// ---------------- native_dropout ----------------

// Keeps element i iff draw i * 2^-32 < 1 - p (a bernoulli(1 - p) trial); kept values are scaled
// by 1 / (1 - p) in opmath, dropped ones are 0.
template <class T>
void dropout_typed(const Tensor& x_in, Tensor& out, Tensor& mask, double p, uint64_t seed, uint64_t offset) {
  const Tensor x = x_in.contiguous();
  const T* xd = static_cast<const T*>(x.impl().data());
  RowMajorTarget out_target(out), mask_target(mask);
  T* od = out_target.data<T>();
  bool* md = mask_target.data<bool>();
  using M = opmath_t<T>;
  const double keep = 1.0 - p;
  const M scale = static_cast<M>(keep == 0.0 ? 0.0 : 1.0 / keep);
  const uint64_t threshold = math::bernoulli_threshold(keep);
  for_each_tile(x.numel(), [&](int64_t b, int64_t e) {
    uint32_t w[kTile];
    draws32(seed, offset, b, e - b, w);
#pragma omp simd
    for (int64_t i = 0; i < e - b; ++i) {
      const bool k = static_cast<uint64_t>(w[i]) < threshold;
      const M scaled = static_cast<M>(xd[b + i]) * scale;
      md[b + i] = k;
      od[b + i] = static_cast<T>(k ? scaled : M(0));
    }
  });
  out_target.commit();
  mask_target.commit();
}

void native_dropout_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  bool train = !c.has_attr(1) || c.bool_attr(1);
  if (!train) {
    outs[0].copy_(x);
    outs[1].fill_(true);
    return;
  }
  KILN_DISPATCH_FLOATING(x.dtype(), "dropout", [&] {
    dropout_typed<scalar_t>(x, outs[0], outs[1], c.double_attr(0), u64_attr(c, 2), u64_attr(c, 3));
  });
}

[[maybe_unused]] const bool registered = [] {
#define KILN_RANDOM_KERNEL(name, fn) {name, fn},
  register_kernels(DeviceType::cpu, {KILN_RANDOM_KERNELS(KILN_RANDOM_KERNEL)});
#undef KILN_RANDOM_KERNEL
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
