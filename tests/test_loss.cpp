// Losses: nll_loss, cross_entropy (class indices and probabilities, weight, ignore_index, label
// smoothing), mse_loss, binary_cross_entropy_with_logits — against hand-written float64 formulas.
#include <numeric>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::matches;
using kiln::testing::values;

namespace {

// Deterministic, irregular values in roughly [-3, 3].
Tensor scores(const std::vector<int64_t>& sizes, DType dtype, double seed = 0.3) {
  std::vector<double> v(numel_of(sizes));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 3.0 * std::sin(seed + 1.7 * static_cast<double>(i) + 0.1 * i * i);
  return tensor<double>(v, sizes).to(dtype);
}

Tensor longs(const std::vector<int64_t>& v, const std::vector<int64_t>& sizes) { return tensor<int64_t>(v, sizes); }

// Input (N, C, S...) as a row-major value list; returns log_softmax over C at (i, :, s).
struct Scores {
  std::vector<double> v;
  int64_t n, classes, spatial;
  double at(int64_t i, int64_t c, int64_t s) const { return v[(i * classes + c) * spatial + s]; }
  double lsm(int64_t i, int64_t c, int64_t s) const {
    double mx = -INFINITY;
    for (int64_t k = 0; k < classes; ++k) mx = std::max(mx, at(i, k, s));
    double z = 0;
    for (int64_t k = 0; k < classes; ++k) z += std::exp(at(i, k, s) - mx);
    return at(i, c, s) - mx - std::log(z);
  }
};

Scores read(const Tensor& x) {
  Scores s{values(x), x.dim() == 1 ? 1 : x.size(0), x.dim() == 1 ? x.size(0) : x.size(1), 1};
  for (int64_t d = 2; d < x.dim(); ++d) s.spatial *= x.size(d);
  return s;
}

struct Ref {
  std::vector<double> none;  // per position
  double sum = 0, mean = 0;
};

// cross_entropy with class indices (ε = label smoothing), straight from the definition: for a
// non-ignored position, (1 - ε) * (-w[t] lsm[t]) + ε / C * (-Σ_c w[c] lsm[c]); the mean divides by
// Σ w[t] over non-ignored positions. With ε = 0 and log-probability input this is nll_loss.
Ref cross_entropy_ref(const Scores& s, const std::vector<int64_t>& target, const std::vector<double>& w,
                      int64_t ignore, double eps, bool input_is_log_probs = false) {
  Ref r;
  double wsum = 0;
  auto lsm = [&](int64_t i, int64_t c, int64_t p) { return input_is_log_probs ? s.at(i, c, p) : s.lsm(i, c, p); };
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t p = 0; p < s.spatial; ++p) {
      int64_t t = target[i * s.spatial + p];
      double loss = 0;
      if (t != ignore) {
        double wt = w.empty() ? 1.0 : w[t];
        double smooth = 0;
        for (int64_t c = 0; c < s.classes; ++c) smooth -= (w.empty() ? 1.0 : w[c]) * lsm(i, c, p);
        loss = (1 - eps) * (-wt * lsm(i, t, p)) + eps / s.classes * smooth;
        wsum += wt;
      }
      r.none.push_back(loss);
      r.sum += loss;
    }
  r.mean = r.sum / wsum;
  return r;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// ---------------- nll_loss ----------------

TEST(NllLoss, MatchesDefinitionWithWeightsIgnoreIndexAndEveryReduction) {
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor x = scores({5, 4}, dt);
    std::vector<int64_t> t = {3, 0, -100, 1, 3};
    std::vector<double> w = {0.5, 2.0, 1.0, 3.0};
    Scores s = read(x);
    for (bool weighted : {false, true}) {
      Ref r = cross_entropy_ref(s, t, weighted ? w : std::vector<double>{}, -100, 0, true);
      Tensor wt = weighted ? tensor<double>(w).to(dt) : Tensor();
      Tensor tt = longs(t, {5});
      EXPECT_TRUE(matches(nll_loss(x, tt, wt, -100, Reduction::none), {5}, r.none)) << dtype_name(dt);
      EXPECT_TRUE(matches(nll_loss(x, tt, wt, -100, Reduction::sum), {}, {r.sum}));
      EXPECT_TRUE(matches(nll_loss(x, tt, wt), {}, {r.mean}));
    }
    // A custom ignore_index that is also a valid class.
    Ref r = cross_entropy_ref(s, {3, 0, 1, 1, 3}, {}, 1, 0, true);
    EXPECT_TRUE(matches(nll_loss(x, longs({3, 0, 1, 1, 3}, {5}), Tensor(), 1), {}, {r.mean}));
  }
}

TEST(NllLoss, SpatialInputsOneDimInputAndNonContiguousInput) {
  Tensor x = scores({2, 3, 2, 2}, kFloat64);
  std::vector<int64_t> t = {0, 2, 1, 1, 2, -100, 0, 0};
  Ref r = cross_entropy_ref(read(x), t, {1.0, 0.5, 2.0}, -100, 0, true);
  Tensor w = tensor<double>({1.0, 0.5, 2.0});
  EXPECT_TRUE(matches(nll_loss(x, longs(t, {2, 2, 2}), w, -100, Reduction::none), {2, 2, 2}, r.none));
  EXPECT_TRUE(matches(nll_loss(x, longs(t, {2, 2, 2}), w), {}, {r.mean}));
  // 1-D input (C) with a 0-dim target.
  Tensor x1 = scores({4}, kFloat32);
  EXPECT_TRUE(matches(nll_loss(x1, tensor<int64_t>({2})[0], Tensor(), -100, Reduction::none), {}, {-values(x1)[2]}));
  // Transposed (N, C).
  Tensor xt = scores({4, 3}, kFloat32).t();  // (3, 4)
  Ref rt = cross_entropy_ref(read(xt.contiguous()), {1, 3, 0}, {}, -100, 0, true);
  EXPECT_TRUE(matches(nll_loss(xt, longs({1, 3, 0}, {3})), {}, {rt.mean}));
}

TEST(NllLoss, AllIgnoredMeanIsNaNAndEmptyBatch) {
  Tensor x = scores({2, 3}, kFloat32);
  EXPECT_TRUE(std::isnan(nll_loss(x, longs({-100, -100}, {2})).item<double>()));
  EXPECT_EQ(nll_loss(x, longs({-100, -100}, {2}), Tensor(), -100, Reduction::sum).item<double>(), 0.0);
  EXPECT_TRUE(matches(nll_loss(scores({0, 3}, kFloat32), longs({}, {0}), Tensor(), -100, Reduction::none), {0}, {}));
}

TEST(NllLoss, BadInputsThrow) {
  Tensor x = scores({3, 4}, kFloat32);
  std::string msg = message_of([&] { nll_loss(x, longs({0, 5, 1}, {3})); });
  EXPECT_NE(msg.find("Target 5 is out of bounds"), std::string::npos) << msg;
  EXPECT_THROW(nll_loss(x, longs({0, -1, 1}, {3})), IndexError);
  EXPECT_THROW(nll_loss(x, longs({0, 1, 1}, {3}).to(kFloat32)), DTypeError);
  EXPECT_THROW(nll_loss(x, longs({0, 1, 1}, {3}).to(kInt32)), DTypeError);
  EXPECT_THROW(nll_loss(x.to(kInt64), longs({0, 1, 1}, {3})), DTypeError);
  EXPECT_THROW(nll_loss(x, longs({0, 1}, {2})), ShapeError);
  EXPECT_THROW(nll_loss(x, longs({0, 1, 1, 0, 0, 0}, {3, 2})), ShapeError);
  EXPECT_THROW(nll_loss(x, longs({0, 1, 1}, {3}), tensor<float>({1, 1, 1})), ShapeError);
  EXPECT_THROW(nll_loss(x, longs({0, 1, 1}, {3}), tensor<double>({1, 1, 1, 1})), DTypeError);
  EXPECT_THROW(nll_loss(scores({}, kFloat32), tensor<int64_t>({0})[0]), ShapeError);
}

// ---------------- cross_entropy ----------------

TEST(CrossEntropy, ClassIndicesEqualNllOfLogSoftmax) {
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor x = scores({6, 5}, dt, 1.1);
    std::vector<int64_t> t = {4, 0, 2, 2, 1, 3};
    Ref r = cross_entropy_ref(read(x), t, {}, -100, 0);
    EXPECT_TRUE(matches(cross_entropy(x, longs(t, {6})), {}, {r.mean})) << dtype_name(dt);
    EXPECT_TRUE(matches(cross_entropy(x, longs(t, {6}), Tensor(), -100, Reduction::none), {6}, r.none));
  }
}

TEST(CrossEntropy, WeightIgnoreIndexAndLabelSmoothing) {
  Tensor x = scores({5, 4}, kFloat64, 0.7);
  std::vector<int64_t> t = {3, -1, 0, 2, -1};
  std::vector<double> w = {0.2, 1.5, 1.0, 2.5};
  Scores s = read(x);
  for (double eps : {0.0, 0.1, 1.0}) {
    for (bool weighted : {false, true}) {
      Ref r = cross_entropy_ref(s, t, weighted ? w : std::vector<double>{}, -1, eps);
      Tensor wt = weighted ? tensor<double>(w) : Tensor();
      Tensor tt = longs(t, {5});
      EXPECT_TRUE(matches(cross_entropy(x, tt, wt, -1, Reduction::mean, eps), {}, {r.mean}))
          << "eps " << eps << " weighted " << weighted;
      EXPECT_TRUE(matches(cross_entropy(x, tt, wt, -1, Reduction::sum, eps), {}, {r.sum}));
      EXPECT_TRUE(matches(cross_entropy(x, tt, wt, -1, Reduction::none, eps), {5}, r.none));
    }
  }
  // float32 with smoothing.
  Ref r = cross_entropy_ref(s, t, w, -1, 0.2);
  EXPECT_TRUE(matches(cross_entropy(x.to(kFloat32), longs(t, {5}), tensor<float>({0.2f, 1.5f, 1.0f, 2.5f}), -1,
                                    Reduction::mean, 0.2),
                      {}, {r.mean}));
}

TEST(CrossEntropy, SpatialAndOneDimInputs) {
  Tensor x = scores({2, 3, 4}, kFloat32, 2.0);  // (N, C, d)
  std::vector<int64_t> t = {0, 2, 1, -100, 2, 2, 0, 1};
  Ref r = cross_entropy_ref(read(x), t, {}, -100, 0.3);
  EXPECT_TRUE(matches(cross_entropy(x, longs(t, {2, 4}), Tensor(), -100, Reduction::mean, 0.3), {}, {r.mean}));
  EXPECT_TRUE(matches(cross_entropy(x, longs(t, {2, 4}), Tensor(), -100, Reduction::none, 0.3), {2, 4}, r.none));
  Tensor x1 = scores({5}, kFloat64);
  Ref r1 = cross_entropy_ref(read(x1), {3}, {}, -100, 0.25);
  EXPECT_TRUE(matches(cross_entropy(x1, tensor<int64_t>({3})[0], Tensor(), -100, Reduction::mean, 0.25), {}, {r1.mean}));
}

TEST(CrossEntropy, ClassProbabilityTargetsWithWeightAndSmoothing) {
  Tensor x = scores({3, 4}, kFloat64, 0.9);
  // Rows of probabilities.
  std::vector<double> p = {0.1, 0.2, 0.3, 0.4, 1, 0, 0, 0, 0.25, 0.25, 0.25, 0.25};
  Tensor target = tensor<double>(p, {3, 4});
  std::vector<double> w = {1.0, 2.0, 0.5, 1.5};
  Scores s = read(x);
  for (double eps : {0.0, 0.2}) {
    for (bool weighted : {false, true}) {
      std::vector<double> none;
      double total = 0;
      for (int64_t i = 0; i < 3; ++i) {
        double l = 0;
        for (int64_t c = 0; c < 4; ++c) {
          double tp = p[i * 4 + c] * (1 - eps) + eps / 4;
          l -= (weighted ? w[c] : 1.0) * tp * s.lsm(i, c, 0);
        }
        none.push_back(l);
        total += l;
      }
      Tensor wt = weighted ? tensor<double>(w) : Tensor();
      EXPECT_TRUE(matches(cross_entropy(x, target, wt, -100, Reduction::none, eps), {3}, none));
      EXPECT_TRUE(matches(cross_entropy(x, target, wt, -100, Reduction::sum, eps), {}, {total}));
      // The mean divides by the number of positions, not by the weights.
      EXPECT_TRUE(matches(cross_entropy(x, target, wt, -100, Reduction::mean, eps), {}, {total / 3}));
    }
  }
}

TEST(CrossEntropy, BadInputsThrow) {
  Tensor x = scores({3, 4}, kFloat32);
  EXPECT_THROW(cross_entropy(x, longs({0, 1, 2}, {3}).to(kFloat32)), DTypeError);      // float class indices
  EXPECT_THROW(cross_entropy(x, longs({0, 1, 9}, {3})), IndexError);
  EXPECT_THROW(cross_entropy(x, longs({0, 1}, {2})), ShapeError);
  EXPECT_THROW(cross_entropy(x, scores({3, 4}, kInt64)), DTypeError);  // integer probabilities
  EXPECT_THROW(cross_entropy(x, scores({3, 4}, kFloat32), Tensor(), 0), ValueError);
  EXPECT_THROW(cross_entropy(x, longs({0, 1, 2}, {3}), Tensor(), -100, Reduction::mean, 1.5), ValueError);
  EXPECT_THROW(cross_entropy(x, longs({0, 1, 2}, {3}), tensor<float>({1, 2})), ShapeError);
  EXPECT_THROW(cross_entropy(x.to(kInt64), longs({0, 1, 2}, {3})), DTypeError);
}

// ---------------- mse_loss ----------------

// Issue 18.21: aten runs mse_loss as a TensorIterator over both operands (promoting them);
// kiln::sub refuses bool operands, so mse_loss converts first.
TEST(MseLoss, BoolAndIntegerOperandsPromote) {
  Tensor x = tensor<float>({1.5f, -2.f, 0.5f, 3.f}).requires_grad_();
  Tensor t = tensor<bool>({true, false, true, true});
  Tensor loss = mse_loss(x, t);
  EXPECT_EQ(loss.dtype(), kFloat32);
  EXPECT_TRUE(matches(loss, {}, {2.125}));
  loss.backward();
  EXPECT_TRUE(matches(x.grad(), {4}, {0.25, -1, -0.25, 1}));  // 2 (x - t) / 4
  EXPECT_TRUE(matches(mse_loss(x.detach(), t, Reduction::sum), {}, {8.5}));
  EXPECT_TRUE(matches(mse_loss(tensor<int64_t>({1, 2}), tensor<double>({0.5, 4})), {}, {2.125}));
  EXPECT_THROW(mse_loss(tensor<bool>({true}), tensor<bool>({false})), DTypeError);  // bool result
}

// Issue 18.18: aten's binary_cross_entropy_with_logits_backward is (sigmoid(x) - t) * grad at
// every x, also at +-0 (where a min/abs formula's subgradients gave -t).
TEST(BceWithLogits, GradientIsSigmoidMinusTargetEverywhere) {
  const std::vector<double> xs{-0.0, 0.0, -100, 100, 1.5, -2};
  const std::vector<double> ts{0.25, 0.25, 0, 1, 0.3, 0.75};
  const std::vector<double> sig_minus_t{0.25, 0.25, 3.720075976020836e-44, 0, 0.5175744761936436,
                                        -0.6307970779778824};
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor x = tensor<double>(xs).to(dt).requires_grad_();
    Tensor t = tensor<double>(ts).to(dt).requires_grad_();
    binary_cross_entropy_with_logits(x, t, Tensor(), Tensor(), Reduction::sum).backward();
    EXPECT_TRUE(matches(x.grad(), {6}, sig_minus_t)) << dtype_name(dt);
    EXPECT_TRUE(matches(t.grad(), {6}, {0, 0, 100, -100, -1.5, 2}));  // -x
  }
  // The report's case, the mean reduction, and pos_weight = 3: ((3t + 1 - t) sigmoid(x) - 3t).
  Tensor x = tensor<float>({-0.0f, 0.0f}).requires_grad_();
  binary_cross_entropy_with_logits(x, full({2}, 0.25), Tensor(), Tensor(), Reduction::sum).backward();
  EXPECT_TRUE(matches(x.grad(), {2}, {0.25, 0.25}));
  Tensor x6 = tensor<double>(xs).requires_grad_();
  binary_cross_entropy_with_logits(x6, tensor<double>(ts)).backward();
  std::vector<double> mean_grad;
  for (double g : sig_minus_t) mean_grad.push_back(g / 6);
  EXPECT_TRUE(matches(x6.grad(), {6}, mean_grad));
  Tensor xp = tensor<double>(xs).requires_grad_();
  binary_cross_entropy_with_logits(xp, tensor<double>(ts), Tensor(), full({6}, 3.0, kFloat64), Reduction::sum)
      .backward();
  EXPECT_TRUE(matches(xp.grad(), {6}, {0, 0, 3.720075976020836e-44, 0, 0.4081191619098299, -1.9519926949447062}));
}

TEST(MseLoss, MatchesDefinitionAndBroadcasts) {
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor a = scores({3, 4}, dt, 0.1), b = scores({3, 4}, dt, 2.2);
    auto va = values(a), vb = values(b);
    std::vector<double> none;
    double total = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      none.push_back((va[i] - vb[i]) * (va[i] - vb[i]));
      total += none.back();
    }
    EXPECT_TRUE(matches(mse_loss(a, b, Reduction::none), {3, 4}, none)) << dtype_name(dt);
    EXPECT_TRUE(matches(mse_loss(a, b, Reduction::sum), {}, {total}));
    EXPECT_TRUE(matches(mse_loss(a, b), {}, {total / 12}));
    // Transposed operands.
    EXPECT_TRUE(matches(mse_loss(a.t(), b.t(), Reduction::sum), {}, {total}));
  }
  Tensor a = scores({2, 3}, kFloat64), row = scores({3}, kFloat64, 5);
  auto va = values(a), vr = values(row);
  double total = 0;
  for (int i = 0; i < 6; ++i) total += (va[i] - vr[i % 3]) * (va[i] - vr[i % 3]);
  EXPECT_TRUE(matches(mse_loss(a, row, Reduction::sum), {}, {total}));
  EXPECT_THROW(mse_loss(scores({2}, kInt64), scores({2}, kInt64)), DTypeError);
  EXPECT_THROW(mse_loss(a, scores({4}, kFloat64)), ShapeError);
}

// ---------------- binary_cross_entropy_with_logits ----------------

namespace {

// Stable log(sigmoid(x)).
double log_sigmoid(double x) { return x < 0 ? x - std::log1p(std::exp(x)) : -std::log1p(std::exp(-x)); }

// -w * (pw * t * log σ(x) + (1 - t) * log(1 - σ(x))), with log(1 - σ(x)) = log σ(-x).
double bce_ref(double x, double t, double w, double pw) {
  return -w * (pw * t * log_sigmoid(x) + (1 - t) * log_sigmoid(-x));
}

}  // namespace

TEST(BceWithLogits, MatchesDefinitionWithWeightAndPosWeight) {
  for (DType dt : {kFloat32, kFloat64}) {
    Tensor x = scores({2, 3}, dt, 0.4);
    Tensor t = tensor<double>({0, 1, 0.3, 1, 0, 0.8}, {2, 3}).to(dt);
    Tensor w = tensor<double>({0.5, 1, 2}).to(dt);
    Tensor pw = tensor<double>({3, 0.5, 1}).to(dt);
    auto vx = values(x), vt = values(t), vw = values(w), vp = values(pw);
    for (bool weighted : {false, true}) {
      for (bool positive : {false, true}) {
        std::vector<double> none;
        double total = 0;
        for (int i = 0; i < 6; ++i) {
          none.push_back(bce_ref(vx[i], vt[i], weighted ? vw[i % 3] : 1, positive ? vp[i % 3] : 1));
          total += none.back();
        }
        Tensor wt = weighted ? w : Tensor(), pt = positive ? pw : Tensor();
        EXPECT_TRUE(matches(binary_cross_entropy_with_logits(x, t, wt, pt, Reduction::none), {2, 3}, none))
            << dtype_name(dt) << " " << weighted << positive;
        EXPECT_TRUE(matches(binary_cross_entropy_with_logits(x, t, wt, pt, Reduction::sum), {}, {total}));
        EXPECT_TRUE(matches(binary_cross_entropy_with_logits(x, t, wt, pt), {}, {total / 6}));
      }
    }
  }
}

TEST(BceWithLogits, StaysFiniteForLargeLogits) {
  Tensor x = tensor<float>({-200.f, -50.f, 50.f, 200.f});
  Tensor t = tensor<float>({1.f, 0.f, 0.f, 1.f});
  std::vector<double> ref;
  for (auto [xi, ti] : std::vector<std::pair<double, double>>{{-200, 1}, {-50, 0}, {50, 0}, {200, 1}})
    ref.push_back(bce_ref(xi, ti, 1, 1));
  EXPECT_TRUE(matches(binary_cross_entropy_with_logits(x, t, Tensor(), Tensor(), Reduction::none), {4}, ref));
}

TEST(BceWithLogits, BadInputsThrow) {
  EXPECT_THROW(binary_cross_entropy_with_logits(scores({2, 3}, kFloat32), scores({2, 4}, kFloat32)), ShapeError);
  EXPECT_THROW(binary_cross_entropy_with_logits(scores({2}, kInt64), scores({2}, kInt64)), DTypeError);
}
