// Derivatives of the normalizations: autograd::gradcheck (float64 finite differences) for
// batch_norm in training mode (through the batch statistics) and in evaluation mode (running
// statistics), layer_norm and group_norm with and without affine parameters; the fused float32
// and bfloat16 backward kernels against the float64 backward of the same values (including sizes
// that split across threads); output masks; and the clear error of a double backward.
#include <cmath>
#include <limits>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;
using kiln::testing::grad_ok;
using kiln::testing::close_to;

namespace {

// Backpropagates ones from y (the gradient of y.sum(), without needing sum's derivative).
void backward_ones(const Tensor& y) { y.backward(ones_like(y)); }

Tensor rnd(const std::vector<int64_t>& sizes) { return randn(sizes, kFloat64).requires_grad_(); }

// Weights the output so that every element's gradient differs (a plain sum makes the input
// gradient of a normalization vanish).
Tensor weighted(const Tensor& y) {
  Tensor w = linspace(-1, 2, y.numel(), kFloat64).view(y.sizes()).to(y.dtype());
  return y * w;
}

// Gradients of sum(f(x, w, b) * g) for x, w, b of dtype t (from float64 values).
TensorList grads_in(DType t, const Tensor& x64, const Tensor& w64, const Tensor& b64,
                    const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& f) {
  Tensor x = x64.to(t, /*copy=*/true).requires_grad_();
  Tensor w = w64.defined() ? w64.to(t, /*copy=*/true).requires_grad_() : Tensor();
  Tensor b = b64.defined() ? b64.to(t, /*copy=*/true).requires_grad_() : Tensor();
  Tensor y = f(x, w, b);
  Tensor g = linspace(-1, 2, y.numel(), kFloat64).view(y.sizes()).sin();
  y.backward(g.to(t));
  return {x.grad(), w.defined() ? w.grad() : Tensor(), b.defined() ? b.grad() : Tensor()};
}

}  // namespace

// ---------------- batch_norm ----------------

TEST(GradcheckNorm, BatchNormTrainingThroughBatchStatistics) {
  manual_seed(1);
  // Running statistics stay undefined: gradcheck calls the function many times.
  autograd::Function affine = [](const TensorList& in) {
    return TensorList{weighted(batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], true, 0.1, 1e-5))};
  };
  autograd::Function plain = [](const TensorList& in) {
    return TensorList{weighted(batch_norm(in[0], Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5))};
  };
  EXPECT_TRUE(grad_ok(affine, {rnd({3, 2, 2, 2}), rnd({2}), rnd({2})}));
  EXPECT_TRUE(grad_ok(affine, {rnd({4, 3}), rnd({3}), rnd({3})}));         // (N, C)
  EXPECT_TRUE(grad_ok(affine, {rnd({2, 2, 3}), rnd({2}), rnd({2})}));      // (N, C, L)
  EXPECT_TRUE(grad_ok(plain, {rnd({2, 3, 2, 2})}));
  // A channels-last-strided input.
  EXPECT_TRUE(grad_ok(affine, {randn({2, 2, 2, 3}, kFloat64).permute({0, 3, 1, 2}).requires_grad_(), rnd({3}), rnd({3})}));
}

TEST(GradcheckNorm, BatchNormEvalIsAffineInRunningStatistics) {
  manual_seed(2);
  Tensor running_mean = randn({3}, kFloat64), running_var = rand({3}, kFloat64) + 0.5;
  autograd::Function f = [&](const TensorList& in) {
    return TensorList{weighted(batch_norm(in[0], running_mean, running_var, in[1], in[2], false, 0.1, 1e-5))};
  };
  EXPECT_TRUE(grad_ok(f, {rnd({2, 3, 2, 2}), rnd({3}), rnd({3})}));
  // dx = dy * w / sqrt(running_var + eps), exactly.
  Tensor x = randn({2, 3, 2, 2}, kFloat64).requires_grad_();
  Tensor w = randn({3}, kFloat64);
  backward_ones(batch_norm(x, running_mean, running_var, w, Tensor(), false, 0.1, 1e-5));
  Tensor expected = (w / (running_var + 1e-5).sqrt()).view({1, 3, 1, 1}).expand({2, 3, 2, 2});
  EXPECT_TRUE(matches(x.grad(), {2, 3, 2, 2}, values(expected)));
}

// Issue 18.20: evaluation is affine in the input: dx = dy * w / sqrt(running_var + eps) whatever
// x holds (PyTorch: 0.999995 for w = 1, var = 1, also at +-inf). The training formula with k = 0
// made it x * 0 = NaN there.
TEST(GradcheckNorm, BatchNormEvalInputGradientAtInfiniteInputs) {
  const double inf = std::numeric_limits<double>::infinity();
  const double s = 1.0 / std::sqrt(1.0 + 1e-5);
  for (DType t : {kFloat32, kFloat64}) {
    Tensor rm = zeros({2}, t), rv = ones({2}, t), w = tensor<double>({1, 2}).to(t);
    // (N, C): the small-plane loop.
    Tensor a = tensor<double>({inf, -inf, 1, 2, -inf, inf}, {3, 2}).to(t).requires_grad_();
    backward_ones(batch_norm(a, rm, rv, w, Tensor(), false, 0.1, 1e-5));
    EXPECT_TRUE(matches(a.grad(), {3, 2}, {s, 2 * s, s, 2 * s, s, 2 * s})) << dtype_name(t);
    // Small planes (planar and channels-last channel rows) and a large plane.
    for (std::vector<int64_t> sizes : {std::vector<int64_t>{2, 2, 3, 3}, std::vector<int64_t>{1, 2, 8, 8}}) {
      for (bool channels_last : {false, true}) {
        Tensor x = randn(sizes, kFloat64).to(t);
        {
          NoGradGuard ng;
          x.view({-1}).select(0, 0).fill_(inf);
          x.view({-1}).select(0, 5).fill_(-inf);
        }
        if (channels_last) x = x.contiguous(kiln::channels_last);
        x.requires_grad_();
        backward_ones(batch_norm(x, rm, rv, w, Tensor(), false, 0.1, 1e-5));
        std::vector<double> want;
        for (int64_t n = 0; n < sizes[0]; ++n)
          for (int64_t c = 0; c < 2; ++c) want.insert(want.end(), sizes[2] * sizes[3], (c + 1) * s);
        EXPECT_TRUE(matches(x.grad(), sizes, want))
            << dtype_name(t) << " " << shape_str(sizes) << (channels_last ? " channels-last" : "");
      }
    }
  }
}

TEST(GradcheckNorm, BatchNormTrainingWithRunningStatsUpdatesThemOnceAndMatches) {
  manual_seed(3);
  Tensor x64 = randn({4, 3, 2, 2}, kFloat64), w64 = randn({3}, kFloat64), b64 = randn({3}, kFloat64);
  Tensor rm = zeros({3}, kFloat64), rv = ones({3}, kFloat64);
  TensorList with_stats = grads_in(kFloat64, x64, w64, b64, [&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return batch_norm(x, rm, rv, w, b, true, 0.1, 1e-5);
  });
  TensorList without = grads_in(kFloat64, x64, w64, b64, [&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5);
  });
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(matches(with_stats[i], without[i].sizes().vec(), values(without[i])));
  // One forward, one momentum step: backward does not touch the running statistics.
  EXPECT_TRUE(matches(rm, {3}, values(x64.mean({0, 2, 3}) * 0.1)));
}

TEST(GradcheckNorm, BatchNormThenInPlaceReluBackpropagates) {
  // DenseNet's pattern: ReLU(inplace=True) on batch_norm's output (which backward does not save).
  manual_seed(4);
  Tensor x = randn({4, 2, 3, 3}, kFloat64).requires_grad_();
  Tensor w = randn({2}, kFloat64).requires_grad_();
  Tensor y = batch_norm(x, Tensor(), Tensor(), w, Tensor(), true, 0.1, 1e-5);
  backward_ones(weighted(y.relu_()));
  Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
  backward_ones(weighted(relu(batch_norm(x2, Tensor(), Tensor(), w2, Tensor(), true, 0.1, 1e-5))));
  EXPECT_TRUE(matches(x.grad(), {4, 2, 3, 3}, values(x2.grad())));
  EXPECT_TRUE(matches(w.grad(), {2}, values(w2.grad())));
}

TEST(GradcheckNorm, BatchNormFloat32AndBfloat16BackwardMatchFloat64) {
  manual_seed(5);
  // Large enough to split channels across threads; a small plane too (DenseNet's last block).
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{8, 32, 16, 16}, std::vector<int64_t>{16, 64, 4, 4}}) {
    Tensor x = randn(sizes, kFloat64) * 2.0 + 0.5, w = randn({sizes[1]}, kFloat64), b = randn({sizes[1]}, kFloat64);
    for (bool training : {true, false}) {
      Tensor rm = randn({sizes[1]}, kFloat64), rv = rand({sizes[1]}, kFloat64) + 0.5;
      auto f = [&](const Tensor& xx, const Tensor& ww, const Tensor& bb) {
        Tensor m = rm.to(xx.dtype() == kBFloat16 ? kFloat32 : xx.dtype()),
               v = rv.to(xx.dtype() == kBFloat16 ? kFloat32 : xx.dtype());
        return batch_norm(xx, training ? Tensor() : m, training ? Tensor() : v, ww, bb, training, 0.1, 1e-5);
      };
      TensorList want = grads_in(kFloat64, x, w, b, f), got = grads_in(kFloat32, x, w, b, f);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(got[i].dtype(), kFloat32);
        EXPECT_TRUE(close_to(got[i], want[i], 2e-5)) << "training " << training << " grad " << i;
      }
      TensorList bf = grads_in(kBFloat16, x, w, b, f);
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(close_to(bf[i], want[i], 5e-2)) << "bf16 grad " << i;
    }
  }
}

// Channels-last activations at DenseNet's small planes, with 4 threads: the backward's sums split
// each 256-row block's channels across threads (16 x 1024 x 4 x 4 is one block; 4 x 256 x 8 x 8
// one block of 256 channels; 4 x 328 x 8 x 8 two groups with a tail of 8), and a large plane splits
// blocks only. Gradients against float64 through the planar (NCHW) loops.
TEST(GradcheckNorm, ChannelsLastBackwardSplitsSmallPlanesAcrossThreadsAndMatchesFloat64) {
  manual_seed(7);
  const int before = get_num_threads();
  set_num_threads(4);
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{16, 1024, 4, 4}, std::vector<int64_t>{4, 256, 8, 8},
                                            std::vector<int64_t>{4, 328, 8, 8}, std::vector<int64_t>{8, 32, 16, 16}}) {
    SCOPED_TRACE(shape_str(sizes));
    Tensor x = randn(sizes, kFloat64) * 2.0 + 0.5, w = randn({sizes[1]}, kFloat64), b = randn({sizes[1]}, kFloat64);
    auto f = [&](bool channels_last) {
      return [channels_last](const Tensor& xx, const Tensor& ww, const Tensor& bb) {
        const Tensor in = channels_last ? xx.contiguous(kiln::channels_last) : xx;
        return relu(batch_norm(in, Tensor(), Tensor(), ww, bb, true, 0.1, 1e-5));
      };
    };
    // The reference runs the planar (NCHW) loops, not the channel rows under test.
    TensorList want = grads_in(kFloat64, x, w, b, f(false)), got = grads_in(kFloat32, x, w, b, f(true));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(close_to(got[i], want[i], 2e-5)) << "grad " << i;
  }
  set_num_threads(before);
}

TEST(GradcheckNorm, BatchNormForwardStatisticsMatchLoopsAtKernelPathSizes) {
  // The statistics the backward reads: per-run merges (large planes, split across threads),
  // column sums (small planes) and (N, C) inputs, in float32 against float64 loops.
  manual_seed(12);
  const OpDef& bn = *OpTable::instance().find("native_batch_norm");
  for (const std::vector<int64_t>& sizes :
       {std::vector<int64_t>{8, 32, 16, 16}, std::vector<int64_t>{64, 48, 2, 2}, std::vector<int64_t>{300, 40}}) {
    Tensor x64 = randn(sizes, kFloat64) * 3.0 + 2.0;
    const int64_t n = sizes[0], c = sizes[1], plane = x64.numel() / (n * c);
    const auto v = values(x64);
    std::vector<double> mean(c, 0.0), invstd(c, 0.0);
    for (int64_t k = 0; k < c; ++k) {
      double s = 0, q = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < plane; ++j) s += v[(i * c + k) * plane + j];
      mean[k] = s / static_cast<double>(n * plane);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < plane; ++j) q += std::pow(v[(i * c + k) * plane + j] - mean[k], 2);
      invstd[k] = 1.0 / std::sqrt(q / static_cast<double>(n * plane) + 1e-5);
    }
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t k = static_cast<int64_t>(i) / plane % c;
      out[i] = (v[i] - mean[k]) * invstd[k];
    }
    TensorList r = call_op(bn, {x64.to(kFloat32), Tensor(), Tensor(), Tensor(), Tensor()}, {true, 0.1, 1e-5});
    kiln::testing::Tolerance tol{1e-5, 1e-5};
    EXPECT_TRUE(matches(r[1], {c}, mean, tol)) << shape_str(sizes);
    EXPECT_TRUE(matches(r[2], {c}, invstd, tol)) << shape_str(sizes);
    EXPECT_TRUE(matches(r[0], sizes, out, tol)) << shape_str(sizes);
  }
}

TEST(GradcheckNorm, BatchNormBackwardHonoursOutputMask) {
  manual_seed(6);
  Tensor x = randn({4, 3, 2, 2}, kFloat64);  // no grad for the input
  Tensor w = randn({3}, kFloat64).requires_grad_(), b = randn({3}, kFloat64).requires_grad_();
  Tensor g = randn({4, 3, 2, 2}, kFloat64);
  batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5).backward(g);
  // d/db = sum(g), d/dw = sum(g * xhat) per channel.
  EXPECT_TRUE(matches(b.grad(), {3}, values(g.sum({0, 2, 3}))));
  Tensor mean = x.mean({0, 2, 3}, true), var = (x - mean).pow(2).mean({0, 2, 3}, true);
  Tensor xhat = (x - mean) / (var + 1e-5).sqrt();
  EXPECT_TRUE(matches(w.grad(), {3}, values((g * xhat).sum({0, 2, 3})), kiln::testing::Tolerance{1e-10, 1e-10}));
}

TEST(GradcheckNorm, DoubleBackwardThroughNormalizationIsAClearError) {
  Tensor x = randn({2, 2, 2}, kFloat64).requires_grad_();
  Tensor y = batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5);
  Tensor gx = autograd::grad({weighted(y)}, {x}, {ones_like(y)}, true, true)[0];
  try {
    backward_ones(gx);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("native_batch_norm_backward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not implemented"), std::string::npos) << e.what();
  }
}

// ---------------- layer_norm ----------------

TEST(GradcheckNorm, LayerNormWithAndWithoutAffine) {
  manual_seed(7);
  autograd::Function affine2 = [](const TensorList& in) {
    return TensorList{weighted(layer_norm(in[0], {2, 3}, in[1], in[2]))};
  };
  autograd::Function affine1 = [](const TensorList& in) {
    return TensorList{weighted(layer_norm(in[0], {4}, in[1], in[2]))};
  };
  autograd::Function weight_only = [](const TensorList& in) {
    return TensorList{weighted(layer_norm(in[0], {4}, in[1]))};
  };
  autograd::Function plain = [](const TensorList& in) { return TensorList{weighted(layer_norm(in[0], {4}))}; };
  EXPECT_TRUE(grad_ok(affine2, {rnd({2, 2, 3}), rnd({2, 3}), rnd({2, 3})}));
  EXPECT_TRUE(grad_ok(affine1, {rnd({3, 4}), rnd({4}), rnd({4})}));
  EXPECT_TRUE(grad_ok(affine1, {randn({4, 3}, kFloat64).t().requires_grad_(), rnd({4}), rnd({4})}));
  EXPECT_TRUE(grad_ok(weight_only, {rnd({2, 4}), rnd({4})}));
  EXPECT_TRUE(grad_ok(plain, {rnd({2, 2, 4})}));
  EXPECT_TRUE(grad_ok(plain, {rnd({4})}));  // a single row
}

TEST(GradcheckNorm, LayerNormFloat32BackwardMatchesFloat64) {
  manual_seed(8);
  Tensor x = randn({64, 33, 48}, kFloat64), w = randn({33, 48}, kFloat64), b = randn({33, 48}, kFloat64);
  auto f = [](const Tensor& xx, const Tensor& ww, const Tensor& bb) { return layer_norm(xx, {33, 48}, ww, bb); };
  TensorList want = grads_in(kFloat64, x, w, b, f), got = grads_in(kFloat32, x, w, b, f);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].dtype(), kFloat32);
    EXPECT_TRUE(close_to(got[i], want[i], 2e-5)) << "grad " << i;
  }
  TensorList bf = grads_in(kBFloat16, x, w, b, f);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(close_to(bf[i], want[i], 5e-2)) << "bf16 grad " << i;
}

// ---------------- group_norm ----------------

TEST(GradcheckNorm, GroupNormWithAndWithoutAffine) {
  manual_seed(9);
  for (int64_t groups : {1, 2, 4}) {
    autograd::Function affine = [&](const TensorList& in) {
      return TensorList{weighted(group_norm(in[0], groups, in[1], in[2]))};
    };
    autograd::Function plain = [&](const TensorList& in) { return TensorList{weighted(group_norm(in[0], groups))}; };
    EXPECT_TRUE(grad_ok(affine, {rnd({2, 4, 2, 2}), rnd({4}), rnd({4})}));
    EXPECT_TRUE(grad_ok(plain, {rnd({2, 4, 3})}));
  }
  autograd::Function no_spatial = [](const TensorList& in) {
    return TensorList{weighted(group_norm(in[0], 2, in[1], in[2]))};
  };
  EXPECT_TRUE(grad_ok(no_spatial, {rnd({3, 4}), rnd({4}), rnd({4})}));
}

TEST(GradcheckNorm, GroupNormFloat32BackwardMatchesFloat64) {
  manual_seed(10);
  Tensor x = randn({6, 32, 12, 12}, kFloat64), w = randn({32}, kFloat64), b = randn({32}, kFloat64);
  auto f = [](const Tensor& xx, const Tensor& ww, const Tensor& bb) { return group_norm(xx, 8, ww, bb); };
  TensorList want = grads_in(kFloat64, x, w, b, f), got = grads_in(kFloat32, x, w, b, f);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].dtype(), kFloat32);
    EXPECT_TRUE(close_to(got[i], want[i], 2e-5)) << "grad " << i;
  }
}

TEST(GradcheckNorm, NormBackwardOpsRejectBadInputs) {
  const OpDef& bn = *OpTable::instance().find("native_batch_norm_backward");
  Tensor x = randn({2, 3, 2}), stat = ones({3});
  std::vector<Attr> attrs{true, std::vector<int64_t>{1, 1, 1}};
  EXPECT_THROW(call_op(bn, {randn({2, 3, 3}), x, Tensor(), stat, stat}, attrs), ShapeError);
  EXPECT_THROW(call_op(bn, {randn({2, 3, 2}), x, Tensor(), ones({4}), stat}, attrs), ShapeError);
  EXPECT_THROW(call_op(bn, {randn({2, 3, 2}), x.to(kInt64), Tensor(), stat, stat}, attrs), DTypeError);
  attrs[1] = std::vector<int64_t>{1};
  EXPECT_THROW(call_op(bn, {randn({2, 3, 2}), x, Tensor(), stat, stat}, attrs), ValueError);
}
