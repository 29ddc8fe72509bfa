// Range factories (arange, linspace, eye) and the comparison helpers (allclose, equal,
// broadcast_shapes, result_type), checked against values computed here.
#include <cmath>
#include <limits>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;

// ---------------- arange ----------------

TEST(Arange, IntegerArgumentsGiveInt64) {
  Tensor a = arange(5);
  EXPECT_EQ(a.dtype(), kInt64);
  EXPECT_TRUE(matches(a, {5}, {0, 1, 2, 3, 4}));
  EXPECT_TRUE(matches(arange(1, 10, 3), {3}, {1, 4, 7}));
  EXPECT_TRUE(matches(arange(10, 0, -3), {4}, {10, 7, 4, 1}));
  EXPECT_TRUE(matches(arange(3, 3), {0}, {}));
}

TEST(Arange, FloatArgumentsGiveTheDefaultDtypeAndCeilSize) {
  Tensor a = arange(0.0, 1.0, 0.25);
  EXPECT_EQ(a.dtype(), kFloat32);
  EXPECT_TRUE(matches(a, {4}, {0, 0.25, 0.5, 0.75}));
  // ceil((1 - 0) / 0.3) = 4 elements; each value is start + i * step in double, then rounded.
  Tensor b = arange(0, 1.0, 0.3);
  ASSERT_EQ(b.numel(), 4);
  auto got = b.to_vector<float>();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], static_cast<float>(0.3 * i));
  EXPECT_EQ(arange(2.5).dtype(), kFloat32);
  EXPECT_TRUE(matches(arange(2.5), {3}, {0, 1, 2}));
  set_default_dtype(kFloat64);
  EXPECT_EQ(arange(1.5).dtype(), kFloat64);
  set_default_dtype(kFloat32);
}

TEST(Arange, ExplicitDtypes) {
  EXPECT_TRUE(matches(arange(0, 5, 2, kFloat64), {3}, {0, 2, 4}));
  EXPECT_EQ(arange(0, 5, 2, kFloat64).dtype(), kFloat64);
  EXPECT_TRUE(matches(arange(-2, 2, 1, kInt32), {4}, {-2, -1, 0, 1}));
  EXPECT_TRUE(matches(arange(0.0, 2.0, 0.5, kFloat16), {4}, {0, 0.5, 1, 1.5}));
  EXPECT_TRUE(matches(arange(0, 4, 1, kBFloat16), {4}, {0, 1, 2, 3}));
  EXPECT_TRUE(matches(arange(0, 3, 1, kUInt8), {3}, {0, 1, 2}));
}

TEST(Arange, Int64ValuesBeyondDoublePrecisionAreExact) {
  const int64_t big = int64_t{1} << 53;
  Tensor a = arange(big + 1, big + 6, 2);
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{big + 1, big + 3, big + 5}));
}

TEST(Arange, BadInputs) {
  EXPECT_THROW(arange(0, 10, 0), ValueError);
  EXPECT_THROW(arange(0.0, 1.0, 0.0), ValueError);
  try {
    arange(0, 10, -1);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("upper bound and larger bound inconsistent with step sign"),
              std::string::npos);
  }
  EXPECT_THROW(arange(0.0, std::numeric_limits<double>::infinity()), ValueError);
  EXPECT_THROW(arange(0, 1, 0.5, kInt64), ValueError);  // the step truncates to 0 in int64
  EXPECT_THROW(arange(0, 3, 1, kBool), DTypeError);
  EXPECT_THROW(arange(0, 3, 1, cuda_device(4096)), DeviceError);
}

// ---------------- linspace ----------------

TEST(Linspace, EvenlySpacedWithExactEndpoints) {
  Tensor a = linspace(0, 1, 5);
  EXPECT_EQ(a.dtype(), kFloat32);
  EXPECT_TRUE(matches(a, {5}, {0, 0.25, 0.5, 0.75, 1}));
  // PyTorch's symmetric formula, reproduced in double: the first half counts up from start, the
  // second half counts down from end.
  Tensor b = linspace(-1, 2, 11, kFloat64);
  auto got = b.to_vector<double>();
  const double step = 3.0 / 10;
  for (int i = 0; i < 11; ++i) {
    double want = i < 5 ? -1 + step * i : 2 - step * (10 - i);
    EXPECT_EQ(got[i], want) << "element " << i;
  }
  EXPECT_EQ(got[10], 2.0);
  EXPECT_TRUE(matches(linspace(3, -3, 4, kFloat16), {4}, {3, 1, -1, -3}));
}

TEST(Linspace, ZeroAndOneSteps) {
  EXPECT_TRUE(matches(linspace(0, 1, 0), {0}, {}));
  EXPECT_TRUE(matches(linspace(2.5, 7, 1), {1}, {2.5}));
}

TEST(Linspace, IntegerDtypeTruncates) {
  Tensor a = linspace(0, 10, 5, kInt64);
  EXPECT_EQ(a.dtype(), kInt64);
  EXPECT_TRUE(matches(a, {5}, {0, 2, 5, 7, 10}));
}

TEST(Linspace, BadInputs) {
  EXPECT_THROW(linspace(0, 1, -1), ValueError);
  EXPECT_THROW(linspace(0, 1, 3, kBool), DTypeError);
}

// ---------------- eye ----------------

TEST(Eye, SquareAndRectangular) {
  EXPECT_TRUE(matches(eye(3), {3, 3}, {1, 0, 0, 0, 1, 0, 0, 0, 1}));
  EXPECT_EQ(eye(3).dtype(), kFloat32);
  EXPECT_TRUE(matches(eye(2, 4), {2, 4}, {1, 0, 0, 0, 0, 1, 0, 0}));
  EXPECT_TRUE(matches(eye(3, 2, kInt64), {3, 2}, {1, 0, 0, 1, 0, 0}));
  EXPECT_TRUE(matches(eye(2, {}, kBool), {2, 2}, {1, 0, 0, 1}));
  EXPECT_TRUE(matches(eye(0), {0, 0}, {}));
  EXPECT_THROW(eye(-1), ValueError);
  EXPECT_THROW(eye(2, -3), ValueError);
}

TEST(Factories, RequiresGradOption) {
  EXPECT_TRUE(arange(0.0, 3.0, 1.0, TensorOptions(kFloat32, kCPU, true)).requires_grad());
  EXPECT_TRUE(eye(2, {}, TensorOptions(std::nullopt, kCPU, true)).requires_grad());
}

// ---------------- allclose / equal ----------------

TEST(Allclose, ToleranceIsAtolPlusRtolTimesOther) {
  Tensor a = tensor<double>({1.0, 100.0});
  EXPECT_TRUE(allclose(a, tensor<double>({1.0 + 5e-6, 100.0 + 5e-4})));
  EXPECT_FALSE(allclose(a, tensor<double>({1.0 + 2e-5, 100.0})));
  EXPECT_TRUE(allclose(a, tensor<double>({1.1, 100.0}), 0.0, 0.11));
  EXPECT_TRUE(allclose(a, a, 0.0, 0.0));
}

TEST(Allclose, BroadcastsAndHandlesNanAndInf) {
  Tensor col = tensor<float>({1, 2, 3}, {3, 1});
  Tensor grid = tensor<float>({1, 1, 2, 2, 3, 3}, {3, 2});
  EXPECT_TRUE(allclose(col, grid));
  EXPECT_FALSE(allclose(col, grid.t().contiguous().view({3, 2})));
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  Tensor x = tensor<float>({nan, inf, 1});
  EXPECT_FALSE(allclose(x, x));
  EXPECT_TRUE(allclose(x, x, 1e-5, 1e-8, /*equal_nan=*/true));
  EXPECT_FALSE(allclose(tensor<float>({inf}), tensor<float>({-inf})));
}

TEST(Allclose, IntegerHalfAndNonContiguousInputs) {
  EXPECT_TRUE(allclose(tensor<int64_t>({100, 200}), tensor<int64_t>({100, 200})));
  EXPECT_TRUE(allclose(tensor<int64_t>({1000000}), tensor<int64_t>({1000001}), 1e-5, 1e-8));
  EXPECT_FALSE(allclose(tensor<int64_t>({10}), tensor<int64_t>({11})));
  Tensor h = tensor<float>({1.0f, 2.0f}).to(kFloat16);
  EXPECT_TRUE(allclose(h, tensor<float>({1.0f, 2.001f}).to(kFloat16), 1e-3, 1e-3));
  Tensor m = tensor<float>({0, 1, 2, 3, 4, 5}, {2, 3});
  EXPECT_TRUE(allclose(m.t(), tensor<float>({0, 3, 1, 4, 2, 5}, {3, 2})));
  EXPECT_TRUE(allclose(tensor<bool>({true, false}), tensor<bool>({true, false})));
}

TEST(Allclose, BadInputs) {
  Tensor f = tensor<float>({1, 2});
  EXPECT_THROW(allclose(f, tensor<double>({1, 2})), DTypeError);
  EXPECT_THROW(allclose(f, tensor<float>({1, 2, 3})), ShapeError);
  EXPECT_THROW(allclose(f, f, -1.0), ValueError);
  EXPECT_THROW(allclose(f, f, 1e-5, -1.0), ValueError);
}

TEST(Equal, SameSizeAndValuesAfterPromotion) {
  Tensor a = tensor<float>({1, 2, 3});
  EXPECT_TRUE(equal(a, tensor<float>({1, 2, 3})));
  EXPECT_FALSE(equal(a, tensor<float>({1, 2, 4})));
  EXPECT_FALSE(equal(a, tensor<float>({1, 2})));
  EXPECT_FALSE(equal(a, a.view({3, 1})));  // equal values, different sizes
  EXPECT_TRUE(equal(a, tensor<int64_t>({1, 2, 3})));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor n = tensor<float>({nan});
  EXPECT_FALSE(equal(n, n));
  Tensor m = tensor<int64_t>({0, 1, 2, 3, 4, 5}, {2, 3});
  EXPECT_TRUE(equal(m.t(), tensor<int64_t>({0, 3, 1, 4, 2, 5}, {3, 2})));
  EXPECT_TRUE(equal(empty({0, 2}), empty({0, 2})));
  EXPECT_TRUE(equal(tensor<bool>({true}), tensor<bool>({true})));
}

// ---------------- broadcast_shapes / result_type ----------------

TEST(BroadcastShapes, FollowsBroadcastingRules) {
  EXPECT_EQ(broadcast_shapes({{2, 1}, {1, 3}}), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(broadcast_shapes({{5, 1, 4}, {3, 1}, {}}), (std::vector<int64_t>{5, 3, 4}));
  EXPECT_EQ(broadcast_shapes({{}}), (std::vector<int64_t>{}));
  EXPECT_EQ(broadcast_shapes({{0}, {1}}), (std::vector<int64_t>{0}));
  EXPECT_THROW(broadcast_shapes({{3}, {2}}), ShapeError);
  EXPECT_THROW(broadcast_shapes({{-1}}), ValueError);
}

TEST(ResultType, DimensionedTensorsDecideWithinACategory) {
  Tensor f32 = tensor<float>({1}), i32 = tensor<int32_t>({1}), i64 = tensor<int64_t>({1});
  EXPECT_EQ(result_type({f32, i64}), kFloat32);
  EXPECT_EQ(result_type({i32, i64}), kInt64);
  EXPECT_EQ(result_type({f32, scalar_tensor(1.0, kFloat64)}), kFloat32);  // 0-dim cannot widen
  EXPECT_EQ(result_type({i32, scalar_tensor(1.0, kFloat64)}), kFloat64);  // but raises the category
  EXPECT_EQ(result_type({tensor<bool>({true}), i32}), kInt32);
  EXPECT_THROW(result_type({}), ValueError);
}
