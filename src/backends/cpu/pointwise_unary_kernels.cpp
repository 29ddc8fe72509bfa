// CPU kernels of the pointwise unary ops: cpu::pointwise over the functors of kiln/math/functors.h.
// Results are computed in the output dtype (inputs converted to it); predicates (isnan, ...)
// compute in the input dtype and write bool.
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "backends/cpu/loops.h"
#include "kiln/math/functors.h"
#include "kiln/op_table.h"

namespace kiln::cpu {

namespace {

namespace m = kiln::math;

enum class Types { floating, numeric, all, integral_and_bool };

template <class F, Types kTypes>
void unary_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Tensor& x = c.input(0);
  if constexpr (kTypes == Types::floating) {
    KILN_DISPATCH_FLOATING(out.dtype(), c.name(), [&] { pointwise<scalar_t>(out, F{}, x); });
  } else if constexpr (kTypes == Types::numeric) {
    KILN_DISPATCH_NUMERIC(out.dtype(), c.name(), [&] { pointwise<scalar_t>(out, F{}, x); });
  } else if constexpr (kTypes == Types::all) {
    KILN_DISPATCH_ALL(out.dtype(), c.name(), [&] { pointwise<scalar_t>(out, F{}, x); });
  } else {
    if (out.dtype() == kBool) return pointwise<bool>(out, F{}, x);
    KILN_DISPATCH_INTEGRAL(out.dtype(), c.name(), [&] { pointwise<scalar_t>(out, F{}, x); });
  }
}

// out (bool) = F(x), computed in x's dtype.
template <class F>
void predicate_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  if (out.numel() == 0) return;
  const Tensor& x = c.input(0);
  KILN_DISPATCH_ALL(x.dtype(), c.name(), [&] { pointwise<scalar_t, bool>(out, F{}, x); });
}

// sqrt and rsqrt over contiguous float32/float64. With -fmath-errno (GCC's default) std::sqrt
// keeps a libm fallback branch that stops the vectorizer, so this loop issues the vector
// instruction itself; it is IEEE sqrt either way, so results match the functors bit for bit.
// (The maskz forms with a full mask: GCC 12 warns about _mm512_sqrt_ps's undefined passthrough.)
template <bool kReciprocal, class T>
void sqrt_contiguous(T* out, const T* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
      __m512 r = _mm512_maskz_sqrt_ps(__mmask16(0xffff), _mm512_loadu_ps(x + i));
      _mm512_storeu_ps(out + i, kReciprocal ? _mm512_div_ps(one, r) : r);
    }
  } else {
    const __m512d one = _mm512_set1_pd(1.0);
    for (; i + 8 <= n; i += 8) {
      __m512d r = _mm512_maskz_sqrt_pd(__mmask8(0xff), _mm512_loadu_pd(x + i));
      _mm512_storeu_pd(out + i, kReciprocal ? _mm512_div_pd(one, r) : r);
    }
  }
#elif defined(__AVX__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
      __m256 r = _mm256_sqrt_ps(_mm256_loadu_ps(x + i));
      _mm256_storeu_ps(out + i, kReciprocal ? _mm256_div_ps(one, r) : r);
    }
  } else {
    const __m256d one = _mm256_set1_pd(1.0);
    for (; i + 4 <= n; i += 4) {
      __m256d r = _mm256_sqrt_pd(_mm256_loadu_pd(x + i));
      _mm256_storeu_pd(out + i, kReciprocal ? _mm256_div_pd(one, r) : r);
    }
  }
#endif
  using F = std::conditional_t<kReciprocal, m::Rsqrt, m::Sqrt>;
  for (; i < n; ++i) out[i] = F{}(x[i]);
}

template <bool kReciprocal>
void sqrt_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const Tensor& x = c.input(0);
  // One dense block each, element i of one at element i of the other: row-major or channels-last.
  bool same_dense = (out.is_contiguous() && x.is_contiguous()) ||
                    (out.is_contiguous(channels_last) && x.is_contiguous(channels_last));
  bool flat = same_dense && x.dtype() == out.dtype() && (out.dtype() == kFloat32 || out.dtype() == kFloat64);
  if (!flat) {
    return unary_kernel<std::conditional_t<kReciprocal, m::Rsqrt, m::Sqrt>, Types::floating>(c, outs);
  }
  auto run = [&]<class T>() {
    T* o = out.data_ptr<T>();
    const T* in = x.data_ptr<T>();
    parallel_for(out.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
      sqrt_contiguous<kReciprocal>(o + begin, in + begin, end - begin);
    });
  };
  if (out.dtype() == kFloat32) run.template operator()<float>();
  else run.template operator()<double>();
}

void gelu_kernel(const OpCall& c, std::span<Tensor> outs) {
  if (c.string_attr(0) == "tanh") unary_kernel<m::GeluTanh, Types::floating>(c, outs);
  else unary_kernel<m::Gelu, Types::floating>(c, outs);
}

[[maybe_unused]] const bool registered = [] {
  auto reg = [](const char* name, Kernel k) { register_kernel(name, DeviceType::cpu, std::move(k)); };
  reg("neg", unary_kernel<m::Neg, Types::numeric>);
  reg("abs", unary_kernel<m::Abs, Types::numeric>);
  reg("exp", unary_kernel<m::Exp, Types::floating>);
  reg("log", unary_kernel<m::Log, Types::floating>);
  reg("log1p", unary_kernel<m::Log1p, Types::floating>);
  reg("expm1", unary_kernel<m::Expm1, Types::floating>);
  reg("sin", unary_kernel<m::Sin, Types::floating>);
  reg("cos", unary_kernel<m::Cos, Types::floating>);
  reg("tan", unary_kernel<m::Tan, Types::floating>);
  reg("tanh", unary_kernel<m::Tanh, Types::floating>);
  reg("sigmoid", unary_kernel<m::Sigmoid, Types::floating>);
  reg("relu", unary_kernel<m::Relu, Types::numeric>);
  reg("gelu", gelu_kernel);
  reg("silu", unary_kernel<m::Silu, Types::floating>);
  reg("sqrt", sqrt_kernel<false>);
  reg("rsqrt", sqrt_kernel<true>);
  reg("reciprocal", unary_kernel<m::Reciprocal, Types::floating>);
  reg("sign", unary_kernel<m::Sign, Types::all>);
  reg("floor", unary_kernel<m::Floor, Types::numeric>);
  reg("ceil", unary_kernel<m::Ceil, Types::numeric>);
  reg("round", unary_kernel<m::Round, Types::numeric>);
  reg("erf", unary_kernel<m::Erf, Types::floating>);
  reg("logical_not", predicate_kernel<m::LogicalNot>);
  reg("isnan", predicate_kernel<m::IsNan>);
  reg("isfinite", predicate_kernel<m::IsFinite>);
  reg("bitwise_not", unary_kernel<m::BitwiseNot, Types::integral_and_bool>);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
