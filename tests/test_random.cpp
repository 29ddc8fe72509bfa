// Random ops: the Philox stream (known-answer vectors, the documented element -> draw mapping),
// reproducibility, statistics of ~1e5 samples, thread-count independence, and bad inputs.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <set>

#include "core/generator.h"
#include "kiln/math/philox.h"
#include "reference.h"

using namespace kiln;
using kiln::testing::values;

namespace {

struct Stats {
  double mean = 0, var = 0, min = 0, max = 0;
};

Stats stats_of(const Tensor& t) {
  auto v = values(t);
  Stats s;
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.var += (x - s.mean) * (x - s.mean);
  s.var /= static_cast<double>(v.size() - 1);
  return s;
}

constexpr int64_t kN = 100000;

// Restores the thread count when a test changes it.
struct ThreadCountGuard {
  int saved = get_num_threads();
  ~ThreadCountGuard() { set_num_threads(saved); }
};

}  // namespace

// ---------------- the stream ----------------

TEST(Philox, MatchesRandom123KnownAnswers) {
  auto b = math::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(b.x[0], 0x6627e8d5u);
  EXPECT_EQ(b.x[1], 0xe169c58du);
  EXPECT_EQ(b.x[2], 0xbc57ac4cu);
  EXPECT_EQ(b.x[3], 0x9b00dbd8u);
  b = math::philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(b.x[0], 0x408f276du);
  EXPECT_EQ(b.x[1], 0x41c83b0eu);
  EXPECT_EQ(b.x[2], 0xa20bc7c6u);
  EXPECT_EQ(b.x[3], 0x6d5451fdu);
  b = math::philox4x32_10(0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0);
  EXPECT_EQ(b.x[0], 0xd16cfe09u);
  EXPECT_EQ(b.x[1], 0x94fdccebu);
  EXPECT_EQ(b.x[2], 0x5001e420u);
  EXPECT_EQ(b.x[3], 0x24126ea1u);
}

TEST(Philox, RandFollowsTheDocumentedElementToDrawMapping) {
  manual_seed(1234);
  auto& gen = detail::default_generator();
  uint64_t offset = gen.offset();
  Tensor f = rand({37});
  auto got = f.to_vector<float>();
  for (uint64_t i = 0; i < 37; ++i)
    EXPECT_EQ(got[i], math::uniform_float(math::philox_draw32(1234, offset, i), 24)) << "element " << i;

  offset = gen.offset();
  Tensor d = rand({11}, kFloat64);
  auto got_d = d.to_vector<double>();
  for (uint64_t i = 0; i < 11; ++i)
    EXPECT_EQ(got_d[i], math::uniform_double(math::philox_draw64(1234, offset, i))) << "element " << i;

  offset = gen.offset();
  Tensor n = randn({7}, kFloat64);
  auto got_n = n.to_vector<double>();
  for (uint64_t i = 0; i < 7; ++i) {
    uint64_t pair = i / 2 * 2;
    auto z = math::box_muller64(math::philox_draw64(1234, offset, pair), math::philox_draw64(1234, offset, pair + 1));
    EXPECT_EQ(got_n[i], i % 2 == 0 ? z.z0 : z.z1) << "element " << i;
  }

  offset = gen.offset();
  Tensor nf = randn({9});
  auto got_nf = nf.to_vector<float>();
  for (uint64_t i = 0; i < 9; ++i) {
    uint64_t pair = i / 2 * 2;
    uint32_t w1 = math::philox_draw32(1234, offset, pair), w2 = math::philox_draw32(1234, offset, pair + 1);
    auto z = math::box_muller32(w1, w2);
    EXPECT_EQ(got_nf[i], i % 2 == 0 ? z.z0 : z.z1) << "element " << i;
    // And the float forms agree with Box-Muller in double.
    double u1 = (w1 >> 8) * 0x1p-24, u2 = (w2 >> 8) * 0x1p-24;
    double r = std::sqrt(-2 * std::log(1 - u1)), theta = 2 * std::numbers::pi * u2;
    EXPECT_NEAR(got_nf[i], i % 2 == 0 ? r * std::cos(theta) : r * std::sin(theta), 1e-6 * (1 + r));
  }
}

TEST(Philox, FloatBoxMullerMathIsAccurate) {
  // Every 97th 24-bit input: log within 1 ulp, sqrt equal to IEEE sqrt, sin/cos within 2e-7.
  for (uint32_t k = 1; k <= (1u << 24); k += 97) {
    float x = static_cast<float>(k) * 0x1p-24f;
    double exact = std::log(static_cast<double>(x));
    float ulp = std::abs(std::nextafter(static_cast<float>(exact), 0.0f) - static_cast<float>(exact));
    ASSERT_LE(std::abs(math::log_unit(x) - exact), ulp + 1e-30) << "log of " << x;
    float v = -2.0f * math::log_unit(x);
    ASSERT_EQ(math::sqrt_nonneg(v), std::sqrt(v)) << "sqrt of " << v;
    auto sc = math::sincos_turns24(k - 1);
    double angle = 2 * std::numbers::pi * (k - 1) * 0x1p-24;
    ASSERT_NEAR(sc.sin, std::sin(angle), 2e-7);
    ASSERT_NEAR(sc.cos, std::cos(angle), 2e-7);
  }
  EXPECT_EQ(math::sqrt_nonneg(0.0f), 0.0f);
  EXPECT_EQ(math::log_unit(1.0f), 0.0f);
}

TEST(Generator, OffsetAdvancesByTheCountersEachCallConsumes) {
  auto& gen = detail::default_generator();
  manual_seed(5);
  EXPECT_EQ(gen.seed(), 5u);
  EXPECT_EQ(gen.offset(), 0u);
  rand({10});  // 10 32-bit draws: 3 counters
  EXPECT_EQ(gen.offset(), 3u);
  rand({10}, kFloat64);  // 10 64-bit draws: 5 counters
  EXPECT_EQ(gen.offset(), 8u);
  randint(0, int64_t{1} << 40, {3});  // range above 2^32: 64-bit draws, 2 counters
  EXPECT_EQ(gen.offset(), 10u);
  bernoulli(zeros({4}), 0.5);
  EXPECT_EQ(gen.offset(), 11u);
  rand({0});
  EXPECT_EQ(gen.offset(), 11u);
}

TEST(Generator, SameSeedSameNumbersAndSuccessiveCallsDiffer) {
  manual_seed(42);
  auto a = values(rand({100}));
  auto b = values(randn({100}));
  auto c = values(randint(0, 1000, {100}));
  manual_seed(42);
  EXPECT_EQ(values(rand({100})), a);
  EXPECT_EQ(values(randn({100})), b);
  EXPECT_EQ(values(randint(0, 1000, {100})), c);
  EXPECT_NE(values(rand({100})), a);
  manual_seed(43);
  EXPECT_NE(values(rand({100})), a);
}

TEST(Generator, ResultsDoNotDependOnTheThreadCount) {
  ThreadCountGuard guard;
  auto draw_all = [] {
    manual_seed(7);
    std::vector<std::vector<double>> out;
    out.push_back(values(rand({200003})));
    out.push_back(values(randn({200003}, kFloat64)));
    out.push_back(values(randint(-5, 5, {200003})));
    out.push_back(values(bernoulli(full({200003}, 0.3))));
    out.push_back(values(dropout(ones({200003}), 0.4)));
    Tensor t = empty({300, 701}).t();
    t.uniform_(-1, 1);
    out.push_back(values(t));
    return out;
  };
  set_num_threads(1);
  auto one = draw_all();
  set_num_threads(2);
  auto two = draw_all();
  set_num_threads(3);
  auto three = draw_all();
  for (size_t k = 0; k < one.size(); ++k) {
    EXPECT_EQ(one[k], two[k]) << "output " << k;
    EXPECT_EQ(one[k], three[k]) << "output " << k;
  }
}

// ---------------- uniform ----------------

TEST(Rand, UniformStatisticsPerDtype) {
  manual_seed(0);
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    Tensor r = rand({kN}, t);
    EXPECT_EQ(r.dtype(), t);
    Stats s = stats_of(r);
    EXPECT_GE(s.min, 0.0) << dtype_name(t);
    EXPECT_LT(s.max, 1.0) << dtype_name(t);
    EXPECT_NEAR(s.mean, 0.5, 5e-3) << dtype_name(t);
    EXPECT_NEAR(s.var, 1.0 / 12, 3e-3) << dtype_name(t);
  }
}

TEST(Rand, UniformInPlaceCoversFromTo) {
  manual_seed(1);
  Tensor t = empty({kN}, kFloat64);
  uniform_(t, -2, 3);
  Stats s = stats_of(t);
  EXPECT_GE(s.min, -2.0);
  EXPECT_LT(s.max, 3.0);
  EXPECT_NEAR(s.mean, 0.5, 0.03);
  EXPECT_NEAR(s.var, 25.0 / 12, 0.05);
}

TEST(Rand, InPlaceOnAStridedViewFillsLogicalRowMajorOrder) {
  manual_seed(9);
  auto expected = values(rand({6, 4}));
  manual_seed(9);
  Tensor base = zeros({4, 6});
  Tensor view = base.t();
  view.uniform_();
  EXPECT_EQ(values(view), expected);
}

TEST(Rand, ShapesDtypesAndOptions) {
  EXPECT_EQ(rand({0, 3}).numel(), 0);
  Tensor s = rand({});
  EXPECT_EQ(s.dim(), 0);
  EXPECT_GE(s.item<double>(), 0.0);
  EXPECT_LT(s.item<double>(), 1.0);
  EXPECT_TRUE(rand({2}, TensorOptions(std::nullopt, kCPU, true)).requires_grad());
  Tensor like = rand_like(zeros({2, 3}, kFloat64));
  EXPECT_EQ(like.dtype(), kFloat64);
  EXPECT_EQ(like.sizes().vec(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(randn_like(zeros({4}), kFloat16).dtype(), kFloat16);
}

// ---------------- normal ----------------

TEST(Randn, StandardNormalStatistics) {
  manual_seed(2);
  for (DType t : {kFloat32, kFloat64, kBFloat16}) {
    Tensor r = randn({kN}, t);
    auto v = values(r);
    Stats s = stats_of(r);
    EXPECT_NEAR(s.mean, 0.0, 0.02) << dtype_name(t);
    EXPECT_NEAR(s.var, 1.0, 0.03) << dtype_name(t);
    double within_one = 0;
    for (double x : v) within_one += std::abs(x) <= 1.0;
    EXPECT_NEAR(within_one / kN, 0.6827, 0.01) << dtype_name(t);
  }
}

TEST(Randn, NormalInPlaceMeanAndStd) {
  manual_seed(3);
  Tensor t = empty({kN});
  normal_(t, 3.0, 2.0);
  Stats s = stats_of(t);
  EXPECT_NEAR(s.mean, 3.0, 0.04);
  EXPECT_NEAR(std::sqrt(s.var), 2.0, 0.03);
  // Odd sizes: the last element uses the cosine half of a pair.
  Tensor odd = randn({5});
  for (double x : values(odd)) EXPECT_TRUE(std::isfinite(x));
}

// ---------------- randint ----------------

TEST(Randint, LowInclusiveHighExclusiveAndUniform) {
  manual_seed(4);
  Tensor r = randint(-3, 4, {kN});
  EXPECT_EQ(r.dtype(), kInt64);
  auto v = values(r);
  std::vector<int64_t> counts(7, 0);
  for (double x : v) {
    ASSERT_GE(x, -3);
    ASSERT_LE(x, 3);
    ASSERT_EQ(x, std::floor(x));
    ++counts[static_cast<size_t>(x + 3)];
  }
  for (int64_t c : counts) EXPECT_NEAR(static_cast<double>(c) / kN, 1.0 / 7, 0.006);
  Stats s = stats_of(randint(10, {kN}));
  EXPECT_EQ(s.min, 0);
  EXPECT_EQ(s.max, 9);
  EXPECT_NEAR(s.mean, 4.5, 0.05);
}

TEST(Randint, WideRangesAndOtherDtypes) {
  manual_seed(5);
  const int64_t high = int64_t{1} << 40;
  Stats s = stats_of(randint(0, high, {kN}));
  EXPECT_GE(s.min, 0);
  EXPECT_LT(s.max, static_cast<double>(high));
  EXPECT_NEAR(s.mean / static_cast<double>(high), 0.5, 0.01);
  auto full_range = randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {1000});
  EXPECT_EQ(full_range.numel(), 1000);
  Tensor f = randint(0, 10, {1000}, kFloat32);
  EXPECT_EQ(f.dtype(), kFloat32);
  for (double x : values(f)) EXPECT_EQ(x, std::floor(x));
  Stats u8 = stats_of(randint(250, 256, {1000}, kUInt8));
  EXPECT_GE(u8.min, 250);
  EXPECT_LE(u8.max, 255);
}

// ---------------- bernoulli ----------------

TEST(Bernoulli, TensorProbabilities) {
  manual_seed(6);
  Tensor p = full({kN}, 0.3, kFloat64);
  Tensor b = bernoulli(p);
  EXPECT_EQ(b.dtype(), kFloat64);
  Stats s = stats_of(b);
  EXPECT_NEAR(s.mean, 0.3, 0.01);
  for (double x : values(b)) ASSERT_TRUE(x == 0.0 || x == 1.0);
  // Certain outcomes, read through a transposed (non-contiguous) p.
  Tensor edges = tensor<float>({0, 1, 0, 1, 0, 1}, {3, 2}).t();
  EXPECT_TRUE(kiln::testing::matches(bernoulli(edges), {2, 3}, {0, 0, 0, 1, 1, 1}));
}

TEST(Bernoulli, ScalarProbabilityKeepsDtypeAndInPlace) {
  manual_seed(7);
  Tensor b = bernoulli(zeros({kN}, kInt64), 0.25);
  EXPECT_EQ(b.dtype(), kInt64);
  EXPECT_NEAR(stats_of(b).mean, 0.25, 0.01);
  Tensor t = empty({kN}, kFloat16);
  t.bernoulli_(0.7);
  EXPECT_NEAR(stats_of(t).mean, 0.7, 0.01);
  Tensor m = empty({kN}, kBool);
  m.bernoulli_(0.5);
  EXPECT_NEAR(stats_of(m).mean, 0.5, 0.01);
  EXPECT_EQ(stats_of(bernoulli(ones({100}), 0.0)).max, 0.0);
  EXPECT_EQ(stats_of(bernoulli(ones({100}), 1.0)).min, 1.0);
}

// ---------------- dropout ----------------

TEST(Dropout, TrainingScalesKeptValuesAndZeroesTheRest) {
  manual_seed(8);
  Tensor x = full({kN}, 2.0);
  Tensor y = dropout(x, 0.2);
  auto v = values(y);
  double kept = 0, total = 0;
  for (double e : v) {
    ASSERT_TRUE(e == 0.0 || std::abs(e - 2.0 / 0.8) < 1e-6) << e;
    kept += e != 0.0;
    total += e;
  }
  EXPECT_NEAR(kept / kN, 0.8, 0.01);
  EXPECT_NEAR(total / kN, 2.0, 0.03);
  Tensor d = dropout(full({kN}, 1.0, kFloat64), 0.5);
  EXPECT_EQ(d.dtype(), kFloat64);
  EXPECT_NEAR(stats_of(d).mean, 1.0, 0.02);
}

TEST(Dropout, EvalAndZeroProbabilityReturnTheInputAndOneGivesZeros) {
  Tensor x = tensor<float>({1, 2, 3});
  EXPECT_TRUE(dropout(x, 0.5, /*training=*/false).same(x));
  EXPECT_TRUE(dropout(x, 0.0).same(x));
  EXPECT_TRUE(kiln::testing::matches(dropout(x, 1.0), {3}, {0, 0, 0}));
  Tensor i = tensor<int64_t>({1, 2});
  EXPECT_TRUE(dropout(i, 0.5, false).same(i));
  Tensor strided = full({4, 6}, 1.0f).t();
  EXPECT_EQ(dropout(strided, 0.5).sizes().vec(), (std::vector<int64_t>{6, 4}));
}

// ---------------- bad inputs ----------------

TEST(RandomBadInputs, ThrowTheRightErrorKind) {
  EXPECT_THROW(rand({2}, kInt64), DTypeError);
  EXPECT_THROW(randn({2}, kInt32), DTypeError);
  EXPECT_THROW(rand_like(zeros({2}, kInt64)), DTypeError);
  Tensor i = zeros({2}, kInt64);
  EXPECT_THROW(i.uniform_(), DTypeError);
  EXPECT_THROW(rand({-1}), ValueError);
  Tensor f = zeros({2});
  EXPECT_THROW(f.uniform_(1, 0), ValueError);
  EXPECT_THROW(f.uniform_(-std::numeric_limits<double>::infinity(), 0), ValueError);
  EXPECT_THROW(f.uniform_(-3e38, 3e38), ValueError);  // to - from overflows float32
  EXPECT_THROW(rand({2}, kFloat16).uniform_(0, 70000), ValueError);
  EXPECT_THROW(f.normal_(0, -1), ValueError);
  EXPECT_THROW(randint(5, 5, {2}), ValueError);
  EXPECT_THROW(randint(0, 300, {2}, kUInt8), ValueError);
  EXPECT_THROW(randint(-1, 2, {2}, kUInt8), ValueError);
  EXPECT_THROW(bernoulli(tensor<int64_t>({0, 1})), DTypeError);
  EXPECT_THROW(bernoulli(tensor<float>({0.5f, 1.5f})), ValueError);
  EXPECT_THROW(bernoulli(tensor<float>({std::numeric_limits<float>::quiet_NaN()})), ValueError);
  EXPECT_THROW(bernoulli(f, 1.5), ValueError);
  EXPECT_THROW(f.bernoulli_(-0.1), ValueError);
  EXPECT_THROW(dropout(f, 1.5), ValueError);
  EXPECT_THROW(dropout(f, -0.5, false), ValueError);
  EXPECT_THROW(dropout(tensor<int64_t>({1, 2}), 0.5), DTypeError);
  EXPECT_THROW(rand({2}, cuda_device(4096)), DeviceError);
}
