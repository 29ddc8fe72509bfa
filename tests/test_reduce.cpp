// Reductions: every op against float64 references computed here with plain loops over the
// input's values (row-major), across dtypes, dim lists, keepdim, strided/broadcast inputs, NaN,
// ties, empty and 0-dim tensors, and one bad input per error kind.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kiln/op_table.h"
#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Deterministic values in [lo, hi).
std::vector<double> random_values(int64_t n, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  std::vector<double> v(static_cast<size_t>(n));
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& e : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    e = lo + (hi - lo) * static_cast<double>(s >> 11) / 9007199254740992.0;
  }
  return v;
}

Tensor random_tensor(const std::vector<int64_t>& sizes, DType dtype, uint64_t seed = 1,
                     double lo = -2.0, double hi = 2.0) {
  return tensor<double>(random_values(numel_of(sizes), seed, lo, hi), sizes).to(dtype);
}

Tensor int_tensor(const std::vector<int64_t>& sizes, DType dtype, uint64_t seed = 1, int lo = -5,
                  int hi = 6) {
  auto v = random_values(numel_of(sizes), seed, lo, hi);
  for (auto& e : v) e = std::floor(e);
  return tensor<double>(v, sizes).to(dtype);
}

// The elements of x grouped by output position (row-major over the kept dims), each group in
// logical order; dims empty means all.
struct Groups {
  std::vector<int64_t> out_sizes;
  std::vector<std::vector<double>> items;
};

Groups group(const Tensor& x, std::vector<int64_t> dims, bool keepdim = false) {
  const int64_t nd = x.dim();
  std::vector<bool> mask(nd, dims.empty());
  for (int64_t d : dims)
    if (nd > 0) mask[d < 0 ? d + nd : d] = true;
  Groups g;
  std::vector<int64_t> kept;
  for (int64_t d = 0; d < nd; ++d) {
    if (!mask[d]) {
      g.out_sizes.push_back(x.size(d));
      kept.push_back(d);
    } else if (keepdim) {
      g.out_sizes.push_back(1);
    }
  }
  int64_t outputs = 1;
  for (int64_t d : kept) outputs *= x.size(d);
  g.items.assign(static_cast<size_t>(outputs), {});
  // Output position of each element: row-major over the kept dims, walked with an index counter.
  std::vector<int64_t> out_stride(nd, 0);
  for (int64_t k = static_cast<int64_t>(kept.size()) - 1, scale = 1; k >= 0; --k) {
    out_stride[kept[k]] = scale;
    scale *= x.size(kept[k]);
  }
  auto v = values(x);
  std::vector<int64_t> idx(nd, 0);
  int64_t o = 0;
  for (double e : v) {
    g.items[o].push_back(e);
    for (int64_t d = nd - 1; d >= 0; --d) {
      o += out_stride[d];
      if (++idx[d] < x.size(d)) break;
      o -= out_stride[d] * x.size(d);
      idx[d] = 0;
    }
  }
  return g;
}

template <class F>
std::vector<double> each(const Groups& g, F f) {
  std::vector<double> out;
  for (const auto& items : g.items) out.push_back(f(items));
  return out;
}

double ref_sum(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0);
}
double ref_prod(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 1.0, std::multiplies<>());
}
double ref_mean(const std::vector<double>& v) {
  return ref_sum(v) / static_cast<double>(v.size());
}
double ref_max(const std::vector<double>& v) {
  double m = -kInf;
  for (double e : v) {
    if (std::isnan(e)) return e;
    m = std::max(m, e);
  }
  return m;
}
double ref_min(const std::vector<double>& v) {
  double m = kInf;
  for (double e : v) {
    if (std::isnan(e)) return e;
    m = std::min(m, e);
  }
  return m;
}
// First index of the max (first NaN wins).
double ref_argmax(const std::vector<double>& v, bool is_max = true) {
  size_t best = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(v[i])) return static_cast<double>(i);
    if (is_max ? v[i] > v[best] : v[i] < v[best]) best = i;
  }
  return static_cast<double>(best);
}
double ref_var(const std::vector<double>& v, int64_t correction) {
  double m = ref_mean(v), ss = 0;
  for (double e : v) ss += (e - m) * (e - m);
  return ss /
         static_cast<double>(std::max<int64_t>(0, static_cast<int64_t>(v.size()) - correction));
}
double ref_norm(const std::vector<double>& v, double p) {
  if (std::isinf(p)) {
    double m = p > 0 ? -kInf : kInf;
    for (double e : v) m = p > 0 ? std::max(m, std::abs(e)) : std::min(m, std::abs(e));
    return v.empty() ? 0.0 : m;
  }
  double s = 0;
  for (double e : v) s += p == 0 ? (e != 0 ? 1.0 : 0.0) : std::pow(std::abs(e), p);
  return p == 0 ? s : std::pow(s, 1.0 / p);
}
double ref_logsumexp(const std::vector<double>& v) {
  double m = ref_max(v);
  if (std::isnan(m)) return m;
  if (std::isinf(m)) m = 0;
  double s = 0;
  for (double e : v) s += std::exp(e - m);
  return std::log(s) + m;
}

// Reference for ops along one dim that keep the shape: f maps each line to a line.
template <class F>
std::vector<double> along(const Tensor& x, int64_t dim, F f) {
  auto v = values(x);
  if (x.dim() == 0) return f(v);
  if (dim < 0) dim += x.dim();
  int64_t outer = 1, n = x.size(dim), inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
  std::vector<double> out(v.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < inner; ++j) {
      std::vector<double> line(n);
      for (int64_t k = 0; k < n; ++k) line[k] = v[(o * n + k) * inner + j];
      auto r = f(line);
      for (int64_t k = 0; k < n; ++k) out[(o * n + k) * inner + j] = r[k];
    }
  return out;
}

std::vector<double> ref_cumsum(const std::vector<double>& v) {
  std::vector<double> r(v.size());
  double acc = 0;
  for (size_t i = 0; i < v.size(); ++i) r[i] = acc += v[i];
  return r;
}
std::vector<double> ref_softmax(const std::vector<double>& v, bool log) {
  double lse = ref_logsumexp(v);
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = log ? v[i] - lse : std::exp(v[i] - lse);
  return r;
}

const std::vector<std::vector<int64_t>> kDimLists = {{},     {0},    {1},      {2},      {-1},
                                                     {0, 2}, {1, 2}, {-3, -2}, {0, 1, 2}};

// Inputs of shape (3, 4, 5) in several layouts: contiguous, permuted, sliced with a step,
// broadcast along dim 1.
std::vector<std::pair<std::string, Tensor>> layouts(DType dtype) {
  return {
      {"contiguous", random_tensor({3, 4, 5}, dtype, 11)},
      {"permuted", random_tensor({5, 3, 4}, dtype, 12).permute({1, 2, 0})},
      {"strided", random_tensor({3, 8, 10}, dtype, 13).slice(1, 0, {}, 2).slice(2, 1, {}, 2)},
      {"broadcast", random_tensor({3, 1, 5}, dtype, 14).expand({3, 4, 5})},
  };
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// sum, mean, prod
// ---------------------------------------------------------------------------------------------

TEST(ReduceSum, MatchesReferenceForEveryDimListLayoutAndKeepdim) {
  for (DType dtype : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    for (auto& [name, x] : layouts(dtype)) {
      for (const auto& dims : kDimLists) {
        for (bool keepdim : {false, true}) {
          Groups g = group(x, dims, keepdim);
          Tensor r = sum(x, dims, keepdim);
          EXPECT_EQ(r.dtype(), dtype);
          EXPECT_TRUE(matches(r, g.out_sizes, each(g, ref_sum)))
              << name << " " << shape_str(dims) << " " << keepdim;
        }
      }
    }
  }
}

TEST(ReduceSum, IntegerAndBoolInputsGiveInt64) {
  for (DType dtype : {kInt8, kUInt8, kInt32, kInt64}) {
    Tensor x = int_tensor({4, 6}, dtype, 3, dtype == kUInt8 ? 0 : -100, 100);
    Tensor r = x.sum({1});
    EXPECT_EQ(r.dtype(), kInt64);
    Groups g = group(x, {1});
    EXPECT_TRUE(matches(r, g.out_sizes, each(g, ref_sum)));
  }
  // int8 values whose sum leaves int8's range.
  Tensor big = full({100}, int64_t{100}).to(kInt8);
  EXPECT_EQ(big.sum().item<int64_t>(), 10000);
  Tensor b = tensor<bool>({true, false, true, true});
  EXPECT_EQ(b.sum().dtype(), kInt64);
  EXPECT_EQ(b.sum().item<int64_t>(), 3);
}

TEST(ReduceSum, DtypeArgumentConvertsBeforeSumming) {
  Tensor x = random_tensor({6, 7}, kFloat32, 5);
  Tensor r = sum(x, {0}, false, kFloat64);
  EXPECT_EQ(r.dtype(), kFloat64);
  Groups g = group(x, {0});
  EXPECT_TRUE(matches(r, g.out_sizes, each(g, ref_sum), Tolerance{1e-12, 1e-12}));
  Tensor i = int_tensor({5}, kInt32, 2);
  Tensor f = i.sum({}, false, kFloat32);
  EXPECT_EQ(f.dtype(), kFloat32);
  EXPECT_TRUE(matches(f, {}, {ref_sum(values(i))}));
  Tensor t = tensor<double>({1.7, 2.9, -0.5});
  EXPECT_EQ(sum(t, {}, false, kInt64).item<int64_t>(), 3);  // truncates each element first
  EXPECT_EQ(sum(t, {}, false, kInt32).dtype(), kInt32);
}

TEST(ReduceSum, HalfAccumulatesInFloat) {
  Tensor x = full({4096}, 1.0, kFloat16);  // a float16 accumulator would stop at 2048
  EXPECT_TRUE(matches(x.sum(), {}, {4096.0}));
  Tensor y = full({3000}, 1.0, kBFloat16);
  EXPECT_EQ(sum(y, {}, false, kFloat32).item<float>(), 3000.0f);
}

TEST(ReduceSum, Float32MillionElementsStayAccurate) {
  // All-positive values are the worst case for a single float accumulator (off by ~1e-3).
  const int64_t n = int64_t{1} << 20;
  Tensor x = random_tensor({n}, kFloat32, 7, 1.0, 2.0);
  double expected = ref_sum(values(x));
  EXPECT_TRUE(matches(x.sum(), {}, {expected}));
  // Per channel of an NCHW batch (dims {0, 2, 3}) and of an NHWC one (dims {0, 1, 2}).
  Tensor nchw = random_tensor({8, 4, 128, 256}, kFloat32, 8, 1.0, 2.0);
  Groups g = group(nchw, {0, 2, 3});
  EXPECT_TRUE(matches(nchw.sum({0, 2, 3}), g.out_sizes, each(g, ref_sum)));
  Tensor nhwc = nchw.permute({0, 2, 3, 1});
  EXPECT_TRUE(matches(nhwc.sum({0, 1, 2}), g.out_sizes, each(g, ref_sum)));
  EXPECT_TRUE(matches(nhwc.contiguous().sum({0, 1, 2}), g.out_sizes, each(g, ref_sum)));
}

TEST(ReduceSum, LargeLayoutsSplitAcrossThreadsMatchReference) {
  // Few outputs with long reductions (split inside an output), a long vertical reduction, and a
  // reduction whose innermost dim is strided.
  Tensor rows = random_tensor({400, 3, 400}, kFloat32, 21).slice(1, 0, 1);
  Groups g1 = group(rows, {0, 2});
  EXPECT_TRUE(matches(rows.sum({0, 2}), g1.out_sizes, each(g1, ref_sum)));
  Tensor tall = random_tensor({70000, 3}, kFloat32, 22);
  Groups g2 = group(tall, {0});
  EXPECT_TRUE(matches(tall.sum({0}), g2.out_sizes, each(g2, ref_sum)));
  EXPECT_TRUE(matches(tall.mean({0}), g2.out_sizes, each(g2, ref_mean)));
  Tensor strided = random_tensor({2, 200000}, kFloat64, 23).slice(1, 0, {}, 3);
  Groups g3 = group(strided, {1});
  EXPECT_TRUE(matches(strided.sum({1}), g3.out_sizes, each(g3, ref_sum)));
  Tensor flat_strided = random_tensor({300000}, kFloat32, 24).slice(0, 1, {}, 2);
  EXPECT_TRUE(matches(flat_strided.sum(), {}, {ref_sum(values(flat_strided))}));
}

TEST(ReduceSum, EmptyReductionIsZeroAndEmptyOutputIsEmpty) {
  Tensor x = zeros({3, 0, 2});
  EXPECT_TRUE(matches(x.sum({1}), {3, 2}, std::vector<double>(6, 0.0)));
  EXPECT_TRUE(matches(x.sum(), {}, {0.0}));
  EXPECT_TRUE(matches(x.sum({0}), {0, 2}, {}));
  EXPECT_TRUE(matches(x.sum({1}, true), {3, 1, 2}, std::vector<double>(6, 0.0)));
}

TEST(ReduceMean, MatchesReferenceAndRejectsIntegers) {
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    for (auto& [name, x] : layouts(dtype)) {
      for (const auto& dims : kDimLists) {
        Groups g = group(x, dims, true);
        EXPECT_TRUE(matches(mean(x, dims, true), g.out_sizes, each(g, ref_mean))) << name;
      }
    }
  }
  EXPECT_TRUE(std::isnan(zeros({0}).mean().item<double>()));
  try {
    int_tensor({3}, kInt64).mean();
    FAIL() << "mean of int64 should throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("[kiln::mean] could not infer output dtype"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("Got: Long"), std::string::npos);
  }
  EXPECT_THROW(tensor<bool>({true}).mean(), DTypeError);
}

TEST(ReduceProd, MatchesReferenceWithIntegerPromotionAndEmptyIsOne) {
  Tensor x = random_tensor({3, 4, 5}, kFloat64, 31, 0.5, 1.5);
  for (std::optional<int64_t> dim :
       {std::optional<int64_t>{}, std::optional<int64_t>{0}, std::optional<int64_t>{-1}}) {
    for (bool keepdim : {false, true}) {
      Groups g = group(x, dim ? std::vector<int64_t>{*dim} : std::vector<int64_t>{}, keepdim);
      EXPECT_TRUE(matches(prod(x, dim, keepdim), g.out_sizes, each(g, ref_prod)));
    }
  }
  Tensor xf = random_tensor({4, 6}, kFloat32, 32, 0.5, 1.5).t();
  Groups gf = group(xf, {1});
  EXPECT_TRUE(matches(xf.prod(1), gf.out_sizes, each(gf, ref_prod)));
  Tensor i = int_tensor({3, 4}, kInt32, 33, -3, 4);
  EXPECT_EQ(i.prod().dtype(), kInt64);
  Groups gi = group(i, {1});
  EXPECT_TRUE(matches(i.prod(1), gi.out_sizes, each(gi, ref_prod)));
  EXPECT_EQ(tensor<bool>({true, true}).prod().dtype(), kInt64);
  EXPECT_TRUE(matches(zeros({2, 0}).prod(1), {2}, {1.0, 1.0}));
  EXPECT_TRUE(matches(zeros({0}).prod(), {}, {1.0}));
}

// ---------------------------------------------------------------------------------------------
// max, min, amax, amin, argmax, argmin
// ---------------------------------------------------------------------------------------------

TEST(ReduceExtrema, AmaxAminMatchReferenceOverDimLists) {
  for (DType dtype : {kFloat32, kFloat16, kInt32, kInt64}) {
    auto xs = layouts(dtype);
    if (!is_floating_point(dtype)) xs = {{"int", int_tensor({3, 4, 5}, dtype, 41, -50, 50)}};
    for (auto& [name, x] : xs) {
      for (const auto& dims : kDimLists) {
        Groups g = group(x, dims);
        EXPECT_TRUE(matches(amax(x, dims), g.out_sizes, each(g, ref_max))) << name;
        EXPECT_TRUE(matches(amin(x, dims), g.out_sizes, each(g, ref_min))) << name;
        EXPECT_EQ(amax(x, dims).dtype(), dtype);
      }
    }
  }
  Tensor b = tensor<bool>({false, true, false});
  EXPECT_TRUE(b.amax().item<bool>());
  EXPECT_FALSE(b.amin().item<bool>());
}

TEST(ReduceExtrema, MaxAndMinPropagateNaN) {
  Tensor x = tensor<float>({1.f, (float)kNaN, 3.f, -1.f, 0.f, 2.f}).view({2, 3});
  EXPECT_TRUE(std::isnan(x.max().item<double>()));
  EXPECT_TRUE(std::isnan(x.min().item<double>()));
  EXPECT_TRUE(matches(x.amax({1}), {2}, {kNaN, 2.0}));
  EXPECT_TRUE(matches(x.amin({0}), {3}, {-1.0, kNaN, 2.0}));
  auto [v, i] = x.max(1);
  EXPECT_TRUE(matches(v, {2}, {kNaN, 2.0}));
  EXPECT_TRUE(matches(i, {2}, {1, 2}));
  // A long row (vector path) with the NaN late.
  std::vector<float> row(1000, 1.f);
  row[700] = (float)kNaN;
  row[800] = (float)kNaN;
  Tensor r = tensor<float>(row);
  EXPECT_EQ(r.argmax().item<int64_t>(), 700);
  EXPECT_EQ(r.argmin().item<int64_t>(), 700);
  EXPECT_TRUE(std::isnan(r.amax().item<double>()));
}

TEST(ReduceExtrema, MaxOverDimReturnsValuesAndFirstIndexOfTies) {
  for (DType dtype : {kFloat32, kFloat64, kBFloat16, kInt64, kUInt8}) {
    // Few distinct values, so ties are everywhere.
    Tensor x = int_tensor({6, 70}, dtype, 51, dtype == kUInt8 ? 0 : -2, 3);
    for (Tensor in : {x, x.t(), x.t().contiguous()}) {
      for (int64_t dim : {0, 1, -1}) {
        for (bool keepdim : {false, true}) {
          Groups g = group(in, {dim}, keepdim);
          auto [mx, imx] = in.max(dim, keepdim);
          auto [mn, imn] = in.min(dim, keepdim);
          EXPECT_EQ(mx.dtype(), dtype);
          EXPECT_EQ(imx.dtype(), kInt64);
          EXPECT_TRUE(matches(mx, g.out_sizes, each(g, ref_max)));
          EXPECT_TRUE(matches(mn, g.out_sizes, each(g, ref_min)));
          EXPECT_TRUE(matches(imx, g.out_sizes,
                              each(g, [](const auto& v) { return ref_argmax(v, true); })));
          EXPECT_TRUE(matches(imn, g.out_sizes,
                              each(g, [](const auto& v) { return ref_argmax(v, false); })));
          EXPECT_TRUE(matches(argmax(in, dim, keepdim), g.out_sizes,
                              each(g, [](const auto& v) { return ref_argmax(v, true); })));
          EXPECT_TRUE(matches(argmin(in, dim, keepdim), g.out_sizes,
                              each(g, [](const auto& v) { return ref_argmax(v, false); })));
        }
      }
    }
  }
}

TEST(ReduceExtrema, ArgmaxWithoutDimUsesTheFlatLogicalIndex) {
  Tensor x = random_tensor({5, 7}, kFloat32, 61);
  Tensor t = x.t();  // non-contiguous: the index is over t's row-major order
  EXPECT_EQ(t.argmax().item<int64_t>(), static_cast<int64_t>(ref_argmax(values(t), true)));
  EXPECT_EQ(t.argmin().item<int64_t>(), static_cast<int64_t>(ref_argmax(values(t), false)));
  EXPECT_EQ(argmax(t, {}, true).sizes().vec(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(argmax(t).dim(), 0);
  // A long row split across threads: ties across the split go to the first.
  std::vector<float> v(300000, 0.f);
  v[250000] = 5.f;
  v[10] = 5.f;
  v[200] = -5.f;
  v[299999] = -5.f;
  Tensor big = tensor<float>(v);
  EXPECT_EQ(big.argmax().item<int64_t>(), 10);
  EXPECT_EQ(big.argmin().item<int64_t>(), 200);
  auto [val, idx] = big.view({1, 300000}).max(1);
  EXPECT_EQ(idx.item<int64_t>(), 10);
  EXPECT_EQ(val.item<float>(), 5.f);
}

TEST(ReduceExtrema, EmptyReductionsThrow) {
  Tensor e = zeros({2, 0});
  EXPECT_THROW(e.max(), ValueError);
  EXPECT_THROW(e.min(), ValueError);
  EXPECT_THROW(e.argmax(), ValueError);
  try {
    e.max(1);
    FAIL() << "max over an empty dim should throw";
  } catch (const IndexError& err) {
    EXPECT_NE(std::string(err.what()).find("Expected reduction dim 1 to have non-zero size."),
              std::string::npos);
  }
  EXPECT_THROW(e.amax(), IndexError);
  EXPECT_THROW(e.amin({1}), IndexError);
  EXPECT_THROW(e.argmin(1), IndexError);
  // Reducing the non-empty dim is fine and gives an empty result.
  EXPECT_TRUE(matches(e.amax({0}), {0}, {}));
  auto [v, i] = e.max(0);
  EXPECT_EQ(v.sizes().vec(), (std::vector<int64_t>{0}));
  EXPECT_THROW(tensor<bool>({true}).argmax(), DTypeError);
}

// ---------------------------------------------------------------------------------------------
// var, std, var_mean
// ---------------------------------------------------------------------------------------------

TEST(ReduceMoments, VarStdVarMeanMatchReferenceForCorrections) {
  for (DType dtype : {kFloat32, kFloat64, kFloat16}) {
    for (auto& [name, x0] : layouts(dtype)) {
      for (const auto& dims : kDimLists) {
        for (int64_t correction : {0, 1, 2}) {
          Groups g = group(x0, dims, true);
          auto var_ref = each(g, [&](const auto& v) { return ref_var(v, correction); });
          auto std_ref = var_ref;
          for (auto& e : std_ref) e = std::sqrt(e);
          Tolerance tol =
              dtype == kFloat16 ? Tolerance{2e-3, 2e-3} : kiln::testing::tolerance_for(dtype);
          EXPECT_TRUE(matches(var(x0, dims, correction, true), g.out_sizes, var_ref, tol)) << name;
          EXPECT_TRUE(matches(kiln::std(x0, dims, correction, true), g.out_sizes, std_ref, tol))
              << name;
          auto [v, m] = var_mean(x0, dims, correction, true);
          EXPECT_TRUE(matches(v, g.out_sizes, var_ref, tol));
          EXPECT_TRUE(matches(m, g.out_sizes, each(g, ref_mean), tol));
        }
      }
    }
  }
}

TEST(ReduceMoments, CorrectionAtLeastCountGivesInfOrNaN) {
  Tensor x = tensor<double>({1.0, 2.0, 4.0});
  EXPECT_TRUE(std::isinf(var(x, {}, 3).item<double>()));  // 4.67 / 0
  EXPECT_TRUE(std::isinf(var(x, {}, 5).item<double>()));
  EXPECT_TRUE(std::isnan(var(tensor<double>({2.0}), {}, 1).item<double>()));  // 0 / 0
  EXPECT_TRUE(std::isnan(var(zeros({0}), {}, 1).item<double>()));
  auto [v, m] = var_mean(zeros({2, 0}), {1});
  EXPECT_TRUE(std::isnan(v.to_vector<double>()[0]));
  EXPECT_TRUE(std::isnan(m.to_vector<double>()[1]));
  EXPECT_TRUE(matches(var(x, {}, -1), {}, {ref_var(values(x), -1)}));
}

TEST(ReduceMoments, LargePerChannelStatisticsAreAccurate) {
  // Mean far from zero: a one-pass sum-of-squares formula would lose most digits here.
  Tensor x = random_tensor({4, 3, 96, 96}, kFloat32, 71, 99.0, 101.0);
  Groups g = group(x, {0, 2, 3});
  auto [v, m] = var_mean(x, {0, 2, 3}, 0);
  EXPECT_TRUE(matches(v, g.out_sizes, each(g, [](const auto& e) { return ref_var(e, 0); })));
  EXPECT_TRUE(matches(m, g.out_sizes, each(g, ref_mean)));
  Tensor all = random_tensor({300000}, kFloat32, 72, 99.0, 101.0);
  EXPECT_TRUE(matches(all.var(), {}, {ref_var(values(all), 1)}));
  Tensor nhwc = x.permute({0, 2, 3, 1}).contiguous();
  auto [v2, m2] = var_mean(nhwc, {0, 1, 2}, 0);
  EXPECT_TRUE(matches(v2, g.out_sizes, each(g, [](const auto& e) { return ref_var(e, 0); })));
  EXPECT_TRUE(matches(m2, g.out_sizes, each(g, ref_mean)));
}

// ---------------------------------------------------------------------------------------------
// norm, logsumexp
// ---------------------------------------------------------------------------------------------

TEST(ReduceNorm, EveryOrderMatchesReference) {
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    for (auto& [name, x] : layouts(dtype)) {
      for (double p : {2.0, 1.0, kInf, -kInf, 0.0, 3.0, 0.5, -1.5}) {
        for (const auto& dims : std::vector<std::vector<int64_t>>{{}, {1}, {0, 2}}) {
          Groups g = group(x, dims);
          EXPECT_TRUE(matches(norm(x, p, dims), g.out_sizes,
                              each(g, [p](const auto& v) { return ref_norm(v, p); })))
              << name << " p=" << p;
        }
      }
    }
  }
  Tensor z = tensor<float>({0.f, 3.f, 0.f, -4.f, (float)kNaN});
  EXPECT_TRUE(matches(norm(z.slice(0, 0, 4), 0), {}, {2.0}));
  EXPECT_TRUE(matches(norm(z, 0), {}, {3.0}));  // NaN counts as non-zero
  EXPECT_TRUE(std::isnan(norm(z).item<double>()));
  EXPECT_TRUE(matches(norm(z.slice(0, 0, 4), int64_t{2}), {}, {5.0}));
  EXPECT_TRUE(matches(zeros({0}).norm(), {}, {0.0}));
  EXPECT_THROW(zeros({0}).norm(kInf), ValueError);
  EXPECT_THROW(zeros({2, 0}).norm(-1.0, {1}), ValueError);
  EXPECT_TRUE(matches(zeros({2, 0}).norm(kInf, {0}), {0}, {}));
  EXPECT_THROW(int_tensor({3}, kInt64).norm(), DTypeError);
}

TEST(ReduceLogsumexp, IsStableAndHandlesInfinities) {
  for (DType dtype : {kFloat32, kFloat64, kFloat16}) {
    for (auto& [name, x] : layouts(dtype)) {
      for (const auto& dims : kDimLists) {
        Groups g = group(x, dims, true);
        EXPECT_TRUE(matches(logsumexp(x, dims, true), g.out_sizes, each(g, ref_logsumexp))) << name;
      }
    }
  }
  Tensor big = tensor<float>({1000.f, 1000.f, 999.f});
  EXPECT_TRUE(matches(logsumexp(big, {0}), {}, {ref_logsumexp(values(big))}));
  Tensor infs = tensor<double>({-kInf, -kInf, 1.0, kInf, -kInf, 0.0}).view({3, 2});
  EXPECT_TRUE(matches(logsumexp(infs, {1}), {3}, {-kInf, kInf, ref_logsumexp({-kInf, 0.0})}));
  EXPECT_TRUE(matches(logsumexp(zeros({2, 0}), {1}), {2}, {-kInf, -kInf}));
  Tensor i = int_tensor({2, 3}, kInt64, 81);
  Tensor li = logsumexp(i, {1});
  EXPECT_EQ(li.dtype(), kFloat32);  // integers give the default float dtype, as in PyTorch
  Groups g = group(i, {1});
  EXPECT_TRUE(matches(li, g.out_sizes, each(g, ref_logsumexp)));
  Tensor nan_row = tensor<float>({1.f, (float)kNaN});
  EXPECT_TRUE(std::isnan(logsumexp(nan_row, {0}).item<double>()));
}

// ---------------------------------------------------------------------------------------------
// any, all
// ---------------------------------------------------------------------------------------------

TEST(ReduceAnyAll, MatchReferenceForDtypesDimsAndEmpty) {
  auto any_ref = [](const auto& v) {
    return std::any_of(v.begin(), v.end(), [](double e) { return e != 0; }) ? 1.0 : 0.0;
  };
  auto all_ref = [](const auto& v) {
    return std::all_of(v.begin(), v.end(), [](double e) { return e != 0; }) ? 1.0 : 0.0;
  };
  for (DType dtype : {kFloat32, kInt32, kBool, kFloat16}) {
    Tensor x = int_tensor({4, 5, 6}, dtype, 91, dtype == kBool ? 0 : -1, 2);
    for (Tensor in : {x, x.permute({2, 0, 1})}) {
      EXPECT_TRUE(matches(in.any(), {}, {any_ref(values(in))}));
      EXPECT_TRUE(matches(in.all(), {}, {all_ref(values(in))}));
      EXPECT_EQ(in.any().dtype(), kBool);
      for (int64_t dim : {0, 1, -1}) {
        for (bool keepdim : {false, true}) {
          Groups g = group(in, {dim}, keepdim);
          EXPECT_TRUE(matches(any(in, dim, keepdim), g.out_sizes, each(g, any_ref)));
          EXPECT_TRUE(matches(all(in, dim, keepdim), g.out_sizes, each(g, all_ref)));
        }
      }
    }
  }
  EXPECT_TRUE(tensor<float>({0.f, (float)kNaN}).any().item<bool>());  // NaN is true
  EXPECT_TRUE(tensor<float>({1.f, (float)kNaN}).all().item<bool>());
  EXPECT_FALSE(zeros({0}).any().item<bool>());
  EXPECT_TRUE(zeros({0}).all().item<bool>());
  EXPECT_TRUE(matches(all(zeros({2, 0}), 1), {2}, {1.0, 1.0}));
  Tensor u = tensor<uint8_t>({0, 7});
  EXPECT_EQ(u.any().dtype(), kUInt8);  // uint8 keeps uint8, as in PyTorch
  EXPECT_EQ(u.any().item<int64_t>(), 1);
  EXPECT_EQ(u.all().item<int64_t>(), 0);
}

// ---------------------------------------------------------------------------------------------
// cumsum, softmax, log_softmax
// ---------------------------------------------------------------------------------------------

TEST(ReduceCumsum, MatchesReferenceAlongEveryDim) {
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    for (auto& [name, x] : layouts(dtype)) {
      for (int64_t dim : {0, 1, 2, -1}) {
        EXPECT_TRUE(matches(x.cumsum(dim), x.sizes().vec(), along(x, dim, ref_cumsum)))
            << name << " " << dim;
      }
    }
  }
  for (DType dtype : {kInt8, kInt32, kBool}) {
    Tensor x = int_tensor({3, 50}, dtype, 101, dtype == kBool ? 0 : -100, 100);
    Tensor r = x.cumsum(1);
    EXPECT_EQ(r.dtype(), kInt64);
    EXPECT_TRUE(matches(r, {3, 50}, along(x, 1, ref_cumsum)));
  }
  Tensor f = random_tensor({100000}, kFloat32, 102, 1.0, 2.0);
  EXPECT_TRUE(matches(f.cumsum(0), {100000}, ref_cumsum(values(f))));
  Tensor d = cumsum(tensor<int64_t>({1, 2, 3}), 0, kFloat64);
  EXPECT_EQ(d.dtype(), kFloat64);
  EXPECT_TRUE(matches(d, {3}, {1, 3, 6}));
  EXPECT_TRUE(matches(zeros({0, 3}).cumsum(0), {0, 3}, {}));
}

TEST(ReduceSoftmax, SoftmaxAndLogSoftmaxMatchReferenceAlongEveryDim) {
  for (DType dtype : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    for (auto& [name, x] : layouts(dtype)) {
      for (int64_t dim : {0, 1, 2, -1}) {
        EXPECT_TRUE(matches(softmax(x, dim), x.sizes().vec(),
                            along(x, dim, [](const auto& v) { return ref_softmax(v, false); })))
            << name << " " << dim;
        EXPECT_TRUE(matches(log_softmax(x, dim), x.sizes().vec(),
                            along(x, dim, [](const auto& v) { return ref_softmax(v, true); })))
            << name << " " << dim;
      }
    }
  }
  // Long rows (the pairwise sum) and wide columns (the vector-lane path).
  Tensor rows = random_tensor({3, 5000}, kFloat32, 111, -10.0, 10.0);
  EXPECT_TRUE(matches(rows.softmax(1), {3, 5000},
                      along(rows, 1, [](const auto& v) { return ref_softmax(v, false); })));
  EXPECT_TRUE(matches(rows.log_softmax(1), {3, 5000},
                      along(rows, 1, [](const auto& v) { return ref_softmax(v, true); })));
  Tensor cols = random_tensor({2, 300, 100}, kFloat32, 112, -10.0, 10.0);
  EXPECT_TRUE(matches(cols.softmax(1), {2, 300, 100},
                      along(cols, 1, [](const auto& v) { return ref_softmax(v, false); })));
  EXPECT_TRUE(matches(cols.log_softmax(1), {2, 300, 100},
                      along(cols, 1, [](const auto& v) { return ref_softmax(v, true); })));
}

TEST(ReduceSoftmax, IsStableForLargeAndInfiniteInputs) {
  Tensor big = tensor<float>({1000.f, 1001.f, 1002.f});
  EXPECT_TRUE(matches(big.softmax(0), {3}, ref_softmax(values(big), false)));
  EXPECT_TRUE(matches(big.log_softmax(0), {3}, ref_softmax(values(big), true)));
  Tensor masked = tensor<float>({1.f, -(float)kInf, 2.f, -(float)kInf});
  EXPECT_TRUE(matches(masked.softmax(0), {4}, ref_softmax(values(masked), false)));
  EXPECT_TRUE(matches(masked.log_softmax(0), {4}, ref_softmax(values(masked), true)));
  Tensor all_inf = full({3}, -kInf);
  auto r = all_inf.softmax(0).to_vector<double>();
  EXPECT_TRUE(std::isnan(r[0]));  // as in PyTorch
}

TEST(ReduceSoftmax, DtypeArgumentAndIntegerInputs) {
  Tensor h = random_tensor({4, 6}, kFloat16, 121);
  Tensor r = softmax(h, 1, kFloat32);
  EXPECT_EQ(r.dtype(), kFloat32);
  EXPECT_TRUE(matches(r, {4, 6}, along(h, 1, [](const auto& v) { return ref_softmax(v, false); })));
  Tensor i = int_tensor({2, 3}, kInt64, 122);
  EXPECT_THROW(softmax(i, 1), DTypeError);
  EXPECT_THROW(log_softmax(i, 1), DTypeError);
  EXPECT_THROW(softmax(h, 1, kInt32), DTypeError);
  Tensor li = log_softmax(i, 1, kFloat64);
  EXPECT_TRUE(matches(li, {2, 3}, along(i, 1, [](const auto& v) { return ref_softmax(v, true); })));
  EXPECT_TRUE(matches(softmax(zeros({0, 4}), 1), {0, 4}, {}));
}

// ---------------------------------------------------------------------------------------------
// 0-dim tensors, methods, errors
// ---------------------------------------------------------------------------------------------

TEST(ReduceZeroDim, ReductionsOfAScalarAcceptDimZeroAndMinusOne) {
  Tensor s = scalar_tensor(2.5);
  for (int64_t dim : {0, -1}) {
    EXPECT_TRUE(matches(s.sum({dim}), {}, {2.5}));
    EXPECT_TRUE(matches(s.sum({dim}, true), {}, {2.5}));
    EXPECT_TRUE(matches(s.mean({dim}), {}, {2.5}));
    EXPECT_TRUE(matches(s.prod(dim), {}, {2.5}));
    EXPECT_TRUE(matches(s.amax({dim}), {}, {2.5}));
    EXPECT_TRUE(matches(s.argmax(dim), {}, {0}));
    auto [v, i] = s.max(dim);
    EXPECT_TRUE(matches(v, {}, {2.5}));
    EXPECT_TRUE(matches(i, {}, {0}));
    EXPECT_TRUE(matches(s.var({dim}, 0), {}, {0.0}));
    EXPECT_TRUE(matches(s.norm(2, {dim}), {}, {2.5}));
    EXPECT_TRUE(matches(s.logsumexp({dim}), {}, {2.5}));
    EXPECT_TRUE(matches(any(s, dim), {}, {1.0}));
    EXPECT_TRUE(matches(s.cumsum(dim), {}, {2.5}));
    EXPECT_TRUE(matches(s.softmax(dim), {}, {1.0}));
    EXPECT_TRUE(matches(s.log_softmax(dim), {}, {0.0}));
  }
  EXPECT_TRUE(matches(s.sum(), {}, {2.5}));
  EXPECT_TRUE(matches(s.max(), {}, {2.5}));
  EXPECT_TRUE(std::isnan(s.var().item<double>()));
  EXPECT_THROW(s.sum({1}), IndexError);
  EXPECT_THROW(s.softmax(1), IndexError);
  EXPECT_THROW(s.max(-2), IndexError);
}

TEST(ReduceMethods, MethodFormsMatchReference) {
  Tensor x = random_tensor({4, 5}, kFloat64, 131);
  Groups g = group(x, {1});
  Groups all_g = group(x, {});
  EXPECT_TRUE(matches(x.sum({1}), g.out_sizes, each(g, ref_sum)));
  EXPECT_TRUE(matches(x.mean({1}), g.out_sizes, each(g, ref_mean)));
  EXPECT_TRUE(matches(x.prod(1), g.out_sizes, each(g, ref_prod)));
  EXPECT_TRUE(matches(x.max(), {}, each(all_g, ref_max)));
  EXPECT_TRUE(matches(x.min(), {}, each(all_g, ref_min)));
  EXPECT_TRUE(matches(std::get<0>(x.min(1)), g.out_sizes, each(g, ref_min)));
  EXPECT_TRUE(matches(x.amin({1}), g.out_sizes, each(g, ref_min)));
  EXPECT_TRUE(matches(x.argmin(1), g.out_sizes,
                      each(g, [](const auto& v) { return ref_argmax(v, false); })));
  EXPECT_TRUE(matches(x.std({1}), g.out_sizes,
                      each(g, [](const auto& v) { return std::sqrt(ref_var(v, 1)); })));
  EXPECT_TRUE(
      matches(x.var({1}), g.out_sizes, each(g, [](const auto& v) { return ref_var(v, 1); })));
  EXPECT_TRUE(
      matches(x.norm(1, {1}), g.out_sizes, each(g, [](const auto& v) { return ref_norm(v, 1); })));
  EXPECT_TRUE(matches(x.logsumexp({1}), g.out_sizes, each(g, ref_logsumexp)));
  EXPECT_TRUE(matches(x.all(), {}, {1.0}));
}

TEST(ReduceErrors, BadInputsThrowTheRightKind) {
  Tensor x = zeros({2, 3, 4});
  EXPECT_THROW(x.sum({3}), IndexError);  // dim out of range
  EXPECT_THROW(x.sum({-4}), IndexError);
  EXPECT_THROW(x.mean({0, -3}), ValueError);  // repeated dim
  EXPECT_THROW(x.amax({1, 1}), ValueError);
  EXPECT_THROW(x.var({2, 2}), ValueError);
  EXPECT_THROW(x.prod(5), IndexError);
  EXPECT_THROW(x.max(3), IndexError);
  EXPECT_THROW(x.argmax(-4), IndexError);
  EXPECT_THROW(x.cumsum(3), IndexError);
  EXPECT_THROW(x.softmax(-4), IndexError);
  EXPECT_THROW(any(x, 3), IndexError);
  EXPECT_THROW(int_tensor({3}, kInt32).var(), DTypeError);
  EXPECT_THROW(int_tensor({3}, kInt32).std(), DTypeError);
  EXPECT_THROW(var_mean(int_tensor({3}, kInt32)), DTypeError);
  try {
    x.sum({7});
    FAIL();
  } catch (const IndexError& e) {
    EXPECT_NE(std::string(e.what()).find("[kiln::sum] dimension out of range"), std::string::npos);
  }
}

TEST(ReduceLeaves, ResultsMergeCorrectlyAcrossLeavesAndLayouts) {
  // Long rows span several 4096-element leaves; tall columns span several 64-row leaves.
  std::vector<double> v = random_values(3 * 20000, 141, -50.0, 50.0);
  std::fill(v.begin() + 20000, v.begin() + 30000, -kInf);  // row 1: first leaves all -inf
  v[2 * 20000 + 15000] = kNaN;                             // row 2: a NaN in a late leaf
  Tensor rows = tensor<double>(v, {3, 20000}).to(kFloat32);
  Groups g = group(rows, {1});
  EXPECT_TRUE(matches(logsumexp(rows, {1}), g.out_sizes, each(g, ref_logsumexp)));
  EXPECT_TRUE(matches(rows.amax({1}), g.out_sizes, each(g, ref_max)));
  EXPECT_TRUE(matches(rows.amin({1}), g.out_sizes, each(g, ref_min)));
  EXPECT_TRUE(matches(argmax(rows, 1), g.out_sizes,
                      each(g, [](const auto& e) { return ref_argmax(e, true); })));
  v[20000 + 12000] = kInf;  // row 1: +inf after the -inf leaves
  Tensor with_inf = tensor<double>(v, {3, 20000}).to(kFloat32);
  EXPECT_TRUE(
      matches(logsumexp(with_inf, {1}), g.out_sizes, each(group(with_inf, {1}), ref_logsumexp)));

  Tensor tall = random_tensor({300, 70}, kFloat32, 142, -20.0, 20.0);
  Tensor tall_nan = tall.clone();
  tall_nan.select(0, 250).select(0, 3).fill_(kNaN);
  for (const Tensor& t : {tall, tall_nan}) {
    Groups gt = group(t, {0});
    EXPECT_TRUE(matches(logsumexp(t, {0}), gt.out_sizes, each(gt, ref_logsumexp)));
    EXPECT_TRUE(matches(t.amax({0}), gt.out_sizes, each(gt, ref_max)));
    EXPECT_TRUE(matches(t.amin({0}), gt.out_sizes, each(gt, ref_min)));
    EXPECT_TRUE(
        matches(t.var({0}), gt.out_sizes, each(gt, [](const auto& e) { return ref_var(e, 1); })));
    EXPECT_TRUE(matches(t.sum({0}), gt.out_sizes, each(gt, ref_sum)));
    EXPECT_TRUE(matches(argmin(t, 0), gt.out_sizes,
                        each(gt, [](const auto& e) { return ref_argmax(e, false); })));
  }
  // Few rows, many columns (one vertical leaf per block), and a wide bool any/all.
  Tensor wide = random_tensor({16, 5000}, kFloat64, 143);
  Groups gw = group(wide, {0});
  EXPECT_TRUE(matches(wide.sum({0}), gw.out_sizes, each(gw, ref_sum)));
  EXPECT_TRUE(matches(wide.norm(2, {0}), gw.out_sizes,
                      each(gw, [](const auto& e) { return ref_norm(e, 2); })));
  Tensor flags = int_tensor({70, 300}, kBool, 144, 0, 2);
  Groups gf = group(flags, {0});
  auto any_ref = [](const auto& e) {
    return std::any_of(e.begin(), e.end(), [](double d) { return d != 0; }) ? 1.0 : 0.0;
  };
  EXPECT_TRUE(matches(any(flags, 0), gf.out_sizes, each(gf, any_ref)));
  EXPECT_TRUE(matches(flags.sum({0}), gf.out_sizes, each(gf, ref_sum)));
}

TEST(ReduceExtrema, LongArraysFindNaNAndInfinities) {
  std::vector<float> v(10000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 97) - 40.f;
  v[6000] = std::numeric_limits<float>::infinity();
  v[7000] = -std::numeric_limits<float>::infinity();
  Tensor t = tensor<float>(v);
  EXPECT_EQ(t.amax().item<float>(), std::numeric_limits<float>::infinity());
  EXPECT_EQ(t.amin().item<float>(), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(t.argmax().item<int64_t>(), 6000);
  v[9999] = std::numeric_limits<float>::quiet_NaN();
  Tensor n = tensor<float>(v);
  EXPECT_TRUE(std::isnan(n.amax().item<float>()));
  EXPECT_TRUE(std::isnan(n.amin().item<float>()));
  EXPECT_TRUE(std::isnan(n.max().item<float>()));
  EXPECT_EQ(n.argmin().item<int64_t>(), 9999);
  Tensor h = n.to(kFloat16);
  EXPECT_TRUE(std::isnan(h.amax().item<double>()));
}

TEST(ReduceLayouts, ManyDimsThatDoNotMergeStillReduceCorrectly) {
  // 18 dims alternating real and broadcast strides: none merge, more than the loops walk directly.
  std::vector<int64_t> base_sizes, sizes;
  for (int i = 0; i < 9; ++i) {
    base_sizes.insert(base_sizes.end(), {2, 1});
    sizes.insert(sizes.end(), {2, 2});
  }
  Tensor x = random_tensor(base_sizes, kFloat32, 151).expand(sizes);
  for (const auto& dims : std::vector<std::vector<int64_t>>{{17}, {0, 3, 4, 9, 16}, {}}) {
    Groups g = group(x, dims);
    EXPECT_TRUE(matches(x.sum(dims), g.out_sizes, each(g, ref_sum)));
    EXPECT_TRUE(matches(x.amax(dims), g.out_sizes, each(g, ref_max)));
  }
  Groups g = group(x, {5});
  EXPECT_TRUE(matches(argmax(x, 5), g.out_sizes,
                      each(g, [](const auto& e) { return ref_argmax(e, true); })));
}

TEST(ReduceLayouts, KernelsWriteIntoStridedOutputs) {
  // The out= path of the op table hands kernels outputs that may be strided.
  Tensor x = random_tensor({4, 5, 6}, kFloat32, 161);
  Groups g = group(x, {1});
  Tensor out = zeros({6, 4}).t();
  Tensor outs[1] = {out};
  call_op_out(*OpTable::instance().find("sum"), {x}, {std::vector<int64_t>{1}, false, Attr()},
              outs);
  EXPECT_TRUE(matches(out, g.out_sizes, each(g, ref_sum)));
  Tensor values = zeros({6, 4}).t(), indices = zeros({6, 4}, kInt64).t();
  Tensor pair[2] = {values, indices};
  call_op_out(*OpTable::instance().find("max.dim"), {x}, {int64_t{1}, false}, pair);
  EXPECT_TRUE(matches(values, g.out_sizes, each(g, ref_max)));
  EXPECT_TRUE(
      matches(indices, g.out_sizes, each(g, [](const auto& e) { return ref_argmax(e, true); })));
  Tensor var_out = zeros({6, 4}).t(), mean_out = zeros({6, 4}).t();
  Tensor moments[2] = {var_out, mean_out};
  call_op_out(*OpTable::instance().find("var_mean"), {x},
              {std::vector<int64_t>{1}, int64_t{1}, false}, moments);
  EXPECT_TRUE(matches(var_out, g.out_sizes, each(g, [](const auto& e) { return ref_var(e, 1); })));
  EXPECT_TRUE(matches(mean_out, g.out_sizes, each(g, ref_mean)));
  Tensor soft = zeros({6, 5, 4}).permute({2, 1, 0});
  Tensor soft_out[1] = {soft};
  call_op_out(*OpTable::instance().find("softmax"), {x}, {int64_t{1}, Attr()}, soft_out);
  EXPECT_TRUE(
      matches(soft, {4, 5, 6}, along(x, 1, [](const auto& v) { return ref_softmax(v, false); })));
}

TEST(ReduceLayouts, ShortRowsAndNarrowColumnsMatchReference) {
  // Short last dims (outputs in vector lanes) and narrow matrices reduced over rows (lanes that
  // cycle through the outputs), with ties, NaN and -inf, and sizes that do and do not divide
  // the vector width.
  for (int64_t width : {1, 2, 3, 4, 7, 8, 16, 17}) {
    for (int64_t rows : {int64_t{5}, int64_t{1000}, int64_t{70000}}) {
      Tensor x = int_tensor({rows, width}, kFloat32, 171 + width, -3, 4);
      if (rows == 1000) {
        x.select(0, 10).select(0, 0).fill_(kNaN);
        x.select(0, 20).select(0, width - 1).fill_(-kInf);
      }
      Groups g_last = group(x, {1}), g_first = group(x, {0});
      EXPECT_TRUE(matches(x.sum({1}), g_last.out_sizes, each(g_last, ref_sum)))
          << width << " " << rows;
      EXPECT_TRUE(matches(x.amax({1}), g_last.out_sizes, each(g_last, ref_max)));
      EXPECT_TRUE(matches(argmax(x, 1), g_last.out_sizes,
                          each(g_last, [](const auto& e) { return ref_argmax(e, true); })));
      EXPECT_TRUE(matches(x.sum({0}), g_first.out_sizes, each(g_first, ref_sum)))
          << width << " " << rows;
      EXPECT_TRUE(matches(x.amin({0}), g_first.out_sizes, each(g_first, ref_min)));
      EXPECT_TRUE(matches(any(x, 0), g_first.out_sizes, each(g_first, [](const auto& e) {
                            return std::any_of(e.begin(), e.end(), [](double d) { return d != 0; })
                                       ? 1.0
                                       : 0.0;
                          })));
      if (rows <= 1000) {
        EXPECT_TRUE(matches(x.softmax(1), {rows, width},
                            along(x, 1, [](const auto& v) { return ref_softmax(v, false); })));
        EXPECT_TRUE(matches(x.log_softmax(1), {rows, width},
                            along(x, 1, [](const auto& v) { return ref_softmax(v, true); })));
      }
    }
  }
  Tensor h = random_tensor({300, 10}, kBFloat16, 181);
  EXPECT_TRUE(matches(h.softmax(1), {300, 10},
                      along(h, 1, [](const auto& v) { return ref_softmax(v, false); })));
  for (int64_t width : {3, 4}) {
    Tensor i = int_tensor({1000, width}, kInt32, 183, -100, 100);
    Groups gi = group(i, {0});
    EXPECT_TRUE(matches(i.sum({0}), gi.out_sizes, each(gi, ref_sum)));
    EXPECT_TRUE(matches(i.sum({1}), {1000}, each(group(i, {1}), ref_sum)));
  }
  // 40000 float64 terms of either sign whose sums are ~1e-2: a split of the rows across more
  // threads (16 on the GPU machine) reorders the additions by up to ~1e-12 absolute, so the bound
  // scales with the terms' magnitude (sum |x| ~ 3e4, times 1e-15), not with the small result.
  Tensor d = random_tensor({40000, 8}, kFloat64, 182);
  Groups gd = group(d, {0});
  const double magnitude = d.abs().sum({0}).amax().item<double>();
  EXPECT_TRUE(matches(d.sum({0}), gd.out_sizes, each(gd, ref_sum), Tolerance{1e-12, 1e-15 * magnitude}));
  EXPECT_TRUE(matches(d.mean({0}), gd.out_sizes, each(gd, ref_mean), Tolerance{1e-12, 1e-15 * magnitude / 40000}));
}
