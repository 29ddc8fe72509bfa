// CPU kernels of the index-returning reductions: argmax, argmin, max.dim, min.dim.
//
// Ties go to the first index and NaN wins (the first NaN), as in PyTorch. A contiguous row is
// scanned twice with vector code (its max, then the first position holding it); when the
// reduced dim is outer to a contiguous kept dim, adjacent outputs are tracked in vector lanes.
#include "kernels/kernel_args.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/reduce_loops.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"

namespace kiln::cpu {

namespace {

using namespace reduce;

template <class A, bool IsMax>
inline bool better(A v, A best) {
  if constexpr (IsMax)
    return v > best || (v != v && best == best);
  else
    return v < best || (v != v && best == best);
}

template <class A>
struct Best {
  A value;
  int64_t index;
};

// The best element of n elements at p with stride s, and its position.
template <class T, bool IsMax>
Best<opmath_t<T>> scan(const T* p, int64_t n, int64_t s) {
  using A = opmath_t<T>;
  if (s != 1 || n < 64) {
    Best<A> best{load<A>(p), 0};
    for (int64_t i = 1; i < n; ++i) {
      A v = load<A>(p + i * s);
      if (better<A, IsMax>(v, best.value)) best = {v, i};
    }
    return best;
  }
  using Op = std::conditional_t<IsMax, MaxOp<A>, MinOp<A>>;
  const A m = reduce_run(Op{}, p, n, 1);
  // The first position holding m (the first NaN when m is NaN), a vector block at a time.
  auto is_m = [m](A v) { return m != m ? v != v : v == m; };
  constexpr int64_t kBlock = 64;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    int hit = 0;
    if (m != m) {
#pragma omp simd reduction(| : hit)
      for (int64_t i = i0; i < i1; ++i) {
        A v = load<A>(p + i);
        hit |= v != v ? 1 : 0;
      }
    } else {
#pragma omp simd reduction(| : hit)
      for (int64_t i = i0; i < i1; ++i) hit |= load<A>(p + i) == m ? 1 : 0;
    }
    if (!hit) continue;
    for (int64_t i = i0; i < i1; ++i)
      if (is_m(load<A>(p + i))) return {load<A>(p + i), i};
  }
  return {m, 0};  // not reached
}

template <class T, bool IsMax>
void arg_reduce(const Tensor& x, const std::vector<bool>& mask, int64_t* indices, T* values) {
  using A = opmath_t<T>;
  ReducePlan plan = make_plan(x, mask, /*reorder=*/false);
  if (plan.num_outputs == 0) return;
  const T* base = static_cast<const T*>(plan.data);
  const Dim red = plan.reduced.back();
  const int64_t D = red.size, s = red.stride;
  const Dim* kept = plan.kept.data();

  // Adjacent outputs in vector lanes: when the reduced dim is outer to a contiguous kept dim
  // (lanes 1 apart, rows s apart), and for short contiguous rows of adjacent outputs (lanes D
  // apart, rows 1 apart: argmax over a last dim of 4).
  const int64_t lane_stride = plan.kept.empty() ? 0 : plan.kept.back().stride;
  if (lane_stride == 1 || (s == 1 && D <= kShortRow && lane_stride == D)) {
    const int64_t row_stride = lane_stride == 1 ? s : 1;
    constexpr int64_t B = 64;
    const int64_t J = plan.kept.back().size, nblocks = (J + B - 1) / B;
    const size_t nouter = plan.kept.size() - 1;
    parallel_for(plan.num_outputs / J * nblocks, std::max<int64_t>(1, kGrainSize / (D * B)),
                 [&](int64_t b0, int64_t e0) {
                   for (int64_t t = b0; t < e0; ++t) {
                     int64_t ko = t / nblocks, j0 = (t % nblocks) * B, jn = std::min(B, J - j0);
                     const T* p = base + offset_of(ko, kept, nouter) + j0 * lane_stride;
                     A best[B];
                     int64_t idx[B] = {};
                     for (int64_t b = 0; b < jn; ++b) best[b] = load<A>(p + b * lane_stride);
                     for (int64_t r = 1; r < D; ++r) {
                       const T* row = p + r * row_stride;
#pragma omp simd
                       for (int64_t b = 0; b < jn; ++b) {
                         A v = load<A>(row + b * lane_stride);
                         bool take = better<A, IsMax>(v, best[b]);
                         best[b] = take ? v : best[b];
                         idx[b] = take ? r : idx[b];
                       }
                       end_of_row();
                     }
                     int64_t o0 = ko * J + j0;
                     for (int64_t b = 0; b < jn; ++b) {
                       indices[o0 + b] = idx[b];
                       if (values) values[o0 + b] = store_as<T>(best[b]);
                     }
                   }
                 });
    return;
  }

  auto write = [&](int64_t o, Best<A> r) {
    indices[o] = r.index;
    if (values) values[o] = store_as<T>(r.value);
  };
  if (plan.num_outputs >= max_threads() || D < 2 * kGrainSize) {
    parallel_for(plan.num_outputs, std::max<int64_t>(1, kGrainSize / D), [&](int64_t b, int64_t e) {
      OffsetWalker w(kept, plan.kept.size(), b);
      for (int64_t o = b; o < e; ++o, w.next()) write(o, scan<T, IsMax>(base + w.offset(), D, s));
    });
    return;
  }
  // Few outputs, long rows: split each row across threads; earlier chunks win ties.
  for (int64_t o = 0; o < plan.num_outputs; ++o) {
    const T* p = base + offset_of(o, kept, plan.kept.size());
    Best<A> r = parallel_fold<Best<A>>(
        D, kGrainSize,
        [&](int64_t b, int64_t e) {
          Best<A> part = scan<T, IsMax>(p + b * s, e - b, s);
          part.index += b;
          return part;
        },
        [](Best<A> a, Best<A> b) { return better<A, IsMax>(b.value, a.value) ? b : a; });
    write(o, r);
  }
}

// argmax/argmin (attrs: dim?, keepdim) and max.dim/min.dim (attrs: dim, keepdim; outputs
// values, indices).
template <bool IsMax>
void arg_kernel(const OpCall& c, std::span<Tensor> outs, bool with_values) {
  auto [x, mask] = kiln::detail::arg_reduction_input(c);
  Tensor& idx_out = with_values ? outs[1] : outs[0];
  Tensor indices = idx_out.is_contiguous()
                       ? idx_out
                       : kiln::detail::make_empty(idx_out.sizes().vec(), kInt64, kCPU);
  Tensor values;
  if (with_values) {
    values = outs[0].is_contiguous()
                 ? outs[0]
                 : kiln::detail::make_empty(outs[0].sizes().vec(), outs[0].dtype(), kCPU);
  }
  KILN_DISPATCH_ALL(x.dtype(), c.name(), [&] {
    arg_reduce<scalar_t, IsMax>(
        x, mask, static_cast<int64_t*>(indices.impl().data()),
        with_values ? static_cast<scalar_t*>(values.impl().data()) : nullptr);
  });
  if (!indices.same(idx_out)) idx_out.copy_(indices);
  if (with_values && !values.same(outs[0])) outs[0].copy_(values);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("argmax", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { arg_kernel<true>(c, o, false); });
  register_kernel("argmin", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { arg_kernel<false>(c, o, false); });
  register_kernel("max.dim", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { arg_kernel<true>(c, o, true); });
  register_kernel("min.dim", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { arg_kernel<false>(c, o, true); });
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
