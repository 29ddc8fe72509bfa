// Type promotion and broadcasting tables, checked through real ops (add, mul, div, where).
#include "reference.h"

using namespace kiln;
using kiln::testing::matches;

namespace {

const DType kAll[] = {kBool, kUInt8, kInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64};

// PyTorch's promote_types table for Kiln's dtypes (row op column). The one difference: uint8 with
// int8 gives int32, as Kiln has no int16.
const DType kTable[9][9] = {
    /* bool */ {kBool, kUInt8, kInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64},
    /* u8   */ {kUInt8, kUInt8, kInt32, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64},
    /* i8   */ {kInt8, kInt32, kInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64},
    /* i32  */ {kInt32, kInt32, kInt32, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64},
    /* i64  */ {kInt64, kInt64, kInt64, kInt64, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64},
    /* f16  */ {kFloat16, kFloat16, kFloat16, kFloat16, kFloat16, kFloat16, kFloat32, kFloat32, kFloat64},
    /* bf16 */ {kBFloat16, kBFloat16, kBFloat16, kBFloat16, kBFloat16, kFloat32, kBFloat16, kFloat32, kFloat64},
    /* f32  */ {kFloat32, kFloat32, kFloat32, kFloat32, kFloat32, kFloat32, kFloat32, kFloat32, kFloat64},
    /* f64  */ {kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64},
};

}  // namespace

TEST(TypePromotion, PromoteTypesMatchesPyTorchTable) {
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 9; ++j)
      EXPECT_EQ(promote_types(kAll[i], kAll[j]), kTable[i][j])
          << dtype_name(kAll[i]) << " with " << dtype_name(kAll[j]);
}

TEST(TypePromotion, BinaryOpResultDtypeFollowsTheTable) {
  for (int i = 0; i < 9; ++i) {
    for (int j = 0; j < 9; ++j) {
      Tensor a = ones({2}, kAll[i]), b = ones({2}, kAll[j]);
      if (kAll[i] == kBool && kAll[j] == kBool) continue;  // bool + bool is logical or in PyTorch
      Tensor r = mul(a, b);
      EXPECT_EQ(r.dtype(), kTable[i][j]) << dtype_name(kAll[i]) << " * " << dtype_name(kAll[j]);
      EXPECT_TRUE(matches(r, {2}, {1, 1}));
    }
  }
}

TEST(TypePromotion, ZeroDimTensorsOnlyRaiseTheCategory) {
  Tensor f16 = ones({3}, kFloat16);
  EXPECT_EQ((f16 + ones({}, kFloat64)).dtype(), kFloat16);  // same category: dimensioned wins
  Tensor i32 = ones({3}, kInt32);
  EXPECT_EQ((i32 + ones({}, kInt64)).dtype(), kInt32);
  EXPECT_EQ((i32 + ones({}, kFloat64)).dtype(), kFloat64);  // higher category: 0-dim's dtype
  EXPECT_EQ((ones({}, kInt32) + ones({}, kInt64)).dtype(), kInt64);  // both 0-dim: promote
}

TEST(TypePromotion, HostScalarsActLikePythonNumbers) {
  Tensor i64 = arange(3);
  EXPECT_EQ((i64 * 2).dtype(), kInt64);
  EXPECT_EQ((i64 * 2.5).dtype(), kFloat32);  // the default dtype, not float64
  EXPECT_TRUE(matches(i64 * 2.5, {3}, {0, 2.5, 5}));
  EXPECT_EQ((ones({2}, kUInt8) + 300).dtype(), kUInt8);  // integer scalars keep the tensor's type
  EXPECT_EQ((ones({2}, kFloat16) * 1e3).dtype(), kFloat16);
  EXPECT_EQ((ones({2}, kBool) + 1).dtype(), kInt64);
  EXPECT_EQ((ones({2}, kBool) * 1.5).dtype(), kFloat32);
  EXPECT_EQ((ones({2}, kInt32) / 2).dtype(), kFloat32);  // true division
  set_default_dtype(kFloat64);
  EXPECT_EQ((i64 * 2.5).dtype(), kFloat64);
  set_default_dtype(kFloat32);
}

TEST(Broadcasting, ShapesCombineFromTheTrailingDim) {
  struct Case {
    std::vector<int64_t> a, b, out;
  };
  const Case cases[] = {
      {{3}, {3}, {3}},
      {{2, 3}, {3}, {2, 3}},
      {{2, 1}, {1, 3}, {2, 3}},
      {{4, 1, 3}, {2, 1}, {4, 2, 3}},
      {{}, {2, 2}, {2, 2}},
      {{0, 3}, {1, 3}, {0, 3}},
      {{5, 1, 1}, {1, 6, 1}, {5, 6, 1}},
  };
  for (const auto& c : cases) {
    Tensor r = add(zeros(c.a), ones(c.b));
    EXPECT_EQ(r.sizes().vec(), c.out);
    EXPECT_EQ(broadcast_shapes({c.a, c.b}), c.out);
  }
}

TEST(Broadcasting, ValuesRepeatAlongStretchedDims) {
  Tensor col = tensor<float>({1, 2}).view({2, 1});
  Tensor row = tensor<float>({10, 20, 30});
  EXPECT_TRUE(matches(col + row, {2, 3}, {11, 21, 31, 12, 22, 32}));
  EXPECT_TRUE(matches(where(col > 1.5, col, row), {2, 3}, {10, 20, 30, 2, 2, 2}));
}

TEST(Broadcasting, IncompatibleShapesThrowShapeError) {
  EXPECT_THROW(add(zeros({2, 3}), zeros({4})), ShapeError);
  EXPECT_THROW(add(zeros({2, 3}), zeros({3, 2})), ShapeError);
  EXPECT_THROW(broadcast_shapes({{2}, {3}}), ShapeError);
  try {
    add(zeros({2, 3}), zeros({4}));
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[kiln::add]"), std::string::npos) << e.what();
  }
}
