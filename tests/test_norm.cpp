// Normalization: batch_norm (training statistics, running-stat updates, eval), layer_norm and
// group_norm, and their native_* table ops' saved statistics, against float64 loops written here.
#include <cmath>
#include <random>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::random_tensor;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

std::vector<Tensor> native(const char* name, std::vector<Tensor> inputs, std::vector<Attr> attrs) {
  const OpDef* op = OpTable::instance().find(name);
  EXPECT_NE(op, nullptr) << name;
  return call_op(*op, std::move(inputs), std::move(attrs));
}

struct BatchNormRef {
  std::vector<double> out, mean, invstd, running_mean, running_var;
};

// Training-mode batch norm over (N, C, *): biased variance normalizes, the unbiased one feeds
// the running variance.
BatchNormRef ref_batch_norm_train(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& rm,
                                  const Tensor& rv, double momentum, double eps) {
  const auto xv = values(x);
  const int64_t n = x.size(0), c = x.size(1), plane = x.numel() / (n * c), count = n * plane;
  BatchNormRef r;
  r.out.resize(xv.size());
  const auto wv = w.defined() ? values(w) : std::vector<double>(c, 1.0);
  const auto bv = b.defined() ? values(b) : std::vector<double>(c, 0.0);
  const auto rmv = rm.defined() ? values(rm) : std::vector<double>(c, 0.0);
  const auto rvv = rv.defined() ? values(rv) : std::vector<double>(c, 1.0);
  for (int64_t ch = 0; ch < c; ++ch) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < plane; ++p) sum += xv[(i * c + ch) * plane + p];
    const double mean = sum / static_cast<double>(count);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < plane; ++p) sq += std::pow(xv[(i * c + ch) * plane + p] - mean, 2);
    const double var = sq / static_cast<double>(count);
    const double invstd = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < plane; ++p) {
        const int64_t at = (i * c + ch) * plane + p;
        r.out[at] = (xv[at] - mean) * invstd * wv[ch] + bv[ch];
      }
    r.mean.push_back(mean);
    r.invstd.push_back(invstd);
    r.running_mean.push_back((1 - momentum) * rmv[ch] + momentum * mean);
    r.running_var.push_back((1 - momentum) * rvv[ch] + momentum * sq / static_cast<double>(count - 1));
  }
  return r;
}

// Normalizes each of `rows` consecutive blocks of `size` values; weight/bias index by param(i, j).
struct NormRef {
  std::vector<double> out, mean, rstd;
};
template <class Param>
NormRef ref_block_norm(const std::vector<double>& xv, int64_t rows, int64_t size, double eps, Param&& affine) {
  NormRef r;
  r.out.resize(xv.size());
  for (int64_t i = 0; i < rows; ++i) {
    double sum = 0, sq = 0;
    for (int64_t j = 0; j < size; ++j) sum += xv[i * size + j];
    const double mean = sum / static_cast<double>(size);
    for (int64_t j = 0; j < size; ++j) sq += std::pow(xv[i * size + j] - mean, 2);
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(size) + eps);
    for (int64_t j = 0; j < size; ++j) {
      auto [w, b] = affine(i, j);
      r.out[i * size + j] = (xv[i * size + j] - mean) * rstd * w + b;
    }
    r.mean.push_back(mean);
    r.rstd.push_back(rstd);
  }
  return r;
}

}  // namespace

// ---------------- batch_norm ----------------

TEST(BatchNorm, TrainingNormalizesWithBatchStatsAndUpdatesRunningStats) {
  for (DType t : {kFloat32, kFloat64}) {
    for (std::vector<int64_t> sizes : {std::vector<int64_t>{4, 3, 5, 6}, {8, 5}, {3, 4, 7}}) {
      const int64_t c = sizes[1];
      Tensor x = random_tensor(sizes, t, 1, -2, 3);
      Tensor w = random_tensor({c}, t, 2), b = random_tensor({c}, t, 3);
      Tensor rm = random_tensor({c}, t, 4), rv = random_tensor({c}, t, 5, 0.5, 2);
      BatchNormRef ref = ref_batch_norm_train(x, w, b, rm, rv, 0.2, 1e-5);
      const uint64_t version = rm.version();
      Tensor y = batch_norm(x, rm, rv, w, b, /*training=*/true, 0.2, 1e-5);
      EXPECT_TRUE(matches(y, sizes, ref.out)) << dtype_name(t) << " " << shape_str(sizes);
      EXPECT_TRUE(matches(rm, {c}, ref.running_mean));
      EXPECT_TRUE(matches(rv, {c}, ref.running_var));
      EXPECT_GT(rm.version(), version);
    }
  }
}

TEST(BatchNorm, NativeOpReturnsSavedMeanAndInvstd) {
  Tensor x = random_tensor({4, 3, 2, 5}, kFloat64, 6);
  Tensor rm = zeros({3}, kFloat64), rv = ones({3}, kFloat64);
  BatchNormRef ref = ref_batch_norm_train(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-3);
  auto outs = native("native_batch_norm", {x, Tensor(), Tensor(), rm, rv}, {true, 0.1, 1e-3});
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_TRUE(matches(outs[0], {4, 3, 2, 5}, ref.out));
  EXPECT_TRUE(matches(outs[1], {3}, ref.mean));
  EXPECT_TRUE(matches(outs[2], {3}, ref.invstd));
  // Eval mode reports the running statistics it normalized with.
  auto eval = native("native_batch_norm", {x, Tensor(), Tensor(), rm, rv}, {false, 0.1, 1e-3});
  std::vector<double> invstd;
  for (double v : values(rv)) invstd.push_back(1.0 / std::sqrt(v + 1e-3));
  EXPECT_TRUE(matches(eval[1], {3}, values(rm)));
  EXPECT_TRUE(matches(eval[2], {3}, invstd));
}

TEST(BatchNorm, EvalUsesRunningStatsAndLeavesThemAlone) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = random_tensor({2, 3, 4, 4}, t, 7);
    Tensor w = random_tensor({3}, t, 8), b = random_tensor({3}, t, 9);
    Tensor rm = random_tensor({3}, t, 10), rv = random_tensor({3}, t, 11, 0.5, 2);
    auto xv = values(x), wv = values(w), bv = values(b), mv = values(rm), vv = values(rv);
    std::vector<double> ref(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
      const size_t c = (i / 16) % 3;
      ref[i] = (xv[i] - mv[c]) / std::sqrt(vv[c] + 1e-5) * wv[c] + bv[c];
    }
    const uint64_t rm_version = rm.version(), rv_version = rv.version();
    Tensor y = batch_norm(x, rm, rv, w, b, /*training=*/false);
    EXPECT_TRUE(matches(y, {2, 3, 4, 4}, ref));
    EXPECT_TRUE(matches(rm, {3}, mv));
    EXPECT_TRUE(matches(rv, {3}, vv));
    // Nothing was written, so the version counters stay (caches keyed on them, such as the
    // compiler's folded convolution weights, stay valid).
    EXPECT_EQ(rm.version(), rm_version);
    EXPECT_EQ(rv.version(), rv_version);
    batch_norm(x, rm, rv, w, b, /*training=*/true);
    EXPECT_GT(rm.version(), rm_version) << "training writes the running statistics";
  }
}

TEST(BatchNorm, TrainingWithoutAffineOrRunningStats) {
  Tensor x = random_tensor({5, 2, 3}, kFloat32, 12);
  BatchNormRef ref = ref_batch_norm_train(x, Tensor(), Tensor(), Tensor(), Tensor(), 0.1, 1e-5);
  EXPECT_TRUE(matches(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true), {5, 2, 3}, ref.out));
}

TEST(BatchNorm, NonContiguousAndReducedPrecisionInputs) {
  Tensor x = random_tensor({3, 5, 4, 2}, kFloat32, 13).permute({0, 3, 1, 2});  // (3, 2, 5, 4), channels strided
  Tensor rm = zeros({2}), rv = ones({2});
  BatchNormRef ref = ref_batch_norm_train(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-5);
  EXPECT_TRUE(matches(batch_norm(x, rm, rv, Tensor(), Tensor(), true), {3, 2, 5, 4}, ref.out));
  EXPECT_TRUE(matches(rm, {2}, ref.running_mean));
  // bfloat16 activations with float32 parameters and running statistics, as in mixed precision.
  Tensor xb = random_tensor({4, 3, 3, 3}, kBFloat16, 14);
  Tensor w = random_tensor({3}, kFloat32, 15), b = random_tensor({3}, kFloat32, 16);
  Tensor rmb = zeros({3}), rvb = ones({3});
  BatchNormRef refb = ref_batch_norm_train(xb, w, b, rmb, rvb, 0.1, 1e-5);
  Tensor yb = batch_norm(xb, rmb, rvb, w, b, true);
  EXPECT_EQ(yb.dtype(), kBFloat16);
  EXPECT_TRUE(matches(yb, {4, 3, 3, 3}, refb.out, Tolerance{2e-2, 2e-2}));
  EXPECT_TRUE(matches(rvb, {3}, refb.running_var, Tolerance{1e-5, 1e-5}));
  Tensor xh = random_tensor({4, 3, 5}, kFloat16, 17);
  BatchNormRef refh = ref_batch_norm_train(xh, Tensor(), Tensor(), Tensor(), Tensor(), 0.1, 1e-5);
  EXPECT_TRUE(matches(batch_norm(xh, Tensor(), Tensor(), Tensor(), Tensor(), true), {4, 3, 5}, refh.out,
                      Tolerance{4e-3, 4e-3}));
}

TEST(BatchNormErrors, BadInputsThrowTheirErrorKinds) {
  Tensor x = zeros({4, 3, 2});
  EXPECT_THROW(batch_norm(x, zeros({4}), ones({3}), Tensor(), Tensor(), true), ShapeError);
  EXPECT_THROW(batch_norm(x, zeros({3}), ones({2}), Tensor(), Tensor(), false), ShapeError);
  EXPECT_THROW(batch_norm(x, Tensor(), Tensor(), ones({2}), Tensor(), true), ShapeError);
  EXPECT_THROW(batch_norm(x, Tensor(), Tensor(), Tensor(), zeros({3, 1}), true), ShapeError);
  EXPECT_THROW(batch_norm(zeros({3}), Tensor(), Tensor(), Tensor(), Tensor(), true), ShapeError);
  EXPECT_THROW(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), false), ValueError);
  EXPECT_THROW(batch_norm(zeros({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true), ValueError);
  EXPECT_THROW(batch_norm(zeros({4, 3}, kInt64), Tensor(), Tensor(), Tensor(), Tensor(), true), DTypeError);
  static float storage[3] = {};
  Tensor on_cuda = from_blob(storage, {3}, {}, kFloat32, cuda_device(0));
  EXPECT_THROW(batch_norm(x, Tensor(), Tensor(), on_cuda, Tensor(), true), DeviceError);
}

// ---------------- layer_norm ----------------

TEST(LayerNorm, NormalizesTrailingDimsWithElementwiseAffine) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = random_tensor({2, 3, 4, 5}, t, 20, -2, 2);
    Tensor w = random_tensor({4, 5}, t, 21), b = random_tensor({4, 5}, t, 22);
    auto wv = values(w), bv = values(b);
    NormRef ref = ref_block_norm(values(x), 6, 20, 1e-5, [&](int64_t, int64_t j) { return std::pair{wv[j], bv[j]}; });
    EXPECT_TRUE(matches(layer_norm(x, {4, 5}, w, b), {2, 3, 4, 5}, ref.out)) << dtype_name(t);
    NormRef plain = ref_block_norm(values(x), 24, 5, 1e-3, [](int64_t, int64_t) { return std::pair{1.0, 0.0}; });
    EXPECT_TRUE(matches(layer_norm(x, {5}, Tensor(), Tensor(), 1e-3), {2, 3, 4, 5}, plain.out));
    auto outs = native("native_layer_norm", {x, w, b}, {std::vector<int64_t>{4, 5}, 1e-5});
    EXPECT_TRUE(matches(outs[1], {2, 3, 1, 1}, ref.mean));
    EXPECT_TRUE(matches(outs[2], {2, 3, 1, 1}, ref.rstd));
  }
}

TEST(LayerNorm, NonContiguousAndReducedPrecision) {
  Tensor x = random_tensor({6, 4}, kFloat32, 23).t();  // (4, 6)
  Tensor w = random_tensor({6}, kFloat32, 24);
  auto wv = values(w);
  NormRef ref = ref_block_norm(values(x), 4, 6, 1e-5, [&](int64_t, int64_t j) { return std::pair{wv[j], 0.0}; });
  EXPECT_TRUE(matches(layer_norm(x, {6}, w), {4, 6}, ref.out));
  for (DType t : {kBFloat16, kFloat16}) {
    Tensor xr = random_tensor({3, 16}, t, 25);
    NormRef r = ref_block_norm(values(xr), 3, 16, 1e-5, [](int64_t, int64_t) { return std::pair{1.0, 0.0}; });
    Tensor y = layer_norm(xr, {16});
    EXPECT_EQ(y.dtype(), t);
    const double tol = t == kBFloat16 ? 2e-2 : 4e-3;
    EXPECT_TRUE(matches(y, {3, 16}, r.out, Tolerance{tol, tol})) << dtype_name(t);
    auto outs = native("native_layer_norm", {xr, Tensor(), Tensor()}, {std::vector<int64_t>{16}, 1e-5});
    EXPECT_EQ(outs[1].dtype(), kFloat32);
  }
}

TEST(LayerNormErrors, BadInputsThrowTheirErrorKinds) {
  try {
    layer_norm(zeros({2, 3}), {5});
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(),
                 "[kiln::layer_norm] given normalized_shape=(5), expected input with shape (*, 5), but got input of "
                 "size (2, 3).");
  }
  EXPECT_THROW(layer_norm(zeros({2, 3}), {2, 2, 3}), ShapeError);
  EXPECT_THROW(layer_norm(zeros({2, 3}), {3}, zeros({4})), ShapeError);
  EXPECT_THROW(layer_norm(zeros({2, 3}), {3}, Tensor(), zeros({2, 3})), ShapeError);
  EXPECT_THROW(layer_norm(zeros({2, 3}), {}), ShapeError);
  EXPECT_THROW(layer_norm(zeros({2, 3}, kInt32), {3}), DTypeError);
  static float storage[3] = {};
  EXPECT_THROW(layer_norm(zeros({2, 3}), {3}, from_blob(storage, {3}, {}, kFloat32, cuda_device(0))), DeviceError);
}

// ---------------- group_norm ----------------

TEST(GroupNorm, NormalizesChannelGroupsWithPerChannelAffine) {
  for (DType t : {kFloat32, kFloat64}) {
    Tensor x = random_tensor({3, 6, 4, 5}, t, 30, -1, 2);
    Tensor w = random_tensor({6}, t, 31), b = random_tensor({6}, t, 32);
    auto wv = values(w), bv = values(b);
    for (int64_t groups : {1, 2, 3, 6}) {
      const int64_t per_group = 6 / groups, block = per_group * 20;
      NormRef ref = ref_block_norm(values(x), 3 * groups, block, 1e-5, [&](int64_t i, int64_t j) {
        const int64_t c = (i % groups) * per_group + j / 20;
        return std::pair{wv[c], bv[c]};
      });
      EXPECT_TRUE(matches(group_norm(x, groups, w, b), {3, 6, 4, 5}, ref.out)) << dtype_name(t) << " " << groups;
      auto outs = native("native_group_norm", {x, w, b}, {groups, 1e-5});
      EXPECT_TRUE(matches(outs[1], {3, groups}, ref.mean));
      EXPECT_TRUE(matches(outs[2], {3, groups}, ref.rstd));
    }
  }
}

TEST(GroupNorm, NoAffineNonContiguousAndTwoDimInputs) {
  Tensor x = random_tensor({2, 5, 4, 3}, kFloat32, 33).permute({0, 3, 1, 2});  // (2, 3, 5, 4), channels strided
  NormRef ref = ref_block_norm(values(x), 2, 60, 1e-5, [](int64_t, int64_t) { return std::pair{1.0, 0.0}; });
  EXPECT_TRUE(matches(group_norm(x, 1), {2, 3, 5, 4}, ref.out));
  Tensor flat = random_tensor({4, 6}, kFloat64, 34);
  NormRef r2 = ref_block_norm(values(flat), 8, 3, 1e-5, [](int64_t, int64_t) { return std::pair{1.0, 0.0}; });
  EXPECT_TRUE(matches(group_norm(flat, 2), {4, 6}, r2.out));
  Tensor hb = random_tensor({2, 4, 8}, kBFloat16, 35);
  NormRef r3 = ref_block_norm(values(hb), 4, 16, 1e-5, [](int64_t, int64_t) { return std::pair{1.0, 0.0}; });
  EXPECT_TRUE(matches(group_norm(hb, 2), {2, 4, 8}, r3.out, Tolerance{2e-2, 2e-2}));
}

TEST(GroupNormErrors, BadInputsThrowTheirErrorKinds) {
  try {
    group_norm(zeros({2, 6, 4}), 4);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("expected number of channels in input to be divisible by num_groups"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(group_norm(zeros({2, 6, 4}), 2, zeros({5})), ShapeError);
  EXPECT_THROW(group_norm(zeros({6}), 2), ShapeError);
  EXPECT_THROW(group_norm(zeros({2, 6, 4}), 0), ValueError);
  EXPECT_THROW(group_norm(zeros({2, 6, 4}, kInt64), 2), DTypeError);
  static float storage[6] = {};
  EXPECT_THROW(group_norm(zeros({2, 6, 4}), 2, from_blob(storage, {6}, {}, kFloat32, cuda_device(0))), DeviceError);
}
