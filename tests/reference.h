// Test helpers: float64 references computed element by element, and tensor comparisons.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kiln/kiln.h"

namespace kiln::testing {

// The number of elements of a tensor of `sizes`.
inline int64_t numel_of(const std::vector<int64_t>& sizes) {
  return std::accumulate(sizes.begin(), sizes.end(), int64_t{1}, std::multiplies<>());
}

// A tensor of `sizes` holding values uniform in [lo, hi) from std::mt19937(seed), row-major,
// drawn in float64 and converted to `dtype` (the same values for every dtype).
inline Tensor random_tensor(const std::vector<int64_t>& sizes, DType dtype = kFloat32, uint32_t seed = 1,
                            double lo = -1, double hi = 1) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(numel_of(sizes)));
  for (auto& x : v) x = dist(gen);
  return tensor<double>(v, sizes).to(dtype);
}

// Row-major float64 copy of any tensor.
inline std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

// Tolerances per dtype for comparing against a float64 reference.
struct Tolerance {
  double rtol, atol;
};
inline Tolerance tolerance_for(DType t) {
  switch (t) {
    case DType::float16: return {1e-3, 1e-3};
    case DType::bfloat16: return {8e-3, 8e-3};
    case DType::float32: return {1.3e-6, 1e-5};
    case DType::float64: return {1e-12, 1e-12};
    default: return {0, 0};
  }
}

// Checks shape and every element of `actual` against `expected` (row-major).
inline ::testing::AssertionResult matches(const Tensor& actual, const std::vector<int64_t>& sizes,
                                          const std::vector<double>& expected,
                                          std::optional<Tolerance> tol = std::nullopt) {
  if (actual.sizes().vec() != sizes)
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.sizes()) << " != " << shape_str(sizes);
  auto got = values(actual);
  if (got.size() != expected.size())
    return ::testing::AssertionFailure() << "numel " << got.size() << " != " << expected.size();
  Tolerance t = tol.value_or(tolerance_for(actual.dtype()));
  for (size_t i = 0; i < got.size(); ++i) {
    double e = expected[i], g = got[i];
    if (std::isnan(e) && std::isnan(g)) continue;
    if (std::isinf(e) && g == e) continue;
    if (!(std::abs(g - e) <= t.atol + t.rtol * std::abs(e)))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", expected " << e
                                           << " (rtol " << t.rtol << ", atol " << t.atol << ")";
  }
  return ::testing::AssertionSuccess();
}

// Reference for a unary elementwise op: applies f in float64 to each element of x.
inline std::vector<double> map_ref(const Tensor& x, const std::function<double(double)>& f) {
  auto v = values(x);
  for (auto& e : v) e = f(e);
  return v;
}

// gradcheck / gradgradcheck with the tolerances every derivative test uses (eps 1e-6, atol 1e-5,
// rtol 1e-3), reporting the failing entry.
inline ::testing::AssertionResult grad_ok(const autograd::Function& fn, const TensorList& inputs) {
  std::string report;
  if (autograd::gradcheck(fn, inputs, 1e-6, 1e-5, 1e-3, &report)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << report;
}

inline ::testing::AssertionResult gradgrad_ok(const autograd::Function& fn, const TensorList& inputs) {
  std::string report;
  if (autograd::gradgradcheck(fn, inputs, 1e-6, 1e-5, 1e-3, &report)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << report;
}

// A low-precision result compared with float64: each element within `rel` times the largest
// magnitude of `want`.
inline ::testing::AssertionResult close_to(const Tensor& got, const Tensor& want, double rel) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << shape_str(got.sizes()) << " != " << shape_str(want.sizes());
  auto g = values(got), w = values(want);
  double scale = 1e-12;
  for (double v : w) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < g.size(); ++i)
    if (!(std::abs(g[i] - w[i]) <= rel * scale))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g[i] << ", expected " << w[i]
                                           << " (scale " << scale << ")";
  return ::testing::AssertionSuccess();
}

// The op-table entry `name` (tests call ops the public API does not expose).
inline const OpDef& op(const char* name) {
  const OpDef* d = OpTable::instance().find(name);
  if (!d) throw Error(std::string("no op ") + name);
  return *d;
}

}  // namespace kiln::testing
