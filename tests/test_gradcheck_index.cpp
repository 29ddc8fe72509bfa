// Derivatives of the indexing, shape and loss ops: autograd::gradcheck (float64 finite
// differences) for every differentiable op, gradgradcheck where the derivative is itself built of
// differentiable ops, direct checks of the backward kernels against hand-computed references
// (including sizes that take the parallel paths), dtypes and in-place forms.
#include <cmath>
#include <numeric>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;
using kiln::testing::grad_ok;
using kiln::testing::gradgrad_ok;
using kiln::testing::op;

namespace {

Tensor rnd(const std::vector<int64_t>& sizes) { return randn(sizes, kFloat64).requires_grad_(); }
Tensor longs(const std::vector<int64_t>& v, const std::vector<int64_t>& sizes) { return tensor<int64_t>(v, sizes); }
Tensor longs(const std::vector<int64_t>& v) { return tensor<int64_t>(v); }

// y * y: makes a linear op's gradient depend on its input, so that gradgradcheck goes through
// the derivative of the op's derivative.
Tensor sq(const Tensor& y) { return y * y; }

}  // namespace

// ---------------- index_select / gather / scatter ----------------

TEST(GradcheckIndex, IndexSelectAccumulatesRepeatedRows) {
  manual_seed(1);
  Tensor x = rnd({4, 3});
  Tensor idx = longs({2, 0, 2, 3});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_select(in[0], 0, idx)}; }, {x}));
  // Non-contiguous input, last dim, int32 index.
  Tensor xt = rnd({3, 4}).t();
  Tensor idx32 = tensor<int32_t>({1, 1, 0});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_select(in[0], -1, idx32)}; }, {xt}));
  // 0-dim self and a 0-dim index.
  Tensor s = rnd({});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_select(in[0], 0, longs({0}))}; }, {s}));
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_select(in[0], 1, longs({2}).view({}))}; },
                      {rnd({2, 3})}));
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(index_select(in[0], 0, idx))}; }, {x}));
}

TEST(GradcheckIndex, IndexSelectGradientValues) {
  Tensor x = zeros({3, 2}, kFloat32).requires_grad_();
  index_select(x, 0, longs({2, 0, 2})).backward(tensor<float>({1, 2, 3, 4, 5, 6}).view({3, 2}));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(x.grad(), {3, 2}, {3, 4, 0, 0, 6, 8}));
}

TEST(GradcheckIndex, Gather) {
  manual_seed(2);
  Tensor x = rnd({3, 4});
  Tensor idx = longs({0, 3, 3, 1, 2, 2}, {3, 2});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{gather(in[0], 1, idx)}; }, {x}));
  // Index smaller than self in the other dim, dim 0, transposed input.
  Tensor xt = rnd({4, 3}).t();
  Tensor idx0 = longs({2, 0, 1, 1}, {2, 2});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{gather(in[0], 0, idx0)}; }, {xt}));
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(gather(in[0], 1, idx))}; }, {x}));
}

TEST(GradcheckIndex, ScatterSrcAndSelf) {
  manual_seed(3);
  Tensor self = rnd({3, 5});
  Tensor src = rnd({3, 4});  // larger than index: its extra elements get zero gradient
  Tensor idx = longs({0, 4, 2, 1, 3, 0}, {2, 3});  // unique per row: the result does not depend on order
  auto fn = [&](const TensorList& in) { return TensorList{scatter(in[0], 1, idx, in[1])}; };
  EXPECT_TRUE(grad_ok(fn, {self, src}));
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(scatter(in[0], 1, idx, in[1]))}; },
                          {self, src}));
  // The unused part of src has zero gradient.
  Tensor s2 = zeros({3, 4}, kFloat64).requires_grad_();
  scatter(zeros({3, 5}, kFloat64), 1, idx, s2).backward(ones({3, 5}, kFloat64));
  EXPECT_TRUE(matches(s2.grad(), {3, 4}, {1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0}));
}

TEST(GradcheckIndex, ScatterValueZeroesTheOverwrittenPositions) {
  manual_seed(4);
  Tensor self = rnd({2, 4});
  Tensor idx = longs({1, 3, 0}, {1, 3});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{scatter(in[0], 1, idx, 2.5)}; }, {self}));
  Tensor x = zeros({2, 4}, kFloat64).requires_grad_();
  scatter(x, 1, idx, 2.5).backward(ones({2, 4}, kFloat64));
  EXPECT_TRUE(matches(x.grad(), {2, 4}, {0, 0, 1, 0, 1, 1, 1, 1}));
}

TEST(GradcheckIndex, ScatterAddWithRepeatedIndices) {
  manual_seed(5);
  Tensor self = rnd({4, 3});
  Tensor src = rnd({3, 3});
  Tensor idx = longs({0, 0, 3, 0, 2, 3}, {2, 3});
  auto fn = [&](const TensorList& in) { return TensorList{scatter_add(in[0], 0, idx, in[1])}; };
  EXPECT_TRUE(grad_ok(fn, {self, src}));
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(scatter_add(in[0], 0, idx, in[1]))}; },
                          {self, src}));
  // 0-dim self, index and src.
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{scatter_add(in[0], 0, longs({0}).view({}), in[1])}; },
                      {rnd({}), rnd({})}));
}

TEST(GradcheckIndex, InPlaceScatterForms) {
  manual_seed(6);
  Tensor x = rnd({3, 4});
  Tensor src = rnd({2, 4});
  Tensor idx = longs({2, 0, 1, 0, 0, 1, 2, 2}, {2, 4});
  Tensor y = x.clone();
  y.scatter_add_(0, idx, src);
  y.scatter_(0, longs({1, 1, 1, 1}, {1, 4}), 7.0);
  Tensor w = randn({3, 4}, kFloat64);
  y.backward(w);
  // x: w with row 1 zeroed (overwritten by the value); src[i][j]: w[idx[i][j]][j] unless that row is 1.
  auto wv = values(w);
  std::vector<double> gx = wv;
  for (int j = 0; j < 4; ++j) gx[4 + j] = 0;
  std::vector<double> gs(8);
  auto iv = idx.to_vector<int64_t>();
  for (int k = 0; k < 8; ++k) gs[k] = iv[k] == 1 ? 0 : wv[iv[k] * 4 + k % 4];
  EXPECT_TRUE(matches(x.grad(), {3, 4}, gx));
  EXPECT_TRUE(matches(src.grad(), {2, 4}, gs));
}

// ---------------- index / index_put ----------------

TEST(GradcheckIndex, AdvancedIndex) {
  manual_seed(7);
  Tensor x = rnd({4, 5});
  Tensor idx = longs({3, 0, 3});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{in[0].index({idx})}; }, {x}));
  // Two broadcast index tensors, adjacent.
  Tensor i0 = longs({0, 3, 3}, {3, 1}), i1 = longs({4, -1}, {1, 2});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{in[0].index({i0, i1})}; }, {x}));
  // Non-adjacent index tensors around a slice, on a non-contiguous input.
  Tensor x3 = rnd({5, 3, 4}).permute({1, 0, 2});  // (3, 5, 4)
  Tensor a = longs({2, 0, 2}), b = longs({1, 3, 1});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{in[0].index({a, Slice(1, 4), b})}; }, {x3}));
  // A boolean mask, and an int followed by a tensor.
  Tensor mask = tensor<bool>({true, false, true, true, false}).view({5});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{in[0].index({Slice(), mask})}; }, {x}));
  Tensor mask2 = tensor<bool>({true, false, false, true, true, false, false, false, true, true, false, true,
                               false, false, false, true, true, false, false, true}).view({4, 5});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{in[0].index({mask2})}; }, {x}));
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{in[0].index({1, idx})}; }, {x}));
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(in[0].index({i0, i1}))}; }, {x}));
}

TEST(GradcheckIndex, IndexPutValuesAndSelf) {
  manual_seed(8);
  Tensor x = rnd({4, 3});
  Tensor v = rnd({2, 3});
  Tensor idx = longs({3, 1});
  auto put = [&](const TensorList& in) { return TensorList{index_put(in[0], {idx}, in[1])}; };
  EXPECT_TRUE(grad_ok(put, {x, v}));
  // Accumulate with repeated indices; values broadcast along the rows (shape (3,) for (3, 3)).
  Tensor rep = longs({0, 2, 0});
  Tensor vb = rnd({3});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_put(in[0], {rep}, in[1], true)}; },
                      {x, vb}));
  // Two index tensors, values of shape (1,).
  Tensor i0 = longs({0, 3}), i1 = longs({2, 0});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_put(in[0], {i0, i1}, in[1])}; },
                      {x, rnd({1})}));
  // A mask with a one-element value that requires grad (not the masked_fill shortcut).
  Tensor mask = tensor<bool>({true, false, true, false});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{index_put(in[0], {mask}, in[1])}; },
                      {x, rnd({1})}));
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(index_put(in[0], {idx}, in[1]))}; },
                          {x, v}));
  EXPECT_TRUE(gradgrad_ok(
      [&](const TensorList& in) { return TensorList{sq(index_put(in[0], {rep}, in[1], true))}; }, {x, vb}));
}

TEST(GradcheckIndex, IndexPutGradientValues) {
  Tensor x = zeros({3, 2}, kFloat32).requires_grad_();
  Tensor v = zeros({3, 2}, kFloat32).requires_grad_();
  Tensor g = tensor<float>({1, 2, 3, 4, 5, 6}).view({3, 2});
  index_put(x, {longs({2, 0, 2})}, v, /*accumulate=*/false).backward(g);
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(x.grad(), {3, 2}, {0, 0, 3, 4, 0, 0}));
  EXPECT_TRUE(matches(v.grad(), {3, 2}, {5, 6, 1, 2, 5, 6}));  // PyTorch: grad.index(indices)
  x.set_grad(Tensor());
  index_put(x, {longs({2, 0, 2})}, v, /*accumulate=*/true).backward(g);
  EXPECT_TRUE(matches(x.grad(), {3, 2}, {1, 2, 3, 4, 5, 6}));
}

TEST(GradcheckIndex, IndexBackwardAccumulatesRepeatedIndicesOnALargeInput) {
  // x[:, idx] with many repeated indices: the accumulation runs bucketed by target row, in
  // parallel over (outer row, target rows).
  manual_seed(23);
  const int64_t A = 3, B = 50, C = 8, N = 5000;
  Tensor idx = randint(0, B, {N});
  for (DType dt : {kFloat32, kBFloat16}) {
    Tensor x = randn({A, B, C}, dt).requires_grad_();
    Tensor g = randn({A, N, C}, dt);
    x.index({Slice(), idx}).backward(g);
    auto gv = values(g);
    auto iv = idx.to_vector<int64_t>();
    std::vector<double> ref(A * B * C, 0.0);
    for (int64_t a = 0; a < A; ++a)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) ref[(a * B + iv[n]) * C + c] += gv[(a * N + n) * C + c];
    kiln::testing::Tolerance tol = dt == kBFloat16 ? kiln::testing::Tolerance{1e-2, 1e-1} : kiln::testing::Tolerance{1e-5, 1e-4};
    EXPECT_EQ(x.grad().dtype(), dt);
    EXPECT_TRUE(matches(x.grad(), {A, B, C}, ref, tol)) << dtype_name(dt);
  }
}

TEST(GradcheckIndex, InPlaceIndexPutThroughTensorIndex) {
  manual_seed(9);
  Tensor x = rnd({4, 3});
  Tensor v = rnd({2, 3});
  Tensor y = x.clone();
  y.index_put_({longs({1, 3})}, v);
  // A sole mask (PyTorch takes a merged view of self for it; autograd must still see self).
  Tensor mask = tensor<bool>({true, false, false, true, false, true, false, false, false, false, false, true}).view({4, 3});
  Tensor s = rnd({1});
  y.index_put_({mask}, s);
  Tensor w = randn({4, 3}, kFloat64);
  y.backward(w);
  auto wv = values(w);
  auto mv = mask.to_vector<bool>();
  std::vector<double> gx(12), gv(6);
  double gs = 0;
  for (int i = 0; i < 12; ++i) {
    bool overwritten = i / 3 == 1 || i / 3 == 3 || mv[i];
    gx[i] = overwritten ? 0 : wv[i];
    if (mv[i]) gs += wv[i];
  }
  for (int j = 0; j < 3; ++j) {
    gv[j] = mv[3 + j] ? 0 : wv[3 + j];
    gv[3 + j] = mv[9 + j] ? 0 : wv[9 + j];
  }
  EXPECT_TRUE(matches(x.grad(), {4, 3}, gx));
  EXPECT_TRUE(matches(v.grad(), {2, 3}, gv));
  EXPECT_TRUE(matches(s.grad(), {1}, {gs}));
}

// ---------------- embedding ----------------

TEST(GradcheckIndex, EmbeddingHonoursPaddingIdx) {
  manual_seed(10);
  Tensor w = rnd({6, 3});
  Tensor idx = longs({1, 4, 4, 0, 5, 1, 4, 2}, {2, 4});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{embedding(in[0], idx)}; }, {w}));
  // With padding_idx the padding row gets no gradient although the output reads it (PyTorch's
  // convention), so a finite-difference check only holds for the other rows: checked below by value.
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(embedding(in[0], idx, -2))}; }, {w}));
  Tensor wf = randn({6, 3}, kFloat32).requires_grad_();
  embedding(wf, idx, 4).backward(ones({2, 4, 3}, kFloat32));
  EXPECT_EQ(wf.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(wf.grad(), {6, 3}, {1, 1, 1, 2, 2, 2, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1}));
  // int32 indices, and a negative padding_idx counted from the end.
  Tensor w2 = zeros({6, 3}, kFloat64).requires_grad_();
  embedding(w2, idx.to(kInt32), -1).backward(ones({2, 4, 3}, kFloat64));
  EXPECT_TRUE(matches(w2.grad(), {6, 3}, {1, 1, 1, 2, 2, 2, 1, 1, 1, 0, 0, 0, 3, 3, 3, 0, 0, 0}));
}

TEST(GradcheckIndex, EmbeddingBackwardMatchesAReferenceOnALargeBatch) {
  // Sizes that take the parallel path, with a skewed index distribution (one very frequent row).
  manual_seed(11);
  const int64_t V = 700, D = 96, N = 6000;
  Tensor idx = randint(0, V, {N});
  idx.index_put_({Slice(0, N, 3)}, 5);  // a third of the positions hit row 5
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    Tensor w = randn({V, D}, dt).requires_grad_();
    Tensor g = randn({N, D}, dt);
    embedding(w, idx, 7).backward(g);
    auto gv = values(g);
    auto iv = idx.to_vector<int64_t>();
    std::vector<double> ref(V * D, 0.0);
    for (int64_t n = 0; n < N; ++n)
      if (iv[n] != 7)
        for (int64_t d = 0; d < D; ++d) ref[iv[n] * D + d] += gv[n * D + d];
    kiln::testing::Tolerance tol = dt == kBFloat16 ? kiln::testing::Tolerance{1e-2, 5e-2} : kiln::testing::Tolerance{1e-5, 1e-4};
    EXPECT_TRUE(matches(w.grad(), {V, D}, ref, tol)) << dtype_name(dt);
  }
}

TEST(GradcheckIndex, EmbeddingDenseBackwardOpScalesByFrequency) {
  manual_seed(12);
  Tensor idx = longs({2, 0, 2, 2, 1});
  Tensor g = rnd({5, 2});
  const OpDef& bw = op("embedding_dense_backward");
  Tensor r = call_op1(bw, {g, idx}, {int64_t{4}, int64_t{1}, true});
  auto gv = values(g);
  std::vector<double> ref(8, 0.0);
  for (int n = 0; n < 5; ++n) {
    int64_t i = idx.to_vector<int64_t>()[n];
    if (i == 1) continue;
    double count = i == 2 ? 3 : 1;
    for (int d = 0; d < 2; ++d) ref[i * 2 + d] += gv[n * 2 + d] / count;
  }
  EXPECT_TRUE(matches(r, {4, 2}, ref));
  // The backward op's own derivative (double backward of embedding), with and without scaling.
  for (bool scale : {false, true}) {
    EXPECT_TRUE(grad_ok([&](const TensorList& in) {
      return TensorList{call_op1(bw, {in[0], idx}, {int64_t{4}, int64_t{1}, scale})};
    }, {g})) << scale;
  }
  EXPECT_THROW(call_op1(bw, {g, longs({0, 1, 4, 0, 0})}, {int64_t{4}, int64_t{-1}, false}), IndexError);
  EXPECT_THROW(call_op1(bw, {g, longs({0, 1})}, {int64_t{4}, int64_t{-1}, false}), ShapeError);
}

TEST(GradcheckIndex, OneHotOutputIsNotDifferentiable) {
  Tensor r = one_hot(longs({0, 2}), 3);
  EXPECT_FALSE(r.requires_grad());
}

// ---------------- cat / stack / split / chunk ----------------

TEST(GradcheckIndex, Cat) {
  manual_seed(13);
  Tensor a = rnd({2, 3}), b = rnd({4, 3}), c = rnd({1, 3});
  auto fn = [](const TensorList& in) { return TensorList{cat(in, 0)}; };
  EXPECT_TRUE(grad_ok(fn, {a, b, c}));
  // Along the last dim, a transposed input, and a legacy empty (0,) tensor that takes no part.
  Tensor d = rnd({3, 2}).t();  // (2, 3)
  Tensor e = randn({0}, kFloat64).requires_grad_();
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{cat(in, -1)}; }, {rnd({2, 2}), d, e}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{sq(cat(in, 1))}; }, {rnd({2, 1}), d}));
}

TEST(GradcheckIndex, CatOfMixedDtypesGivesEachInputItsDtype) {
  Tensor a = ones({2}, kFloat32).requires_grad_();
  Tensor b = ones({3}, kFloat64).requires_grad_();
  Tensor r = cat({a, b});
  EXPECT_EQ(r.dtype(), kFloat64);
  r.backward(tensor<double>({1, 2, 3, 4, 5}));
  EXPECT_EQ(a.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(a.grad(), {2}, {1, 2}));
  EXPECT_TRUE(matches(b.grad(), {3}, {3, 4, 5}));
}

TEST(GradcheckIndex, StackSplitChunk) {
  manual_seed(14);
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{stack(in, 1)}; }, {rnd({2, 3}), rnd({2, 3})}));
  // split and chunk return views of the input: cloned, so that gradcheck's perturbed evaluations
  // do not alias the input it restores.
  auto cloned = [](TensorList ts) {
    for (Tensor& t : ts) t = t.clone();
    return ts;
  };
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return cloned(split(in[0], 2, 1)); }, {rnd({2, 5})}));
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return cloned(split(in[0], std::vector<int64_t>{1, 3}, 0)); },
                      {rnd({4, 2})}));
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return cloned(chunk(in[0], 3, -1)); }, {rnd({2, 7})}));
  // Using only some of the outputs: the others contribute zeros.
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return cloned({chunk(in[0], 2, 0)[1]}); }, {rnd({4, 2})}));
}

// ---------------- padding ----------------

TEST(GradcheckIndex, ConstantPadWithPositiveAndNegativePads) {
  manual_seed(15);
  Tensor x = rnd({2, 3, 4});
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pad(in[0], {1, 2, 0, 1}, "constant", 2.5)}; }, {x}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pad(in[0], {-1, 2, 1, -2, 0, 1})}; }, {x}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pad(in[0], {-2, -1})}; }, {x.transpose(1, 2)}));
  EXPECT_TRUE(gradgrad_ok([](const TensorList& in) { return TensorList{sq(pad(in[0], {-1, 2, 1, 0}))}; }, {x}));
}

TEST(GradcheckIndex, ReflectionAndReplicationPads) {
  manual_seed(16);
  for (const char* mode : {"reflect", "replicate"}) {
    SCOPED_TRACE(mode);
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{pad(in[0], {2, 1}, mode)}; }, {rnd({2, 4})}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{pad(in[0], {1, 2, 2, 1}, mode)}; },
                        {rnd({1, 2, 3, 3})}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{pad(in[0], {1, 0, 1, 1, 0, 1}, mode)}; },
                        {rnd({2, 2, 2, 3}).transpose(1, 3)}));  // (2, 3, 2, 2): 3-D pad, non-contiguous
    EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{sq(pad(in[0], {1, 2, 2, 1}, mode))}; },
                            {rnd({2, 3, 3})}));
  }
  // Negative padding (crop) on one side.
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pad(in[0], {-1, 3}, "replicate")}; }, {rnd({1, 4})}));
  EXPECT_TRUE(grad_ok([](const TensorList& in) { return TensorList{pad(in[0], {2, -1}, "reflect")}; }, {rnd({1, 4})}));
}

TEST(GradcheckIndex, ReplicationPadBackwardValues) {
  // Edges of replicate padding collect the gradient of every copy.
  Tensor x = zeros({1, 3}, kFloat32).requires_grad_();
  pad(x, {2, 1}, "replicate").backward(tensor<float>({1, 2, 3, 4, 5, 6}).view({1, 6}));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(x.grad(), {1, 3}, {6, 4, 11}));
  Tensor y = zeros({1, 3}, kFloat64).requires_grad_();
  pad(y, {2, 2}, "reflect").backward(tensor<double>({1, 2, 3, 4, 5, 6, 7}).view({1, 7}));
  // out = [x2, x1, x0, x1, x2, x1, x0]
  EXPECT_TRUE(matches(y.grad(), {1, 3}, {3 + 7, 2 + 4 + 6, 1 + 5}));
}

// ---------------- losses ----------------

TEST(GradcheckIndex, NllLossAllReductionsWeightsAndIgnoreIndex) {
  manual_seed(17);
  Tensor x = rnd({4, 3});
  Tensor t = longs({2, 0, 1, 2});
  Tensor w = rand({3}, kFloat64) + 0.5;
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    SCOPED_TRACE(static_cast<int>(r));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{nll_loss(in[0], t, Tensor(), -100, r)}; }, {x}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{nll_loss(in[0], t, w, 2, r)}; }, {x}));
    EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{nll_loss(sq(in[0]), t, w, 0, r)}; }, {x}));
  }
  // Spatial (N, C, d) input, and a 1-D input with a 0-dim target.
  Tensor xs = rnd({2, 3, 2});
  Tensor ts = longs({0, 2, 1, -100}, {2, 2});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{nll_loss(in[0], ts, w)}; }, {xs}));
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{nll_loss(in[0], longs({1}).view({}))}; }, {rnd({3})}));
}

TEST(GradcheckIndex, NllLossBackwardValuesAndErrors) {
  Tensor x = zeros({3, 2}, kFloat32).requires_grad_();
  Tensor w = tensor<float>({2, 3});
  nll_loss(x, longs({1, 0, 1}), w, 0).backward();  // target 0 ignored; total weight 6
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_TRUE(matches(x.grad(), {3, 2}, {0, -0.5, 0, 0, 0, -0.5}));
  // Every target ignored: mean is NaN, the gradient is zero.
  Tensor y = zeros({2, 2}, kFloat64).requires_grad_();
  nll_loss(y, longs({-100, -100})).backward();
  EXPECT_TRUE(matches(y.grad(), {2, 2}, {0, 0, 0, 0}));
  // The class weights are not differentiable (as in PyTorch).
  Tensor wg = ones({2}, kFloat64).requires_grad_();
  Tensor z = zeros({2, 2}, kFloat64).requires_grad_();
  EXPECT_THROW(nll_loss(z, longs({0, 1}), wg).backward(), Error);
  // The backward op checks its inputs.
  const OpDef& bw = op("nll_loss_backward");
  Tensor tw = ones({}, kFloat64);
  EXPECT_THROW(call_op1(bw, {ones({}, kFloat64), longs({0, 5}), Tensor(), tw}, {std::vector<int64_t>{2, 2}, int64_t{1}, int64_t{-100}}),
               IndexError);
  EXPECT_THROW(call_op1(bw, {ones({3}, kFloat64), longs({0, 1}), Tensor(), tw}, {std::vector<int64_t>{2, 2}, int64_t{0}, int64_t{-100}}),
               ShapeError);
}

TEST(GradcheckIndex, NllLossBackwardMatchesAReferenceOnALargeBatch) {
  manual_seed(18);
  const int64_t N = 3000, C = 50;
  Tensor x = randn({N, C}, kFloat32).requires_grad_();
  Tensor t = randint(0, C, {N});
  t.index_put_({Slice(0, N, 7)}, 3);  // ignore_index = 3
  Tensor w = rand({C}, kFloat32);
  nll_loss(x, t, w, 3, Reduction::mean).backward();
  auto tv = t.to_vector<int64_t>();
  auto wv = values(w);
  double total = 0;
  for (int64_t n = 0; n < N; ++n)
    if (tv[n] != 3) total += wv[tv[n]];
  std::vector<double> ref(N * C, 0.0);
  for (int64_t n = 0; n < N; ++n)
    if (tv[n] != 3) ref[n * C + tv[n]] = -wv[tv[n]] / total;
  EXPECT_TRUE(matches(x.grad(), {N, C}, ref));
}

TEST(GradcheckIndex, CrossEntropyClassIndices) {
  manual_seed(19);
  Tensor x = rnd({3, 4});
  Tensor t = longs({3, 1, 0});
  Tensor w = rand({4}, kFloat64) + 0.5;
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    SCOPED_TRACE(static_cast<int>(r));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], t, Tensor(), -100, r)}; }, {x}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], t, w, 1, r, 0.2)}; }, {x}));
  }
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], t, w, 1, Reduction::mean, 0.1)}; },
                          {x}));
  // Spatial input.
  Tensor ts = longs({0, 2, 1, 3}, {2, 2});
  EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], ts, w, 2, Reduction::mean, 0.3)}; },
                      {rnd({2, 4, 2})}));
}

TEST(GradcheckIndex, CrossEntropyClassProbabilities) {
  manual_seed(20);
  Tensor x = rnd({3, 4});
  Tensor p = softmax(randn({3, 4}, kFloat64), 1).requires_grad_();
  Tensor w = rand({4}, kFloat64) + 0.5;
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    SCOPED_TRACE(static_cast<int>(r));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], in[1], Tensor(), -100, r)}; },
                        {x, p}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], in[1], w, -100, r, 0.25)}; },
                        {x, p}));
  }
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{cross_entropy(in[0], in[1], w, -100, Reduction::mean, 0.1)}; },
                          {x, p}));
}

TEST(GradcheckIndex, MseLossAllReductions) {
  manual_seed(21);
  Tensor a = rnd({2, 3}), b = rnd({2, 3}), row = rnd({3});
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    SCOPED_TRACE(static_cast<int>(r));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{mse_loss(in[0], in[1], r)}; }, {a, b}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{mse_loss(in[0], in[1], r)}; }, {a.t(), b.t()}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) { return TensorList{mse_loss(in[0], in[1], r)}; }, {a, row}));
  }
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) { return TensorList{mse_loss(in[0], in[1])}; }, {a, b}));
}

TEST(GradcheckIndex, BinaryCrossEntropyWithLogits) {
  manual_seed(22);
  Tensor x = rnd({2, 3});
  Tensor t = rand({2, 3}, kFloat64).requires_grad_();
  Tensor w = (rand({2, 3}, kFloat64) + 0.5).requires_grad_();
  Tensor pw = (rand({3}, kFloat64) + 0.5).requires_grad_();
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    SCOPED_TRACE(static_cast<int>(r));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) {
      return TensorList{binary_cross_entropy_with_logits(in[0], in[1], Tensor(), Tensor(), r)};
    }, {x, t}));
    EXPECT_TRUE(grad_ok([&](const TensorList& in) {
      return TensorList{binary_cross_entropy_with_logits(in[0], in[1], in[2], in[3], r)};
    }, {x, t, w, pw}));
  }
  EXPECT_TRUE(gradgrad_ok([&](const TensorList& in) {
    return TensorList{binary_cross_entropy_with_logits(in[0], in[1], Tensor(), in[2])};
  }, {x, t, pw}));
}
