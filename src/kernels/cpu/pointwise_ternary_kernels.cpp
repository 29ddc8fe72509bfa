// CPU kernels of the pointwise ternary ops: where, masked_fill, clamp, lerp, addcmul, addcdiv.
//
// where/masked_fill read a bool condition next to two values of the output dtype, which
// cpu::pointwise (one input dtype) does not cover, so they have a local select loop. Scalar
// bounds and weights (0-dim) are read once and captured, so the loop stays a contiguous one.
#include "kernels/cpu/loops.h"
#include "kiln/math/functors.h"
#include "kiln/op_table.h"

namespace kiln::cpu {

namespace {

namespace m = kiln::math;

// out = condition ? a : b, with a and b already of out's dtype. Selecting moves bits, so the
// loop runs on unsigned integers of the element's size (which vectorize for every dtype, where
// Half/BFloat16 structs and bool loads would not). Out may share memory with a or b at the same
// positions (in-place masked_fill_), so no restrict.
template <class U>
void select_loop(Tensor& out, const Tensor& condition, const Tensor& a, const Tensor& b) {
  StridedLoop<4> loop(out.sizes(), {&out, &condition, &a, &b});
  parallel_for(loop.numel, kGrainSize, [&](int64_t begin, int64_t end) {
    loop.run(begin, end, [](const std::array<char*, 4>& p, const std::array<int64_t, 4>& st, int64_t n) {
      U* o = reinterpret_cast<U*>(p[0]);
      const uint8_t* c = reinterpret_cast<const uint8_t*>(p[1]);  // bool storage: 0 or 1
      const U* x = reinterpret_cast<const U*>(p[2]);
      const U* y = reinterpret_cast<const U*>(p[3]);
      const m::Where where;
      if (st[0] == 1 && st[1] == 1 && st[2] == 1 && st[3] == 1) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = where(c[i] != 0, x[i], y[i]);
      } else if (st[0] == 1 && st[1] == 1 && st[2] == 0 && st[3] == 1) {
        const U xv = x[0];
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = where(c[i] != 0, xv, y[i]);
      } else if (st[0] == 1 && st[1] == 1 && st[2] == 1 && st[3] == 0) {
        const U yv = y[0];
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = where(c[i] != 0, x[i], yv);
      } else {
        for (int64_t i = 0; i < n; ++i) o[i * st[0]] = where(c[i * st[1]] != 0, x[i * st[2]], y[i * st[3]]);
      }
    });
  });
}

void select_kernel(Tensor& out, const Tensor& condition, const Tensor& a, const Tensor& b) {
  if (out.numel() == 0) return;
  Tensor x = as_dtype(a, out.dtype()), y = as_dtype(b, out.dtype());
  switch (out.element_size()) {
    case 1: return select_loop<uint8_t>(out, condition, x, y);
    case 2: return select_loop<uint16_t>(out, condition, x, y);
    case 4: return select_loop<uint32_t>(out, condition, x, y);
    default: return select_loop<uint64_t>(out, condition, x, y);
  }
}

void where_kernel(const OpCall& c, std::span<Tensor> outs) {
  select_kernel(outs[0], c.input(0), c.input(1), c.input(2));
}

void masked_fill_kernel(const OpCall& c, std::span<Tensor> outs) {
  select_kernel(outs[0], c.input(1), c.input(2), c.input(0));
}

template <class T>
opmath_t<T> scalar_value(const Tensor& t) {
  return t.item().to<opmath_t<T>>();
}

void clamp_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Tensor &x = c.input(0), &lo = c.input(1), &hi = c.input(2);
  KILN_DISPATCH_NUMERIC(out.dtype(), "clamp", [&] {
    using M = opmath_t<scalar_t>;
    bool lo_scalar = !lo.defined() || lo.dim() == 0, hi_scalar = !hi.defined() || hi.dim() == 0;
    if (lo_scalar && hi_scalar) {
      if (lo.defined() && hi.defined()) {
        M l = scalar_value<scalar_t>(lo), h = scalar_value<scalar_t>(hi);
        pointwise<scalar_t>(out, [l, h](M v) { return m::Clamp{}(v, l, h); }, x);
      } else if (lo.defined()) {
        M l = scalar_value<scalar_t>(lo);
        pointwise<scalar_t>(out, [l](M v) { return m::ClampMin{}(v, l); }, x);
      } else {
        M h = scalar_value<scalar_t>(hi);
        pointwise<scalar_t>(out, [h](M v) { return m::ClampMax{}(v, h); }, x);
      }
    } else if (lo.defined() && hi.defined()) {
      pointwise<scalar_t>(out, m::Clamp{}, x, lo, hi);
    } else if (lo.defined()) {
      pointwise<scalar_t>(out, m::ClampMin{}, x, lo);
    } else {
      pointwise<scalar_t>(out, m::ClampMax{}, x, hi);
    }
  });
}

void lerp_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Tensor &start = c.input(0), &end = c.input(1), &weight = c.input(2);
  KILN_DISPATCH_FLOATING(out.dtype(), "lerp", [&] {
    using M = opmath_t<scalar_t>;
    if (weight.dim() == 0) {
      M w = scalar_value<scalar_t>(weight);
      pointwise<scalar_t>(out, [w](M s, M e) { return m::Lerp{}(s, e, w); }, start, end);
    } else {
      pointwise<scalar_t>(out, m::Lerp{}, start, end, weight);
    }
  });
}

template <template <class> class F>
void addc_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Scalar& value = c.scalar_attr(0);
  KILN_DISPATCH_NUMERIC(out.dtype(), c.name(), [&] {
    using M = opmath_t<scalar_t>;
    pointwise<scalar_t>(out, F<M>{value.to<M>()}, c.input(0), c.input(1), c.input(2));
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("where", DeviceType::cpu, where_kernel);
  register_kernel("masked_fill", DeviceType::cpu, masked_fill_kernel);
  register_kernel("clamp", DeviceType::cpu, clamp_kernel);
  register_kernel("lerp", DeviceType::cpu, lerp_kernel);
  register_kernel("addcmul", DeviceType::cpu, addc_kernel<m::Addcmul>);
  register_kernel("addcdiv", DeviceType::cpu, addc_kernel<m::Addcdiv>);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
