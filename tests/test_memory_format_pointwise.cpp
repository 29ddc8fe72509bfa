// Memory formats (channels-last / NHWC): the MemoryFormat API itself (is_contiguous, contiguous,
// to, suggest_memory_format on dense, transposed, sliced, expanded, ambiguous and non-4-D
// tensors), and PyTorch's layout propagation through the pointwise ops (unary, binary, ternary,
// the activations and their backward formulas) and cat: a 4-D result follows its first
// full-shaped, non-expanded operand (cat: all inputs must agree), values equal the contiguous
// path's. Also: broadcasting with a [1, C, 1, 1] operand, mixed and non-dense layouts, in-place
// and out= targets of the other layout, gradients on channels-last inputs, and compile() giving
// the eager layouts.
#include <functional>
#include <string>
#include <vector>

#include "compile_helpers.h"
#include "kiln/compiler.h"
#include "reference.h"

using namespace kiln;
using kiln::testing::grad_ok;
using kiln::testing::matches;
using kiln::testing::op;
using kiln::testing::Tolerance;
using kiln::testing::values;

namespace {

const std::vector<int64_t> kShape = {2, 3, 4, 5};
// Above the CPU loops' grain size, so the parallel split runs too.
const std::vector<int64_t> kLarge = {4, 64, 16, 16};

Tensor cl(const Tensor& t) { return t.contiguous(kiln::channels_last); }

// Distinct float64 values in [lo, hi], scrambled so that neighbours differ (and so a wrong
// element order shows).
Tensor sample(const std::vector<int64_t>& sizes, double lo = -2.0, double hi = 2.0) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[i] = lo + (hi - lo) * static_cast<double>((i * 7919) % n) / static_cast<double>(std::max<int64_t>(n - 1, 1));
  return tensor<double>(v, sizes);
}

// The values a tensor holds, whatever its layout, compared with a reference tensor's.
::testing::AssertionResult same_values(const Tensor& got, const Tensor& want,
                                       Tolerance tol = Tolerance{1e-12, 1e-12}) {
  if (got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << "dtype " << dtype_name(got.dtype()) << " != " << dtype_name(want.dtype());
  return matches(got, want.sizes().vec(), values(want), tol);
}

::testing::AssertionResult channels_last_dense(const Tensor& t) {
  if (t.is_contiguous(kiln::channels_last)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "strides " << shape_str(t.strides()) << " of shape "
                                       << shape_str(t.sizes()) << " are not channels-last";
}

::testing::AssertionResult row_major(const Tensor& t) {
  if (t.is_contiguous()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "strides " << shape_str(t.strides()) << " of shape "
                                       << shape_str(t.sizes()) << " are not row-major";
}

Tensor leaf(Tensor t) {
  t.requires_grad_();
  return t;
}

struct Unary {
  const char* name;
  std::function<Tensor(const Tensor&)> fn;
};

const std::vector<Unary>& unary_ops() {
  static const std::vector<Unary> all = {
      {"neg", [](const Tensor& x) { return neg(x); }},
      {"abs", [](const Tensor& x) { return abs(x); }},
      {"exp", [](const Tensor& x) { return exp(x); }},
      {"log", [](const Tensor& x) { return log(abs(x) + 0.1); }},
      {"sin", [](const Tensor& x) { return sin(x); }},
      {"tanh", [](const Tensor& x) { return tanh(x); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }},
      {"relu", [](const Tensor& x) { return relu(x); }},
      {"gelu", [](const Tensor& x) { return gelu(x); }},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, "tanh"); }},
      {"silu", [](const Tensor& x) { return silu(x); }},
      {"sqrt", [](const Tensor& x) { return sqrt(abs(x)); }},
      {"rsqrt", [](const Tensor& x) { return rsqrt(abs(x) + 0.1); }},
      {"reciprocal", [](const Tensor& x) { return reciprocal(x); }},
      {"erf", [](const Tensor& x) { return erf(x); }},
      {"floor", [](const Tensor& x) { return floor(x); }},
      {"sign", [](const Tensor& x) { return sign(x); }},
      {"isnan", [](const Tensor& x) { return isnan(x); }},
      {"logical_not", [](const Tensor& x) { return logical_not(x); }},
  };
  return all;
}

struct Binary {
  const char* name;
  std::function<Tensor(const Tensor&, const Tensor&)> fn;
};

const std::vector<Binary>& binary_ops() {
  static const std::vector<Binary> all = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b, 2); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(abs(a) + 0.5, b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"atan2", [](const Tensor& a, const Tensor& b) { return atan2(a, b); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); }},
      {"eq", [](const Tensor& a, const Tensor& b) { return eq(a, b); }},
      {"logical_and", [](const Tensor& a, const Tensor& b) { return logical_and(a, b); }},
  };
  return all;
}

}  // namespace

// ---------------- the MemoryFormat API ----------------

TEST(MemoryFormatApi, RowMajorTensorIsContiguousFormat) {
  Tensor x = sample(kShape);
  EXPECT_TRUE(x.is_contiguous());
  EXPECT_TRUE(x.is_contiguous(kiln::contiguous_format));
  EXPECT_FALSE(x.is_contiguous(kiln::channels_last));
  EXPECT_EQ(x.suggest_memory_format(), kiln::contiguous_format);
  EXPECT_TRUE(x.contiguous(kiln::contiguous_format).is_alias_of(x));
  EXPECT_TRUE(x.contiguous(kiln::preserve_format).is_alias_of(x));
}

TEST(MemoryFormatApi, ChannelsLastHasNhwcStridesAndTheSameValues) {
  Tensor x = sample(kShape);
  Tensor y = x.to(kiln::channels_last);
  EXPECT_EQ(y.sizes().vec(), kShape);
  EXPECT_EQ(y.strides().vec(), (std::vector<int64_t>{60, 1, 15, 3}));
  EXPECT_TRUE(y.is_contiguous(kiln::channels_last));
  EXPECT_FALSE(y.is_contiguous());
  EXPECT_EQ(y.suggest_memory_format(), kiln::channels_last);
  EXPECT_TRUE(same_values(y, x));
  // Already channels-last: no copy. Back to row-major: a copy with the same values.
  EXPECT_TRUE(y.contiguous(kiln::channels_last).is_alias_of(y));
  EXPECT_TRUE(y.to(kiln::preserve_format).is_alias_of(y));
  Tensor z = y.contiguous();
  EXPECT_TRUE(row_major(z));
  EXPECT_FALSE(z.is_alias_of(y));
  EXPECT_TRUE(same_values(z, x));
  EXPECT_TRUE(same_values(y.to(kiln::contiguous_format), x));
}

TEST(MemoryFormatApi, PermutedNhwcBufferIsChannelsLast) {
  // PyTorch's other way to make one: an NHWC tensor viewed as NCHW.
  Tensor nhwc = sample({2, 4, 5, 3});
  Tensor x = nhwc.permute({0, 3, 1, 2});
  EXPECT_TRUE(x.is_contiguous(kiln::channels_last));
  EXPECT_EQ(x.suggest_memory_format(), kiln::channels_last);
  EXPECT_TRUE(x.to(kiln::channels_last).is_alias_of(nhwc));
}

TEST(MemoryFormatApi, TransposedAndSlicedTensors) {
  Tensor x = sample(kShape);
  // H and W swapped: neither format.
  Tensor t = x.transpose(2, 3);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_FALSE(t.is_contiguous(kiln::channels_last));
  EXPECT_EQ(t.suggest_memory_format(), kiln::contiguous_format);
  EXPECT_TRUE(same_values(cl(t), t));
  EXPECT_TRUE(channels_last_dense(cl(t)));
  // A slice of a channels-last tensor still orders its dims channels-last, though not dense.
  Tensor y = cl(sample({2, 6, 4, 5}));
  for (Tensor s : {y.narrow(1, 1, 3), y.narrow(3, 0, 2), y.slice(2, 0, 4, 2)}) {
    SCOPED_TRACE(shape_str(s.sizes()));
    EXPECT_FALSE(s.is_contiguous(kiln::channels_last));
    EXPECT_EQ(s.suggest_memory_format(), kiln::channels_last);
    Tensor d = cl(s);
    EXPECT_TRUE(channels_last_dense(d));
    EXPECT_TRUE(same_values(d, s));
  }
}

TEST(MemoryFormatApi, ExpandedTensorSuggestsContiguous) {
  Tensor e = sample({1, 3, 1, 1}).expand(kShape);
  EXPECT_FALSE(e.is_contiguous(kiln::channels_last));
  EXPECT_EQ(e.suggest_memory_format(), kiln::contiguous_format);
  Tensor d = e.to(kiln::channels_last);
  EXPECT_TRUE(channels_last_dense(d));
  EXPECT_TRUE(same_values(d, e));
}

TEST(MemoryFormatApi, OneChannelOrOnePixelIsBothFormatsAndSuggestsContiguous) {
  // Both formats order these elements alike: PyTorch calls them contiguous.
  for (std::vector<int64_t> sizes : {std::vector<int64_t>{2, 1, 4, 5}, std::vector<int64_t>{2, 3, 1, 1}}) {
    SCOPED_TRACE(shape_str(sizes));
    Tensor x = sample(sizes);
    EXPECT_TRUE(x.is_contiguous());
    EXPECT_TRUE(x.is_contiguous(kiln::channels_last));
    EXPECT_EQ(x.suggest_memory_format(), kiln::contiguous_format);
    EXPECT_TRUE(x.to(kiln::channels_last).is_alias_of(x));
  }
}

TEST(MemoryFormatApi, EmptyTensorsConvert) {
  Tensor x = zeros({2, 3, 0, 5});
  Tensor y = x.to(kiln::channels_last);
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{2, 3, 0, 5}));
  EXPECT_TRUE(y.is_contiguous(kiln::channels_last));
  EXPECT_EQ(y.suggest_memory_format(), kiln::contiguous_format);
  EXPECT_EQ(relu(y).numel(), 0);
}

TEST(MemoryFormatApi, NonFourDimensionalTensorsHaveNoChannelsLast) {
  for (std::vector<int64_t> sizes : {std::vector<int64_t>{}, std::vector<int64_t>{6}, std::vector<int64_t>{2, 3, 4},
                                     std::vector<int64_t>{1, 2, 3, 4, 5}}) {
    SCOPED_TRACE(shape_str(sizes));
    Tensor x = zeros(sizes);
    EXPECT_FALSE(x.is_contiguous(kiln::channels_last));
    EXPECT_EQ(x.suggest_memory_format(), kiln::contiguous_format);
    try {
      (void)x.contiguous(kiln::channels_last);
      ADD_FAILURE() << "expected ShapeError";
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find("channels_last needs a 4-D (N, C, H, W) tensor, got " +
                                           std::to_string(sizes.size()) + " dims"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW((void)x.to(kiln::channels_last), ShapeError);
  }
}

TEST(MemoryFormatApi, PreserveIsNotAFormatATensorIsIn) {
  Tensor x = sample(kShape);
  try {
    (void)x.is_contiguous(kiln::preserve_format);
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("[kiln::is_contiguous] preserve_format"), std::string::npos) << e.what();
  }
  EXPECT_STREQ(memory_format_name(kiln::contiguous_format), "contiguous_format");
  EXPECT_STREQ(memory_format_name(kiln::channels_last), "channels_last");
  EXPECT_STREQ(memory_format_name(kiln::preserve_format), "preserve_format");
}

// ---------------- unary ops ----------------

TEST(MemoryFormatPointwise, UnaryOpsKeepChannelsLast) {
  Tensor x = sample(kShape);
  for (const Unary& u : unary_ops()) {
    SCOPED_TRACE(u.name);
    Tensor want = u.fn(x);
    EXPECT_TRUE(row_major(want));
    Tensor got = u.fn(cl(x));
    EXPECT_TRUE(channels_last_dense(got));
    EXPECT_TRUE(same_values(got, want));
  }
}

TEST(MemoryFormatPointwise, UnaryOpsOnLargeFloat32AndHalfTensors) {
  // The parallel split and the float16/bfloat16 opmath path on channels-last operands.
  // The same math element for element, up to the last bit of a vectorized transcendental.
  for (DType t : {kFloat32, kFloat16, kBFloat16}) {
    SCOPED_TRACE(dtype_name(t));
    Tolerance tol = kiln::testing::tolerance_for(t);
    tol = {2 * tol.rtol, 2 * tol.atol};
    Tensor x = sample(kLarge).to(t);
    for (const Unary& u : unary_ops()) {
      SCOPED_TRACE(u.name);
      Tensor got = u.fn(cl(x));
      EXPECT_TRUE(channels_last_dense(got));
      EXPECT_TRUE(same_values(got, u.fn(x), tol));
    }
  }
}

TEST(MemoryFormatPointwise, NonDenseChannelsLastInputGivesDenseChannelsLastResult) {
  Tensor y = cl(sample({2, 6, 4, 5}));
  Tensor s = y.narrow(1, 1, 3);
  Tensor got = exp(s);
  EXPECT_TRUE(channels_last_dense(got));
  EXPECT_TRUE(same_values(got, exp(s.contiguous())));
}

TEST(MemoryFormatPointwise, AmbiguousAndNonFourDimensionalResultsAreRowMajor) {
  EXPECT_TRUE(row_major(relu(cl(sample({2, 1, 4, 5})))));
  EXPECT_TRUE(row_major(relu(cl(sample({2, 3, 1, 1})))));
  // A 3-D tensor with channels fastest stays what it is for views, but results are row-major.
  Tensor t = sample({4, 5, 3}).permute({2, 0, 1});
  Tensor got = sigmoid(t);
  EXPECT_TRUE(row_major(got));
  EXPECT_TRUE(same_values(got, sigmoid(t.contiguous())));
  // Transposed 4-D input: not channels-last either.
  EXPECT_TRUE(row_major(neg(sample(kShape).transpose(2, 3))));
}

// ---------------- binary ops ----------------

TEST(MemoryFormatPointwise, BinaryOpsOnChannelsLastOperands) {
  Tensor a = sample(kShape), b = sample(kShape, 0.5, 3.0);
  for (const Binary& op : binary_ops()) {
    SCOPED_TRACE(op.name);
    Tensor want = op.fn(a, b);
    EXPECT_TRUE(row_major(want));
    Tensor got = op.fn(cl(a), cl(b));
    EXPECT_TRUE(channels_last_dense(got));
    EXPECT_TRUE(same_values(got, want));
  }
}

TEST(MemoryFormatPointwise, IntegerAndBitwiseOpsKeepChannelsLast) {
  Tensor a = (sample(kShape) * 10).to(kInt64), b = (sample(kShape, 1, 9)).to(kInt64);
  Tensor got = bitwise_and(cl(a), cl(b));
  EXPECT_TRUE(channels_last_dense(got));
  EXPECT_TRUE(same_values(got, bitwise_and(a, b), Tolerance{0, 0}));
  Tensor r = remainder(cl(a), cl(b));
  EXPECT_TRUE(channels_last_dense(r));
  EXPECT_TRUE(same_values(r, remainder(a, b), Tolerance{0, 0}));
}

TEST(MemoryFormatPointwise, BroadcastPerChannelOperandFollowsTheFullShapedOne) {
  Tensor x = sample(kShape), bias = sample({1, 3, 1, 1}, 0.5, 1.5), row = sample({5});
  for (const Binary& op : binary_ops()) {
    SCOPED_TRACE(op.name);
    Tensor got = op.fn(cl(x), bias);
    EXPECT_TRUE(channels_last_dense(got));
    EXPECT_TRUE(same_values(got, op.fn(x, bias)));
    // The broadcast operand first: the full-shaped one still decides.
    Tensor flipped = op.fn(bias, cl(x));
    EXPECT_TRUE(channels_last_dense(flipped));
    EXPECT_TRUE(same_values(flipped, op.fn(bias, x)));
    Tensor lower_rank = op.fn(cl(x), row);
    EXPECT_TRUE(channels_last_dense(lower_rank));
    EXPECT_TRUE(same_values(lower_rank, op.fn(x, row)));
  }
  // Host scalars on either side.
  EXPECT_TRUE(channels_last_dense(cl(x) * 2.5));
  EXPECT_TRUE(channels_last_dense(1 - cl(x)));
  EXPECT_TRUE(same_values(1 - cl(x), 1 - x));
  EXPECT_TRUE(channels_last_dense(cl(x) > 0));
}

TEST(MemoryFormatPointwise, MixedLayoutsFollowTheFirstOperand) {
  Tensor a = sample(kShape), b = sample(kShape, -1, 3);
  Tensor ab = cl(a) + b;
  EXPECT_TRUE(channels_last_dense(ab));
  EXPECT_TRUE(same_values(ab, a + b));
  Tensor ba = b + cl(a);
  EXPECT_TRUE(row_major(ba));
  EXPECT_TRUE(same_values(ba, b + a));
  // An expanded operand has no layout of its own: the next full-shaped one decides.
  Tensor e = sample({1, 3, 1, 1}).expand(kShape);
  Tensor eb = e * cl(b);
  EXPECT_TRUE(channels_last_dense(eb));
  EXPECT_TRUE(same_values(eb, e * b));
  // Transposed (neither format) first: row-major.
  Tensor t = sample({2, 3, 5, 4}).transpose(2, 3);
  Tensor tb = t - cl(b);
  EXPECT_TRUE(row_major(tb));
  EXPECT_TRUE(same_values(tb, t.contiguous() - b));
}

TEST(MemoryFormatPointwise, LargeMixedLayoutsAndDtypes) {
  Tensor a = sample(kLarge).to(kFloat32), b = sample(kLarge, -1, 3).to(kFloat32), c = sample(kLarge, 1, 2);
  Tensor want = a * b;
  EXPECT_TRUE(same_values(cl(a) * cl(b), want, Tolerance{0, 0}));
  EXPECT_TRUE(same_values(cl(a) * b, want, Tolerance{0, 0}));
  EXPECT_TRUE(same_values(a * cl(b), want, Tolerance{0, 0}));
  // float32 channels-last * float64 row-major: promoted, converted operand, channels-last out.
  Tensor mixed = cl(a) * c;
  EXPECT_EQ(mixed.dtype(), kFloat64);
  EXPECT_TRUE(channels_last_dense(mixed));
  EXPECT_TRUE(same_values(mixed, a.to(kFloat64) * c));
}

// ---------------- ternary ops ----------------

TEST(MemoryFormatPointwise, TernaryOpsKeepChannelsLast) {
  Tensor x = sample(kShape), y = sample(kShape, -3, 1), z = sample(kShape, 0.5, 2);
  Tensor cond = x > 0.3, bias = sample({1, 3, 1, 1});
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&)> fn;
  };
  const std::vector<Case> cases = {
      {"where", [](const Tensor& c, const Tensor& a, const Tensor& b, const Tensor&) { return where(c, a, b); }},
      {"where scalar", [](const Tensor& c, const Tensor&, const Tensor& b, const Tensor&) { return where(c, 0.5, b); }},
      {"clamp", [](const Tensor&, const Tensor& a, const Tensor&, const Tensor&) { return clamp(a, -0.5, 0.7); }},
      {"clamp tensors", [](const Tensor&, const Tensor& a, const Tensor& b, const Tensor& w) { return clamp(a, b, w); }},
      {"lerp", [](const Tensor&, const Tensor& a, const Tensor& b, const Tensor&) { return lerp(a, b, 0.3); }},
      {"lerp tensor", [](const Tensor&, const Tensor& a, const Tensor& b, const Tensor& w) { return lerp(a, b, w); }},
      {"addcmul", [](const Tensor&, const Tensor& a, const Tensor& b, const Tensor& w) { return addcmul(a, b, w, 0.5); }},
      {"addcdiv", [](const Tensor&, const Tensor& a, const Tensor& b, const Tensor& w) { return addcdiv(a, b, w, 2); }},
      {"masked_fill", [](const Tensor& c, const Tensor& a, const Tensor&, const Tensor&) { return masked_fill(a, c, -1); }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    Tensor want = k.fn(cond, x, y, z);
    EXPECT_TRUE(row_major(want));
    Tensor got = k.fn(cl(cond), cl(x), cl(y), cl(z));
    EXPECT_TRUE(channels_last_dense(got));
    EXPECT_TRUE(same_values(got, want));
  }
  // Per-channel operands broadcast into a channels-last result.
  Tensor w = where(cl(cond), cl(x), bias);
  EXPECT_TRUE(channels_last_dense(w));
  EXPECT_TRUE(same_values(w, where(cond, x, bias)));
  Tensor affine = addcmul(bias, cl(x), bias);
  EXPECT_TRUE(channels_last_dense(affine));
  EXPECT_TRUE(same_values(affine, addcmul(bias, x, bias)));
  // where's condition is its first operand: a row-major condition gives a row-major result.
  Tensor w2 = where(cond, cl(x), cl(y));
  EXPECT_TRUE(row_major(w2));
  EXPECT_TRUE(same_values(w2, where(cond, x, y)));
}

TEST(MemoryFormatPointwise, LargeWhereSelectsOnChannelsLast) {
  Tensor x = sample(kLarge).to(kFloat32), y = sample(kLarge, -1, 1).to(kFloat32);
  Tensor cond = x > y;
  Tensor got = where(cl(cond), cl(x), cl(y));
  EXPECT_TRUE(channels_last_dense(got));
  EXPECT_TRUE(same_values(got, where(cond, x, y), Tolerance{0, 0}));
  Tensor scalar = where(cl(cond), cl(x), 0.0f);
  EXPECT_TRUE(channels_last_dense(scalar));
  EXPECT_TRUE(same_values(scalar, where(cond, x, 0.0f), Tolerance{0, 0}));
}

// ---------------- activations and their backward formulas ----------------

TEST(MemoryFormatPointwise, ActivationGradientsOnChannelsLastInputs) {
  const std::vector<Unary> acts = {
      {"relu", [](const Tensor& x) { return relu(x); }},
      {"gelu", [](const Tensor& x) { return gelu(x); }},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, "tanh"); }},
      {"silu", [](const Tensor& x) { return silu(x); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }},
      {"tanh", [](const Tensor& x) { return tanh(x); }},
      {"erf", [](const Tensor& x) { return erf(x); }},
  };
  Tensor x0 = sample(kShape), g0 = sample(kShape, -1, 1);
  for (const Unary& a : acts) {
    SCOPED_TRACE(a.name);
    Tensor xr = leaf(x0.clone());
    a.fn(xr).backward(g0);
    Tensor xc = leaf(cl(x0));
    Tensor y = a.fn(xc);
    EXPECT_TRUE(channels_last_dense(y));
    // The gradient the backward formula computes (before the leaf stores it) is channels-last.
    Tensor incoming;
    xc.register_hook([&incoming](const Tensor& g) {
      incoming = g;
      return Tensor();
    });
    y.backward(cl(g0));
    ASSERT_TRUE(incoming.defined());
    EXPECT_TRUE(channels_last_dense(incoming));
    EXPECT_TRUE(same_values(incoming, xr.grad()));
    EXPECT_TRUE(same_values(xc.grad(), xr.grad()));
  }
}

TEST(MemoryFormatPointwise, GradcheckOnChannelsLastInputs) {
  Tensor x = sample({2, 3, 3, 2}) * 0.9 + 0.05;  // no element at relu's kink
  Tensor y = sample({2, 3, 3, 2}, 0.5, 1.5), bias = sample({1, 3, 1, 1}, 0.5, 1);
  Tensor cond = x > 0;
  using F = autograd::Function;
  const std::vector<std::pair<const char*, F>> unary = {
      {"relu", [](const TensorList& t) -> TensorList { return {relu(t[0])}; }},
      {"gelu", [](const TensorList& t) -> TensorList { return {gelu(t[0])}; }},
      {"silu", [](const TensorList& t) -> TensorList { return {silu(t[0])}; }},
      {"sigmoid", [](const TensorList& t) -> TensorList { return {sigmoid(t[0])}; }},
  };
  for (const auto& [name, fn] : unary) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(grad_ok(fn, {leaf(cl(x))}));
  }
  const std::vector<std::pair<const char*, F>> ternary = {
      {"mul div", [](const TensorList& t) -> TensorList { return {t[0] * t[1] / t[2]}; }},
      {"add sub", [](const TensorList& t) -> TensorList { return {add(t[0], t[1], 3) - t[2]}; }},
      {"where", [cond](const TensorList& t) -> TensorList { return {where(cl(cond), t[0], t[1] * t[2])}; }},
      {"lerp", [](const TensorList& t) -> TensorList { return {lerp(t[0], t[1], t[2])}; }},
      {"addcmul", [](const TensorList& t) -> TensorList { return {addcmul(t[0], t[1], t[2], 0.5)}; }},
      {"addcdiv", [](const TensorList& t) -> TensorList { return {addcdiv(t[0], t[1], t[2], 2)}; }},
      {"clamp", [](const TensorList& t) -> TensorList { return {clamp(t[0], -0.5, 0.6) * t[1] + t[2]}; }},
  };
  for (const auto& [name, fn] : ternary) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(grad_ok(fn, {leaf(cl(x)), leaf(cl(y)), leaf(bias.clone())}));
    EXPECT_TRUE(grad_ok(fn, {leaf(cl(x)), leaf(y.clone()), leaf(cl(y + 0.25))}));  // mixed layouts
  }
}

// ---------------- in-place ops and out= targets ----------------

TEST(MemoryFormatPointwise, InPlaceOpsKeepTheTargetsLayout) {
  Tensor a = sample(kShape), b = sample(kShape, 0.5, 2), bias = sample({1, 3, 1, 1});
  struct Case {
    const char* name;
    std::function<void(Tensor&, const Tensor&)> apply;
    std::function<Tensor(const Tensor&, const Tensor&)> ref;
  };
  const std::vector<Case> cases = {
      {"add_", [](Tensor& t, const Tensor& o) { t.add_(o, 2); }, [](const Tensor& t, const Tensor& o) { return add(t, o, 2); }},
      {"mul_", [](Tensor& t, const Tensor& o) { t.mul_(o); }, [](const Tensor& t, const Tensor& o) { return t * o; }},
      {"div_", [](Tensor& t, const Tensor& o) { t /= o; }, [](const Tensor& t, const Tensor& o) { return t / o; }},
      {"relu_", [](Tensor& t, const Tensor&) { t.relu_(); }, [](const Tensor& t, const Tensor&) { return relu(t); }},
      {"sigmoid_", [](Tensor& t, const Tensor&) { t.sigmoid_(); }, [](const Tensor& t, const Tensor&) { return sigmoid(t); }},
      {"clamp_", [](Tensor& t, const Tensor&) { t.clamp_(-0.5, 0.5); }, [](const Tensor& t, const Tensor&) { return clamp(t, -0.5, 0.5); }},
      {"lerp_", [](Tensor& t, const Tensor& o) { t.lerp_(o, 0.25); }, [](const Tensor& t, const Tensor& o) { return lerp(t, o, 0.25); }},
      {"addcmul_", [](Tensor& t, const Tensor& o) { t.addcmul_(o, o, 0.5); }, [](const Tensor& t, const Tensor& o) { return addcmul(t, o, o, 0.5); }},
      {"masked_fill_", [](Tensor& t, const Tensor& o) { t.masked_fill_(o > 1, 9); }, [](const Tensor& t, const Tensor& o) { return masked_fill(t, o > 1, 9); }},
      {"copy_", [](Tensor& t, const Tensor& o) { t.copy_(o); }, [](const Tensor&, const Tensor& o) { return o; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    Tensor want = k.ref(a, b);
    // Channels-last target, row-major / channels-last / per-channel operand; and the reverse.
    for (const Tensor& other : {b, cl(b)}) {
      Tensor t = cl(a);
      k.apply(t, other);
      EXPECT_TRUE(channels_last_dense(t));
      EXPECT_TRUE(same_values(t, want));
      Tensor r = a.clone();
      k.apply(r, other);
      EXPECT_TRUE(row_major(r));
      EXPECT_TRUE(same_values(r, want));
    }
  }
  Tensor t = cl(a);
  t.add_(bias);
  EXPECT_TRUE(channels_last_dense(t));
  EXPECT_TRUE(same_values(t, a + bias));
}

TEST(MemoryFormatPointwise, OutTargetsOfAnyLayoutGetTheValues) {
  Tensor a = sample(kShape), b = sample(kShape, 0.5, 2);
  Tensor want = a + b;
  // Row-major, channels-last, and non-dense targets (a window of a bigger buffer, a transpose).
  auto targets = [] {
    return std::vector<Tensor>{zeros(kShape, kFloat64), cl(zeros(kShape, kFloat64)), zeros({2, 3, 6, 7}, kFloat64).narrow(2, 1, 4).narrow(3, 2, 5),
                               cl(zeros({2, 5, 6, 5}, kFloat64)).narrow(1, 1, 3).narrow(2, 1, 4),
                               zeros({2, 3, 5, 4}, kFloat64).transpose(2, 3)};
  };
  for (const Tensor& x : {a, cl(a)}) {
    for (const Tensor& y : {b, cl(b)}) {
      for (Tensor out : targets()) {
        SCOPED_TRACE(shape_str(x.strides()) + " + " + shape_str(y.strides()) + " -> " + shape_str(out.strides()));
        const std::vector<int64_t> strides = out.strides().vec();
        Tensor outs[1] = {out};
        call_op_out(op("add"), {x, y}, {Scalar(1)}, outs);
        EXPECT_EQ(out.strides().vec(), strides);
        EXPECT_TRUE(same_values(out, want));
      }
    }
  }
  // A ternary op and a dtype-converting target.
  Tensor cond = a > 0;
  for (Tensor out : targets()) {
    Tensor outs[1] = {out};
    call_op_out(op("where"), {cl(cond), cl(a), b}, {}, outs);
    EXPECT_TRUE(same_values(out, where(cond, a, b)));
  }
  Tensor f32 = cl(zeros(kShape, kFloat32));
  Tensor outs[1] = {f32};
  call_op_out(op("mul"), {a, cl(b)}, {}, outs);
  EXPECT_TRUE(channels_last_dense(f32));
  EXPECT_TRUE(same_values(f32, (a * b).to(kFloat32), Tolerance{0, 0}));
}

// ---------------- cat ----------------

TEST(MemoryFormatCat, ChannelsLastInputsGiveChannelsLastAlongEveryDim) {
  for (const std::vector<int64_t>& base : {kShape, kLarge}) {
    for (int64_t dim = 0; dim < 4; ++dim) {
      SCOPED_TRACE(shape_str(base) + " dim " + std::to_string(dim));
      std::vector<int64_t> s1 = base, s2 = base, s3 = base;
      s2[dim] = 1;
      s3[dim] = 2;
      Tensor a = sample(s1), b = sample(s2, 5, 6), c = sample(s3, -6, -5);
      Tensor want = cat({a, b, c}, dim);
      EXPECT_TRUE(row_major(want));
      Tensor got = cat({cl(a), cl(b), cl(c)}, dim);
      if (dim == 1) {
        // b has one channel: ambiguous, so it suggests contiguous and the inputs disagree.
        EXPECT_TRUE(row_major(got));
        got = cat({cl(a), cl(c), cl(a)}, dim);
        want = cat({a, c, a}, dim);
      }
      EXPECT_TRUE(channels_last_dense(got));
      EXPECT_TRUE(same_values(got, want));
      EXPECT_TRUE(same_values(cat({cl(a), cl(c)}, dim).to(kFloat32), cat({a, c}, dim).to(kFloat32), Tolerance{0, 0}));
    }
  }
}

TEST(MemoryFormatCat, DisagreeingInputsGiveRowMajor) {
  Tensor a = sample(kShape), b = sample(kShape, 3, 4);
  for (int64_t dim : {0, 1, 3}) {
    SCOPED_TRACE(dim);
    Tensor want = cat({a, b}, dim);
    Tensor ab = cat({cl(a), b}, dim);
    EXPECT_TRUE(row_major(ab));
    EXPECT_TRUE(same_values(ab, want));
    Tensor ba = cat({a, cl(b)}, dim);
    EXPECT_TRUE(row_major(ba));
    EXPECT_TRUE(same_values(ba, want));
  }
}

TEST(MemoryFormatCat, EmptyInputsHaveNoSay) {
  Tensor a = sample(kShape), b = sample(kShape, 3, 4);
  Tensor legacy = zeros({0}, kFloat64);
  Tensor none = zeros({2, 0, 4, 5}, kFloat64);
  Tensor got = cat({legacy, cl(a), none, cl(b)}, 1);
  EXPECT_TRUE(channels_last_dense(got));
  EXPECT_TRUE(same_values(got, cat({a, b}, 1)));
  Tensor all_empty = cat({none, none}, 1);
  EXPECT_EQ(all_empty.numel(), 0);
  EXPECT_TRUE(row_major(all_empty));
}

TEST(MemoryFormatCat, NonDenseAndConvertedInputs) {
  Tensor big = cl(sample({2, 8, 4, 5}));
  Tensor slice = big.narrow(1, 2, 3);  // channels-last order, not dense
  Tensor b = cl(sample(kShape, 3, 4)).to(kFloat32).to(kiln::channels_last);
  Tensor got = cat({slice, b}, 1);
  EXPECT_EQ(got.dtype(), kFloat64);
  EXPECT_TRUE(channels_last_dense(got));
  EXPECT_TRUE(same_values(got, cat({slice.contiguous(), b.contiguous()}, 1)));
  // A transposed input among channels-last ones: neither format, so a row-major result.
  Tensor t = sample({2, 3, 5, 4}).transpose(2, 3);
  Tensor mixed = cat({cl(sample(kShape)), t}, 0);
  EXPECT_TRUE(row_major(mixed));
  EXPECT_TRUE(same_values(mixed, cat({sample(kShape), t.contiguous()}, 0)));
}

TEST(MemoryFormatCat, NonFourDimensionalResultsAreRowMajor) {
  Tensor a = sample({4, 5, 3}).permute({2, 0, 1}), b = sample({4, 5, 2}).permute({2, 0, 1});
  Tensor got = cat({a, b}, 0);
  EXPECT_TRUE(row_major(got));
  EXPECT_TRUE(same_values(got, cat({a.contiguous(), b.contiguous()}, 0)));
}

TEST(MemoryFormatCat, OutTargetsOfAnyLayout) {
  Tensor a = sample(kShape), b = sample({2, 2, 4, 5}, 3, 4);
  Tensor want = cat({a, b}, 1);
  const std::vector<int64_t> shape = {2, 5, 4, 5};
  for (Tensor out : {zeros(shape, kFloat64), cl(zeros(shape, kFloat64)), zeros({2, 5, 6, 5}, kFloat64).narrow(2, 1, 4),
                     cl(zeros({2, 7, 4, 5}, kFloat64)).narrow(1, 1, 5)}) {
    for (bool channels_last_inputs : {false, true}) {
      SCOPED_TRACE(shape_str(out.strides()) + (channels_last_inputs ? " channels-last inputs" : ""));
      Tensor outs[1] = {out};
      Tensor x = channels_last_inputs ? cl(a) : a, y = channels_last_inputs ? cl(b) : b;
      call_op_out(op("cat"), {x, y}, {int64_t{1}}, outs);
      EXPECT_TRUE(same_values(out, want));
    }
  }
}

TEST(MemoryFormatCat, GradientsOnChannelsLastInputs) {
  Tensor a = leaf(cl(sample({2, 3, 3, 2}))), b = leaf(cl(sample({2, 2, 3, 2}, 1, 2)));
  Tensor y = cat({a, b}, 1);
  EXPECT_TRUE(channels_last_dense(y));
  Tensor g = sample({2, 5, 3, 2});
  y.backward(cl(g));
  EXPECT_TRUE(same_values(a.grad(), g.narrow(1, 0, 3)));
  EXPECT_TRUE(same_values(b.grad(), g.narrow(1, 3, 2)));
  autograd::Function fn = [](const TensorList& t) -> TensorList { return {cat({t[0], t[1] * t[1]}, 1).sigmoid()}; };
  EXPECT_TRUE(grad_ok(fn, {leaf(cl(sample({2, 3, 3, 2}))), leaf(cl(sample({2, 2, 3, 2})))}));
  EXPECT_TRUE(grad_ok(fn, {leaf(cl(sample({2, 3, 3, 2}))), leaf(sample({2, 2, 3, 2}))}));
}

// ---------------- compile() ----------------

class MemoryFormatCompile : public kiln::testing::CompilerTest {};

TEST_F(MemoryFormatCompile, CopyToChannelsLastHasTheEagerLayout) {
  auto body = [](const Tensor& x) { return x.contiguous(kiln::channels_last); };
  auto f = kiln::compile(body, {.backend = "eager"});
  Tensor x = sample(kShape);
  kiln::testing::Delta d;
  Tensor got = f(x);
  EXPECT_GE(d.now().graph_runs, 1);
  Tensor want = body(x);
  EXPECT_EQ(got.strides().vec(), want.strides().vec());
  EXPECT_TRUE(channels_last_dense(got));
  EXPECT_TRUE(same_values(got, x));
}

TEST_F(MemoryFormatCompile, PointwiseAndCatHaveTheEagerLayouts) {
  Tensor bias = sample({1, 3, 1, 1});
  auto body = [bias](const Tensor& x, const Tensor& y) {
    Tensor h = relu(x + bias) * 2;
    Tensor s = where(h > 0.5, h, sigmoid(y));
    return cat({s, h, x.to(kiln::channels_last)}, 1);
  };
  for (std::string backend : {"eager", "aot_eager"}) {
    SCOPED_TRACE(backend);
    compiler::reset();
    auto f = kiln::compile(body, {.backend = backend});
    for (bool channels_last_inputs : {true, false}) {
      SCOPED_TRACE(channels_last_inputs);
      Tensor x = sample(kShape), y = sample(kShape, -1, 1);
      if (channels_last_inputs) {
        x = cl(x);
        y = cl(y);
      }
      kiln::testing::Delta d;
      Tensor got = f(x, y);
      EXPECT_GE(d.now().graph_runs, 1);
      Tensor want = body(x, y);
      EXPECT_EQ(got.strides().vec(), want.strides().vec());
      EXPECT_EQ(got.is_contiguous(kiln::channels_last), channels_last_inputs);
      EXPECT_TRUE(same_values(got, want));
    }
  }
}

// ---------------- clone(format), .grad() layout, Module::to(format) ----------------

TEST(MemoryFormatApi, CloneInAFormatAlwaysCopies) {
  Tensor x = randn({2, 3, 4, 5});
  Tensor nhwc = cl(x);
  Tensor a = nhwc.clone(kiln::channels_last);
  EXPECT_TRUE(a.is_contiguous(kiln::channels_last));
  EXPECT_FALSE(a.is_alias_of(nhwc)) << "a clone owns its memory even when the format already matches";
  EXPECT_TRUE(same_values(a, x));
  Tensor p = nhwc.clone(kiln::preserve_format);
  EXPECT_TRUE(p.is_contiguous(kiln::channels_last)) << "preserve keeps channels-last";
  EXPECT_TRUE(x.clone(kiln::preserve_format).is_contiguous()) << "preserve keeps row-major";
  EXPECT_TRUE(nhwc.clone(kiln::contiguous_format).is_contiguous());
  EXPECT_THROW(randn({2, 3}).clone(kiln::channels_last), kiln::ShapeError);
}

TEST(MemoryFormatApi, AccumulatedGradFollowsTheLeafsFormat) {
  Tensor x = cl(randn({2, 3, 4, 5})).requires_grad_();
  (x * 2).sum().backward();  // the incoming gradient is row-major
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().is_contiguous(kiln::channels_last));
  EXPECT_TRUE(same_values(x.grad(), full({2, 3, 4, 5}, 2.0)));
  (x * 3).sum().backward();  // accumulates in place, keeping the layout
  EXPECT_TRUE(x.grad().is_contiguous(kiln::channels_last));
  EXPECT_TRUE(same_values(x.grad(), full({2, 3, 4, 5}, 5.0)));
  Tensor y = randn({2, 3, 4, 5}).requires_grad_();
  (cl(y) * 2).sum().backward();
  EXPECT_TRUE(y.grad().is_contiguous()) << "a row-major leaf gets a row-major gradient";
}

TEST(MemoryFormatApi, ModuleToChannelsLastConvertsFourDimensionalParameters) {
  manual_seed(1);
  nn::Sequential net;
  net.push_back(std::make_shared<nn::Conv2d>(3, 4, 3));
  net.push_back(std::make_shared<nn::BatchNorm2d>(4));
  net.push_back(std::make_shared<nn::Flatten>());
  net.push_back(std::make_shared<nn::Linear>(4 * 4 * 4, 2));
  Tensor x = randn({2, 3, 6, 6});
  Tensor want = net.forward(x);
  net.to(kiln::channels_last);
  for (const auto& [name, p] : net.named_parameters()) {
    if (p.dim() == 4) EXPECT_TRUE(p.is_contiguous(kiln::channels_last)) << name;
    else EXPECT_TRUE(p.is_contiguous()) << name << " (not 4-D: unchanged)";
  }
  EXPECT_TRUE(same_values(net.forward(cl(x)), want, Tolerance{1e-4, 1e-5}));
  net.to(kiln::contiguous_format);
  for (const auto& [name, p] : net.named_parameters()) EXPECT_TRUE(p.is_contiguous()) << name;
}
