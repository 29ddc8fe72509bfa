// CPU kernels for the range factories (arange, linspace, eye) and the whole-tensor comparisons
// (allclose, equal). Arithmetic follows PyTorch's CPU kernels so the values match bit for bit
// where PyTorch's own result does not depend on its vector width.
#include <atomic>
#include <cmath>

#include "kernels/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

constexpr int64_t kRangeGrain = 32768;

// Runs fill(T* data) on a contiguous buffer for `out` (out itself, or a temporary copied back).
template <class T, class F>
void fill_contiguous(Tensor& out, F&& fill) {
  Tensor buf = out.is_contiguous() ? out : detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  fill(static_cast<T*>(buf.impl().data()));
  if (!buf.same(out)) out.copy_(buf);
}

template <class T>
constexpr bool is_reduced_float = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// Rounds an opmath value to T and back (float16/bfloat16 arithmetic rounds after every op).
template <class T>
inline opmath_t<T> round_to(opmath_t<T> v) {
  if constexpr (is_reduced_float<T>) return static_cast<float>(T(v));
  else return v;
}

// ---------------- arange ----------------

// start + step * i in the accumulate type: double for float32/float64, float for
// float16/bfloat16, wrapping int64 for integers.
template <class T>
void arange_typed(Tensor& out, const Scalar& start, const Scalar& step) {
  const int64_t n = out.numel();
  fill_contiguous<T>(out, [&](T* data) {
    if constexpr (std::is_integral_v<T>) {
      const uint64_t s = static_cast<uint64_t>(start.to_int()), st = static_cast<uint64_t>(step.to_int());
      parallel_for(n, kRangeGrain, [&](int64_t b, int64_t e) {
#pragma omp simd
        for (int64_t i = b; i < e; ++i) data[i] = static_cast<T>(s + st * static_cast<uint64_t>(i));
      });
    } else {
      using Acc = std::conditional_t<is_reduced_float<T>, float, double>;
      const Acc s = static_cast<Acc>(start.to_double()), st = static_cast<Acc>(step.to_double());
      parallel_for(n, kRangeGrain, [&](int64_t b, int64_t e) {
#pragma omp simd
        for (int64_t i = b; i < e; ++i) data[i] = static_cast<T>(s + st * static_cast<Acc>(i));
      });
    }
  });
}

void arange_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_NUMERIC(outs[0].dtype(), "arange", [&] {
    arange_typed<scalar_t>(outs[0], c.scalar_attr(0), c.scalar_attr(2));
  });
}

// ---------------- linspace ----------------

// PyTorch's symmetric form: the first half counts up from start, the second half down from end,
// so both ends are exact. The step is computed in T (double for integers).
template <class T>
void linspace_typed(Tensor& out, double start_d, double end_d) {
  const int64_t steps = out.numel();
  fill_contiguous<T>(out, [&](T* data) {
    if (steps == 0) return;
    if constexpr (std::is_integral_v<T>) {
      const T start = static_cast<T>(static_cast<int64_t>(start_d));
      const T end = static_cast<T>(static_cast<int64_t>(end_d));
      if (steps == 1) {
        data[0] = start;
        return;
      }
      const double step = (static_cast<double>(end) - static_cast<double>(start)) / static_cast<double>(steps - 1);
      const int64_t halfway = steps / 2;
      parallel_for(steps, kRangeGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          double v = i < halfway ? start + step * static_cast<double>(i)
                                 : end - step * static_cast<double>(steps - i - 1);
          data[i] = static_cast<T>(static_cast<int64_t>(v));
        }
      });
    } else {
      using M = opmath_t<T>;
      const M start = static_cast<M>(static_cast<T>(start_d));
      const M end = static_cast<M>(static_cast<T>(end_d));
      if (steps == 1) {
        data[0] = static_cast<T>(start);
        return;
      }
      // Each operation rounds to T, like PyTorch's scalar_t arithmetic.
      const M step = round_to<T>(round_to<T>(end - start) / round_to<T>(static_cast<M>(steps - 1)));
      const int64_t halfway = steps / 2;
      parallel_for(steps, kRangeGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          M v = i < halfway
                    ? start + round_to<T>(step * round_to<T>(static_cast<M>(i)))
                    : end - round_to<T>(step * round_to<T>(static_cast<M>(steps - i - 1)));
          data[i] = static_cast<T>(v);
        }
      });
    }
  });
}

void linspace_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_NUMERIC(outs[0].dtype(), "linspace", [&] {
    linspace_typed<scalar_t>(outs[0], c.scalar_attr(0).to_double(), c.scalar_attr(1).to_double());
  });
}

// ---------------- eye ----------------

void eye_kernel(const OpCall&, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  KILN_DISPATCH_ALL(out.dtype(), "eye", [&] {
    const int64_t n = out.sizes()[0], m = out.sizes()[1];
    fill_contiguous<scalar_t>(out, [&](scalar_t* data) {
      const scalar_t zero = static_cast<scalar_t>(0.0f), one = static_cast<scalar_t>(1.0f);
      parallel_for(n * m, kRangeGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) data[i] = zero;
      });
      for (int64_t i = 0; i < std::min(n, m); ++i) data[i * m + i] = one;
    });
  });
}

// ---------------- allclose / equal ----------------

// Calls test(a_ptr, b_ptr, a_stride, b_stride, count) over runs of a and b (already of one
// dtype and broadcast to one shape); true when every run passes.
template <class Test>
bool all_runs(const Tensor& a, const Tensor& b, IntArrayRef shape, Test&& test) {
  StridedLoop<2> loop(shape, {&a, &b});
  std::atomic<bool> ok{true};
  parallel_for(loop.numel, kGrainSize, [&](int64_t begin, int64_t end) {
    loop.run(begin, end, [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& st, int64_t n) {
      if (ok.load(std::memory_order_relaxed) && !test(p[0], p[1], st[0], st[1], n))
        ok.store(false, std::memory_order_relaxed);
    });
  });
  return ok.load();
}

// PyTorch's isclose: a == b, or (equal_nan and both nan), or |a - b| <= atol + |rtol * b| with a
// finite |a - b|; computed in T (integers: the difference in T, the tolerance in float32).
template <class T>
bool allclose_typed(const Tensor& a, const Tensor& b, IntArrayRef shape, double rtol, double atol,
                    bool equal_nan) {
  using M = std::conditional_t<std::is_integral_v<T>, float, opmath_t<T>>;
  const M rt = static_cast<M>(rtol), at = static_cast<M>(atol);
  const bool exact_only = rtol == 0.0 && atol == 0.0;
  return all_runs(a, b, shape, [&](const char* pa, const char* pb, int64_t sa, int64_t sb, int64_t n) {
    const T* x = reinterpret_cast<const T*>(pa);
    const T* y = reinterpret_cast<const T*>(pb);
    bool all = true;
    for (int64_t i = 0; i < n; ++i) {
      const T xv = x[i * sa], yv = y[i * sb];
      bool close;
      if constexpr (std::is_integral_v<T>) {
        if (xv == yv) continue;
        if (exact_only) return false;
        T diff = static_cast<T>(xv - yv);
        if constexpr (std::is_signed_v<T>) diff = diff < 0 ? static_cast<T>(-diff) : diff;
        close = static_cast<M>(diff) <= at + std::abs(rt * static_cast<M>(yv));
      } else {
        const M xm = static_cast<M>(xv), ym = static_cast<M>(yv);
        if (xm == ym || (equal_nan && std::isnan(xm) && std::isnan(ym))) continue;
        if (exact_only) return false;
        const M allowed = round_to<T>(at + round_to<T>(std::abs(round_to<T>(rt * ym))));
        const M actual = round_to<T>(std::abs(round_to<T>(xm - ym)));
        close = std::isfinite(actual) && actual <= allowed;
      }
      all = all && close;
      if (!all) return false;
    }
    return all;
  });
}

void allclose_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor a = c.input(0), b = c.input(1);
  if (a.dtype() == DType::bool_) {  // PyTorch compares bools as default-dtype floats
    a = a.to(default_dtype());
    b = b.to(default_dtype());
  }
  const std::vector<int64_t> shape = detail::broadcast_sizes(a.sizes(), b.sizes(), "allclose");
  bool result = KILN_DISPATCH_NUMERIC(a.dtype(), "allclose", [&] {
    return allclose_typed<scalar_t>(a, b, shape, c.double_attr(0), c.double_attr(1), c.bool_attr(2));
  });
  *static_cast<bool*>(outs[0].impl().data()) = result;
}

// torch.equal: same sizes and every element equal after promotion to the common dtype (nan is
// never equal to anything).
void equal_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& a0 = c.input(0);
  const Tensor& b0 = c.input(1);
  bool result = a0.sizes() == b0.sizes();
  if (result) {
    DType common = detail::result_type(c.inputs);
    Tensor a = as_dtype(a0, common), b = as_dtype(b0, common);
    result = KILN_DISPATCH_ALL(common, "equal", [&] {
      return all_runs(a, b, a.sizes(), [](const char* pa, const char* pb, int64_t sa, int64_t sb, int64_t n) {
        const scalar_t* x = reinterpret_cast<const scalar_t*>(pa);
        const scalar_t* y = reinterpret_cast<const scalar_t*>(pb);
        for (int64_t i = 0; i < n; ++i) {
          if (!(static_cast<opmath_t<scalar_t>>(x[i * sa]) == static_cast<opmath_t<scalar_t>>(y[i * sb])))
            return false;
        }
        return true;
      });
    });
  }
  *static_cast<bool*>(outs[0].impl().data()) = result;
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("arange", DeviceType::cpu, arange_kernel);
  register_kernel("linspace", DeviceType::cpu, linspace_kernel);
  register_kernel("eye", DeviceType::cpu, eye_kernel);
  register_kernel("allclose", DeviceType::cpu, allclose_kernel);
  register_kernel("equal", DeviceType::cpu, equal_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
