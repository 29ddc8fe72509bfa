// Batch norm + relu fusion: the batch_norm_relu op against relu(native_batch_norm(...)) and
// batch_norm_relu_backward against native_batch_norm_backward(where(r <= 0, 0, grad), ...) (dtypes,
// planar and channels-last layouts, small and large planes, training and inference, running
// statistics, output masks, NaN, out= targets), batch_norm_relu_backward_recompute bit for bit
// against batch_norm_relu_backward reading the forward's result, the derivative of
// batch_norm_relu, the fuse_batch_norm_relu pass on captured graphs (fused where the pattern
// holds, left alone otherwise, the mask recomputed only where the forward's operands are the
// backward's, scalar slots and run-time host scalars kept), and DenseNet training steps compiled
// with the kiln backend, which runs the pass, against eager.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "compiler/graph/passes.h"
#include "kiln/autograd.h"
#include "kiln/compiler.h"
#include "kiln/compiler/graph.h"
#include "kiln/kiln.h"
#include "kiln/models.h"
#include "kiln/threading.h"
#include "reference.h"

namespace {

using namespace kiln;
using namespace kiln::testing;  // compile_helpers.h, reference.h
using kiln::compiler::Arguments;
using kiln::compiler::Graph;
using kiln::compiler::Node;
namespace passes = kiln::compiler::passes;
namespace fs = std::filesystem;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_fuse_batch_norm_relu");

const OpDef& op(const char* name) {
  const OpDef* d = OpTable::instance().find(name);
  if (!d) throw std::runtime_error(std::string(name) + " is not registered");
  return *d;
}

int count_op(const Graph& g, std::string_view name) {
  int n = 0;
  for (const Node& node : g)
    if (node.target() == name) ++n;
  return n;
}

std::string describe(DType t, bool channels_last, bool training) {
  return std::string(dtype_name(t)) + (channels_last ? ", channels-last" : ", planar") +
         (training ? ", training" : ", inference");
}

// Same shape, dtype and values, NaN matching NaN.
::testing::AssertionResult same(const Tensor& a, const Tensor& b, double rtol = 0,
                                double atol = 0) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure()
           << "shape/dtype " << shape_str(a.sizes()) << " " << dtype_name(a.dtype()) << " vs "
           << shape_str(b.sizes()) << " " << dtype_name(b.dtype());
  if (a.numel() == 0 || allclose(a, b, rtol, atol, /*equal_nan=*/true))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\nactual:   " << a << "\nexpected: " << b;
}

// The same loops run in the fused and the plain backward, but a compiler may contract them
// differently: a few ulps.
double backward_rtol(DType t) {
  return t == kFloat64 ? 1e-12 : 1e-5;
}
double backward_atol(DType t) {
  return t == kFloat64 ? 1e-12 : 1e-5;
}

Tensor in_layout(const Tensor& t, bool channels_last) {
  return channels_last ? t.contiguous(kiln::channels_last) : t.contiguous();
}

// A batch norm's operands, in the given dtype and layout.
struct BatchNormCase {
  Tensor x, weight, bias, running_mean, running_var;

  static BatchNormCase make(std::vector<int64_t> sizes, DType t, bool channels_last,
                            bool affine = true) {
    const int64_t c = sizes[1];
    BatchNormCase b;
    // A shift keeps some normalized values on each side of 0 without centring them.
    b.x = in_layout(randn(sizes, t) * 2 + 0.5, channels_last && sizes.size() == 4);
    if (affine) {
      b.weight = randn({c}, t);
      b.bias = randn({c}, t) * 0.5;
    }
    b.running_mean = randn({c}, t) * 0.1;
    b.running_var = rand({c}, t) + 0.5;
    return b;
  }
  TensorList forward(const char* name, bool training, Tensor& running_mean, Tensor& running_var,
                     double momentum = 0.1, double eps = 1e-5) const {
    running_mean = this->running_mean.clone();
    running_var = this->running_var.clone();
    return call_op(op(name), {x, weight, bias, running_mean, running_var},
                   {training, momentum, eps});
  }
};

const std::vector<std::vector<int64_t>> kShapes = {
    {4, 5, 6, 7},  // planes of 42: run by run (planar), one channel at a time (channel rows)
    {3, 6, 2, 3},  // planes of 6: the column loops
    {2, 136, 3,
     3},  // channel rows in tiles of 128 (float32) or 64 (float64) channels, then 16, then 1
    {2, 40, 5, 3},
};

// ================================ batch_norm_relu ================================

// Same statistics, same affine pass, relu after the rounding: bit for bit relu(native_batch_norm).
TEST(BatchNormRelu, EqualsReluOfNativeBatchNorm) {
  manual_seed(0);
  for (DType t : {kFloat32, kFloat64})
    for (bool channels_last : {false, true})
      for (bool training : {true, false})
        for (const auto& sizes : kShapes) {
          SCOPED_TRACE(describe(t, channels_last, training) + ", " + shape_str(sizes));
          BatchNormCase b = BatchNormCase::make(sizes, t, channels_last);
          Tensor rm_fused, rv_fused, rm_plain, rv_plain;
          TensorList fused = b.forward("batch_norm_relu", training, rm_fused, rv_fused, 0.3, 1e-3);
          TensorList plain =
              b.forward("native_batch_norm", training, rm_plain, rv_plain, 0.3, 1e-3);
          EXPECT_TRUE(same(fused[0], relu(plain[0])));
          EXPECT_TRUE(same(fused[1], plain[1])) << "mean";
          EXPECT_TRUE(same(fused[2], plain[2])) << "invstd";
          EXPECT_TRUE(same(rm_fused, rm_plain)) << "running_mean";
          EXPECT_TRUE(same(rv_fused, rv_plain)) << "running_var";
          if (training) {
            EXPECT_FALSE(same(rm_fused, b.running_mean)) << "training updates the running mean";
          }
          EXPECT_GT(sum(eq(fused[0], 0)).item<int64_t>(), 0)
              << "the relu clamped nothing: a weak test";
          EXPECT_GT(sum(gt(fused[0], 0)).item<int64_t>(), 0);
          if (channels_last) {
            EXPECT_TRUE(fused[0].is_contiguous(kiln::channels_last)) << "the input's layout";
          } else {
            EXPECT_TRUE(fused[0].is_contiguous());
          }
        }
}

TEST(BatchNormRelu, WorksWithoutAffineParametersOrRunningStatsAndOnOtherRanks) {
  manual_seed(1);
  for (std::vector<int64_t> sizes : {std::vector<int64_t>{8, 5}, {4, 3, 10}, {2, 3, 2, 2, 3}}) {
    SCOPED_TRACE(shape_str(sizes));
    BatchNormCase b = BatchNormCase::make(sizes, kFloat32, false, /*affine=*/false);
    Tensor fused = call_op(op("batch_norm_relu"), {b.x, Tensor(), Tensor(), Tensor(), Tensor()},
                           {true, 0.1, 1e-5})[0];
    Tensor plain = call_op(op("native_batch_norm"), {b.x, Tensor(), Tensor(), Tensor(), Tensor()},
                           {true, 0.1, 1e-5})[0];
    EXPECT_TRUE(same(fused, relu(plain)));
  }
}

// A NaN poisons its channel's statistics in training (the whole channel is NaN) and only itself
// in inference; relu keeps NaN, as relu does.
TEST(BatchNormRelu, KeepsNaNLikeReluOfBatchNorm) {
  manual_seed(2);
  for (bool channels_last : {false, true})
    for (bool training : {true, false}) {
      SCOPED_TRACE(describe(kFloat32, channels_last, training));
      BatchNormCase b = BatchNormCase::make({2, 3, 6, 6}, kFloat32, false);
      b.x.select(0, 1).select(0, 1).select(0, 2).select(0, 3).fill_(kNaN);
      b.x = in_layout(b.x, channels_last);
      Tensor rm1, rv1, rm2, rv2;
      TensorList fused = b.forward("batch_norm_relu", training, rm1, rv1);
      TensorList plain = b.forward("native_batch_norm", training, rm2, rv2);
      EXPECT_TRUE(same(fused[0], relu(plain[0])));
      EXPECT_TRUE(same(rm1, rm2));
      EXPECT_TRUE(same(rv1, rv2));
      EXPECT_EQ(sum(isnan(fused[0])).item<int64_t>(), training ? 2 * 36 : 1);
    }
}

TEST(BatchNormRelu, WritesOutTargetsOfAnyLayout) {
  manual_seed(3);
  for (bool channels_last : {false, true}) {
    SCOPED_TRACE(channels_last ? "channels-last input" : "planar input");
    BatchNormCase b = BatchNormCase::make({2, 4, 5, 6}, kFloat32, channels_last);
    Tensor rm, rv;
    TensorList plain = b.forward("native_batch_norm", true, rm, rv);
    Tensor want = relu(plain[0]);
    struct Target {
      const char* what;
      Tensor out;
    };
    std::vector<Target> targets;
    targets.push_back({"row-major", full({2, 4, 5, 6}, 7.0, kFloat32)});
    targets.push_back(
        {"channels-last", full({2, 4, 5, 6}, 7.0, kFloat32).contiguous(kiln::channels_last)});
    targets.push_back({"a strided slice", full({2, 8, 5, 6}, 7.0, kFloat32).slice(1, 0, 8, 2)});
    for (Target& target : targets) {
      SCOPED_TRACE(target.what);
      Tensor mean = empty({4}), invstd = empty({4});
      Tensor rm2 = b.running_mean.clone(), rv2 = b.running_var.clone();
      std::vector<Tensor> outs{target.out, mean, invstd};
      call_op_out(op("batch_norm_relu"), {b.x, b.weight, b.bias, rm2, rv2}, {true, 0.1, 1e-5},
                  outs);
      EXPECT_TRUE(same(target.out, want));
      EXPECT_TRUE(same(mean, plain[1]));
      EXPECT_TRUE(same(rv2, rv));
    }
  }
}

TEST(BatchNormRelu, RejectsBadOperandsNamingItself) {
  Tensor x = randn({2, 3, 4, 4});
  try {
    call_op(op("batch_norm_relu"), {x, randn({4}), Tensor(), Tensor(), Tensor()},
            {true, 0.1, 1e-5});
    FAIL() << "a weight of the wrong size was accepted";
  } catch (const ShapeError& e) {
    EXPECT_TRUE(
        contains(e.what(), "[kiln::batch_norm_relu] weight should be a 1-D tensor of 3 elements"));
  }
  EXPECT_THROW(call_op(op("batch_norm_relu"), {x, Tensor(), Tensor(), Tensor(), Tensor()},
                       {false, 0.1, 1e-5}),
               ValueError)
      << "inference needs running statistics";
}

// Derivative: batch_norm_relu_backward, checked against finite differences and against the
// gradients of relu(batch_norm(...)).
TEST(BatchNormRelu, GradientsMatchFiniteDifferencesAndTheUnfusedComposition) {
  manual_seed(4);
  for (bool channels_last : {false, true})
    for (bool training : {true, false}) {
      SCOPED_TRACE(describe(kFloat64, channels_last, training));
      BatchNormCase b = BatchNormCase::make({3, 2, 3, 3}, kFloat64, channels_last);
      Tensor x = b.x.detach().requires_grad_(), w = b.weight.detach().requires_grad_(),
             bias = b.bias.detach().requires_grad_();
      Tensor rm = b.running_mean.clone(), rv = b.running_var.clone();
      auto fused = [&](const TensorList& in) {
        return TensorList{call_op(op("batch_norm_relu"), {in[0], in[1], in[2], rm, rv},
                                  {training, 0.1, 1e-5})[0]};
      };
      EXPECT_TRUE(grad_ok(fused, {x, w, bias}));
      Tensor go = randn({3, 2, 3, 3}, kFloat64);
      TensorList got = autograd::grad({fused({x, w, bias})[0]}, {x, w, bias}, {go});
      TensorList want = autograd::grad({relu(batch_norm(x, rm, rv, w, bias, training, 0.1, 1e-5))},
                                       {x, w, bias}, {go});
      for (size_t i = 0; i < 3; ++i)
        EXPECT_TRUE(same(got[i], want[i], 1e-12, 1e-12)) << "input " << i;
      if (channels_last) {
        EXPECT_TRUE(got[0].is_contiguous(kiln::channels_last)) << "grad_input follows the input";
      }
    }
}

// ================================ batch_norm_relu_backward ================================

// Saved statistics as the forward returns them (batch statistics in training, the running mean
// and 1 / sqrt(running_var + eps) in inference), the relu's result and an incoming gradient.
struct BackwardCase {
  BatchNormCase b;
  Tensor r, mean, invstd, grad;

  static BackwardCase make(std::vector<int64_t> sizes, DType t, bool channels_last, bool training) {
    BackwardCase c{BatchNormCase::make(sizes, t, channels_last), {}, {}, {}, {}};
    Tensor rm, rv;
    TensorList out = c.b.forward("native_batch_norm", training, rm, rv);
    c.r = relu(out[0]);
    c.mean = out[1];
    c.invstd = out[2];
    c.grad = in_layout(randn(sizes, t), channels_last && sizes.size() == 4);
    return c;
  }
  TensorList fused(bool training, std::vector<int64_t> mask, const Tensor& threshold = {},
                   const Tensor& fill = {}) const {
    return call_op(op("batch_norm_relu_backward"),
                   {grad, r, b.x, b.weight, mean, invstd, threshold, fill}, {training, mask});
  }
  // The unfused graph: relu's backward, then the batch norm's.
  TensorList reference(bool training, std::vector<int64_t> mask, const Tensor& threshold = {},
                       const Tensor& fill = {}) const {
    Tensor t = threshold.defined() ? threshold : scalar_tensor(0, kFloat64);
    Tensor v = fill.defined() ? fill : scalar_tensor(0, kFloat64);
    Tensor masked = where(le(r, t), v, grad);
    return call_op(op("native_batch_norm_backward"), {masked, b.x, b.weight, mean, invstd},
                   {training, mask});
  }
};

TEST(BatchNormReluBackward, EqualsNativeBackwardOfTheMaskedGradient) {
  manual_seed(5);
  const std::vector<std::vector<int64_t>> masks = {
      {1, 1, 1}, {1, 0, 0}, {0, 1, 1}, {1, 1, 0}, {0, 0, 1}};
  for (DType t : {kFloat32, kFloat64})
    for (bool channels_last : {false, true})
      for (bool training : {true, false})
        for (const auto& sizes : kShapes) {
          SCOPED_TRACE(describe(t, channels_last, training) + ", " + shape_str(sizes));
          BackwardCase c = BackwardCase::make(sizes, t, channels_last, training);
          for (const auto& mask : masks) {
            SCOPED_TRACE("output_mask " + shape_str(mask));
            TensorList got = c.fused(training, mask), want = c.reference(training, mask);
            for (size_t i = 0; i < 3; ++i) {
              EXPECT_TRUE(same(got[i], want[i], backward_rtol(t), backward_atol(t)))
                  << "output " << i;
              if (!mask[i]) {
                EXPECT_EQ(got[i].numel(), 0) << "output " << i << " was not asked for";
              }
            }
            if (mask[0]) {
              EXPECT_TRUE(channels_last ? got[0].is_contiguous(kiln::channels_last)
                                        : got[0].is_contiguous());
            }
          }
        }
}

// where(r <= 0, 0, grad): a NaN gradient under the mask is dropped; a NaN in r compares false,
// so its gradient passes.
TEST(BatchNormReluBackward, MasksNaNLikeLeAndWhere) {
  manual_seed(6);
  for (bool channels_last : {false, true})
    for (bool training : {true, false}) {
      SCOPED_TRACE(describe(kFloat32, channels_last, training));
      BackwardCase c = BackwardCase::make({2, 3, 6, 6}, kFloat32, false, training);
      // Positions (n, h, w) of channel 1 where the relu clamped and where it did not.
      auto at = [](Tensor& t, int64_t i) {
        return t.select(0, i / 36).select(0, 1).select(0, i / 6 % 6).select(0, i % 6);
      };
      int64_t clamped = -1, passed = -1;
      for (int64_t i = 0; i < 72; ++i) {
        const float v = at(c.r, i).item<float>();
        if (v == 0 && clamped < 0) clamped = i;
        if (v > 0 && passed < 0) passed = i;
      }
      ASSERT_TRUE(clamped >= 0 && passed >= 0);
      Tensor g = c.grad.clone(), r = c.r.clone();
      at(g, clamped).fill_(kNaN);
      at(r, passed).fill_(kNaN);
      at(g, passed).fill_(1000.0);  // passes: the NaN r is not <= 0
      c.grad = in_layout(g, channels_last);
      c.r = in_layout(r, channels_last);
      c.b.x = in_layout(c.b.x, channels_last);
      TensorList got = c.fused(training, {1, 1, 1}), want = c.reference(training, {1, 1, 1});
      for (size_t i = 0; i < 3; ++i)
        EXPECT_TRUE(same(got[i], want[i], 1e-5, 1e-5)) << "output " << i;
      EXPECT_EQ(sum(isnan(got[0])).item<int64_t>(), 0) << "the NaN gradient sat under the mask";
      TensorList unmasked = c.fused(training, {1, 1, 1}, scalar_tensor(-1.0, kFloat64));
      EXPECT_GT(sum(isnan(unmasked[0])).item<int64_t>(), 0)
          << "with threshold -1 the NaN gradient passes";
    }
}

// The threshold and fill the relu backward wrapped (0-dim tensors, possibly of other dtypes).
TEST(BatchNormReluBackward, ReadsThresholdAndFillOperands) {
  manual_seed(7);
  for (bool channels_last : {false, true})
    for (bool training : {true, false}) {
      SCOPED_TRACE(describe(kFloat32, channels_last, training));
      BackwardCase c = BackwardCase::make({2, 4, 3, 5}, kFloat32, channels_last, training);
      const std::vector<std::pair<Tensor, Tensor>> operands = {
          {scalar_tensor(0.3, kFloat64), scalar_tensor(-2.0, kFloat64)},
          {scalar_tensor(int64_t{1}, kInt64), scalar_tensor(0.25, kFloat32)},
          {full({}, 0.7, kFloat32), Tensor()},
      };
      for (const auto& [threshold, fill] : operands) {
        TensorList got = c.fused(training, {1, 1, 1}, threshold, fill);
        TensorList want = c.reference(training, {1, 1, 1}, threshold, fill);
        for (size_t i = 0; i < 3; ++i)
          EXPECT_TRUE(same(got[i], want[i], 1e-5, 1e-5)) << "output " << i;
      }
    }
}

// Operands in mixed layouts are read as they are; grad_input takes the input's layout, or the
// layout of an out= target.
TEST(BatchNormReluBackward, HandlesMixedLayoutsAndOutTargets) {
  manual_seed(8);
  for (bool channels_last : {false, true}) {
    SCOPED_TRACE(channels_last ? "channels-last input" : "planar input");
    BackwardCase c = BackwardCase::make({2, 4, 5, 6}, kFloat64, channels_last, true);
    c.grad = in_layout(c.grad, !channels_last);
    c.r = in_layout(c.r, !channels_last);
    TensorList want = c.reference(true, {1, 1, 1});
    TensorList got = c.fused(true, {1, 1, 1});
    for (size_t i = 0; i < 3; ++i)
      EXPECT_TRUE(same(got[i], want[i], 1e-12, 1e-12)) << "output " << i;
    if (channels_last) {
      EXPECT_TRUE(got[0].is_contiguous(kiln::channels_last));
    }
    for (Tensor target : {zeros({2, 4, 5, 6}, kFloat64),
                          zeros({2, 4, 5, 6}, kFloat64).contiguous(kiln::channels_last),
                          zeros({2, 4, 5, 12}, kFloat64).slice(3, 0, 12, 2)}) {
      Tensor gw = empty({4}, kFloat64), gb = empty({4}, kFloat64);
      std::vector<Tensor> outs{target, gw, gb};
      call_op_out(op("batch_norm_relu_backward"),
                  {c.grad, c.r, c.b.x, c.b.weight, c.mean, c.invstd, Tensor(), Tensor()},
                  {true, std::vector<int64_t>{1, 1, 1}}, outs);
      EXPECT_TRUE(same(target, want[0], 1e-12, 1e-12));
      EXPECT_TRUE(same(gw, want[1], 1e-12, 1e-12));
      EXPECT_TRUE(same(gb, want[2], 1e-12, 1e-12));
    }
  }
}

TEST(BatchNormReluBackward, RejectsBadOperandsNamingItself) {
  BackwardCase c = BackwardCase::make({2, 3, 4, 4}, kFloat32, false, true);
  auto call = [&](const Tensor& r, const Tensor& threshold, const Tensor& grad) {
    return call_op(op("batch_norm_relu_backward"),
                   {grad, r, c.b.x, c.b.weight, c.mean, c.invstd, threshold, Tensor()},
                   {true, std::vector<int64_t>{1, 1, 1}});
  };
  try {
    call(randn({2, 3, 4, 5}), Tensor(), c.grad);
    FAIL() << "a result of the wrong shape was accepted";
  } catch (const ShapeError& e) {
    EXPECT_TRUE(
        contains(e.what(), "[kiln::batch_norm_relu_backward] result has shape (2, 3, 4, 5)"));
  }
  EXPECT_THROW(call(c.r, zeros({1}), c.grad), ShapeError) << "threshold must be 0-dim";
  EXPECT_THROW(call(c.r.to(kFloat64), Tensor(), c.grad), DTypeError);
  EXPECT_THROW(call(c.r, Tensor(), c.grad.to(kFloat64)), DTypeError);
  EXPECT_THROW(call(c.r, Tensor(), randn({2, 3, 4, 5})), ShapeError);
}

// ========================== batch_norm_relu_backward_recompute ==========================

// batch_norm_relu_backward_recompute on the forward's operands, and batch_norm_relu_backward on
// the result batch_norm_relu returned. The recomputed result is the forward's bit for bit, so the
// masks are the same: grad_bias, the masked gradient's sum (additions only, in the same order), is
// equal bit for bit, and with a gradient of ones it counts the elements the mask passes. The
// other outputs agree to a few ulps (the compiler may contract the two instantiations' products
// into fmas differently).
struct RecomputeCase {
  BatchNormCase b;
  TensorList fwd;  // batch_norm_relu's (result, save_mean, save_invstd)
  Tensor grad;

  static RecomputeCase make(const Tensor& x, bool affine, bool training) {
    RecomputeCase c{BatchNormCase::make(x.sizes().vec(), x.dtype(), false, affine), {}, {}};
    c.b.x = x;
    Tensor rm, rv;
    c.fwd = c.b.forward("batch_norm_relu", training, rm, rv);
    c.grad = randn(x.sizes().vec(), x.dtype()) * 2 + 0.5;
    if (x.dim() == 4 && x.suggest_memory_format() == kiln::channels_last) c.grad = in_layout(c.grad, true);
    return c;
  }
  TensorList reading(bool training, std::vector<int64_t> mask, const Tensor& threshold = {},
                     const Tensor& fill = {}) const {
    return call_op(op("batch_norm_relu_backward"),
                   {grad, fwd[0], b.x, b.weight, fwd[1], fwd[2], threshold, fill}, {training, mask});
  }
  TensorList recomputing(bool training, std::vector<int64_t> mask, const Tensor& threshold = {},
                         const Tensor& fill = {}) const {
    return call_op(op("batch_norm_relu_backward_recompute"),
                   {grad, b.x, b.weight, fwd[1], fwd[2], b.bias, threshold, fill}, {training, mask});
  }
};

::testing::AssertionResult bitwise_same(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "shape/dtype " << shape_str(a.sizes()) << " vs " << shape_str(b.sizes());
  if (a.numel() == 0 || (equal(isnan(a), isnan(b)) && equal(where(isnan(a), 0, a), where(isnan(b), 0, b))))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\nrecomputed: " << a << "\nread:       " << b;
}

// Same masks (grad_bias bit for bit, also with a gradient of ones), the other outputs within a few
// ulps of t.
void expect_same_backward(const TensorList& got, const TensorList& want, DType t) {
  EXPECT_TRUE(bitwise_same(got[2], want[2])) << "grad_bias: the masks differ";
  const double tol = t == kFloat16 || t == kBFloat16 ? 1e-2 : backward_rtol(t);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(same(got[i], want[i], tol, tol)) << "output " << i;
}

TEST(BatchNormReluBackwardRecompute, EqualsTheBackwardReadingTheForwardsResult) {
  manual_seed(20);
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16})
    for (bool channels_last : {false, true})
      for (bool training : {true, false})
        for (bool affine : {true, false})
          for (const auto& sizes : kShapes) {
            SCOPED_TRACE(describe(t, channels_last, training) + (affine ? ", affine, " : ", no affine, ") +
                         shape_str(sizes));
            RecomputeCase c = RecomputeCase::make(in_layout(randn(sizes, t) * 2 + 0.5, channels_last), affine,
                                                  training);
            expect_same_backward(c.recomputing(training, {1, 1, 1}), c.reading(training, {1, 1, 1}), t);
            TensorList only_input = c.recomputing(training, {1, 0, 0});
            EXPECT_TRUE(same(only_input[0], c.reading(training, {1, 0, 0})[0], 1e-2, 1e-2));
            EXPECT_EQ(only_input[1].numel() + only_input[2].numel(), 0);
            EXPECT_TRUE(channels_last ? only_input[0].is_contiguous(kiln::channels_last)
                                      : only_input[0].is_contiguous());
            c.grad = ones_like(c.grad);
            if (channels_last) c.grad = in_layout(c.grad, true);
            EXPECT_TRUE(bitwise_same(c.recomputing(training, {0, 0, 1})[2], c.reading(training, {0, 0, 1})[2]))
                << "the elements each channel's mask passes";
          }
}

// Inputs as the compiled DenseNet passes them: a channel slice of a wider channels-last buffer,
// and 3-D and 2-D inputs; the threshold and fill operands; NaN and infinities in the input (in
// evaluation mode, where they stay in their own element).
TEST(BatchNormReluBackwardRecompute, HandlesSlicesOtherRanksOperandsAndNonFiniteInputs) {
  manual_seed(21);
  Tensor buffer = randn({3, 200, 5, 4}).contiguous(kiln::channels_last);
  const std::vector<std::pair<const char*, Tensor>> inputs = {
      {"a channel slice of a channels-last buffer", buffer.slice(1, 0, 136)},
      {"a 3-D input", randn({4, 6, 9})},
      {"a 2-D input", randn({8, 5})},
  };
  for (const auto& [what, x] : inputs)
    for (bool training : {true, false}) {
      SCOPED_TRACE(std::string(what) + (training ? ", training" : ", inference"));
      RecomputeCase c = RecomputeCase::make(x, true, training);
      expect_same_backward(c.recomputing(training, {1, 1, 1}), c.reading(training, {1, 1, 1}), kFloat32);
      for (const auto& [threshold, fill] : std::vector<std::pair<Tensor, Tensor>>{
               {scalar_tensor(0.3, kFloat64), scalar_tensor(-2.0, kFloat64)},
               {scalar_tensor(-1.0, kFloat64), Tensor()},
               {scalar_tensor(int64_t{1}, kInt64), scalar_tensor(0.25, kFloat32)}}) {
        expect_same_backward(c.recomputing(training, {1, 1, 1}, threshold, fill),
                             c.reading(training, {1, 1, 1}, threshold, fill), kFloat32);
      }
    }
  for (bool channels_last : {false, true}) {
    SCOPED_TRACE(channels_last ? "non-finite, channels-last" : "non-finite, planar");
    Tensor x = randn({2, 3, 4, 4});
    x.select(1, 0).select(1, 1).fill_(kNaN);
    x.select(1, 1).select(1, 2).fill_(std::numeric_limits<double>::infinity());
    x.select(1, 2).select(1, 3).fill_(-std::numeric_limits<double>::infinity());
    RecomputeCase c = RecomputeCase::make(in_layout(x, channels_last), true, false);
    expect_same_backward(c.recomputing(false, {1, 1, 1}), c.reading(false, {1, 1, 1}), kFloat32);
  }
}

TEST(BatchNormReluBackwardRecompute, RejectsBadOperandsNamingItself) {
  RecomputeCase c = RecomputeCase::make(randn({2, 3, 4, 4}), true, true);
  auto call = [&](const Tensor& grad, const Tensor& bias, const Tensor& threshold) {
    return call_op(op("batch_norm_relu_backward_recompute"),
                   {grad, c.b.x, c.b.weight, c.fwd[1], c.fwd[2], bias, threshold, Tensor()},
                   {true, std::vector<int64_t>{1, 1, 1}});
  };
  try {
    call(c.grad, randn({4}), Tensor());
    FAIL() << "a bias of the wrong shape was accepted";
  } catch (const ShapeError& e) {
    EXPECT_TRUE(contains(e.what(), "[kiln::batch_norm_relu_backward_recompute] bias should be a 1-D tensor of 3"))
        << e.what();
  }
  EXPECT_THROW(call(c.grad, randint(0, 3, {3}), Tensor()), DTypeError) << "an integer bias";
  EXPECT_THROW(call(c.grad, c.b.bias, zeros({1})), ShapeError) << "threshold must be 0-dim";
  EXPECT_THROW(call(c.grad.to(kFloat64), c.b.bias, Tensor()), DTypeError);
  EXPECT_THROW(call(randn({2, 3, 4, 5}), c.b.bias, Tensor()), ShapeError);
  EXPECT_NO_THROW(call(c.grad, Tensor(), Tensor())) << "no bias: shift = -mean * scale";
}

// ================================ the pass ================================

using Captured = kiln::testing::CapturedGraph;

// Outputs of `g` on clones of `tensors`, then the clones (the graph may write its inputs:
// running statistics).
std::vector<Tensor> run(const Graph& g, const std::vector<Tensor>& tensors,
                        const std::vector<Attr>& scalars) {
  std::vector<Tensor> in;
  for (const Tensor& t : tensors) in.push_back(t.clone());
  std::vector<Tensor> out = kiln::compiler::interpreter(g)(Arguments{in, scalars});
  out.insert(out.end(), in.begin(), in.end());
  return out;
}

// Runs functionalize and the pass on a copy of the captured graph; checks that it validates,
// keeps the calling convention and computes (and writes) what the functionalized graph does,
// with the captured arguments and with `other` ones when given. Returns the rewritten graph.
Graph fuse(Captured& c, const std::vector<Tensor>& other_tensors = {},
           const std::vector<Attr>& other_scalars = {}) {
  passes::functionalize(c.graph);
  Graph h = c.graph;
  passes::fuse_batch_norm_relu(h);
  EXPECT_NO_THROW(h.validate()) << h;
  EXPECT_EQ(h.scalars.size(), c.graph.scalars.size()) << "the pass changed the calling convention";
  EXPECT_EQ(h.inputs.size(), c.graph.inputs.size());
  EXPECT_EQ(h.outputs.size(), c.graph.outputs.size());
  auto check = [&](const std::vector<Tensor>& tensors, const std::vector<Attr>& scalars) {
    std::vector<Tensor> got = run(h, tensors, scalars), want = run(c.graph, tensors, scalars);
    EXPECT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
      EXPECT_TRUE(same(got[i], want[i], 1e-5, 1e-6)) << "output " << i << "\nbefore:\n"
                                                     << c.graph << "after:\n"
                                                     << h;
  };
  check(c.tensors, c.scalars);
  if (!other_tensors.empty() || !other_scalars.empty())
    check(other_tensors.empty() ? c.tensors : other_tensors,
          other_scalars.empty() ? c.scalars : other_scalars);
  return h;
}

// conv -> batch norm -> relu -> conv, forward and backward, with trainable parameters.
struct SmallNet {
  Tensor w1 = (randn({6, 3, 3, 3}) * 0.3).requires_grad_();
  Tensor w2 = (randn({4, 6, 1, 1}) * 0.3).requires_grad_();
  Tensor gamma = (rand({6}) + 0.5).requires_grad_();
  Tensor beta = (randn({6}) * 0.1).requires_grad_();
  Tensor running_mean = zeros({6}), running_var = ones({6});

  Tensor features(const Tensor& x, bool training = true) const {
    Tensor y = conv2d(x, w1, {}, {1, 1}, {1, 1});
    return relu(batch_norm(y, running_mean, running_var, gamma, beta, training, 0.1, 1e-5));
  }
  Tensor loss(const Tensor& x) const { return conv2d(features(x), w2).pow(2).mean(); }
  Tensor step(const Tensor& x) const {
    Tensor l = loss(x);
    TensorList g = autograd::grad({l}, {w1, w2, gamma, beta});
    return l + g[0].sum() + g[1].sum() + g[2].sum() + g[3].sum();
  }
};

TEST(FuseBatchNormRelu, FusesTheForwardAndTheBackwardOfATrainingStep) {
  manual_seed(10);
  SmallNet net;
  for (bool channels_last : {false, true}) {
    SCOPED_TRACE(channels_last ? "channels-last" : "planar");
    Tensor x = in_layout(randn({2, 3, 6, 6}), channels_last);
    Captured c = capture_graph([&](const Tensor& in) { return net.step(in); }, x);
    ASSERT_EQ(count_op(c.graph, "native_batch_norm"), 1) << c.graph;
    ASSERT_EQ(count_op(c.graph, "native_batch_norm_backward"), 1) << c.graph;
    Graph h = fuse(c);
    EXPECT_EQ(count_op(h, "batch_norm_relu"), 1) << h;
    EXPECT_EQ(count_op(h, "batch_norm_relu_backward_recompute"), 1) << "the mask is recomputed\n" << h;
    for (const char* gone : {"native_batch_norm", "native_batch_norm_backward", "relu", "le", "where",
                             "batch_norm_relu_backward"})
      EXPECT_EQ(count_op(h, gone), 0) << gone << "\n" << h;
    EXPECT_EQ(h.nodes.size(), c.graph.nodes.size() - 3);
  }
}

// momentum and eps are run-time scalars: their slots stay on the fused node (same attrs), and the
// host scalars of relu's backward stay run-time inputs of the fused backward.
TEST(FuseBatchNormRelu, KeepsScalarSlotsAndRunTimeHostScalars) {
  manual_seed(11);
  Tensor w = rand({5}) + 0.5, b = randn({5}), rm = zeros({5}), rv = ones({5});
  auto fn = [&](const Tensor& x, const Tensor& g) {
    TensorList out = call_op(op("native_batch_norm"), {x, w, b, rm, rv}, {true, 0.1, 1e-5});
    Tensor r = relu(out[0]);
    Tensor masked = where(le(r, 0.25), -0.5, g);
    TensorList grads = call_op(op("native_batch_norm_backward"), {masked, x, w, out[1], out[2]},
                               {true, std::vector<int64_t>{1, 1, 1}});
    return std::vector<Tensor>{r, grads[0], grads[1], grads[2]};
  };
  Captured c = capture_graph(fn, randn({3, 5, 4, 4}), randn({3, 5, 4, 4}));
  ASSERT_EQ(c.scalars.size(), 2u) << "momentum and eps\n" << c.graph;
  // Other scalars, and other values of the wrapped host scalars (0.25, -0.5): the graph is reused
  // for any, so the fused node must read them, not bake them in.
  std::vector<Tensor> other = c.tensors;
  int wrapped = 0;
  for (size_t k = 0; k < c.graph.inputs.size(); ++k)
    if (c.graph.values[c.graph.inputs[k]].is_wrapped_number)
      other[k] = full({}, wrapped++ == 0 ? 0.75 : 3.0, other[k].dtype());
  ASSERT_EQ(wrapped, 2) << c.graph;
  Graph h = fuse(c, other, {Scalar(0.4), Scalar(0.01)});
  ASSERT_EQ(count_op(h, "batch_norm_relu"), 1) << h;
  ASSERT_EQ(count_op(h, "batch_norm_relu_backward_recompute"), 1) << h;
  for (size_t k = 0; k < h.scalars.size(); ++k) {
    EXPECT_EQ(h.nodes.at(h.scalars[k].node).target(), "batch_norm_relu") << h;
    EXPECT_EQ(h.scalars[k].attr, c.graph.scalars[k].attr);
  }
}

TEST(FuseBatchNormRelu, LeavesPatternsThatDoNotHold) {
  manual_seed(12);
  Tensor w = rand({4}) + 0.5, b = randn({4}), rm = zeros({4}), rv = ones({4});
  Tensor x = randn({2, 4, 3, 3}), grad = randn({2, 4, 3, 3});
  auto bn = [&](const Tensor& in, bool training = true) {
    return call_op(op("native_batch_norm"), {in, w, b, rm, rv}, {training, 0.1, 1e-5});
  };
  auto bn_backward = [&](const Tensor& g, const Tensor& in, const TensorList& fwd) {
    return call_op(op("native_batch_norm_backward"), {g, in, w, fwd[1], fwd[2]},
                   {true, std::vector<int64_t>{1, 1, 1}});
  };
  struct Case {
    const char* what;
    Captured captured;
    bool backward = false;  // the relu backward pattern (else the forward one)
  };
  std::vector<Case> cases;
  // Forward patterns.
  auto bn_output_returned = [&](const Tensor& t) {
    Tensor y = bn(t)[0];
    return std::vector<Tensor>{y, relu(y)};
  };
  auto bn_output_read_twice = [&](const Tensor& t) {
    Tensor y = bn(t)[0];
    return relu(y) + y;
  };
  auto bn_output_viewed = [&](const Tensor& t) {
    Tensor y = bn(t)[0];
    return relu(y) + y.flatten().sum();
  };
  auto two_relus = [&](const Tensor& t) {
    Tensor y = bn(t)[0];
    return relu(y) * relu(y).sum();
  };
  auto written_before_relu = [&](const Tensor& t) {
    Tensor y = bn(t)[0];
    y.narrow(1, 0, 2).mul_(-1);  // a write into a view stays in place
    return relu(y);
  };
  auto gelu_after_bn = [&](const Tensor& t) { return gelu(bn(t)[0]); };
  auto inference_bn = [&](const Tensor& t) { return relu(bn(t, false)[0]); };
  cases.push_back({"the batch norm's output is also returned", capture_graph(bn_output_returned, x)});
  cases.push_back({"the batch norm's output is read twice", capture_graph(bn_output_read_twice, x)});
  cases.push_back({"a view of the batch norm's output", capture_graph(bn_output_viewed, x)});
  cases.push_back({"two relus read it", capture_graph(two_relus, x)});
  cases.push_back({"written in place before the relu", capture_graph(written_before_relu, x)});
  cases.push_back({"another activation", capture_graph(gelu_after_bn, x)});
  cases.push_back({"an inference batch norm (decomposed and fused by the code generator instead)",
                   capture_graph(inference_bn, x)});
  // Backward patterns; the forward's relu reads bn * 2, so only the backward pattern is there.
  auto masked_returned = [&](const Tensor& t, const Tensor& g) {
    TensorList fwd = bn(t);
    Tensor masked = where(le(relu(fwd[0] * 2), 0), 0, g);
    return std::vector<Tensor>{masked, bn_backward(masked, t, fwd)[0]};
  };
  auto mask_read_elsewhere = [&](const Tensor& t, const Tensor& g) {
    TensorList fwd = bn(t);
    Tensor mask = le(relu(fwd[0] * 2), 0);
    return std::vector<Tensor>{mask, bn_backward(where(mask, 0, g), t, fwd)[0]};
  };
  auto not_a_relu = [&](const Tensor& t, const Tensor& g) {
    TensorList fwd = bn(t);
    return bn_backward(where(le(sigmoid(fwd[0] * 2), 0), 0, g), t, fwd)[0];
  };
  auto threshold_broadcasts = [&](const Tensor& t, const Tensor& g) {
    TensorList fwd = bn(t);
    return bn_backward(where(le(relu(fwd[0] * 2), zeros({1, 4, 1, 1})), 0, g), t, fwd)[0];
  };
  auto grad_broadcasts = [&](const Tensor& t, const Tensor& g) {
    TensorList fwd = bn(t);
    return bn_backward(where(le(relu(fwd[0] * 2), 0), 0, g.sum(0, true)), t, fwd)[0];
  };
  auto grad_written = [&](const Tensor& t, const Tensor& g) {
    TensorList fwd = bn(t);
    Tensor masked = where(le(relu(fwd[0] * 2), 0), 0, g);
    Tensor written = g;
    written.mul_(3);  // after functionalize: copied back into the input at the end
    return bn_backward(masked, t, fwd)[0];
  };
  cases.push_back(
      {"the masked gradient is also returned", capture_graph(masked_returned, x, grad), true});
  cases.push_back({"the mask is read elsewhere", capture_graph(mask_read_elsewhere, x, grad), true});
  cases.push_back({"r is no relu's result", capture_graph(not_a_relu, x, grad), true});
  cases.push_back(
      {"the threshold broadcasts (not 0-dim)", capture_graph(threshold_broadcasts, x, grad), true});
  cases.push_back({"the gradient broadcasts", capture_graph(grad_broadcasts, x, grad), true});
  cases.push_back(
      {"the gradient is an input written in place", capture_graph(grad_written, x, grad.clone()), true});
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    Graph before = c.captured.graph;
    passes::functionalize(before);
    ASSERT_EQ(count_op(before, "native_batch_norm"), 1) << before;
    if (c.backward) {
      ASSERT_EQ(count_op(before, "native_batch_norm_backward"), 1) << before;
      ASSERT_EQ(count_op(before, "where"), 1) << before;
      ASSERT_EQ(count_op(before, "le"), 1) << before;
    } else {
      ASSERT_GE(count_op(before, "relu") + count_op(before, "gelu"), 1) << before;
    }
    Graph h = fuse(c.captured);
    EXPECT_EQ(h.str(), before.str());
    EXPECT_EQ(count_op(h, "batch_norm_relu") + count_op(h, "batch_norm_relu_backward") +
                  count_op(h, "batch_norm_relu_backward_recompute"),
              0);
  }
}

// The relu backward folds into the batch norm backward whatever relu made r (here one the
// forward fusion cannot take).
TEST(FuseBatchNormRelu, FusesTheBackwardOfAnyRelu) {
  manual_seed(16);
  Tensor w = rand({4}) + 0.5, b = randn({4}), rm = zeros({4}), rv = ones({4});
  Captured c = capture_graph(
      [&](const Tensor& t, const Tensor& g) {
        TensorList fwd = call_op(op("native_batch_norm"), {t, w, b, rm, rv}, {true, 0.1, 1e-5});
        Tensor r = relu(fwd[0] * 2);
        Tensor masked = where(le(r, 0), 0, g);
        return call_op(op("native_batch_norm_backward"), {masked, t, w, fwd[1], fwd[2]},
                       {true, std::vector<int64_t>{1, 0, 1}});
      },
      randn({2, 4, 3, 3}), randn({2, 4, 3, 3}));
  Graph h = fuse(c);
  EXPECT_EQ(count_op(h, "batch_norm_relu"), 0) << h;
  EXPECT_EQ(count_op(h, "batch_norm_relu_backward"), 1) << h;
  EXPECT_EQ(count_op(h, "relu"), 1) << h;
  EXPECT_EQ(count_op(h, "where") + count_op(h, "le"), 0) << h;
}

// The mask is recomputed only from the operands the forward ran with: a backward with another
// weight, in another mode, or after a write into the bias or the input reads the relu's result.
TEST(FuseBatchNormRelu, RecomputesTheMaskOnlyFromTheForwardsOwnOperands) {
  manual_seed(17);
  Tensor w = rand({4}) + 0.5, w2 = rand({4}) + 0.5, b = randn({4}), rm = zeros({4}), rv = ones({4});
  auto forward = [&](const Tensor& t, const Tensor& bias) {
    return call_op(op("batch_norm_relu"), {t, w, bias, rm, rv}, {true, 0.1, 1e-5});
  };
  auto backward = [&](const Tensor& g, const Tensor& t, const Tensor& weight, const TensorList& fwd, bool train) {
    Tensor masked = where(le(fwd[0], 0), 0, g);
    return call_op(op("native_batch_norm_backward"), {masked, t, weight, fwd[1], fwd[2]},
                   {train, std::vector<int64_t>{1, 1, 1}})[0];
  };
  struct Case {
    const char* what;
    std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)> fn;
    bool recomputes;
  };
  const std::vector<Case> cases = {
      {"the forward's operands", [&](const Tensor& t, const Tensor& g, const Tensor& bias) {
         return backward(g, t, w, forward(t, bias), true);
       }, true},
      {"another weight", [&](const Tensor& t, const Tensor& g, const Tensor& bias) {
         return backward(g, t, w2, forward(t, bias), true);
       }, false},
      {"evaluation-mode backward", [&](const Tensor& t, const Tensor& g, const Tensor& bias) {
         return backward(g, t, w, forward(t, bias), false);
       }, false},
      {"the bias written in between", [&](const Tensor& t, const Tensor& g, const Tensor& bias) {
         TensorList fwd = forward(t, bias);
         bias.narrow(0, 0, 2).mul_(-1);  // a write into a view stays in place
         return backward(g, t, w, fwd, true);
       }, false},
      {"the input written in between", [&](const Tensor& t, const Tensor& g, const Tensor& bias) {
         TensorList fwd = forward(t, bias);
         t.narrow(1, 0, 1).add_(1.0);
         return backward(g, t, w, fwd, true);
       }, false},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    Captured c = capture_graph(k.fn, randn({2, 4, 3, 3}), randn({2, 4, 3, 3}), b.clone());
    Graph h = fuse(c);
    EXPECT_EQ(count_op(h, "batch_norm_relu_backward_recompute"), k.recomputes ? 1 : 0) << h;
    EXPECT_EQ(count_op(h, "batch_norm_relu_backward"), k.recomputes ? 0 : 1) << h;
  }
}

// A relu output that is also a graph output is still produced, now by the fused node.
TEST(FuseBatchNormRelu, FusesWhenTheReluResultIsAlsoReturned) {
  manual_seed(13);
  Tensor w = rand({4}) + 0.5, b = randn({4}), rm = zeros({4}), rv = ones({4});
  Captured c = capture_graph(
      [&](const Tensor& t) {
        Tensor r = relu(call_op(op("native_batch_norm"), {t, w, b, rm, rv}, {true, 0.1, 1e-5})[0]);
        return std::vector<Tensor>{r, r.sum()};
      },
      randn({2, 4, 3, 3}));
  Graph h = fuse(c);
  EXPECT_EQ(count_op(h, "batch_norm_relu"), 1) << h;
  EXPECT_EQ(count_op(h, "relu"), 0) << h;
}

int64_t dense_net_batch_norms(const models::DenseNetConfig& config) {
  int64_t n = 2;  // norm0 and norm5
  for (size_t i = 0; i < config.block_config.size(); ++i) {
    n += 2 * config.block_config[i];
    if (i + 1 < config.block_config.size()) ++n;  // transition
  }
  return n;
}

const models::DenseNetConfig kTinyDenseNet{.growth_rate = 4,
                                           .block_config = {2, 2},
                                           .num_init_features = 8,
                                           .bn_size = 2,
                                           .num_classes = 5};

TEST(FuseBatchNormRelu, FusesEveryBatchNormOfADenseNetTrainingStep) {
  manual_seed(14);
  auto net = std::make_shared<models::DenseNet>(kTinyDenseNet);
  Tensor target = randint(0, 5, {3});
  Captured c = capture_graph(
      [&](const Tensor& in) {
        Tensor loss = nn::functional::cross_entropy(net->forward(in), target);
        loss.backward();
        return loss;
      },
      randn({3, 3, 32, 32}));
  const int64_t n = dense_net_batch_norms(kTinyDenseNet);
  ASSERT_EQ(count_op(c.graph, "native_batch_norm"), n) << c.graph;
  Graph h = fuse(c);
  EXPECT_EQ(count_op(h, "batch_norm_relu"), n) << h;
  EXPECT_EQ(count_op(h, "batch_norm_relu_backward_recompute"), n) << h;
  for (const char* gone : {"native_batch_norm", "native_batch_norm_backward", "relu", "le", "where",
                           "batch_norm_relu_backward"})
    EXPECT_EQ(count_op(h, gone), 0) << gone << "\n" << h;
}

// ================================ compiled with the kiln backend ================================

class KilnBatchNormRelu : public CompilerTest {};

// Whether op_profile_report() has a row for `op`, called as is or in its out= form ("op_").
bool profiled(const std::string& profile, const std::string& op) {
  return contains(profile, "\n" + op + " ") || contains(profile, "\n" + op + "_ ");
}

// Two Adam steps of a DenseNet compiled with the kiln backend against the same steps run eagerly:
// losses, parameters and running statistics. The profile shows the fused ops ran and the relu and
// mask kernels did not.
void expect_compiled_training_matches_eager(const CompileOptions& options) {
  manual_seed(15);
  auto model_c = std::make_shared<models::DenseNet>(kTinyDenseNet);
  auto model_e = std::make_shared<models::DenseNet>(kTinyDenseNet);
  model_e->load_state_dict(model_c->state_dict());
  // Adam's default eps (1e-8) turns a near-zero gradient into a full step of its sign: norm0's
  // weight gradient is ~1e-6 here, and the channels-last convolutions' rounding (~1e-7) flips
  // some signs, with or without the fusion. A larger eps keeps such steps proportional.
  const optim::AdamOptions adam{.lr = 0.01, .eps = 1e-3};
  auto opt_c = std::make_shared<optim::Adam>(model_c->parameters(), adam);
  auto opt_e = std::make_shared<optim::Adam>(model_e->parameters(), adam);
  auto step_c = kiln::compile(training_step(model_c, opt_c), options);
  auto step_e = training_step(model_e, opt_e);
  Tensor x = randn({4, 3, 32, 32});
  Tensor y = tensor<int64_t>({0, 3, 1, 4});
  Delta d;
  reset_op_profile();
  set_op_profiling(true);
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    Tensor lc = step_c(x, y);
    Tensor le = step_e(x, y);
    EXPECT_TRUE(close(lc, le, Tolerance{1e-4, 1e-4}));
  }
  set_op_profiling(false);
  const std::string profile = op_profile_report();
  EXPECT_GT(d.now().graph_runs, 0);
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_TRUE(profiled(profile, "batch_norm_relu")) << "the fused forward ran\n" << profile;
  EXPECT_TRUE(profiled(profile, "batch_norm_relu_backward_recompute")) << "the fused backward ran\n" << profile;
  EXPECT_FALSE(contains(profile, "kernel[relu]")) << profile;
  EXPECT_FALSE(contains(profile, "le+where")) << profile;
  EXPECT_FALSE(contains(profile, "kernel[cat")) << "the dense blocks' concatenations share a buffer (cat_into_slices)\n"
                                          << profile;
  auto pc = model_c->named_parameters(), pe = model_e->named_parameters();
  ASSERT_EQ(pc.size(), pe.size());
  for (size_t i = 0; i < pc.size(); ++i)
    EXPECT_TRUE(close(pc[i].second, pe[i].second, Tolerance{1e-4, 1e-4}))
        << pc[i].first << " after 2 steps";
  auto bc = model_c->named_buffers(), be = model_e->named_buffers();
  ASSERT_EQ(bc.size(), be.size());
  for (size_t i = 0; i < bc.size(); ++i)
    if (bc[i].second.is_floating_point()) {
      EXPECT_TRUE(close(bc[i].second, be[i].second, Tolerance{1e-4, 1e-4}))
          << bc[i].first << " after 2 steps";
    }
}

TEST_F(KilnBatchNormRelu, DenseNetTrainingStepsMatchEagerChannelsLast) {
  CompileOptions options;
  options.backend = std::string("kiln");
  expect_compiled_training_matches_eager(options);
}

// reduce_overhead: the fused ops write into the static memory plan's buffers (out= calls).
TEST_F(KilnBatchNormRelu, DenseNetTrainingStepsMatchEagerReduceOverhead) {
  CompileOptions options;
  options.backend = std::string("kiln");
  options.mode = Mode::reduce_overhead;
  expect_compiled_training_matches_eager(options);
}

// max_autotune: the static plan plus timed convolution algorithms (Winograd where it wins).
TEST_F(KilnBatchNormRelu, DenseNetTrainingStepsMatchEagerMaxAutotune) {
  CompileOptions options;
  options.backend = std::string("kiln");
  options.mode = Mode::max_autotune;
  expect_compiled_training_matches_eager(options);
}

TEST_F(KilnBatchNormRelu, DenseNetTrainingStepsMatchEagerPlanar) {
  CompileOptions options;
  options.backend = std::string("kiln");
  options.options["layout_optimization"] = false;
  expect_compiled_training_matches_eager(options);
}

}  // namespace
