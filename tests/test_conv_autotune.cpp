// Convolution autotuning (src/kernels/cpu/conv_autotune.h, compile()'s max_autotune on the CPU):
// outside an AutotuneScope (src/kernels/autotune_scope.h) convolutions run the direct plan
// exactly as before and nothing is timed; inside one, float32 3x3/stride-1 convolutions time
// direct against oneDNN's Winograd and (channels-last) Kiln's own per direction and layout, record
// the decision and stay within float32 tolerance of a float64 reference; scopes nest;
// configurations Winograd can't run record nothing; racing threads time a key once; and a
// compiled training step with mode max_autotune goes through the kiln backend and records
// decisions, while the default mode records none.
//
// Tolerance: Winograd F(4,3) rounds differently from the direct kernels (its input and output
// transforms add and subtract terms of several magnitudes). Errors are measured as the largest
// absolute error over the largest reference magnitude of each result (y, dx, dw, db); with
// unit-variance inputs and fan-in scaled weights, direct measured up to 1.4e-6 and Winograd up to
// 1.5e-6 on these shapes (the tests print them as "[ measured ]"); the bound is 1e-5. Kiln's own
// Winograd (winograd_nhwc) uses the classic points 0, +-1, +-2, whose transforms grow values by up
// to 8x: it measured up to 7.8e-6 (DenseNet's 128-channel shape), so its bound is 2e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/autotune_scope.h"
#include "kernels/cpu/conv_autotune.h"
#include "compile_helpers.h"
#include "kernel_cache_dir.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using namespace kiln::testing;  // compile_helpers.h
using cpu::ConvAlgorithm;
using cpu::ConvAutotuneDecision;
using cpu::ConvDirection;
using kernels::AutotuneScope;
using kernels::ConvAutotuneMode;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_conv_autotune");

constexpr double kRelativeTolerance = 1e-5;
constexpr double kKilnWinogradTolerance = 2e-5;

struct ConvParams {
  std::vector<int64_t> stride{1, 1}, padding{1, 1}, dilation{1, 1};
  int64_t groups = 1;
};

struct ConvResult {
  Tensor y, dx, dw, db;
};

// Forward and backward (through autograd: conv2d and convolution_backward) of one convolution.
ConvResult run_conv(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& gy, const ConvParams& p) {
  Tensor xr = x.detach().requires_grad_();
  Tensor wr = w.detach().requires_grad_();
  Tensor br = b.defined() ? b.detach().requires_grad_() : Tensor();
  Tensor y = conv2d(xr, wr, br, p.stride, p.padding, p.dilation, p.groups);
  y.backward(gy);
  return {y.detach(), xr.grad(), wr.grad(), br.defined() ? br.grad() : Tensor()};
}

// The operands of a test convolution: unit-variance input and output gradient, weights scaled by
// 1/sqrt(fan-in) (as nn::Conv2d initializes them), so results are of order one.
struct Operands {
  Tensor x, w, b, gy;
};

Operands make_operands(std::vector<int64_t> x_shape, std::vector<int64_t> w_shape, const ConvParams& p, DType t,
                       bool channels_last) {
  Operands o;
  o.x = randn(x_shape, t);
  const double fan_in = static_cast<double>(w_shape[1] * w_shape[2] * w_shape[3]);
  o.w = randn(w_shape, t) * (1.0 / std::sqrt(fan_in));
  o.b = randn({w_shape[0]}, t);
  Tensor y = conv2d(o.x, o.w, o.b, p.stride, p.padding, p.dilation, p.groups);  // for the output shape
  o.gy = randn(y.sizes().vec(), t);
  if (channels_last) {
    o.x = o.x.contiguous(kiln::channels_last);
    o.gy = o.gy.contiguous(kiln::channels_last);
  }
  return o;
}

ConvResult run_conv(const Operands& o, const ConvParams& p) { return run_conv(o.x, o.w, o.b, o.gy, p); }

ConvResult reference(const Operands& o, const ConvParams& p) {
  return run_conv(o.x.to(kFloat64), o.w.to(kFloat64), o.b.defined() ? o.b.to(kFloat64) : Tensor(), o.gy.to(kFloat64),
                  p);
}

// max |got - want| / max |want|.
double relative_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double err = 0, mag = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    err = std::max(err, std::abs(g[i] - w[i]));
    mag = std::max(mag, std::abs(w[i]));
  }
  return mag > 0 ? err / mag : err;
}

// `tolerance`: kKilnWinogradTolerance where the timed choice may be Kiln's Winograd.
::testing::AssertionResult near_reference(const ConvResult& got, const ConvResult& want, const std::string& what,
                                          double tolerance = kRelativeTolerance) {
  const char* names[4] = {"y", "dx", "dw", "db"};
  const Tensor* g[4] = {&got.y, &got.dx, &got.dw, &got.db};
  const Tensor* w[4] = {&want.y, &want.dx, &want.dw, &want.db};
  std::string measured;
  for (int i = 0; i < 4; ++i) {
    if (!g[i]->defined() || !w[i]->defined())
      return ::testing::AssertionFailure() << what << ": " << names[i] << " undefined";
    if (!(g[i]->sizes() == w[i]->sizes()))
      return ::testing::AssertionFailure() << what << ": " << names[i] << " shape " << shape_str(g[i]->sizes());
    const double e = relative_error(*g[i], *w[i]);
    std::ostringstream text;
    text << " " << names[i] << " " << std::setprecision(2) << std::scientific << e;
    measured += text.str();
    if (!(e <= tolerance))
      return ::testing::AssertionFailure() << what << ": " << names[i] << " relative error " << e << " > "
                                           << tolerance;
  }
  std::cout << "[ measured ] " << what << ":" << measured << "\n";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult bit_identical(const ConvResult& a, const ConvResult& b) {
  const char* names[4] = {"y", "dx", "dw", "db"};
  const Tensor* x[4] = {&a.y, &a.dx, &a.dw, &a.db};
  const Tensor* y[4] = {&b.y, &b.dx, &b.dw, &b.db};
  for (int i = 0; i < 4; ++i) {
    if (x[i]->defined() != y[i]->defined()) return ::testing::AssertionFailure() << names[i] << " defined differs";
    if (x[i]->defined() && !equal(*x[i], *y[i])) return ::testing::AssertionFailure() << names[i] << " differs";
  }
  return ::testing::AssertionSuccess();
}

// The decisions recorded for input shape `input`, output channels `out`, and layout
// `channels_last` (either when unset).
std::vector<ConvAutotuneDecision> decisions_for(std::array<int64_t, 4> input, int64_t out,
                                                std::optional<bool> channels_last) {
  std::vector<ConvAutotuneDecision> found;
  for (const auto& d : cpu::conv_autotune_decisions())
    if (d.input == input && d.weight[0] == out && (!channels_last || d.channels_last == *channels_last))
      found.push_back(d);
  return found;
}

// The directions a float32 3x3 convolution (stride 1) is timed in: all three where oneDNN has
// Winograd (AVX-512); elsewhere only those Kiln's own Winograd runs: channels-last activations,
// and for the forward and backward-weights only without bias.
std::vector<ConvDirection> timed_directions(bool channels_last, bool bias) {
  if (cpu::onednn_winograd_available())
    return {ConvDirection::forward, ConvDirection::backward_data, ConvDirection::backward_weights};
  if (!channels_last) return {};
  if (bias) return {ConvDirection::backward_data};
  return {ConvDirection::forward, ConvDirection::backward_data, ConvDirection::backward_weights};
}

// Each direction of `expected` recorded once, with the timings of the algorithms that can run it,
// and nothing else.
void expect_directions(const std::vector<ConvAutotuneDecision>& found, const std::vector<ConvDirection>& expected) {
  for (ConvDirection dir : {ConvDirection::forward, ConvDirection::backward_data, ConvDirection::backward_weights}) {
    auto n = std::count_if(found.begin(), found.end(), [&](const auto& d) { return d.direction == dir; });
    const bool timed = std::find(expected.begin(), expected.end(), dir) != expected.end();
    EXPECT_EQ(n, timed ? 1 : 0) << cpu::name(dir);
  }
  for (const auto& d : found) {
    EXPECT_GT(d.direct_ms, 0) << d.str();
    if (cpu::onednn_winograd_available()) EXPECT_GT(d.winograd_ms, 0) << d.str();
    else EXPECT_LT(d.winograd_ms, 0) << d.str();
    EXPECT_NE(d.str().find(cpu::name(d.chosen)), std::string::npos) << d.str();
  }
}

class ConvAutotune : public ::testing::Test {
 protected:
  void SetUp() override {
    cpu::clear_conv_autotune_decisions();
    manual_seed(0);
  }
  void TearDown() override { cpu::clear_conv_autotune_decisions(); }
};

// ---------------- outside a scope ----------------

// Eager convolutions time nothing and run the direct plan: the results before any scope, after a
// scope that ran Winograd, and inside a KILN_CONV_AUTOTUNE=0 (inert) scope are bit-identical.
// Scopes nest: each reads KILN_CONV_AUTOTUNE when it opens, the innermost one's mode applies, and
// closing it restores the enclosing one's.
TEST(AutotuneScopes, NestAndRestoreTheEnclosingConvolutionMode) {
  EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
  {
    ScopedEnv timed("KILN_CONV_AUTOTUNE", "1");
    AutotuneScope outer;
    EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::timed);
    {
      ScopedEnv off("KILN_CONV_AUTOTUNE", "0");
      AutotuneScope inner;
      EXPECT_TRUE(kernels::autotune_active());
      EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
      {
        ScopedEnv nhwc("KILN_CONV_AUTOTUNE", "winograd_nhwc");
        AutotuneScope innermost;
        EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::force_winograd_nhwc);
      }
      EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
    }
    EXPECT_TRUE(kernels::autotune_active());
    EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::timed);
    // Another thread has no scope of its own.
    std::thread([] {
      EXPECT_FALSE(kernels::autotune_active());
      EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
    }).join();
  }
  EXPECT_FALSE(kernels::autotune_active());
  EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
}

TEST_F(ConvAutotune, OutsideAScopeNothingIsTimedAndTheDirectPlanRuns) {
  for (bool channels_last : {false, true}) {
    SCOPED_TRACE(channels_last ? "channels_last" : "contiguous");
    const ConvParams p;
    Operands o = make_operands({4, 64, 16, 16}, {32, 64, 3, 3}, p, kFloat32, channels_last);
    EXPECT_FALSE(kernels::autotune_active());
    EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
    ConvResult before = run_conv(o, p);
    EXPECT_TRUE(cpu::conv_autotune_decisions().empty());
    ConvResult winograd;
    {
      ScopedEnv force("KILN_CONV_AUTOTUNE", "winograd");
      AutotuneScope scope;
      EXPECT_TRUE(kernels::autotune_active());
      EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::force_winograd);
      winograd = run_conv(o, p);
    }
    EXPECT_FALSE(kernels::autotune_active());
    EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
    if (cpu::onednn_winograd_available()) {  // elsewhere forcing it warns and runs the timed choice
      EXPECT_FALSE(bit_identical(winograd, before)) << "the forced scope should have run Winograd";
    }
    ConvResult after = run_conv(o, p);
    EXPECT_TRUE(bit_identical(after, before));
    {
      ScopedEnv off("KILN_CONV_AUTOTUNE", "0");
      cpu::clear_conv_autotune_decisions();
      AutotuneScope scope;
      EXPECT_TRUE(kernels::autotune_active()) << "the scope is open; only convolutions stay untimed";
      EXPECT_EQ(kernels::conv_autotune_mode(), ConvAutotuneMode::off);
      EXPECT_TRUE(bit_identical(run_conv(o, p), before));
      EXPECT_TRUE(cpu::conv_autotune_decisions().empty());
    }
  }
}

// ---------------- inside a scope ----------------

// Winograd (forced, wherever oneDNN has it) forward, backward-data and backward-weights in both
// layouts stay within float32 tolerance of float64, and differ from the direct plan's rounding
// (so Winograd really ran).
TEST_F(ConvAutotune, WinogradMatchesFloat64InBothLayouts) {
  if (!cpu::onednn_winograd_available()) GTEST_SKIP() << "oneDNN has no Winograd convolution on this CPU";
  for (int64_t size : {16, 32})
    for (bool channels_last : {false, true}) {
      const std::string what = std::to_string(size) + "x" + std::to_string(size) +
                               (channels_last ? " channels_last" : " contiguous") + " winograd";
      SCOPED_TRACE(what);
      const ConvParams p;
      Operands o = make_operands({4, 64, size, size}, {32, 64, 3, 3}, p, kFloat32, channels_last);
      ConvResult direct = run_conv(o, p);
      ConvResult got;
      {
        ScopedEnv force("KILN_CONV_AUTOTUNE", "winograd");
        AutotuneScope scope;
        got = run_conv(o, p);
      }
      ConvResult want = reference(o, p);
      EXPECT_TRUE(near_reference(got, want, what));
      EXPECT_TRUE(near_reference(direct, want, what.substr(0, what.size() - 9) + " direct"));
      EXPECT_FALSE(equal(got.y, direct.y)) << "forward ran the direct plan";
      EXPECT_FALSE(equal(got.dx, direct.dx)) << "backward-data ran the direct plan";
      EXPECT_FALSE(equal(got.dw, direct.dw)) << "backward-weights ran the direct plan";
      if (channels_last) {
        EXPECT_TRUE(got.y.is_contiguous(kiln::channels_last));
        EXPECT_TRUE(got.dx.is_contiguous(kiln::channels_last));
      }
      expect_directions(decisions_for({4, 64, size, size}, 32, channels_last), timed_directions(channels_last, true));
    }
}

// Kiln's own Winograd (winograd_nhwc, forced): forward, backward-data and backward-weights of
// channels-last convolutions without bias stay within float32 tolerance of float64 on shapes with
// partial tiles, padding 0 to 2, a channels-last (OHWI) weight, one image, few and many channels,
// and differ from the direct plan's rounding (so it ran). It is timed only where it can run:
// channels-last activations, and no bias for the forward and backward-weights.
TEST_F(ConvAutotune, KilnWinogradMatchesFloat64) {
  struct Case {
    std::vector<int64_t> x, w;
    int64_t pad;
    bool weight_channels_last;
  };
  const std::vector<Case> cases = {
      {{4, 64, 16, 16}, {32, 64, 3, 3}, 1, false},
      {{2, 128, 32, 32}, {32, 128, 3, 3}, 1, false},  // DenseNet-121's first block, two images
      {{3, 5, 7, 9}, {6, 5, 3, 3}, 0, false},        // partial tiles, no padding
      {{2, 3, 5, 6}, {17, 3, 3, 3}, 2, true},
      {{1, 32, 13, 3}, {128, 32, 3, 3}, 1, true},
      {{1, 2, 2, 1}, {1, 2, 3, 3}, 1, false},  // one output channel, one column
      {{2, 1024, 9, 7}, {8, 1024, 3, 3}, 1, false},  // wide: blocks of 14 tiles keep its scratch near 2 MB
  };
  for (const Case& c : cases) {
    const std::string what = "input " + shape_str(c.x) + ", weight " + shape_str(c.w) + ", padding " +
                             std::to_string(c.pad) + (c.weight_channels_last ? ", OHWI weight" : "");
    SCOPED_TRACE(what);
    cpu::clear_conv_autotune_decisions();
    ConvParams p;
    p.padding = {c.pad, c.pad};
    Operands o = make_operands(c.x, c.w, p, kFloat32, true);
    o.b = Tensor();
    if (c.weight_channels_last) o.w = o.w.contiguous(kiln::channels_last);
    const ConvResult direct = run_conv(o, p);
    ConvResult got;
    {
      ScopedEnv force("KILN_CONV_AUTOTUNE", "winograd_nhwc");
      AutotuneScope scope;
      got = run_conv(o, p);
    }
    const ConvResult want = reference(o, p);
    EXPECT_LE(relative_error(got.y, want.y), kKilnWinogradTolerance) << "y";
    EXPECT_LE(relative_error(got.dx, want.dx), kKilnWinogradTolerance) << "dx";
    EXPECT_LE(relative_error(got.dw, want.dw), kKilnWinogradTolerance) << "dw";
    std::cout << "[ measured ] winograd_nhwc " << what << ": y " << relative_error(got.y, want.y) << " dx "
              << relative_error(got.dx, want.dx) << " dw " << relative_error(got.dw, want.dw) << "\n";
    EXPECT_TRUE(c.weight_channels_last ? got.dw.is_contiguous(kiln::channels_last) : got.dw.is_contiguous());
    EXPECT_TRUE(got.y.is_contiguous(kiln::channels_last));
    EXPECT_TRUE(got.dx.is_contiguous(kiln::channels_last));
    if (got.y.numel() > 100) {
      EXPECT_FALSE(equal(got.y, direct.y)) << "forward ran the direct plan";
      EXPECT_FALSE(equal(got.dx, direct.dx)) << "backward-data ran the direct plan";
      EXPECT_FALSE(equal(got.dw, direct.dw)) << "backward-weights ran the direct plan";
    }
    const auto found = decisions_for({c.x[0], c.x[1], c.x[2], c.x[3]}, c.w[0], true);
    EXPECT_EQ(found.size(), 3u);
    for (const auto& d : found) EXPECT_GT(d.winograd_nhwc_ms, 0) << d.str();
  }
  // Contiguous activations, and a forward with bias: not timed.
  cpu::clear_conv_autotune_decisions();
  const ConvParams p;
  Operands contiguous = make_operands({2, 16, 8, 8}, {8, 16, 3, 3}, p, kFloat32, false);
  Operands with_bias = make_operands({2, 16, 8, 8}, {8, 16, 3, 3}, p, kFloat32, true);
  {
    AutotuneScope scope;
    run_conv(contiguous, p);
    run_conv(with_bias, p);
  }
  for (const auto& d : decisions_for({2, 16, 8, 8}, 8, false)) EXPECT_LT(d.winograd_nhwc_ms, 0) << d.str();
  for (const auto& d : decisions_for({2, 16, 8, 8}, 8, true))
    if (d.direction != ConvDirection::backward_data) {
      EXPECT_LT(d.winograd_nhwc_ms, 0) << d.str();
    }
}

// The timed choice (whichever won) is within tolerance, and each direction's decision is
// recorded once, with both timings, and reused by later calls.
TEST_F(ConvAutotune, TimedChoiceRecordsEachDirectionAndMatchesFloat64) {
  for (int64_t size : {16, 32})
    for (bool channels_last : {false, true}) {
      const std::string what =
          std::to_string(size) + "x" + std::to_string(size) + (channels_last ? " channels_last" : " contiguous");
      SCOPED_TRACE(what);
      const ConvParams p;
      Operands o = make_operands({4, 64, size, size}, {32, 64, 3, 3}, p, kFloat32, channels_last);
      AutotuneScope scope;
      ConvResult first = run_conv(o, p);
      auto found = decisions_for({4, 64, size, size}, 32, channels_last);
      expect_directions(found, timed_directions(channels_last, /*bias=*/true));
      for (const auto& d : found) std::cout << "[ decision ] " << d.str() << "\n";
      EXPECT_TRUE(near_reference(first, reference(o, p), what + " timed choice", kKilnWinogradTolerance));
      // A second call reuses the decisions (same plans: same bits) and times nothing new.
      const size_t recorded = cpu::conv_autotune_decisions().size();
      EXPECT_TRUE(bit_identical(run_conv(o, p), first));
      EXPECT_EQ(cpu::conv_autotune_decisions().size(), recorded);
    }
}

// A decision holds for the thread count it was timed at: the same convolution at another thread
// count times again (and records that count), and going back reuses the first decision.
TEST_F(ConvAutotune, EachThreadCountTimesItsOwnDecision) {
  const int before = get_num_threads();
  const ConvParams p;
  Operands o = make_operands({4, 64, 16, 16}, {32, 64, 3, 3}, p, kFloat32, /*channels_last=*/true);
  const std::vector<ConvDirection> directions = timed_directions(true, /*bias=*/true);
  auto at_threads = [&](int threads) {
    std::vector<ConvAutotuneDecision> found;
    for (const auto& d : decisions_for({4, 64, 16, 16}, 32, true))
      if (d.threads == threads) found.push_back(d);
    return found;
  };
  {
    AutotuneScope scope;
    set_num_threads(1);
    ConvResult one = run_conv(o, p);
    expect_directions(at_threads(1), directions);
    set_num_threads(2);
    run_conv(o, p);
    expect_directions(at_threads(2), directions);
    for (const auto& d : at_threads(2)) EXPECT_NE(d.str().find(", 2 threads:"), std::string::npos) << d.str();
    const size_t recorded = cpu::conv_autotune_decisions().size();
    EXPECT_EQ(recorded, 2 * directions.size());
    set_num_threads(1);
    EXPECT_TRUE(bit_identical(run_conv(o, p), one));
    EXPECT_EQ(cpu::conv_autotune_decisions().size(), recorded);
  }
  set_num_threads(before);
}

// Configurations oneDNN's Winograd can't run (stride 2, 1x1, dilation 2, groups 2, float64) are
// not timed, record nothing, and compute what they compute outside a scope.
TEST_F(ConvAutotune, ConfigurationsWinogradCantRunRecordNothing) {
  struct Case {
    const char* name;
    ConvParams p;
    std::vector<int64_t> w;
    DType dtype;
  };
  const std::vector<Case> cases = {
      {"stride 2", ConvParams{{2, 2}, {1, 1}, {1, 1}, 1}, {32, 64, 3, 3}, kFloat32},
      {"1x1", ConvParams{{1, 1}, {0, 0}, {1, 1}, 1}, {32, 64, 1, 1}, kFloat32},
      {"dilation 2", ConvParams{{1, 1}, {2, 2}, {2, 2}, 1}, {32, 64, 3, 3}, kFloat32},
      {"groups 2", ConvParams{{1, 1}, {1, 1}, {1, 1}, 2}, {32, 32, 3, 3}, kFloat32},
      {"float64", ConvParams{}, {32, 64, 3, 3}, kFloat64},
  };
  for (const Case& c : cases)
    for (bool channels_last : {false, true}) {
      const std::string what = std::string(c.name) + (channels_last ? " channels_last" : " contiguous");
      SCOPED_TRACE(what);
      Operands o = make_operands({4, 64, 16, 16}, c.w, c.p, c.dtype, channels_last);
      ConvResult outside = run_conv(o, c.p);
      ConvResult inside;
      {
        AutotuneScope scope;
        inside = run_conv(o, c.p);
      }
      EXPECT_TRUE(cpu::conv_autotune_decisions().empty());
      EXPECT_TRUE(bit_identical(inside, outside));
      if (c.dtype == kFloat32) {
        EXPECT_TRUE(near_reference(inside, reference(o, c.p), what));
      }
    }
}

// Two threads meeting a new configuration at once: one decision per direction, and both get
// correct results.
TEST_F(ConvAutotune, RacingThreadsRecordOneDecisionPerDirection) {
  const ConvParams p;
  Operands o = make_operands({4, 64, 16, 16}, {32, 64, 3, 3}, p, kFloat32, true);
  const ConvResult want = reference(o, p);
  ConvResult got[2];
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i)
    threads.emplace_back([&, i] {
      AutotuneScope scope;
      got[i] = run_conv(o, p);
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(near_reference(got[i], want, "thread " + std::to_string(i), kKilnWinogradTolerance));
  expect_directions(decisions_for({4, 64, 16, 16}, 32, true), timed_directions(true, /*bias=*/true));
  EXPECT_TRUE(bit_identical(got[0], got[1])) << "both threads must use the same decisions";
}

// ---------------- compile(..., {.mode = max_autotune}) ----------------

class ConvAutotuneCompile : public CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    cpu::clear_conv_autotune_decisions();
  }
  void TearDown() override {
    cpu::clear_conv_autotune_decisions();
    CompilerTest::TearDown();
  }
};

std::shared_ptr<nn::Sequential> small_conv_net() {
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(8, 32, 3, 1, 1), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Conv2d>(32, 32, 3, 1, 1), std::make_shared<nn::ReLU>());
}

auto forward_backward(std::shared_ptr<nn::Sequential> net) {
  return [net](const Tensor& x) {
    Tensor loss = net->forward(x).pow(2).mean();
    loss.backward();
    return loss;
  };
}

struct TrainingResult {
  Tensor loss;
  std::vector<Tensor> grads;
};

TrainingResult compiled_step(Mode mode, const std::shared_ptr<nn::Sequential>& reference_net, const Tensor& x,
                             compiler::Counters* delta) {
  auto net = small_conv_net();
  net->load_state_dict(reference_net->state_dict());
  auto step = kiln::compile(forward_backward(net), {.backend = std::string("kiln"), .mode = mode});
  Delta d;
  TrainingResult r;
  r.loss = step(x);
  *delta = d.now();
  for (const Tensor& p : net->parameters()) r.grads.push_back(p.grad());
  return r;
}

TEST_F(ConvAutotuneCompile, MaxAutotuneTimesTheConvolutionsOfACompiledTrainingStep) {
  manual_seed(1);
  auto eager_net = small_conv_net();
  Tensor x = randn({4, 8, 16, 16});
  Tensor eager_loss = forward_backward(eager_net)(x);
  ASSERT_TRUE(cpu::conv_autotune_decisions().empty()) << "eager must time nothing";

  compiler::Counters delta;
  TrainingResult got = compiled_step(Mode::max_autotune, eager_net, x, &delta);
  EXPECT_GE(delta.graph_runs, 1);
  EXPECT_GT(delta.kernel_runs, 0) << "generated kernels ran";
  EXPECT_EQ(delta.eager_frames, 0);
  EXPECT_LE(relative_error(got.loss, eager_loss), kRelativeTolerance);
  auto params = eager_net->parameters();
  ASSERT_EQ(got.grads.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(got.grads[i].defined()) << "parameter " << i;
    const double e = relative_error(got.grads[i], params[i].grad());
    std::cout << "[ measured ] compiled max_autotune grad " << i << " relative error " << e << "\n";
    EXPECT_LE(e, kRelativeTolerance) << "parameter " << i;
  }
  // The second convolution (32 -> 32) gets every direction; the first (8 -> 32, its input needs
  // no gradient) forward and backward-weights. The kiln backend runs the second channels-last
  // (the first one's backward sees the NCHW input, so it may run NCHW).
  auto second = decisions_for({4, 32, 16, 16}, 32, true);
  expect_directions(second, timed_directions(true, /*bias=*/true));
  auto first = decisions_for({4, 8, 16, 16}, 32, std::nullopt);
  const bool first_timed = cpu::onednn_winograd_available();  // with bias: Kiln's Winograd can't
  for (ConvDirection dir : {ConvDirection::forward, ConvDirection::backward_weights})
    EXPECT_EQ(std::count_if(first.begin(), first.end(), [&](const auto& d) { return d.direction == dir; }),
              first_timed ? 1 : 0)
        << cpu::name(dir);
  for (const auto& d : cpu::conv_autotune_decisions()) std::cout << "[ decision ] " << d.str() << "\n";

  // The same step with Winograd forced wherever it can run (this small net's timings pick direct)
  // is still within tolerance of eager.
  ScopedEnv force("KILN_CONV_AUTOTUNE", "winograd");
  TrainingResult winograd = compiled_step(Mode::max_autotune, eager_net, x, &delta);
  EXPECT_GE(delta.graph_runs, 1);
  EXPECT_LE(relative_error(winograd.loss, eager_loss), kRelativeTolerance);
  for (size_t i = 0; i < params.size(); ++i) {
    const double e = relative_error(winograd.grads[i], params[i].grad());
    std::cout << "[ measured ] compiled max_autotune, Winograd forced: grad " << i << " relative error " << e << "\n";
    EXPECT_LE(e, kRelativeTolerance) << "parameter " << i;
    if (i % 2 == 0 && cpu::onednn_winograd_available()) {  // the convolution weights' gradients
      EXPECT_FALSE(equal(winograd.grads[i], got.grads[i])) << "Winograd did not run for weight " << i;
    }
  }
}

// Module-style training (`compile(model)`, the loss and backward outside the compiled call): the
// backward graph, compiled when backward first runs, takes the module's max_autotune too, so the
// second convolution's backward-data and backward-weights are timed as in the whole compiled step.
TEST_F(ConvAutotuneCompile, MaxAutotuneTimesTheBackwardConvolutionsOfACompiledModule) {
  manual_seed(1);
  auto eager_net = small_conv_net();
  Tensor x = randn({4, 8, 16, 16});
  Tensor eager_loss = forward_backward(eager_net)(x);
  ASSERT_TRUE(cpu::conv_autotune_decisions().empty());

  auto net = small_conv_net();
  net->load_state_dict(eager_net->state_dict());
  auto model = kiln::compile(net, {.backend = std::string("kiln"), .mode = Mode::max_autotune});
  Delta d;
  Tensor loss = model(x).pow(2).mean();
  loss.backward();
  const compiler::Counters delta = d.now();
  EXPECT_GE(delta.graph_runs, 2) << "the forward and the backward graph";
  EXPECT_EQ(delta.eager_frames, 0);
  EXPECT_LE(relative_error(loss, eager_loss), kRelativeTolerance);
  auto params = eager_net->parameters(), got = net->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_LE(relative_error(got[i].grad(), params[i].grad()), kRelativeTolerance) << "parameter " << i;
  for (const auto& dd : cpu::conv_autotune_decisions()) std::cout << "[ decision ] " << dd.str() << "\n";
  expect_directions(decisions_for({4, 32, 16, 16}, 32, true), timed_directions(true, /*bias=*/true));
}

TEST_F(ConvAutotuneCompile, DefaultModeRecordsNoDecision) {
  manual_seed(1);
  auto eager_net = small_conv_net();
  Tensor x = randn({4, 8, 16, 16});
  Tensor eager_loss = forward_backward(eager_net)(x);
  compiler::Counters delta;
  TrainingResult got = compiled_step(Mode::default_, eager_net, x, &delta);
  EXPECT_GE(delta.graph_runs, 1);
  EXPECT_GT(delta.kernel_runs, 0);
  EXPECT_LE(relative_error(got.loss, eager_loss), kRelativeTolerance);
  EXPECT_TRUE(cpu::conv_autotune_decisions().empty());
  // reduce_overhead does not autotune either.
  got = compiled_step(Mode::reduce_overhead, eager_net, x, &delta);
  EXPECT_GE(delta.graph_runs, 1);
  EXPECT_TRUE(cpu::conv_autotune_decisions().empty());
}

}  // namespace
