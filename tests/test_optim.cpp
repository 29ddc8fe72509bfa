// kiln::optim: optimizer updates against float64 loops implementing PyTorch's formulas,
// zero_grad, state layout, state_dict round trips, schedulers and bad inputs.
#include <gmock/gmock.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <numbers>
#include <random>

#include "kernels/fused_optim.h"
#include "kiln/op_table.h"
#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::Tolerance;
using kiln::testing::values;
using ::testing::HasSubstr;

namespace {

// ---------------- float64 references (PyTorch's _single_tensor_sgd / _single_tensor_adam)
// ----------------

struct SgdReference {
  std::vector<double> p, buf;
  bool has_buf = false;

  void step(std::vector<double> g, const optim::SGDOptions& o) {
    for (size_t i = 0; i < p.size(); ++i) {
      if (o.maximize) g[i] = -g[i];
      if (o.weight_decay != 0) g[i] += o.weight_decay * p[i];
    }
    if (o.momentum != 0) {
      if (!has_buf) {
        buf = g;
        has_buf = true;
      } else {
        for (size_t i = 0; i < p.size(); ++i)
          buf[i] = o.momentum * buf[i] + (1 - o.dampening) * g[i];
      }
      for (size_t i = 0; i < p.size(); ++i) g[i] = o.nesterov ? g[i] + o.momentum * buf[i] : buf[i];
    }
    for (size_t i = 0; i < p.size(); ++i) p[i] -= o.lr * g[i];
  }
};

struct AdamReference {
  std::vector<double> p, m, v, vmax;
  int64_t t = 0;

  template <class Options>
  void step(std::vector<double> g, const Options& o, bool decoupled) {
    const size_t n = p.size();
    if (t == 0) m = v = vmax = std::vector<double>(n, 0.0);
    ++t;
    const double b1 = o.betas[0], b2 = o.betas[1];
    for (size_t i = 0; i < n; ++i) {
      if (o.maximize) g[i] = -g[i];
      if (o.weight_decay != 0) {
        if (decoupled)
          p[i] *= 1 - o.lr * o.weight_decay;
        else
          g[i] += o.weight_decay * p[i];
      }
      m[i] += (1 - b1) * (g[i] - m[i]);  // lerp
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    }
    const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
    const double step_size = o.lr / bc1, bc2_sqrt = std::sqrt(bc2);
    for (size_t i = 0; i < n; ++i) {
      double vv = v[i];
      if (o.amsgrad) vv = vmax[i] = std::max(vmax[i], v[i]);
      p[i] -= step_size * m[i] / (std::sqrt(vv) / bc2_sqrt + o.eps);
    }
  }
};

// Deterministic gradients that change sign and size from step to step (so amsgrad's running
// maximum differs from exp_avg_sq).
std::vector<double> grad_values(int64_t step, size_t n, double salt = 0.0) {
  std::vector<double> g(n);
  const double scale = step % 2 == 0 ? 2.0 : 0.25;
  for (size_t i = 0; i < n; ++i)
    g[i] = scale * std::sin(0.9 * double(i) + 1.7 * double(step) + 0.3 + salt);
  return g;
}

std::vector<double> initial_values(size_t n, double salt = 0.0) {
  std::vector<double> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = std::cos(0.7 * double(i) + salt) - 0.2;
  return p;
}

// A leaf parameter of `dtype` holding `v` (rounded to dtype).
Tensor make_param(const std::vector<double>& v, IntArrayRef sizes, DType dtype) {
  Tensor p = tensor<double>(v, sizes).to(dtype);
  p.requires_grad_();
  return p;
}

// Sets the grad of `p` to `g` (in p's dtype) and returns the values as the optimizer sees them.
std::vector<double> set_grad_values(const Tensor& p, const std::vector<double>& g) {
  Tensor grad = tensor<double>(g, p.sizes()).to(p.dtype());
  p.set_grad(grad);
  return values(grad);
}

Tolerance tolerance(DType dtype) {
  switch (dtype) {
    case kFloat64:
      return {1e-12, 1e-12};
    case kFloat32:
      return {2e-5, 2e-6};
    default:
      return {2e-2, 2e-2};
  }
}

const std::vector<int64_t> kShape = {2, 3};
constexpr size_t kNumel = 6;

// Runs `steps` steps of SGD on one parameter and compares with the reference after each.
void check_sgd(const optim::SGDOptions& o, DType dtype, int steps = 5) {
  Tensor p = make_param(initial_values(kNumel), kShape, dtype);
  SgdReference ref{values(p)};
  optim::SGD opt({p}, o);
  for (int k = 0; k < steps; ++k) {
    ref.step(set_grad_values(p, grad_values(k, kNumel)), o);
    opt.step();
    ASSERT_TRUE(matches(p, kShape, ref.p, tolerance(dtype))) << "after step " << k + 1;
  }
}

template <class Optimizer, class Options>
void check_adam(const Options& o, bool decoupled, DType dtype, int steps = 6) {
  Tensor p = make_param(initial_values(kNumel), kShape, dtype);
  AdamReference ref{values(p)};
  Optimizer opt({p}, o);
  for (int k = 0; k < steps; ++k) {
    ref.step(set_grad_values(p, grad_values(k, kNumel)), o, decoupled);
    opt.step();
    ASSERT_TRUE(matches(p, kShape, ref.p, tolerance(dtype))) << "after step " << k + 1;
  }
}

// ---------------- SGD ----------------

TEST(SGD, PlainStepIsParamMinusLrTimesGrad) {
  for (DType dtype : {kFloat32, kFloat64}) {
    SCOPED_TRACE(dtype_name(dtype));
    check_sgd({.lr = 0.1}, dtype);
  }
}

TEST(SGD, MatchesReferenceForEveryOptionCombination) {
  for (DType dtype : {kFloat32, kFloat64})
    for (double momentum : {0.0, 0.9})
      for (double dampening : {0.0, 0.3})
        for (double weight_decay : {0.0, 0.05})
          for (bool nesterov : {false, true})
            for (bool maximize : {false, true}) {
              if (nesterov && (momentum == 0 || dampening != 0)) continue;
              optim::SGDOptions o{.lr = 0.05,
                                  .momentum = momentum,
                                  .dampening = dampening,
                                  .weight_decay = weight_decay,
                                  .nesterov = nesterov,
                                  .maximize = maximize};
              SCOPED_TRACE(std::string(dtype_name(dtype)) + " momentum " +
                           std::to_string(momentum) + " dampening " + std::to_string(dampening) +
                           " wd " + std::to_string(weight_decay) + " nesterov " +
                           std::to_string(nesterov) + " maximize " + std::to_string(maximize));
              check_sgd(o, dtype);
            }
}

TEST(SGD, FirstMomentumStepUsesTheGradientUndampened) {
  // PyTorch: buf = grad on the first step (dampening not applied), so step 1 is plain SGD.
  Tensor p = make_param({1.0, 2.0}, {2}, kFloat64);
  optim::SGD opt({p}, {.lr = 0.5, .momentum = 0.9, .dampening = 0.5});
  p.set_grad(tensor<double>({1.0, -1.0}));
  opt.step();
  EXPECT_TRUE(matches(p, {2}, {0.5, 2.5}));
  EXPECT_TRUE(matches(opt.state(p).at("momentum_buffer"), {2}, {1.0, -1.0}));
  opt.step();  // buf = 0.9 * buf + 0.5 * grad = (1.4, -1.4)
  EXPECT_TRUE(matches(opt.state(p).at("momentum_buffer"), {2}, {1.4, -1.4}));
  EXPECT_TRUE(matches(p, {2}, {0.5 - 0.7, 2.5 + 0.7}));
}

TEST(SGD, MomentumBufferDoesNotAliasTheGradient) {
  Tensor p = make_param({1.0, 2.0}, {2}, kFloat32);
  optim::SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  Tensor g = tensor<float>({1.f, 1.f});
  p.set_grad(g);
  opt.step();
  EXPECT_FALSE(opt.state(p).at("momentum_buffer").is_alias_of(g));
  g.fill_(5);  // changing the grad later must not change the buffer
  EXPECT_TRUE(matches(opt.state(p).at("momentum_buffer"), {2}, {1.0, 1.0}));
}

TEST(SGD, HalfPrecisionParamsFollowTheReferenceLoosely) {
  check_sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01}, kBFloat16);
  check_sgd({.lr = 0.05, .momentum = 0.9, .nesterov = true}, kFloat16);
}

// ---------------- Adam / AdamW ----------------

TEST(Adam, MatchesReferenceForEveryOptionCombination) {
  for (DType dtype : {kFloat32, kFloat64})
    for (bool amsgrad : {false, true})
      for (double weight_decay : {0.0, 0.1})
        for (bool maximize : {false, true})
          for (auto betas : {std::array<double, 2>{0.9, 0.999}, std::array<double, 2>{0.5, 0.8}}) {
            optim::AdamOptions o{.lr = 0.01,
                                 .betas = betas,
                                 .eps = 1e-8,
                                 .weight_decay = weight_decay,
                                 .amsgrad = amsgrad,
                                 .maximize = maximize};
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " amsgrad " + std::to_string(amsgrad) +
                         " wd " + std::to_string(weight_decay) + " maximize " +
                         std::to_string(maximize) + " beta1 " + std::to_string(betas[0]));
            check_adam<optim::Adam>(o, /*decoupled=*/false, dtype);
          }
}

TEST(Adam, LargeEpsAndZeroBeta1) {
  check_adam<optim::Adam>(optim::AdamOptions{.lr = 0.1, .betas = {0.0, 0.9}, .eps = 0.5}, false,
                          kFloat64);
}

TEST(Adam, HalfPrecisionParamsFollowTheReferenceLoosely) {
  check_adam<optim::Adam>(optim::AdamOptions{.lr = 0.01, .amsgrad = true}, false, kBFloat16, 4);
  check_adam<optim::Adam>(optim::AdamOptions{.lr = 0.01, .weight_decay = 0.1}, false, kFloat16, 4);
}

TEST(Adam, ZeroLearningRateLeavesParamsUnchangedAndFinite) {
  // The end of a cosine schedule sets lr = 0; the update must not divide by it.
  Tensor p = make_param(initial_values(kNumel), kShape, kFloat32);
  std::vector<double> before = values(p);
  optim::Adam opt({p}, {.lr = 0.0, .amsgrad = true});
  for (int k = 0; k < 3; ++k) {
    set_grad_values(p, k == 1 ? std::vector<double>(kNumel, 0.0) : grad_values(k, kNumel));
    opt.step();
  }
  EXPECT_TRUE(matches(p, kShape, before, Tolerance{0, 0}));
}

TEST(Adam, UpdatesANonContiguousParameterThroughItsView) {
  Tensor base = tensor<double>(initial_values(kNumel), {3, 2});
  Tensor p = base.t();  // a strided leaf (its base does not require grad)
  ASSERT_FALSE(p.is_contiguous());
  std::vector<double> start = values(p);
  AdamReference ref{start};
  optim::AdamOptions o{.lr = 0.02, .weight_decay = 0.01, .amsgrad = true};
  optim::Adam opt({p}, o);
  for (int k = 0; k < 4; ++k) {
    ref.step(set_grad_values(p, grad_values(k, kNumel)), o, false);
    opt.step();
  }
  EXPECT_TRUE(matches(p, {2, 3}, ref.p));
  EXPECT_TRUE(matches(base.t(), {2, 3}, ref.p));
}

TEST(AdamW, MatchesReferenceWithDecoupledWeightDecay) {
  for (DType dtype : {kFloat32, kFloat64})
    for (bool amsgrad : {false, true})
      for (double weight_decay : {0.0, 0.01, 0.3})
        for (bool maximize : {false, true}) {
          optim::AdamWOptions o{
              .lr = 0.02, .weight_decay = weight_decay, .amsgrad = amsgrad, .maximize = maximize};
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " amsgrad " + std::to_string(amsgrad) +
                       " wd " + std::to_string(weight_decay) + " maximize " +
                       std::to_string(maximize));
          check_adam<optim::AdamW>(o, /*decoupled=*/true, dtype);
        }
}

// ---------------- the fused update (kernels/fused_optim.h) ----------------

// Whether op_profile_report() has a row for `op` or its in-place form.
bool profiled(const std::string& profile, const std::string& op) {
  return profile.find("\n" + op + " ") != std::string::npos || profile.find("\n" + op + "_ ") != std::string::npos;
}

// One group of many parameters: empty, single elements, several of the fused kernel's chunks
// (16384 elements on the CPU), more than one CUDA launch holds (32), a strided one (which takes the
// per-op update) and, last, one that gets no gradient (left alone).
std::vector<Tensor> many_parameters() {
  std::vector<int64_t> numels = {0, 1, 70000, 16385, 5, 16384};
  for (int i = 0; i < 36; ++i) numels.push_back(7 + 3 * i);
  std::vector<Tensor> params;
  for (size_t i = 0; i < numels.size(); ++i)
    params.push_back(make_param(initial_values(static_cast<size_t>(numels[i]), 0.1 * double(i)), {numels[i]}, kFloat32));
  params.push_back(tensor<double>(initial_values(kNumel, 9.0), {3, 2}).to(kFloat32).t());
  params.push_back(make_param(initial_values(4, 3.0), {4}, kFloat32));
  return params;
}

// Sets step k's gradients of all of many_parameters() but the last; returns their values.
std::vector<std::vector<double>> set_many_grads(const std::vector<Tensor>& params, int k) {
  std::vector<std::vector<double>> grads;
  for (size_t i = 0; i + 1 < params.size(); ++i)
    grads.push_back(set_grad_values(params[i], grad_values(k, static_cast<size_t>(params[i].numel()), 0.3 * double(i))));
  return grads;
}

// Adam or AdamW over many_parameters(): each follows its float64 reference after each of 4 steps.
template <class Optimizer, class Options>
void check_many_parameters(const Options& o, bool decoupled) {
  std::vector<Tensor> params = many_parameters();
  std::vector<AdamReference> refs;
  for (size_t i = 0; i + 1 < params.size(); ++i) refs.push_back(AdamReference{values(params[i])});
  const Tensor unused = params.back();
  const std::vector<double> unused_start = values(unused);
  Optimizer opt(params, o);
  for (int k = 0; k < 4; ++k) {
    const std::vector<std::vector<double>> grads = set_many_grads(params, k);
    for (size_t i = 0; i < refs.size(); ++i) refs[i].step(grads[i], o, decoupled);
    opt.step();
    for (size_t i = 0; i < refs.size(); ++i)
      ASSERT_TRUE(matches(params[i], params[i].sizes().vec(), refs[i].p, tolerance(kFloat32)))
          << "parameter " << i << " after step " << k + 1;
  }
  EXPECT_TRUE(matches(unused, {4}, unused_start, Tolerance{0, 0}));
  EXPECT_FALSE(opt.state(unused).count("step"));
  EXPECT_EQ(opt.state(params[2]).at("step").template item<float>(), 4.0f);
}

TEST(Adam, FusedUpdateOfManyParametersFollowsTheReference) {
  check_many_parameters<optim::Adam>(optim::AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true}, false);
  check_many_parameters<optim::Adam>(optim::AdamOptions{.lr = 0.02, .betas = {0.5, 0.8}, .maximize = true}, false);
}

TEST(AdamW, FusedUpdateOfManyParametersFollowsTheReference) {
  check_many_parameters<optim::AdamW>(optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.05}, true);
  check_many_parameters<optim::AdamW>(optim::AdamWOptions{.lr = 0.01, .amsgrad = true, .maximize = true}, true);
}

// SGD over many_parameters(): every option that changes the fused update's arithmetic, each
// parameter against its float64 reference after each of 4 steps; the momentum buffers start at the
// first step (undampened) and never alias the gradients.
void check_many_sgd_parameters(const optim::SGDOptions& o) {
  std::vector<Tensor> params = many_parameters();
  std::vector<SgdReference> refs;
  for (size_t i = 0; i + 1 < params.size(); ++i) refs.push_back(SgdReference{values(params[i])});
  const Tensor unused = params.back();
  optim::SGD opt(params, o);
  for (int k = 0; k < 4; ++k) {
    const std::vector<std::vector<double>> grads = set_many_grads(params, k);
    for (size_t i = 0; i < refs.size(); ++i) refs[i].step(grads[i], o);
    opt.step();
    for (size_t i = 0; i < refs.size(); ++i) {
      ASSERT_TRUE(matches(params[i], params[i].sizes().vec(), refs[i].p, tolerance(kFloat32)))
          << "parameter " << i << " after step " << k + 1;
      if (o.momentum != 0) {
        const Tensor& buf = opt.state(params[i]).at("momentum_buffer");
        ASSERT_TRUE(matches(buf, params[i].sizes().vec(), refs[i].buf, tolerance(kFloat32))) << "buffer " << i;
        if (params[i].numel() > 0) {
          EXPECT_NE(buf.impl().data(), params[i].grad().impl().data());
        }
      }
    }
  }
  EXPECT_TRUE(opt.state(unused).empty());
}

TEST(SGD, FusedUpdateOfManyParametersFollowsTheReference) {
  check_many_sgd_parameters({.lr = 0.05});
  check_many_sgd_parameters({.lr = 0.05, .momentum = 0.9, .dampening = 0.25, .weight_decay = 0.1});
  check_many_sgd_parameters({.lr = 0.05, .momentum = 0.8, .weight_decay = 0.01, .nesterov = true, .maximize = true});
}

// Dense parameters take the fused kernel (one profiler row, no per-op adds) and are written in
// place (their version moves); a strided gradient sends its parameter to the per-op update, which
// carries on from the buffer the fused step made.
TEST(SGD, DenseParametersTakeTheFusedUpdateAndStridedOnesThePerOpOne) {
  Tensor p = make_param(initial_values(kNumel), kShape, kFloat32);
  Tensor q = make_param(initial_values(kNumel, 1.0), {3, 2}, kFloat32);
  const optim::SGDOptions o{.lr = 0.1, .momentum = 0.9};
  optim::SGD opt({p, q}, o);
  SgdReference ref_p{values(p)}, ref_q{values(q)};
  auto profile_step = [&] {
    reset_op_profile();
    set_op_profiling(true);
    opt.step();
    set_op_profiling(false);
    return op_profile_report();
  };
  ref_p.step(set_grad_values(p, grad_values(0, kNumel)), o);
  ref_q.step(set_grad_values(q, grad_values(1, kNumel)), o);
  const uint64_t before = p.version();
  std::string profile = profile_step();
  EXPECT_FALSE(profiled(profile, "add") || profiled(profile, "mul") || profiled(profile, "clone")) << profile;
  EXPECT_NE(profile.find("\n_fused_sgd_ "), std::string::npos) << profile;
  EXPECT_GT(p.version(), before);
  std::vector<double> g = grad_values(2, kNumel);
  q.set_grad(tensor<double>({g[0], g[2], g[4], g[1], g[3], g[5]}, {2, 3}).to(kFloat32).t());
  ref_q.step(g, o);
  ref_p.step(set_grad_values(p, grad_values(3, kNumel)), o);
  profile = profile_step();
  EXPECT_TRUE(profiled(profile, "add")) << profile;
  EXPECT_TRUE(matches(p, kShape, ref_p.p, tolerance(kFloat32)));
  EXPECT_TRUE(matches(q, {3, 2}, ref_q.p, tolerance(kFloat32)));
}

// Dense parameters take the fused kernels, not the per-op update (whose ops the profiler would
// list); a strided one takes the per-op update.
TEST(Adam, DenseParametersTakeTheFusedUpdateAndStridedOnesThePerOpOne) {
  Tensor p = make_param(initial_values(kNumel), kShape, kFloat32);
  Tensor q = make_param(initial_values(kNumel, 1.0), {3, 2}, kFloat32);
  optim::Adam opt({p, q}, {.lr = 0.01});
  auto profile_step = [&] {
    reset_op_profile();
    set_op_profiling(true);
    opt.step();
    set_op_profiling(false);
    return op_profile_report();
  };
  set_grad_values(p, grad_values(0, kNumel));
  set_grad_values(q, grad_values(1, kNumel));
  std::string profile = profile_step();
  EXPECT_FALSE(profiled(profile, "addcdiv") || profiled(profile, "lerp") || profiled(profile, "addcmul")) << profile;
  EXPECT_NE(profile.find("\n_fused_adam_ "), std::string::npos) << profile;
  // A strided gradient (a parameter's grad may be any layout) sends that parameter to the per-op update.
  q.set_grad(tensor<double>(grad_values(2, kNumel), {2, 3}).to(kFloat32).t());
  profile = profile_step();
  EXPECT_TRUE(profiled(profile, "addcdiv")) << profile;
}

// The fused kernels write the parameters in place as the per-op update does: a graph that saved a
// parameter before the step refuses to run backward after it.
TEST(Adam, FusedStepCountsAsAnInPlaceWriteOfTheParameters) {
  Tensor p = make_param(initial_values(kNumel), kShape, kFloat32);
  optim::Adam opt({p}, {.lr = 0.01});
  Tensor loss = (p * p).sum();
  const uint64_t before = p.version();
  set_grad_values(p, grad_values(0, kNumel));
  opt.step();
  EXPECT_GT(p.version(), before);
  EXPECT_GT(opt.state(p).at("exp_avg").version(), 0u);
  try {
    loss.backward();
    ADD_FAILURE() << "backward ran on a parameter the step changed";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("modified by an in-place operation"));
  }
}

TEST(AdamW, DefaultsMatchPyTorch) {
  Tensor p = make_param({1.0}, {1}, kFloat32);
  optim::AdamW opt({p});
  const auto& o = opt.param_groups()[0].options;
  EXPECT_EQ(o.lr, 1e-3);
  EXPECT_EQ(o.weight_decay, 1e-2);
  EXPECT_EQ(o.betas[0], 0.9);
  EXPECT_EQ(o.betas[1], 0.999);
  EXPECT_EQ(o.eps, 1e-8);
  EXPECT_EQ(optim::Adam({p}).param_groups()[0].options.weight_decay, 0.0);
  EXPECT_EQ(optim::SGD(std::vector<Tensor>{make_param({1.0}, {1}, kFloat32)}).lr(0), 1e-3);
}

// ---------------- state layout, groups, skipping ----------------

TEST(Optimizer, AdamStateIsTensorsWithAFloat32StepCount) {
  Tensor p = make_param(initial_values(kNumel), kShape, kFloat64);
  optim::Adam opt({p}, {.amsgrad = true});
  EXPECT_TRUE(opt.state(p).empty());
  for (int k = 0; k < 3; ++k) {
    set_grad_values(p, grad_values(k, kNumel));
    opt.step();
  }
  const optim::ParamState& st = opt.state(p);
  std::vector<std::string> names;
  for (const auto& [name, _] : st) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"}));
  const Tensor& step = st.at("step");
  EXPECT_EQ(step.dim(), 0);
  EXPECT_EQ(step.dtype(), kFloat32);
  EXPECT_EQ(step.device(), p.device());
  EXPECT_EQ(step.item<double>(), 3.0);
  for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
    EXPECT_EQ(st.at(name).sizes().vec(), kShape) << name;
    EXPECT_EQ(st.at(name).dtype(), kFloat64) << name;
    EXPECT_FALSE(st.at(name).requires_grad()) << name;
  }
}

TEST(Optimizer, SgdWithoutMomentumKeepsNoState) {
  Tensor p = make_param({1.0}, {1}, kFloat32);
  optim::SGD opt({p}, {.lr = 0.1});
  p.set_grad(ones({1}));
  opt.step();
  EXPECT_TRUE(opt.state(p).empty());
  EXPECT_TRUE(opt.state_dict().size() == 7u);  // params + 6 options, no state entries
}

TEST(Optimizer, SkipsParamsWithoutGradAndCountsStepsPerParam) {
  Tensor a = make_param(initial_values(kNumel), kShape, kFloat64);
  Tensor b = make_param(initial_values(kNumel, 1.0), kShape, kFloat64);
  std::vector<double> b_start = values(b);
  optim::AdamOptions o{.lr = 0.05};
  optim::Adam opt({a, b}, o);
  AdamReference ref_a{values(a)}, ref_b{values(b)};
  for (int k = 0; k < 3; ++k) {
    ref_a.step(set_grad_values(a, grad_values(k, kNumel)), o, false);
    opt.step();
  }
  EXPECT_TRUE(matches(b, kShape, b_start, Tolerance{0, 0}));
  EXPECT_TRUE(opt.state(b).empty());
  // b joins later: its own step count starts at 1 (bias corrections of step 1).
  ref_a.step(set_grad_values(a, grad_values(3, kNumel)), o, false);
  ref_b.step(set_grad_values(b, grad_values(3, kNumel, 0.5)), o, false);
  opt.step();
  EXPECT_EQ(opt.state(a).at("step").item<double>(), 4.0);
  EXPECT_EQ(opt.state(b).at("step").item<double>(), 1.0);
  EXPECT_TRUE(matches(a, kShape, ref_a.p));
  EXPECT_TRUE(matches(b, kShape, ref_b.p));
}

TEST(Optimizer, ParamGroupsHaveTheirOwnOptions) {
  Tensor a = make_param({1.0, 2.0}, {2}, kFloat64);
  Tensor b = make_param({3.0, 4.0}, {2}, kFloat64);
  Tensor c = make_param({5.0}, {1}, kFloat64);
  optim::SGD opt({{{a}, {.lr = 0.1}}, {{b}, {.lr = 0.01, .momentum = 0.5}}}, {.lr = 1.0});
  opt.add_param_group({c});  // the defaults: lr 1.0
  ASSERT_EQ(opt.num_param_groups(), 3u);
  EXPECT_EQ(opt.lr(1), 0.01);
  EXPECT_EQ(opt.param_groups()[1].options.momentum, 0.5);
  EXPECT_EQ(opt.lr(2), 1.0);
  EXPECT_EQ(opt.parameters().size(), 3u);
  for (const Tensor& p : opt.parameters()) p.set_grad(ones_like(p));
  opt.step();
  EXPECT_TRUE(matches(a, {2}, {0.9, 1.9}));
  EXPECT_TRUE(matches(b, {2}, {2.99, 3.99}));
  EXPECT_TRUE(matches(c, {1}, {4.0}));
  opt.param_groups()[0].options.lr = 0.5;  // changed between steps, like param_groups[0]['lr']
  opt.step();
  EXPECT_TRUE(matches(a, {2}, {0.4, 1.4}));
}

TEST(Optimizer, ZeroGradSetToNoneDropsTheGradients) {
  Tensor a = make_param({1.0, 2.0}, {2}, kFloat32);
  Tensor b = make_param({3.0}, {1}, kFloat32);
  optim::SGD opt({a, b});
  a.set_grad(ones({2}));  // b has none: zero_grad must cope
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(Optimizer, ZeroGradWithoutSetToNoneZeroesInPlace) {
  Tensor a = make_param({1.0, 2.0}, {2}, kFloat32);
  optim::SGD opt({a});
  Tensor g = tensor<float>({3.f, 4.f});
  a.set_grad(g);
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(a.grad().defined());
  EXPECT_TRUE(matches(a.grad(), {2}, {0.0, 0.0}));
  EXPECT_TRUE(matches(g, {2}, {0.0, 0.0}));  // the same memory, zeroed in place
}

TEST(Optimizer, ZeroGradDetachesAGradThatHasAGraph) {
  Tensor a = make_param({1.0, 2.0}, {2}, kFloat32);
  Tensor w = make_param({2.0, 2.0}, {2}, kFloat32);
  optim::SGD opt({a});
  a.set_grad(w * 3.0);  // a grad that requires grad, as a create_graph backward leaves
  opt.zero_grad(false);
  EXPECT_FALSE(a.grad().requires_grad());
  EXPECT_TRUE(matches(a.grad(), {2}, {0.0, 0.0}));
}

TEST(Optimizer, StepDoesNotRecordAutogradHistory) {
  Tensor p = make_param({1.0, 2.0}, {2}, kFloat32);
  optim::Adam opt({p}, {.weight_decay = 0.1, .maximize = true});
  p.set_grad(ones({2}));
  opt.step();
  EXPECT_TRUE(p.is_leaf());
  EXPECT_TRUE(p.requires_grad());
  for (const auto& [name, t] : opt.state(p)) EXPECT_FALSE(t.requires_grad()) << name;
}

// ---------------- state_dict ----------------

template <class Optimizer, class Options>
void check_round_trip(const Options& o, bool through_file) {
  Tensor a = make_param(initial_values(kNumel), kShape, kFloat32);
  Tensor b = make_param(initial_values(3, 2.0), {3}, kFloat32);
  Optimizer first({a, b}, o);
  for (int k = 0; k < 3; ++k) {
    set_grad_values(a, grad_values(k, kNumel));
    if (k != 1)
      set_grad_values(b, grad_values(k, 3));
    else
      b.set_grad(Tensor());
    first.step();
  }
  NamedTensors sd = first.state_dict();
  if (through_file) {
    std::random_device rd;
    auto path =
        std::filesystem::temp_directory_path() / ("kiln_test_optim_" + std::to_string(::getpid()) +
                                                  "_" + std::to_string(rd()) + ".safetensors");
    save_safetensors(path.string(), sd);
    sd = load_safetensors(path.string());
    std::filesystem::remove(path);
  }
  Tensor a2 = a.detach().clone().requires_grad_();
  Tensor b2 = b.detach().clone().requires_grad_();
  Optimizer second({a2, b2}, Options{.lr = 0.5});
  second.load_state_dict(sd);
  EXPECT_EQ(second.lr(0), o.lr);
  for (const Tensor& p : {a2, b2})
    for (const auto& [name, t] : second.state(p)) {
      EXPECT_FALSE(t.is_alias_of(first.state(p.same(a2) ? a : b).at(name))) << name;
      EXPECT_EQ(t.dtype(), name == "step" ? kFloat32 : p.dtype()) << name;
    }
  for (int k = 3; k < 6; ++k) {
    for (auto [p, q] : {std::pair{a, a2}, std::pair{b, b2}}) {
      Tensor g = tensor<double>(grad_values(k, size_t(p.numel())), p.sizes()).to(p.dtype());
      p.set_grad(g);
      q.set_grad(g.clone());
    }
    first.step();
    second.step();
    ASSERT_TRUE(equal(a, a2)) << "after step " << k + 1;
    ASSERT_TRUE(equal(b, b2)) << "after step " << k + 1;
  }
}

TEST(StateDict, AFreshOptimizerLoadedFromTheStateContinuesIdentically) {
  check_round_trip<optim::Adam>(
      optim::AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true}, false);
  check_round_trip<optim::AdamW>(optim::AdamWOptions{.lr = 0.01, .betas = {0.8, 0.99}}, false);
  check_round_trip<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true},
                               false);
}

TEST(StateDict, SurvivesASafetensorsFile) {
  check_round_trip<optim::Adam>(optim::AdamOptions{.lr = 0.01, .amsgrad = true, .maximize = true},
                                true);
  check_round_trip<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.1},
                               true);
}

TEST(StateDict, NamesFollowPyTorchsLayout) {
  Tensor a = make_param({1.0, 2.0}, {2}, kFloat32);
  Tensor b = make_param({3.0}, {1}, kFloat32);
  optim::Adam opt({{{a}, {.lr = 0.1}}, {{b}, {.lr = 0.2}}});
  b.set_grad(ones({1}));
  opt.step();
  std::vector<std::string> names;
  for (const auto& [name, _] : opt.state_dict()) names.push_back(name);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "state.1.exp_avg", "state.1.exp_avg_sq", "state.1.step", "param_groups.0.params",
                "param_groups.0.lr", "param_groups.0.betas", "param_groups.0.eps",
                "param_groups.0.weight_decay", "param_groups.0.amsgrad", "param_groups.0.maximize",
                "param_groups.1.params", "param_groups.1.lr", "param_groups.1.betas",
                "param_groups.1.eps", "param_groups.1.weight_decay", "param_groups.1.amsgrad",
                "param_groups.1.maximize"}));
  NamedTensors sd = opt.state_dict();
  auto find = [&](const std::string& n) {
    for (auto& [name, t] : sd)
      if (name == n) return t;
    return Tensor();
  };
  EXPECT_EQ(find("param_groups.1.params").to_vector<int64_t>(), std::vector<int64_t>{1});
  EXPECT_EQ(find("param_groups.1.lr").item<double>(), 0.2);
  EXPECT_EQ(find("param_groups.0.betas").to_vector<double>(), (std::vector<double>{0.9, 0.999}));
  EXPECT_EQ(find("param_groups.0.amsgrad").dtype(), kBool);
}

NamedTensors adam_state_after_one_step(Tensor& p) {
  p = make_param({1.0, 2.0}, {2}, kFloat32);
  optim::Adam opt({p}, {.lr = 0.1});
  p.set_grad(ones({2}));
  opt.step();
  return opt.state_dict();
}

NamedTensors with(NamedTensors sd, const std::string& name, Tensor value) {
  for (auto& [n, t] : sd)
    if (n == name) {
      t = value;
      return sd;
    }
  sd.emplace_back(name, value);
  return sd;
}

NamedTensors without(NamedTensors sd, const std::string& name) {
  std::erase_if(sd, [&](const auto& e) { return e.first == name; });
  return sd;
}

TEST(StateDict, MismatchesThrowValueErrorAndChangeNothing) {
  Tensor src;
  NamedTensors sd = adam_state_after_one_step(src);
  Tensor p = make_param({5.0, 6.0}, {2}, kFloat32);
  optim::Adam opt({p}, {.lr = 0.3});
  auto expect_rejected = [&](const NamedTensors& bad, const std::string& message) {
    try {
      opt.load_state_dict(bad);
      ADD_FAILURE() << "no exception; expected " << message;
    } catch (const ValueError& e) {
      EXPECT_THAT(e.what(), HasSubstr(message));
    }
    EXPECT_EQ(opt.lr(0), 0.3);
    EXPECT_TRUE(opt.state(p).empty());
  };
  expect_rejected(with(sd, "param_groups.1.params", tensor<int64_t>({7})),
                  "different number of parameter groups");
  expect_rejected(with(sd, "param_groups.0.params", tensor<int64_t>({0, 1})),
                  "doesn't match the size of optimizer's group");
  expect_rejected(with(sd, "param_groups.0.momentum", scalar_tensor(0.9, kFloat64)),
                  "unexpected key");
  expect_rejected(without(sd, "param_groups.0.eps"), "missing 'param_groups.0.eps'");
  expect_rejected(with(sd, "param_groups.0.lr", scalar_tensor(-1.0, kFloat64)),
                  "Invalid learning rate: -1.0");
  expect_rejected(with(sd, "param_groups.0.betas", tensor<double>({0.9})),
                  "1-D tensor of 2 values");
  expect_rejected(with(sd, "state.0.exp_avg", zeros({3})),
                  "has shape (3) but the parameter has shape (2)");
  expect_rejected(without(sd, "state.0.exp_avg_sq"), "lacks 'exp_avg_sq'");
  expect_rejected(with(sd, "state.0.momentum_buffer", zeros({2})), "keeps no such state");
  expect_rejected(with(sd, "state.4.step", zeros({})), "which no parameter group lists");
  expect_rejected(with(sd, "something", zeros({})), "unexpected key 'something'");

  // SGD's state dict does not fit Adam.
  Tensor q = make_param({1.0, 2.0}, {2}, kFloat32);
  optim::SGD sgd({q}, {.lr = 0.1, .momentum = 0.9});
  q.set_grad(ones({2}));
  sgd.step();
  expect_rejected(sgd.state_dict(), "keeps no such state");
  expect_rejected(without(sgd.state_dict(), "state.0.momentum_buffer"),
                  "unexpected key 'param_groups.0.momentum'");

  opt.load_state_dict(sd);  // the untouched one loads
  EXPECT_EQ(opt.lr(0), 0.1);
  EXPECT_EQ(opt.state(p).at("step").item<double>(), 1.0);
}

// ---------------- schedulers ----------------

optim::SGD make_sgd(std::vector<double> lrs) {
  std::vector<optim::ParamGroup<optim::SGDOptions>> groups;
  for (double lr : lrs) groups.push_back({{make_param({1.0}, {1}, kFloat32)}, {.lr = lr}});
  return optim::SGD(std::move(groups));
}

void expect_lrs(const optim::Optimizer& opt, const optim::LRScheduler& sched,
                const std::vector<double>& expected, int64_t epoch) {
  ASSERT_EQ(sched.get_last_lr().size(), expected.size());
  for (size_t g = 0; g < expected.size(); ++g) {
    EXPECT_NEAR(sched.get_last_lr()[g], expected[g], 1e-12 * std::max(1.0, std::abs(expected[g])))
        << "epoch " << epoch << " group " << g;
    EXPECT_EQ(opt.lr(g), sched.get_last_lr()[g]);
  }
}

TEST(LRScheduler, StepLRDecaysEveryStepSizeEpochs) {
  auto opt = make_sgd({0.1, 0.4});
  optim::StepLR sched(opt, /*step_size=*/3, /*gamma=*/0.5);
  for (int64_t e = 0; e <= 10; ++e) {
    if (e > 0) sched.step();
    EXPECT_EQ(sched.last_epoch(), e);
    double f = std::pow(0.5, double(e / 3));
    expect_lrs(opt, sched, {0.1 * f, 0.4 * f}, e);
  }
}

TEST(LRScheduler, CosineAnnealingMatchesTheClosedFormOverSeveralPeriods) {
  auto opt = make_sgd({0.1, 1.0});
  const int64_t T = 5;
  const double eta_min = 0.01;
  optim::CosineAnnealingLR sched(opt, T, eta_min);
  for (int64_t e = 0; e <= 3 * T + 2; ++e) {
    if (e > 0) sched.step();
    std::vector<double> expected;
    for (double base : {0.1, 1.0})
      expected.push_back(eta_min + (base - eta_min) *
                                       (1 + std::cos(std::numbers::pi * double(e) / double(T))) /
                                       2);
    for (size_t g = 0; g < 2; ++g)
      EXPECT_NEAR(sched.get_last_lr()[g], expected[g], 1e-12) << "epoch " << e << " group " << g;
  }
}

TEST(LRScheduler, CosineAnnealingReachesEtaMinExactlyAtTMax) {
  auto opt = make_sgd({0.1});
  optim::CosineAnnealingLR sched(opt, 4);
  for (int i = 0; i < 4; ++i) sched.step();
  EXPECT_NEAR(opt.lr(0), 0.0, 1e-17);
}

TEST(LRScheduler, LinearLRRampsThenHolds) {
  auto opt = make_sgd({0.2, 0.05});
  const double start = 0.25, end = 1.0;
  const int64_t total = 4;
  optim::LinearLR sched(opt, start, end, total);
  for (int64_t e = 0; e <= 8; ++e) {
    if (e > 0) sched.step();
    double f = start + (end - start) * double(std::min(e, total)) / double(total);
    expect_lrs(opt, sched, {0.2 * f, 0.05 * f}, e);
  }
}

TEST(LRScheduler, LinearLRDecaysWhenEndIsBelowStart) {
  auto opt = make_sgd({1.0});
  optim::LinearLR sched(opt, 1.0, 0.1, 3);
  std::vector<double> expected = {1.0, 0.7, 0.4, 0.1, 0.1};
  for (size_t e = 0; e < expected.size(); ++e) {
    if (e > 0) sched.step();
    expect_lrs(opt, sched, {expected[e]}, int64_t(e));
  }
}

TEST(LRScheduler, ChainedSchedulersComposeLikePyTorch) {
  // LinearLR warm-up and StepLR stepping together; values worked out by hand from PyTorch's
  // recursive forms (StepLR's base is the initial lr 0.1, not the warmed-up 0.05).
  auto opt = make_sgd({0.1});
  optim::LinearLR warmup(opt, 0.5, 1.0, 2);
  optim::StepLR decay(opt, 2, 0.1);
  EXPECT_EQ(decay.base_lrs(), std::vector<double>{0.1});
  EXPECT_NEAR(opt.lr(0), 0.05, 1e-15);
  std::vector<double> expected = {0.075, 0.01, 0.01, 0.001};
  for (double lr : expected) {
    warmup.step();
    decay.step();
    EXPECT_NEAR(opt.lr(0), lr, 1e-15);
  }
}

TEST(LRScheduler, StateDictResumesTheSchedule) {
  auto opt = make_sgd({0.1});
  optim::CosineAnnealingLR sched(opt, 10, 0.001);
  for (int i = 0; i < 4; ++i) sched.step();
  NamedTensors opt_state = opt.state_dict(), sched_state = sched.state_dict();

  auto opt2 = make_sgd({0.7});
  optim::CosineAnnealingLR sched2(opt2, 10, 0.001);
  opt2.load_state_dict(opt_state);
  sched2.load_state_dict(sched_state);
  EXPECT_EQ(opt2.initial_lr(0), std::optional<double>(0.1));
  for (int i = 0; i < 8; ++i) {
    sched.step();
    sched2.step();
    EXPECT_EQ(opt.lr(0), opt2.lr(0)) << i;
  }
}

TEST(LRScheduler, SteersTheOptimizersUpdates) {
  Tensor p = make_param({1.0}, {1}, kFloat64);
  optim::SGD opt({p}, {.lr = 1.0});
  optim::StepLR sched(opt, 1, 0.5);
  double expected = 1.0;
  for (double lr : {1.0, 0.5, 0.25}) {
    p.set_grad(ones({1}, kFloat64));
    opt.step();
    sched.step();
    expected -= lr;
  }
  EXPECT_TRUE(matches(p, {1}, {expected}));
}

// ---------------- bad inputs ----------------

template <class F>
void expect_value_error(F&& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected ValueError with: " << message;
  } catch (const ValueError& e) {
    EXPECT_THAT(e.what(), HasSubstr(message));
  }
}

TEST(OptimizerErrors, InvalidOptionsThrowValueErrorWithPyTorchsMessages) {
  std::vector<Tensor> ps = {make_param({1.0}, {1}, kFloat32)};
  expect_value_error([&] { optim::SGD(ps, {.lr = -1.0}); }, "Invalid learning rate: -1.0");
  expect_value_error([&] { optim::SGD(ps, {.momentum = -0.5}); }, "Invalid momentum value: -0.5");
  expect_value_error([&] { optim::SGD(ps, {.weight_decay = -0.001}); },
                     "Invalid weight_decay value: -0.001");
  expect_value_error([&] { optim::SGD(ps, {.lr = 0.1, .nesterov = true}); },
                     "Nesterov momentum requires a momentum and zero dampening");
  expect_value_error(
      [&] { optim::SGD(ps, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
      "Nesterov momentum requires a momentum and zero dampening");
  expect_value_error([&] { optim::Adam(ps, {.lr = -0.001}); }, "Invalid learning rate: -0.001");
  expect_value_error(
      [&] {
        optim::Adam(ps, {.betas = {1.0, 0.999}});
      },
      "Invalid beta parameter at index 0: 1.0");
  expect_value_error(
      [&] {
        optim::Adam(ps, {.betas = {0.9, -0.1}});
      },
      "Invalid beta parameter at index 1: -0.1");
  expect_value_error(
      [&] {
        optim::AdamW(ps, {.betas = {0.9, 1.5}});
      },
      "Invalid beta parameter at index 1: 1.5");
  expect_value_error([&] { optim::Adam(ps, {.eps = -1e-8}); }, "Invalid epsilon value: -1e-08");
  expect_value_error([&] { optim::AdamW(ps, {.weight_decay = -1}); },
                     "Invalid weight_decay value: -1.0");
  expect_value_error([&] { optim::Adam(ps, {.lr = std::nan("")}); }, "Invalid learning rate: nan");
}

TEST(OptimizerErrors, EmptyParameterListThrowsValueError) {
  expect_value_error([] { optim::SGD(std::vector<Tensor>{}); },
                     "optimizer got an empty parameter list");
  expect_value_error([] { optim::Adam(std::vector<Tensor>{}, {.lr = 0.1}); },
                     "optimizer got an empty parameter list");
  expect_value_error([] { optim::AdamW(std::vector<optim::ParamGroup<optim::AdamWOptions>>{}); },
                     "optimizer got an empty parameter list");
  // Options are checked first, as in PyTorch.
  expect_value_error([] { optim::SGD(std::vector<Tensor>{}, {.lr = -1}); },
                     "Invalid learning rate");
}

TEST(OptimizerErrors, BadParametersAreRejected) {
  Tensor p = make_param({1.0}, {1}, kFloat32);
  expect_value_error([&] { optim::SGD({p, Tensor()}); }, "undefined");
  expect_value_error([&] { optim::SGD({p, p}); }, "duplicate parameters");
  expect_value_error([&] { optim::SGD({p * 2.0}); }, "can't optimize a non-leaf Tensor");
  EXPECT_THROW(optim::SGD({tensor<int64_t>({1, 2})}), DTypeError);

  optim::SGD opt({p});
  expect_value_error([&] { opt.add_param_group({p}); },
                     "some parameters appear in more than one parameter group");
  expect_value_error(
      [&] {
        opt.add_param_group({{make_param({1.0}, {1}, kFloat32)}, {.lr = -2}});
      },
      "Invalid learning rate: -2.0");
  EXPECT_EQ(opt.num_param_groups(), 1u);
  expect_value_error([&] { opt.state(make_param({1.0}, {1}, kFloat32)); },
                     "not a parameter of this optimizer");
  EXPECT_THROW(opt.lr(3), IndexError);
}

TEST(SchedulerErrors, InvalidArgumentsThrowValueError) {
  auto opt = make_sgd({0.1});
  expect_value_error(
      [&] { optim::LinearLR(opt, 0.0); },
      "Starting multiplicative factor expected to be greater than 0 and less or equal to 1");
  expect_value_error([&] { optim::LinearLR(opt, 1.5); }, "Starting multiplicative factor");
  expect_value_error([&] { optim::LinearLR(opt, 0.5, 1.2); },
                     "Ending multiplicative factor expected to be between 0 and 1");
  expect_value_error([&] { optim::StepLR(opt, 0); }, "step_size must be a positive integer");
  expect_value_error([&] { optim::CosineAnnealingLR(opt, 0); }, "T_max must be a positive integer");

  optim::StepLR sched(opt, 2);
  opt.add_param_group({make_param({1.0}, {1}, kFloat32)});
  expect_value_error([&] { sched.step(); },
                     "Create the scheduler after adding every parameter group");
  expect_value_error(
      [&] {
        sched.load_state_dict({{"last_epoch", zeros({})}});
      },
      "must hold last_epoch");
}

}  // namespace

// The fused update ops check their tensor lists before writing anything: a list that is not
// parallel lists of the layout, a state tensor unlike its parameter, a strided tensor, an integer
// parameter or a step counter of another dtype is refused with a message naming the tensor, and
// the parameters keep their values.
TEST(FusedOptimizerOps, RefuseBadTensorListsAndWriteNothing) {
  const kiln::detail::AdamHyper adam{0.1, 0.9, 0.999, 1e-8, 0.0, false, false, false};
  Tensor p = ones({2, 3}), g = ones({2, 3}), m = zeros({2, 3}), v = zeros({2, 3}), step = zeros({});
  auto fused_adam = [&](std::vector<Tensor> tensors) {
    call_op(kiln::detail::fused_adam_op(), std::move(tensors), adam.attrs());
  };
  auto refused = [&](auto&& call, const std::string& message) {
    try {
      call();
      ADD_FAILURE() << "no exception; expected one with: " << message;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(message));
    }
    EXPECT_TRUE(matches(p, {2, 3}, std::vector<double>(6, 1.0), Tolerance{0, 0})) << "nothing written";
  };
  refused([&] { fused_adam({p, g, m, v, step, p}); },
          "[kiln::_fused_adam_] expected 5 lists of equal length (params, grads, exp_avgs, exp_avg_sqs, steps), got 6");
  refused([&] { fused_adam({p, ones({3, 2}), m, v, step}); }, "grads[0] is float32(3, 2) but its parameter is float32(2, 3)");
  refused([&] { fused_adam({p, g, zeros({3, 2}).t(), v, step}); }, "exp_avgs[0] must be contiguous");
  refused([&] { fused_adam({p, g, m, v, zeros({}, kFloat64)}); }, "steps[0] must be a 0-dim float32 step counter");
  refused([&] { fused_adam({p, g, m, v, zeros({1})}); }, "steps[0] must be a 0-dim float32 step counter");
  Tensor ints = ones({2, 3}, kInt64);
  refused([&] { fused_adam({ints, ints, ints, ints, step}); }, "params[0] has dtype int64");
  refused([&] { fused_adam({p, ones({4}, kFloat64), g, m, v, step, step, step, step, step}); }, "params[1] has dtype float64");
  refused([&] { call_op(kiln::detail::fused_adam_op(), {p, g, m, v, step}, {0.1, 0.9}); }, "takes 8 non-tensor arguments");

  const kiln::detail::SgdHyper sgd{0.1, 0.9, 0.0, 0.0, false, false};
  refused([&] { call_op(kiln::detail::fused_sgd_op(), {p, g, m, p}, sgd.attrs({1, 0})); },
          "[kiln::_fused_sgd_] expected 3 lists of equal length (params, grads, momentum_buffers), got 4 tensors");
  refused([&] { call_op(kiln::detail::fused_sgd_op(), {p, g, m}, sgd.attrs({1, 0})); },
          "first holds 2 flags but the list has 1 parameters with momentum buffers");
  refused([&] { call_op(kiln::detail::fused_sgd_op(), {p, g, p}, sgd.attrs({})); },
          "expected 2 lists of equal length (params, grads), got 3 tensors");

  // A good list runs: parameters move, gradients stay.
  fused_adam({p, g, m, v, step});
  EXPECT_EQ(step.item<float>(), 1.0f);
  EXPECT_LT(p.max().item<float>(), 1.0f);
  EXPECT_TRUE(matches(g, {2, 3}, std::vector<double>(6, 1.0), Tolerance{0, 0}));
}

// The options' `fused` (PyTorch's): false takes the per-op update for dense parameters too; true
// takes the fused one, and a parameter that cannot take it (a strided gradient) throws before any
// parameter moves or any state is made.
TEST(Optimizer, FusedOptionChoosesTheUpdate) {
  auto profiled_step = [](optim::Optimizer& opt) {
    reset_op_profile();
    set_op_profiling(true);
    opt.step();
    set_op_profiling(false);
    return op_profile_report();
  };
  Tensor p = make_param(initial_values(kNumel), kShape, kFloat32);
  set_grad_values(p, grad_values(0, kNumel));
  optim::Adam per_op({p}, {.lr = 0.01, .fused = false});
  std::string profile = profiled_step(per_op);
  EXPECT_TRUE(profiled(profile, "addcdiv")) << profile;
  EXPECT_FALSE(profiled(profile, "_fused_adam")) << profile;
  optim::Adam fused({p}, {.lr = 0.01, .fused = true});
  profile = profiled_step(fused);
  EXPECT_TRUE(profiled(profile, "_fused_adam")) << profile;
  EXPECT_FALSE(profiled(profile, "addcdiv")) << profile;

  Tensor q = make_param(initial_values(kNumel, 1.0), {3, 2}, kFloat32);
  q.set_grad(tensor<double>(grad_values(1, kNumel), {2, 3}).to(kFloat32).t());
  const std::vector<double> p_before = values(p), q_before = values(q);
  optim::SGD sgd({p, q}, {.lr = 0.1, .momentum = 0.9, .fused = true});
  try {
    sgd.step();
    ADD_FAILURE() << "a strided gradient took the fused update";
  } catch (const ValueError& e) {
    EXPECT_THAT(e.what(), HasSubstr("[kiln::optim::SGD] fused = true, but parameter 1 of group 0 cannot take the fused update"));
  }
  EXPECT_TRUE(matches(p, kShape, p_before, Tolerance{0, 0}));
  EXPECT_TRUE(matches(q, {3, 2}, q_before, Tolerance{0, 0}));
  EXPECT_FALSE(sgd.state(p).count("momentum_buffer")) << "no unwritten buffer is left in the state";
  optim::AdamW adamw({q}, {.fused = true});
  try {
    adamw.step();
    ADD_FAILURE() << "a strided gradient took the fused update";
  } catch (const ValueError& e) {
    EXPECT_THAT(e.what(), HasSubstr("[kiln::optim::AdamW] fused = true, but parameter 0 of group 0"));
  }
}
