// Linear algebra: mm, bmm, addmm, dot and the matmul/linear/outer front-ends, against float64
// products computed here with plain loops.
#include <random>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::random_tensor;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

// Uniform values in [lo, hi), deterministic per seed.
Tensor random_ints(const std::vector<int64_t>& sizes, DType dtype, uint32_t seed, int64_t lo = -5, int64_t hi = 5) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  std::vector<int64_t> v(static_cast<size_t>(numel_of(sizes)));
  for (auto& x : v) x = dist(gen);
  return tensor<int64_t>(v, sizes).to(dtype);
}

// A strided view of `t` whose inner stride is 2 (not expressible to BLAS without a copy).
Tensor every_other_column(const Tensor& base) { return base.slice(-1, 0, std::nullopt, 2); }

// Batched product of row-major float64 data: (B, n, k) x (B, k, p).
std::vector<double> ref_bmm(const std::vector<double>& a, const std::vector<double>& b, int64_t batch, int64_t n,
                            int64_t k, int64_t p) {
  std::vector<double> out(static_cast<size_t>(batch * n * p), 0.0);
  for (int64_t q = 0; q < batch; ++q)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < p; ++j) {
        double s = 0;
        for (int64_t kk = 0; kk < k; ++kk) s += a[(q * n + i) * k + kk] * b[(q * k + kk) * p + j];
        out[(q * n + i) * p + j] = s;
      }
  return out;
}

std::vector<double> ref_mm(const Tensor& a, const Tensor& b) {
  return ref_bmm(values(a), values(b), 1, a.size(0), a.size(1), b.size(1));
}

// PyTorch's matmul semantics written out directly: 1-D operands get a unit dim that is dropped
// afterwards, batch dims broadcast.
struct RefResult {
  std::vector<int64_t> sizes;
  std::vector<double> data;
};
RefResult ref_matmul(const Tensor& a, const Tensor& b) {
  const bool a_vec = a.dim() == 1, b_vec = b.dim() == 1;
  std::vector<int64_t> as = a_vec ? std::vector<int64_t>{1, a.size(0)} : a.sizes().vec();
  std::vector<int64_t> bs = b_vec ? std::vector<int64_t>{b.size(0), 1} : b.sizes().vec();
  const int64_t n = as[as.size() - 2], k = as.back(), p = bs.back();
  std::vector<int64_t> ab(as.begin(), as.end() - 2), bb(bs.begin(), bs.end() - 2);
  const size_t nd = std::max(ab.size(), bb.size());
  ab.insert(ab.begin(), nd - ab.size(), 1);
  bb.insert(bb.begin(), nd - bb.size(), 1);
  std::vector<int64_t> batch(nd);
  for (size_t i = 0; i < nd; ++i) batch[i] = ab[i] == 1 ? bb[i] : ab[i];
  const auto av = values(a), bv = values(b);
  const int64_t nbatch = numel_of(batch);
  RefResult r;
  r.data.assign(static_cast<size_t>(nbatch * n * p), 0.0);
  for (int64_t q = 0; q < nbatch; ++q) {
    int64_t rem = q, qa = 0, qb = 0, sa = 1, sb = 1;
    for (size_t d = nd; d-- > 0;) {
      const int64_t idx = rem % batch[d];
      rem /= batch[d];
      qa += (ab[d] == 1 ? 0 : idx) * sa;
      qb += (bb[d] == 1 ? 0 : idx) * sb;
      sa *= ab[d];
      sb *= bb[d];
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < p; ++j) {
        double s = 0;
        for (int64_t kk = 0; kk < k; ++kk) s += av[(qa * n + i) * k + kk] * bv[(qb * k + kk) * p + j];
        r.data[(q * n + i) * p + j] = s;
      }
  }
  r.sizes = batch;
  if (!a_vec) r.sizes.push_back(n);
  if (!b_vec) r.sizes.push_back(p);
  return r;
}

::testing::AssertionResult matmul_matches(const Tensor& a, const Tensor& b, std::optional<Tolerance> tol = {}) {
  RefResult r = ref_matmul(a, b);
  return matches(matmul(a, b), r.sizes, r.data, tol);
}

}  // namespace

TEST(Mm, MatchesNaiveProductInFloat32AndFloat64) {
  for (DType t : {kFloat32, kFloat64}) {
    for (auto [n, k, p] : {std::tuple{3, 4, 5}, std::tuple{1, 7, 1}, std::tuple{17, 33, 9}, std::tuple{64, 1, 3}}) {
      Tensor a = random_tensor({n, k}, t, 1), b = random_tensor({k, p}, t, 2);
      Tensor c = mm(a, b);
      EXPECT_EQ(c.dtype(), t);
      EXPECT_TRUE(matches(c, {n, p}, ref_mm(a, b))) << dtype_name(t) << " " << n << "x" << k << "x" << p;
    }
  }
}

TEST(Mm, TransposedAndStridedOperandsNeedNoContiguousInput) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor at = random_tensor({6, 5}, t, 3).t();          // (5, 6), column-major
    Tensor b = random_tensor({6, 4}, t, 4);
    Tensor bt = random_tensor({4, 6}, t, 5).t();          // (6, 4), column-major
    Tensor rows = random_tensor({10, 6}, t, 6).slice(0, 1, 9, 2);  // row stride 12
    Tensor cols = every_other_column(random_tensor({6, 8}, t, 7));  // inner stride 2: copied
    EXPECT_TRUE(matches(mm(at, b), {5, 4}, ref_mm(at, b)));
    EXPECT_TRUE(matches(mm(at, bt), {5, 4}, ref_mm(at, bt)));
    EXPECT_TRUE(matches(mm(rows, bt), {4, 4}, ref_mm(rows, bt)));
    EXPECT_TRUE(matches(mm(at, cols), {5, 4}, ref_mm(at, cols)));
    Tensor row_vector = random_tensor({1, 6}, t, 8);
    EXPECT_TRUE(matches(mm(row_vector, cols), {1, 4}, ref_mm(row_vector, cols)));
  }
}

TEST(Mm, WritesIntoNonContiguousOutputs) {
  Tensor a = random_tensor({4, 3}, kFloat32, 9), b = random_tensor({3, 5}, kFloat32, 10);
  const OpDef* op = OpTable::instance().find("mm");
  ASSERT_NE(op, nullptr);
  Tensor column_major = empty({5, 4}).t();
  Tensor outs[1] = {column_major};
  call_op_out(*op, {a, b}, {}, outs);
  EXPECT_TRUE(matches(column_major, {4, 5}, ref_mm(a, b)));
  Tensor strided = every_other_column(empty({4, 10}));
  Tensor outs2[1] = {strided};
  call_op_out(*op, {a, b}, {}, outs2);
  EXPECT_TRUE(matches(strided, {4, 5}, ref_mm(a, b)));
}

TEST(Mm, ReducedPrecisionComputesThroughFloat32) {
  for (DType t : {kFloat16, kBFloat16}) {
    Tensor a = random_tensor({7, 12}, t, 11), b = random_tensor({12, 5}, t, 12);
    Tensor c = mm(a, b);
    EXPECT_EQ(c.dtype(), t);
    const double tol = t == kFloat16 ? 1e-2 : 5e-2;
    EXPECT_TRUE(matches(c, {7, 5}, ref_mm(a, b), Tolerance{tol, tol})) << dtype_name(t);
  }
}

TEST(Mm, IntegerProductsAreExact) {
  for (DType t : {kInt64, kInt32, kInt8, kUInt8}) {
    const int64_t lo = t == kUInt8 ? 0 : -4;
    Tensor a = random_ints({5, 6}, t, 13, lo, 4), b = random_ints({6, 3}, t, 14, lo, 4);
    Tensor c = mm(a, b);
    EXPECT_EQ(c.dtype(), t);
    std::vector<double> ref = ref_mm(a, b);
    if (t == kUInt8)
      for (auto& v : ref) v = static_cast<double>(static_cast<uint8_t>(static_cast<int64_t>(v)));
    EXPECT_TRUE(matches(c, {5, 3}, ref)) << dtype_name(t);
  }
  Tensor a = random_ints({4, 3}, kInt64, 15);
  Tensor bt = random_ints({5, 3}, kInt64, 16).t();
  EXPECT_TRUE(matches(mm(a, bt), {4, 5}, ref_mm(a, bt)));
}

TEST(Mm, EmptyOperands) {
  EXPECT_TRUE(matches(mm(zeros({0, 3}), zeros({3, 4})), {0, 4}, {}));
  EXPECT_TRUE(matches(mm(zeros({2, 0}), zeros({0, 3})), {2, 3}, std::vector<double>(6, 0.0)));
  EXPECT_TRUE(matches(mm(zeros({2, 0}, kInt64), zeros({0, 3}, kInt64)), {2, 3}, std::vector<double>(6, 0.0)));
}

TEST(Bmm, BatchedTransposedAndBroadcastBatches) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor a = random_tensor({3, 4, 5}, t, 17), b = random_tensor({3, 5, 2}, t, 18);
    EXPECT_TRUE(matches(bmm(a, b), {3, 4, 2}, ref_bmm(values(a), values(b), 3, 4, 5, 2)));
    Tensor bt = random_tensor({3, 2, 5}, t, 19).mT();
    EXPECT_TRUE(matches(bmm(a, bt), {3, 4, 2}, ref_bmm(values(a), values(bt), 3, 4, 5, 2)));
    Tensor shared = random_tensor({1, 5, 2}, t, 20).expand({3, 5, 2});  // batch stride 0
    EXPECT_TRUE(matches(bmm(a, shared), {3, 4, 2}, ref_bmm(values(a), values(shared), 3, 4, 5, 2)));
    Tensor big_a = random_tensor({40, 8, 8}, t, 21), big_b = random_tensor({40, 8, 8}, t, 22);  // many small GEMMs
    EXPECT_TRUE(matches(bmm(big_a, big_b), {40, 8, 8}, ref_bmm(values(big_a), values(big_b), 40, 8, 8, 8)));
  }
  Tensor ia = random_ints({2, 3, 4}, kInt32, 23), ib = random_ints({2, 4, 3}, kInt32, 24);
  EXPECT_TRUE(matches(ia.bmm(ib), {2, 3, 3}, ref_bmm(values(ia), values(ib), 2, 3, 4, 3)));
}

TEST(Matmul, OneDimensionalCases) {
  Tensor v = random_tensor({4}, kFloat32, 25), w = random_tensor({4}, kFloat32, 26);
  Tensor m = random_tensor({3, 4}, kFloat32, 27), mt = random_tensor({4, 5}, kFloat32, 28);
  EXPECT_TRUE(matmul_matches(v, w));
  EXPECT_EQ(matmul(v, w).dim(), 0);
  EXPECT_TRUE(matmul_matches(m, v));
  EXPECT_TRUE(matmul_matches(v, mt));
  EXPECT_TRUE(matmul_matches(random_tensor({2, 3, 4}, kFloat64, 29), random_tensor({4}, kFloat64, 30)));
  EXPECT_TRUE(matmul_matches(random_tensor({4}, kFloat64, 31), random_tensor({2, 4, 3}, kFloat64, 32)));
}

TEST(Matmul, BroadcastsBatchDims) {
  EXPECT_TRUE(matmul_matches(random_tensor({2, 1, 3, 4}, kFloat32, 33), random_tensor({5, 4, 2}, kFloat32, 34)));
  EXPECT_TRUE(matmul_matches(random_tensor({3, 4}, kFloat32, 35), random_tensor({2, 4, 6}, kFloat32, 36)));
  EXPECT_TRUE(matmul_matches(random_tensor({2, 3, 4}, kFloat64, 37), random_tensor({4, 6}, kFloat64, 38)));
  EXPECT_TRUE(matmul_matches(random_tensor({2, 3, 4}, kFloat64, 39).transpose(0, 1), random_tensor({4, 6}, kFloat64, 40)));
  EXPECT_TRUE(matmul_matches(random_tensor({1, 3, 4}, kFloat32, 41), random_tensor({6, 5, 4}, kFloat32, 42).mT()));
  EXPECT_TRUE(matmul_matches(random_ints({2, 2, 3}, kInt64, 43), random_ints({3, 2}, kInt64, 44)));
  EXPECT_TRUE(matmul_matches(random_tensor({0, 3, 4}, kFloat32, 45), random_tensor({4, 2}, kFloat32, 46)));
}

TEST(Matmul, TensorMethodsMatchFreeFunctions) {
  Tensor a = random_tensor({3, 4}, kFloat64, 47), b = random_tensor({4, 2}, kFloat64, 48);
  EXPECT_TRUE(matches(a.matmul(b), {3, 2}, ref_mm(a, b)));
  EXPECT_TRUE(matches(a.mm(b), {3, 2}, ref_mm(a, b)));
  Tensor v = random_tensor({4}, kFloat64, 49);
  double s = 0;
  for (double x : values(v)) s += x * x;
  EXPECT_TRUE(matches(v.dot(v), {}, {s}));
}

TEST(Addmm, ScalesAndBroadcastsSelf) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor a = random_tensor({3, 4}, t, 50), b = random_tensor({4, 5}, t, 51);
    auto prod = ref_mm(a, b);
    Tensor row = random_tensor({5}, t, 52), full_self = random_tensor({3, 5}, t, 53);
    auto rv = values(row), fv = values(full_self);
    std::vector<double> expect_row(15), expect_full(15);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 5; ++j) {
        expect_row[i * 5 + j] = 0.5 * rv[j] + 2.0 * prod[i * 5 + j];
        expect_full[i * 5 + j] = fv[i * 5 + j] + prod[i * 5 + j];
      }
    EXPECT_TRUE(matches(addmm(row, a, b, 0.5, 2.0), {3, 5}, expect_row));
    EXPECT_TRUE(matches(addmm(full_self, a, b), {3, 5}, expect_full));
    Tensor column_self = random_tensor({3, 1}, t, 54);
    auto cv = values(column_self);
    std::vector<double> expect_col(15);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 5; ++j) expect_col[i * 5 + j] = cv[i] + prod[i * 5 + j];
    EXPECT_TRUE(matches(addmm(column_self, a, b), {3, 5}, expect_col));
  }
}

TEST(Addmm, BetaZeroIgnoresSelfIncludingNan) {
  Tensor a = random_tensor({2, 3}, kFloat32, 55), b = random_tensor({3, 2}, kFloat32, 56);
  Tensor nan_self = full({2, 2}, std::nan(""));
  EXPECT_TRUE(matches(addmm(nan_self, a, b, 0, 1), {2, 2}, ref_mm(a, b)));
  Tensor self = full({2, 2}, 3.0);
  EXPECT_TRUE(matches(addmm(self, zeros({2, 0}), zeros({0, 2}), 2, 1), {2, 2}, std::vector<double>(4, 6.0)));
  Tensor ia = random_ints({2, 3}, kInt64, 57), ib = random_ints({3, 2}, kInt64, 58);
  auto ip = ref_mm(ia, ib);
  for (auto& v : ip) v = 3 * v + 2 * 7;
  EXPECT_TRUE(matches(addmm(full({2, 2}, int64_t{7}), ia, ib, 2, 3), {2, 2}, ip));
}

TEST(Linear, MatchesXTimesWeightTransposedPlusBias) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor w = random_tensor({6, 4}, t, 59), bias = random_tensor({6}, t, 60);
    for (std::vector<int64_t> xs : {std::vector<int64_t>{4}, {3, 4}, {2, 3, 4}}) {
      Tensor x = random_tensor(xs, t, 61);
      RefResult r = ref_matmul(x, w.t());
      auto bv = values(bias);
      std::vector<double> with_bias = r.data;
      for (size_t i = 0; i < with_bias.size(); ++i) with_bias[i] += bv[i % 6];
      EXPECT_TRUE(matches(linear(x, w), r.sizes, r.data)) << shape_str(xs);
      EXPECT_TRUE(matches(linear(x, w, bias), r.sizes, with_bias)) << shape_str(xs);
    }
  }
}

// A Linear's product with 16 to 64 rows and a large weight runs transposed (C^T = W x^T, then
// transposed back: oneDNN's sgemm is several times slower the direct way at these shapes). Rows on
// both sides of that range, with and without beta (the bias), into a dense and a row-strided
// output, against float64.
TEST(Linear, FewRowsTimesALargeTransposedWeightMatchFloat64) {
  const int64_t k = 512, n = 256;
  Tensor w = random_tensor({n, k}, kFloat32, 70), bias = random_tensor({n}, kFloat32, 71);
  const auto bv = values(bias);
  const OpDef* mm_op = OpTable::instance().find("mm");
  ASSERT_NE(mm_op, nullptr);
  for (int64_t m : {15, 16, 40, 64, 65}) {
    SCOPED_TRACE("rows " + std::to_string(m));
    Tensor x = random_tensor({m, k}, kFloat32, 72 + m);
    const std::vector<double> prod = ref_mm(x, w.t());
    std::vector<double> with_bias = prod, scaled = prod;
    for (size_t i = 0; i < prod.size(); ++i) {
      with_bias[i] += bv[i % static_cast<size_t>(n)];
      scaled[i] = 0.5 * bv[i % static_cast<size_t>(n)] + 2.0 * prod[i];
    }
    const Tolerance tol{1e-5, 1e-4};  // float32 dot products of 512 terms
    EXPECT_TRUE(matches(mm(x, w.t()), {m, n}, prod, tol));
    EXPECT_TRUE(matches(linear(x, w, bias), {m, n}, with_bias, tol));
    EXPECT_TRUE(matches(addmm(bias, x, w.t(), 0.5, 2.0), {m, n}, scaled, tol));
    Tensor strided = empty({m, n + 8}).slice(1, 0, n);  // rows n + 8 apart
    Tensor outs[1] = {strided};
    call_op_out(*mm_op, {x, w.t()}, {}, outs);
    EXPECT_TRUE(matches(strided, {m, n}, prod, tol));
  }
}

TEST(Outer, PromotesLikeMultiplication) {
  Tensor a = random_tensor({3}, kFloat64, 62), b = random_tensor({4}, kFloat64, 63);
  auto av = values(a), bv = values(b);
  std::vector<double> expect;
  for (double x : av)
    for (double y : bv) expect.push_back(x * y);
  EXPECT_TRUE(matches(outer(a, b), {3, 4}, expect));
  Tensor ints = tensor<int64_t>({1, 2, 3});
  Tensor floats = tensor<float>({0.5f, -1.0f});
  Tensor o = outer(ints, floats);
  EXPECT_EQ(o.dtype(), kFloat32);
  EXPECT_TRUE(matches(o, {3, 2}, {0.5, -1, 1, -2, 1.5, -3}));
}

TEST(Dot, StridedFloatAndIntegerVectors) {
  Tensor a = every_other_column(random_tensor({10}, kFloat32, 64)), b = random_tensor({5}, kFloat32, 65);
  auto av = values(a), bv = values(b);
  double s = 0;
  for (int i = 0; i < 5; ++i) s += av[i] * bv[i];
  EXPECT_TRUE(matches(dot(a, b), {}, {s}));
  EXPECT_TRUE(matches(dot(tensor<int32_t>({1, 2, 3}), tensor<int32_t>({4, 5, 6})), {}, {32}));
  Tensor h = tensor<float>({0.5f, 1.5f, -2.0f}).to(kBFloat16);
  EXPECT_TRUE(matches(dot(h, h), {}, {6.5}));
  EXPECT_TRUE(matches(dot(zeros({0}), zeros({0})), {}, {0.0}));
}

TEST(LinalgErrors, InnerSizeMismatchNamesBothShapes) {
  try {
    matmul(zeros({2, 3}), zeros({4, 5}));
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "[kiln::matmul] shapes (2, 3) and (4, 5) cannot be multiplied. Inner sizes must match.");
  }
  EXPECT_THROW(mm(zeros({2, 3}), zeros({4, 5})), ShapeError);
  EXPECT_THROW(matmul(zeros({3}), zeros({4})), ShapeError);
  EXPECT_THROW(matmul(zeros({2, 3, 4}), zeros({2, 5, 4})), ShapeError);
  EXPECT_THROW(matmul(zeros({2, 3, 4}), zeros({3, 4, 5})), ShapeError);  // batch dims 2 vs 3
  EXPECT_THROW(linear(zeros({2, 3}), zeros({4, 5})), ShapeError);
  EXPECT_THROW(dot(zeros({3}), zeros({4})), ShapeError);
  EXPECT_THROW(addmm(zeros({3}), zeros({2, 3}), zeros({3, 4})), ShapeError);
}

TEST(LinalgErrors, BadRanksThrowShapeError) {
  EXPECT_THROW(matmul(scalar_tensor(1.0), zeros({3})), ShapeError);
  EXPECT_THROW(mm(zeros({3}), zeros({3, 2})), ShapeError);
  EXPECT_THROW(bmm(zeros({2, 3}), zeros({3, 2})), ShapeError);
  EXPECT_THROW(bmm(zeros({2, 3, 4}), zeros({3, 4, 2})), ShapeError);
  EXPECT_THROW(dot(zeros({2, 2}), zeros({4})), ShapeError);
  EXPECT_THROW(outer(zeros({2, 2}), zeros({4})), ShapeError);
}

TEST(LinalgErrors, MismatchedDtypesThrowDTypeError) {
  try {
    mm(zeros({2, 3}), zeros({3, 2}, kFloat64));
    FAIL() << "expected DTypeError";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("expected m1 and m2 to have the same dtype"), std::string::npos) << e.what();
  }
  EXPECT_THROW(matmul(zeros({2, 3}), zeros({3}, kInt64)), DTypeError);
  EXPECT_THROW(dot(zeros({3}), zeros({3}, kFloat64)), DTypeError);
  EXPECT_THROW(addmm(zeros({2, 2}, kFloat64), zeros({2, 3}), zeros({3, 2})), DTypeError);
  EXPECT_THROW(mm(zeros({2, 3}, kBool), zeros({3, 2}, kBool)), DTypeError);
}

TEST(LinalgErrors, MismatchedDevicesThrowDeviceError) {
  static float storage[6] = {};
  Tensor on_cuda = from_blob(storage, {3, 2}, {}, kFloat32, cuda_device(0));
  EXPECT_THROW(mm(zeros({2, 3}), on_cuda), DeviceError);
  EXPECT_THROW(matmul(zeros({2, 3}), on_cuda), DeviceError);
  EXPECT_THROW(linear(zeros({2, 2}), zeros({3, 2}), from_blob(storage, {3}, {}, kFloat32, cuda_device(0))),
               DeviceError);
}
