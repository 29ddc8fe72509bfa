// CPU kernels of the pointwise unary ops: cpu::pointwise over the functors of kiln/math/functors.h.
// Results are computed in the output dtype (inputs converted to it); predicates (isnan, ...)
// compute in the input dtype and write bool.
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "kernels/cpu/loops.h"
#include "kiln/math/functors.h"
#include "kiln/op_table.h"
#include "ops/pointwise_list.h"

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

// The kernel of a KILN_UNARY_POINTWISE_OPS line by its dtype rule (pointwise_list.h); sqrt and
// rsqrt take the vectorized contiguous path.
enum class Rule { floating, numeric, negation, any, predicate, bitwise };

template <class F, Rule kRule>
Kernel listed_unary_kernel() {
  if constexpr (std::is_same_v<F, m::Sqrt>) return sqrt_kernel<false>;
  else if constexpr (std::is_same_v<F, m::Rsqrt>) return sqrt_kernel<true>;
  else if constexpr (kRule == Rule::floating) return unary_kernel<F, Types::floating>;
  else if constexpr (kRule == Rule::numeric || kRule == Rule::negation) return unary_kernel<F, Types::numeric>;
  else if constexpr (kRule == Rule::any) return unary_kernel<F, Types::all>;
  else if constexpr (kRule == Rule::predicate) return predicate_kernel<F>;
  else return unary_kernel<F, Types::integral_and_bool>;  // bitwise
}

[[maybe_unused]] const bool registered = [] {
#define KILN_REGISTER_UNARY(name, Functor, rule, derivative) \
  register_kernel(#name, DeviceType::cpu, listed_unary_kernel<m::Functor, Rule::rule>());
  KILN_UNARY_POINTWISE_OPS(KILN_REGISTER_UNARY)
#undef KILN_REGISTER_UNARY
  register_kernel("gelu", DeviceType::cpu, gelu_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
