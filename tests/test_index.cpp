// Indexing: index_select, gather, scatter(_add), advanced index / index_put, embedding, one_hot,
// and Tensor::index / index_put_ expressions — against float64 references built with loops.
#include <numeric>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::matches;
using kiln::testing::values;

namespace {

Tensor seq(const std::vector<int64_t>& sizes, DType dtype, double offset = 0, double step = 1) {
  std::vector<double> v(numel_of(sizes));
  for (size_t i = 0; i < v.size(); ++i) v[i] = offset + step * static_cast<double>(i);
  return tensor<double>(v, sizes).to(dtype);
}

Tensor longs(const std::vector<int64_t>& v, const std::vector<int64_t>& sizes) { return tensor<int64_t>(v, sizes); }
Tensor longs(const std::vector<int64_t>& v) { return tensor<int64_t>(v); }

std::vector<int64_t> strides_for(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) st[d] = st[d + 1] * sizes[d + 1];
  return st;
}

// Row-major coordinates of linear index `lin` in `sizes`.
std::vector<int64_t> coords(int64_t lin, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> c(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    c[d] = lin % sizes[d];
    lin /= sizes[d];
  }
  return c;
}

int64_t linear(const std::vector<int64_t>& c, const std::vector<int64_t>& sizes) {
  auto st = strides_for(sizes);
  int64_t off = 0;
  for (size_t d = 0; d < c.size(); ++d) off += c[d] * st[d];
  return off;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// ---------------- index_select ----------------

TEST(IndexSelect, MatchesReferenceAlongEveryDim) {
  for (DType dt : {kFloat32, kFloat64, kInt64, kBool, kFloat16}) {
    Tensor x = seq({3, 4, 5}, dt, 1, 0.5);
    auto vx = values(x);
    std::vector<int64_t> xs = {3, 4, 5};
    for (int64_t dim : {0, 1, 2, -1}) {
      int64_t d = dim < 0 ? dim + 3 : dim;
      std::vector<int64_t> idx = {xs[d] - 1, 0, 1, 0};
      for (DType it : {kInt64, kInt32}) {
        Tensor out = index_select(x, dim, longs(idx).to(it));
        std::vector<int64_t> os = xs;
        os[d] = 4;
        std::vector<double> ref(numel_of(os));
        for (int64_t i = 0; i < numel_of(os); ++i) {
          auto c = coords(i, os);
          c[d] = idx[c[d]];
          ref[i] = vx[linear(c, xs)];
        }
        EXPECT_TRUE(matches(out, os, ref)) << dtype_name(dt) << " dim " << dim;
      }
    }
  }
}

TEST(IndexSelect, NonContiguousSourceZeroDimAndEmpty) {
  Tensor x = seq({5, 3}, kFloat32).t();  // (3, 5)
  Tensor out = x.index_select(1, longs({4, 0}));
  EXPECT_TRUE(matches(out, {3, 2}, {12, 0, 13, 1, 14, 2}));
  EXPECT_TRUE(matches(x.index_select(0, longs({2})), {1, 5}, {2, 5, 8, 11, 14}));
  EXPECT_TRUE(matches(index_select(seq({}, kFloat64, 7), 0, longs({0})), {}, {7}));
  EXPECT_TRUE(matches(index_select(seq({3, 2}, kFloat32), 0, longs({}, {0})), {0, 2}, {}));
  EXPECT_TRUE(matches(index_select(seq({3, 2}, kFloat32), 0, tensor<int64_t>({1})[0]), {1, 2}, {2, 3}));
}

TEST(IndexSelect, LargeRowsUseTheParallelPathCorrectly) {
  Tensor w = seq({100, 300}, kFloat32);
  std::vector<int64_t> idx;
  for (int i = 0; i < 500; ++i) idx.push_back((i * 37) % 100);
  Tensor out = index_select(w, 0, longs(idx));
  std::vector<double> ref;
  for (int64_t r : idx)
    for (int64_t c = 0; c < 300; ++c) ref.push_back(static_cast<double>(r * 300 + c));
  EXPECT_TRUE(matches(out, {500, 300}, ref));
}

TEST(IndexSelect, BadIndicesThrow) {
  Tensor x = seq({3, 2}, kFloat32);
  std::string msg = message_of([&] { index_select(x, 0, longs({0, 5})); });
  EXPECT_TRUE(contains(msg, "index 5 is out of bounds for dimension 0 with size 3")) << msg;
  EXPECT_THROW(index_select(x, 0, longs({5})), IndexError);
  EXPECT_THROW(index_select(x, 0, longs({-1})), IndexError);  // PyTorch does not wrap here
  EXPECT_THROW(index_select(x, 0, seq({1}, kFloat32)), DTypeError);
  EXPECT_THROW(index_select(x, 0, longs({0, 1}, {1, 2})), IndexError);  // not a vector
  EXPECT_THROW(index_select(x, 2, longs({0})), IndexError);
}

// ---------------- gather ----------------

TEST(Gather, MatchesReferenceIncludingNonContiguousOperands) {
  for (DType dt : {kFloat32, kFloat64, kInt64, kBool}) {
    Tensor x = seq({3, 4}, dt, 2, 0.5);
    auto vx = values(x);
    Tensor idx1 = longs({3, 0, 1, 1, 2, 2}, {3, 2});
    // dim 1: out[i][j] = x[i][idx[i][j]]
    std::vector<double> ref1;
    auto vi = idx1.to_vector<int64_t>();
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 2; ++j) ref1.push_back(vx[i * 4 + vi[i * 2 + j]]);
    EXPECT_TRUE(matches(gather(x, 1, idx1), {3, 2}, ref1)) << dtype_name(dt);
    EXPECT_TRUE(matches(x.gather(-1, idx1), {3, 2}, ref1));
    // dim 0: out[i][j] = x[idx[i][j]][j], index smaller than self.
    Tensor idx0 = longs({2, 0, 1, 1, 0, 2}, {2, 3});
    auto vi0 = idx0.to_vector<int64_t>();
    std::vector<double> ref0;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) ref0.push_back(vx[vi0[i * 3 + j] * 4 + j]);
    EXPECT_TRUE(matches(gather(x, 0, idx0), {2, 3}, ref0));
  }
  // Transposed self and index.
  Tensor x = seq({4, 3}, kFloat32).t();  // (3, 4): x[i][j] = 3 * j + i
  Tensor idx = longs({0, 1, 2, 3, 3, 2}, {2, 3}).t();  // (3, 2)
  auto vi = idx.contiguous().to_vector<int64_t>();
  std::vector<double> ref;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) ref.push_back(3.0 * vi[i * 2 + j] + i);
  EXPECT_TRUE(matches(gather(x, 1, idx), {3, 2}, ref));
}

TEST(Gather, ThreeDimsZeroDimAndEmpty) {
  Tensor x = seq({2, 3, 4}, kFloat64);
  auto vx = values(x);
  std::vector<int64_t> iv;
  for (int i = 0; i < 2 * 2 * 4; ++i) iv.push_back((i * 7) % 3);
  Tensor idx = longs(iv, {2, 2, 4});
  std::vector<double> ref;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < 4; ++c) ref.push_back(vx[a * 12 + iv[a * 8 + b * 4 + c] * 4 + c]);
  EXPECT_TRUE(matches(gather(x, 1, idx), {2, 2, 4}, ref));
  EXPECT_TRUE(matches(gather(seq({}, kFloat32, 3), 0, tensor<int64_t>({0})[0]), {}, {3}));
  EXPECT_TRUE(matches(gather(seq({3}, kFloat32), 0, longs({}, {0})), {0}, {}));
}

TEST(Gather, BadInputsThrow) {
  Tensor x = seq({3, 4}, kFloat32);
  std::string msg = message_of([&] { gather(x, 0, longs({0, 3}, {1, 2})); });
  EXPECT_TRUE(contains(msg, "index 3 is out of bounds for dimension 0 with size 3")) << msg;
  EXPECT_THROW(gather(x, 1, longs({-1}, {1, 1})), IndexError);
  EXPECT_THROW(gather(x, 1, longs({0}, {1, 1}).to(kInt32)), DTypeError);
  EXPECT_THROW(gather(x, 1, longs({0}, {1})), ShapeError);          // rank mismatch
  EXPECT_THROW(gather(x, 1, longs({0, 0, 0, 0}, {4, 1})), ShapeError);  // larger than self off-dim
}

// ---------------- scatter / scatter_add ----------------

namespace {

// Reference scatter over 2-D: out = self; out[idx-chosen] (+)= src[i][j].
std::vector<double> scatter_ref(const Tensor& self, int64_t dim, const Tensor& index, const std::vector<double>& src,
                                int64_t src_cols, bool add) {
  auto out = values(self);
  int64_t cols = self.size(1);
  auto iv = index.contiguous().to_vector<int64_t>();
  int64_t ir = index.size(0), ic = index.size(1);
  for (int64_t i = 0; i < ir; ++i)
    for (int64_t j = 0; j < ic; ++j) {
      int64_t k = iv[i * ic + j];
      int64_t pos = dim == 0 ? k * cols + j : i * cols + k;
      double s = src[i * src_cols + j];
      out[pos] = add ? out[pos] + s : s;
    }
  return out;
}

}  // namespace

TEST(Scatter, SrcValueAndAddMatchReference) {
  for (DType dt : {kFloat32, kFloat64, kInt64}) {
    Tensor self = seq({3, 4}, dt, 1);
    Tensor src = seq({2, 4}, dt, 100, 2);
    auto vs = values(src);
    Tensor idx0 = longs({2, 0, 1, 2, 0, 1, 2, 0}, {2, 4});  // distinct per column
    EXPECT_TRUE(matches(scatter(self, 0, idx0, src), {3, 4}, scatter_ref(self, 0, idx0, vs, 4, false)));
    Tensor idx1 = longs({3, 1, 0, 2}, {2, 2});
    EXPECT_TRUE(matches(scatter(self, 1, idx1, src), {3, 4}, scatter_ref(self, 1, idx1, vs, 4, false)));
    std::vector<double> sevens(8, 7);
    EXPECT_TRUE(matches(scatter(self, -1, idx1, 7), {3, 4}, scatter_ref(self, 1, idx1, sevens, 4, false)));
    // Repeated indices add up.
    Tensor rep = longs({1, 1, 1, 0, 0, 0, 2, 2}, {2, 4});
    EXPECT_TRUE(matches(scatter_add(self, 0, rep, src), {3, 4}, scatter_ref(self, 0, rep, vs, 4, true)));
    Tensor rep1 = longs({0, 0, 0, 3, 3, 3}, {2, 3});
    EXPECT_TRUE(matches(scatter_add(self, 1, rep1, src), {3, 4}, scatter_ref(self, 1, rep1, vs, 4, true)));
  }
}

TEST(Scatter, HalfAndBoolScatterAdd) {
  Tensor self = seq({2, 3}, kFloat16, 0.5);
  Tensor src = seq({2, 3}, kFloat16, 0.25, 0.25);
  Tensor idx = longs({0, 0, 1, 1, 1, 0}, {2, 3});
  EXPECT_TRUE(matches(scatter_add(self, 0, idx, src), {2, 3}, scatter_ref(self, 0, idx, values(src), 3, true)));
  Tensor b = seq({2, 2}, kBool);  // {0, 1, 1, 1}
  Tensor bsrc = tensor<bool>({true, false, false, false}).view({2, 2});
  EXPECT_TRUE(matches(scatter_add(b, 1, longs({0, 0, 0, 0}, {2, 2}), bsrc), {2, 2}, {1, 1, 1, 1}));
}

TEST(Scatter, InPlaceFormsWriteThroughViewsAndBumpTheVersion) {
  Tensor base = seq({4, 4}, kFloat32);
  Tensor x = base.slice(1, 0, 4, 2);  // (4, 2), non-contiguous view
  Tensor src = seq({1, 2}, kFloat32, -10);
  uint64_t v0 = base.version();
  x.scatter_(0, longs({3, 0}, {1, 2}), src);
  EXPECT_GT(base.version(), v0);
  auto vb = values(base);
  EXPECT_EQ(vb[3 * 4 + 0], -10);
  EXPECT_EQ(vb[0 * 4 + 2], -9);
  x.scatter_(1, longs({1}, {1, 1}), 5.5);
  EXPECT_EQ(values(base)[2], 5.5);
  x.scatter_add_(0, longs({1, 1}, {2, 1}), seq({2, 1}, kFloat32, 1));
  EXPECT_EQ(values(base)[4], 4 + 1 + 2);
  // Non-contiguous src.
  Tensor y = seq({2, 3}, kFloat64);
  Tensor tsrc = seq({3, 2}, kFloat64, 10).t();  // (2, 3)
  y.scatter_(1, longs({2, 1, 0, 0, 1, 2}, {2, 3}), tsrc);
  EXPECT_TRUE(matches(y, {2, 3}, {14, 12, 10, 11, 13, 15}));
}

TEST(Scatter, OutOfBoundsIndexThrowsBeforeAnyWrite) {
  Tensor x = seq({3, 3}, kFloat32);
  auto before = values(x);
  std::string msg = message_of([&] { x.scatter_(0, longs({0, 1, 9}, {1, 3}), seq({1, 3}, kFloat32, 50)); });
  EXPECT_TRUE(contains(msg, "index 9 is out of bounds for dimension 0 with size 3")) << msg;
  EXPECT_EQ(values(x), before);
  EXPECT_THROW(x.scatter_add_(1, longs({-1}, {1, 1}), seq({1, 1}, kFloat32)), IndexError);
  EXPECT_EQ(values(x), before);
}

TEST(Scatter, BadInputsThrow) {
  Tensor x = seq({3, 3}, kFloat32);
  EXPECT_THROW(scatter(x, 0, longs({0}, {1, 1}).to(kFloat32), seq({1, 1}, kFloat32)), DTypeError);
  EXPECT_THROW(scatter(x, 0, longs({0}, {1, 1}), seq({1, 1}, kFloat64)), DTypeError);  // src dtype
  EXPECT_THROW(scatter(x, 0, longs({0, 0}, {1, 2}), seq({1, 1}, kFloat32)), ShapeError);  // index > src
  EXPECT_THROW(scatter(x, 0, longs({0, 0, 0, 0}, {1, 4}), seq({1, 4}, kFloat32)), ShapeError);  // > self
  EXPECT_THROW(scatter(x, 0, longs({0}, {1}), seq({1}, kFloat32)), ShapeError);  // rank
  EXPECT_THROW(scatter_add(x, 2, longs({0}, {1, 1}), seq({1, 1}, kFloat32)), IndexError);
  EXPECT_NO_THROW(scatter(x, 0, longs({}, {0, 3}), 1.0));  // empty index: no checks, a copy
}

// ---------------- advanced index / index_put ----------------

TEST(AdvancedIndex, SingleIndexTensorWrapsNegativesAndKeepsItsShape) {
  for (DType dt : {kFloat32, kInt64, kBool, kBFloat16}) {
    Tensor x = seq({4, 3}, dt, 1);
    auto vx = values(x);
    Tensor idx = longs({-1, 0, 2, 2}, {2, 2});
    std::vector<double> ref;
    for (int64_t r : {3, 0, 2, 2})
      for (int c = 0; c < 3; ++c) ref.push_back(vx[r * 3 + c]);
    EXPECT_TRUE(matches(index(x, {idx}), {2, 2, 3}, ref)) << dtype_name(dt);
    // Along dim 1 (undefined first entry = all rows).
    std::vector<double> ref1;
    for (int r = 0; r < 4; ++r)
      for (int64_t c : {2, 0, 1, 2}) ref1.push_back(vx[r * 3 + c]);
    EXPECT_TRUE(matches(index(x, {Tensor(), longs({-1, 0, 1, 2}, {2, 2}).to(kInt32)}), {4, 2, 2}, ref1));
  }
}

TEST(AdvancedIndex, AdjacentIndicesBroadcastInPlaceAndSeparatedOnesGoFirst) {
  Tensor x = seq({2, 3, 4}, kFloat64);
  auto vx = values(x);
  // Adjacent (dims 1, 2), index shapes (2, 1) and (3,) broadcast to (2, 3).
  Tensor i1 = longs({0, 2}, {2, 1}), i2 = longs({1, 3, -4});
  std::vector<double> ref;
  for (int a = 0; a < 2; ++a)
    for (int64_t p : {0, 2})
      for (int64_t q : {1, 3, 0}) ref.push_back(vx[a * 12 + p * 4 + q]);
  EXPECT_TRUE(matches(index(x, {Tensor(), i1, i2}), {2, 2, 3}, ref));
  // Separated (dims 0 and 2): broadcast dims first, then the remaining dim 1.
  Tensor j0 = longs({1, 0, 1}), j2 = longs({3, 2, 0});
  std::vector<double> ref2;
  for (int k = 0; k < 3; ++k)
    for (int b = 0; b < 3; ++b) ref2.push_back(vx[j0.to_vector<int64_t>()[k] * 12 + b * 4 + j2.to_vector<int64_t>()[k]]);
  EXPECT_TRUE(matches(index(x, {j0, Tensor(), j2}), {3, 3}, ref2));
}

TEST(AdvancedIndex, BoolMasksSelectInRowMajorOrder) {
  Tensor x = seq({3, 4}, kFloat32);
  Tensor mask = tensor<bool>({true, false, false, true, false, true, true, false, false, false, false, true})
                    .view({3, 4});
  EXPECT_TRUE(matches(index(x, {mask}), {5}, {0, 3, 5, 6, 11}));
  Tensor rows = tensor<bool>({false, true, true});
  EXPECT_TRUE(matches(index(x, {rows}), {2, 4}, {4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_TRUE(matches(index(x, {Tensor(), tensor<bool>({true, false, false, true})}), {3, 2}, {0, 3, 4, 7, 8, 11}));
  EXPECT_TRUE(matches(index(x, {tensor<bool>({false, false, false})}), {0, 4}, {}));
}

TEST(AdvancedIndex, MasksOverUnmergeableDimsOrWithOtherIndicesUseCoordinates) {
  // A transposed view cannot merge the mask's dims: one coordinate tensor per mask dim.
  Tensor xt = seq({4, 3}, kFloat32).t();  // (3, 4), xt[i][j] = 3j + i
  Tensor mask = tensor<bool>({false, true, false, false, true, false, false, true, false, false, false, true})
                    .view({3, 4});
  EXPECT_TRUE(matches(index(xt, {mask}), {4}, {3, 1, 10, 11}));
  // A mask next to another index tensor: its nonzero coordinates broadcast with it.
  Tensor x = seq({2, 3, 4}, kFloat64);
  Tensor m = tensor<bool>({true, false, true, false, false, true}).view({2, 3});  // (0,0) (0,2) (1,2)
  EXPECT_TRUE(matches(index(x, {m, longs({3, 0, 1})}), {3}, {3, 8, 21}));
  EXPECT_TRUE(matches(index(x, {m, longs({2})}), {3}, {2, 10, 22}));
  // uint8 masks behave like bool ones.
  EXPECT_TRUE(matches(index(x, {m.to(kUInt8), longs({2})}), {3}, {2, 10, 22}));
}

TEST(AdvancedIndex, LargeMasksMatchReferenceAcrossThreadChunks) {
  const int64_t rows = 300, cols = 301;
  std::vector<bool> mv(rows * cols);
  std::vector<double> ref;
  for (int64_t i = 0; i < rows * cols; ++i) {
    mv[i] = (i * 7) % 3 == 0 || i % 11 == 0;
    if (mv[i]) ref.push_back(static_cast<double>(i));
  }
  Tensor mask = tensor<bool>(mv, {rows, cols});
  Tensor x = seq({rows, cols}, kFloat64);
  EXPECT_TRUE(matches(index(x, {mask}), {static_cast<int64_t>(ref.size())}, ref));
  // Coordinate path (mask dims not mergeable in a transposed view of the transpose).
  Tensor xt = seq({cols, rows}, kFloat64).t();  // (rows, cols), xt[i][j] = j * rows + i
  std::vector<double> ref_t;
  for (int64_t i = 0; i < rows * cols; ++i)
    if (mv[i]) ref_t.push_back(static_cast<double>((i % cols) * rows + i / cols));
  EXPECT_TRUE(matches(index(xt, {mask}), {static_cast<int64_t>(ref_t.size())}, ref_t));
}

TEST(AdvancedIndex, NonContiguousSelfAndEmptyIndex) {
  Tensor x = seq({4, 3}, kFloat32).t();  // (3, 4), x[i][j] = 3j + i
  EXPECT_TRUE(matches(index(x, {longs({2, 0})}), {2, 4}, {2, 5, 8, 11, 0, 3, 6, 9}));
  EXPECT_TRUE(matches(index(x, {longs({1, 2}), longs({3, 0})}), {2}, {10, 2}));
  EXPECT_TRUE(matches(index(x, {longs({}, {0})}), {0, 4}, {}));
}

TEST(AdvancedIndex, BadIndicesThrow) {
  Tensor x = seq({3, 4}, kFloat32);
  std::string msg = message_of([&] { index(x, {longs({0, 3})}); });
  EXPECT_TRUE(contains(msg, "index 3 is out of bounds for dimension 0 with size 3")) << msg;
  EXPECT_THROW(index(x, {longs({-4})}), IndexError);
  EXPECT_THROW(index(x, {Tensor(), longs({4})}), IndexError);
  EXPECT_THROW(index(x, {seq({1}, kFloat32)}), DTypeError);
  EXPECT_THROW(index(x, {longs({0, 1}), longs({0, 1, 2})}), IndexError);  // broadcast mismatch
  EXPECT_THROW(index(x, {longs({0}), longs({0}), longs({0})}), IndexError);  // too many
  EXPECT_THROW(index(x, {tensor<bool>({true, false})}), IndexError);  // mask shape
}

TEST(IndexPut, AccumulateAddsRepeatedIndicesAndFunctionalFormCopies) {
  for (DType dt : {kFloat32, kFloat64, kInt64}) {
    Tensor x = seq({4, 2}, dt, 1);
    Tensor idx = longs({1, 3, 1, 1});
    Tensor v = seq({4, 2}, dt, 10, 10);
    auto ref = values(x);
    auto vv = values(v);
    int k = 0;
    for (int64_t r : {1, 3, 1, 1}) {
      for (int c = 0; c < 2; ++c) ref[r * 2 + c] += vv[k * 2 + c];
      ++k;
    }
    auto before = values(x);
    EXPECT_TRUE(matches(index_put(x, {idx}, v, true), {4, 2}, ref)) << dtype_name(dt);
    EXPECT_EQ(values(x), before);
    // Without accumulate, each position gets one of its values; distinct indices are exact.
    Tensor r = index_put(x, {longs({2, 0})}, seq({2}, dt, -1, -1));  // values broadcast over rows
    EXPECT_TRUE(matches(r, {4, 2}, {-1, -2, before[2], before[3], -1, -2, before[6], before[7]}));
  }
  // float16 accumulate in opmath.
  Tensor h = seq({3}, kFloat16);
  EXPECT_TRUE(matches(index_put(h, {longs({0, 0, 2})}, seq({3}, kFloat16, 0.5), true), {3}, {0 + 0.5 + 1.5, 1, 2 + 2.5}));
}

TEST(IndexPut, MasksTwoIndicesAndBroadcastValues) {
  Tensor x = seq({3, 3}, kFloat32);
  Tensor mask = gt(x, 4.0);
  Tensor r = index_put(x, {mask}, scalar_tensor(0.0, kFloat32));
  EXPECT_TRUE(matches(r, {3, 3}, {0, 1, 2, 3, 4, 0, 0, 0, 0}));
  Tensor r2 = index_put(x, {longs({0, 2}), longs({2, 0})}, seq({2}, kFloat32, 100));
  EXPECT_TRUE(matches(r2, {3, 3}, {0, 1, 100, 3, 4, 5, 101, 7, 8}));
  Tensor r3 = index_put(x, {Tensor(), longs({1})}, seq({3, 1}, kFloat32, -5));
  EXPECT_TRUE(matches(r3, {3, 3}, {0, -5, 2, 3, -4, 5, 6, -3, 8}));
}

TEST(IndexPut, MaskWithTensorValuesWritesInRowMajorOrder) {
  Tensor x = seq({2, 3}, kFloat32);
  Tensor mask = tensor<bool>({true, false, true, false, true, true}).view({2, 3});
  Tensor r = index_put(x, {mask}, tensor<float>({10, 20, 30, 40}));
  EXPECT_TRUE(matches(r, {2, 3}, {10, 1, 20, 3, 30, 40}));
  EXPECT_TRUE(matches(x, {2, 3}, {0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(matches(index_put(x, {mask}, tensor<float>({1, 2, 3, 4}), true), {2, 3}, {1, 1, 4, 3, 7, 9}));
  Tensor xt = seq({3, 2}, kFloat32).t();  // (2, 3), non-contiguous: xt[i][j] = 2j + i
  xt.index_put_({mask}, tensor<float>({-1, -2, -3, -4}));
  EXPECT_TRUE(matches(xt, {2, 3}, {-1, 2, -2, 1, -3, -4}));
  // A one-element value goes through masked_fill, uint8 masks included.
  Tensor y = seq({2, 3}, kInt64);
  y.index_put_({mask.to(kUInt8)}, tensor<int64_t>({7}));
  EXPECT_TRUE(matches(y, {2, 3}, {7, 1, 7, 3, 7, 7}));
  Tensor z = seq({2, 3, 2}, kFloat64);
  z.index_put_({Slice(), tensor<bool>({false, true, false})}, 0.5);
  EXPECT_TRUE(matches(z, {2, 3, 2}, {0, 1, 0.5, 0.5, 4, 5, 6, 7, 0.5, 0.5, 10, 11}));
}

TEST(IndexPut, BadInputsThrowBeforeWriting) {
  Tensor x = seq({3, 3}, kFloat32);
  EXPECT_THROW(index_put(x, {longs({0})}, seq({3}, kFloat64)), DTypeError);
  EXPECT_THROW(index_put(x, {longs({0, 1})}, seq({2, 2}, kFloat32)), ShapeError);
  EXPECT_THROW(index_put(x, {longs({7})}, seq({3}, kFloat32)), IndexError);
  auto before = values(x);
  EXPECT_THROW(x.index_put_({longs({0, 5})}, 1.0), IndexError);
  EXPECT_EQ(values(x), before);
}

// ---------------- Tensor::index expressions ----------------

TEST(TensorIndexing, BasicIndicesReturnViewsSharingStorage) {
  Tensor x = seq({4, 5, 6}, kFloat32);
  auto vx = values(x);
  Tensor a = x.index({1});
  EXPECT_TRUE(a.is_alias_of(x));
  EXPECT_TRUE(matches(a, {5, 6}, std::vector<double>(vx.begin() + 30, vx.begin() + 60)));
  Tensor b = x.index({Slice(), Slice(1, std::nullopt, 2), -1});  // (4, 2)
  EXPECT_TRUE(b.is_alias_of(x));
  std::vector<double> ref;
  for (int i = 0; i < 4; ++i)
    for (int j : {1, 3}) ref.push_back(vx[i * 30 + j * 6 + 5]);
  EXPECT_TRUE(matches(b, {4, 2}, ref));
  Tensor c = x.index({Ellipsis, Slice(-3, -1)});
  EXPECT_EQ(c.sizes().vec(), (std::vector<int64_t>{4, 5, 2}));
  EXPECT_EQ(values(c)[0], 3);
  Tensor d = x.index({None, 0, Ellipsis, None});
  EXPECT_EQ(d.sizes().vec(), (std::vector<int64_t>{1, 5, 6, 1}));
  EXPECT_TRUE(d.is_alias_of(x));
  Tensor e = x.index({});
  EXPECT_TRUE(e.is_alias_of(x));
  EXPECT_EQ(e.sizes().vec(), x.sizes().vec());
  Tensor f = x.index({Slice(10, 20)});
  EXPECT_EQ(f.sizes().vec(), (std::vector<int64_t>{0, 5, 6}));
  // Writes through a basic-index view reach the base.
  x.index({2, Slice(0, 2), 0}).fill_(-7.0);
  EXPECT_EQ(values(x)[2 * 30 + 6], -7);
  // A 0-dim integer tensor selects like an integer (a view).
  Tensor g = x.index({tensor<int64_t>({3})[0]});
  EXPECT_TRUE(g.is_alias_of(x));
  EXPECT_EQ(g.sizes().vec(), (std::vector<int64_t>{5, 6}));
}

TEST(TensorIndexing, AdvancedIndicesCopyAndFollowPyTorchPlacement) {
  Tensor x = seq({3, 4, 5}, kFloat64);
  auto vx = values(x);
  Tensor idx = longs({2, 0});
  Tensor a = x.index({idx});
  EXPECT_FALSE(a.is_alias_of(x));
  EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{2, 4, 5}));
  // Integer then tensor: the integer is a basic select, so idx lands where dim 2 was.
  Tensor b = x.index({0, Slice(), idx});
  std::vector<double> ref;
  for (int j = 0; j < 4; ++j)
    for (int64_t k : {2, 0}) ref.push_back(vx[j * 5 + k]);
  EXPECT_TRUE(matches(b, {4, 2}, ref));
  // Tensors separated by a slice: broadcast dims first.
  Tensor c = x.index({idx, Slice(), longs({4, 1})});
  std::vector<double> ref2;
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < 4; ++j) ref2.push_back(vx[(k == 0 ? 2 : 0) * 20 + j * 5 + (k == 0 ? 4 : 1)]);
  EXPECT_TRUE(matches(c, {2, 4}, ref2));
  // Adjacent tensors after a slice stay in place.
  EXPECT_EQ(x.index({Slice(), idx, longs({1, 1})}).sizes().vec(), (std::vector<int64_t>{3, 2}));
  // Slicing and masks together; a 2-D mask spans two dims.
  std::vector<bool> m45v(20, false), m34v(12, false);
  m45v[0 * 5 + 1] = m45v[2 * 5 + 3] = m45v[3 * 5 + 0] = true;
  m34v[0 * 4 + 0] = m34v[2 * 4 + 3] = true;
  Tensor m45 = tensor<bool>(m45v, {4, 5}), m34 = tensor<bool>(m34v, {3, 4});
  std::vector<double> ref3;
  for (int p : {1, 2})
    for (auto [q, k] : std::vector<std::pair<int, int>>{{0, 1}, {2, 3}, {3, 0}}) ref3.push_back(vx[p * 20 + q * 5 + k]);
  EXPECT_TRUE(matches(x.index({Slice(1, 3), m45}), {2, 3}, ref3));
  std::vector<double> ref4;
  for (auto [p, q] : std::vector<std::pair<int, int>>{{0, 0}, {2, 3}})
    for (int k : {0, 2, 4}) ref4.push_back(vx[p * 20 + q * 5 + k]);
  EXPECT_TRUE(matches(x.index({m34, Slice(0, 5, 2)}), {2, 3}, ref4));
  // Booleans add a dim of size 1 (true) or 0 (false).
  EXPECT_EQ(x.index({tensor<bool>({true})[0]}).sizes().vec(), (std::vector<int64_t>{1, 3, 4, 5}));
  EXPECT_EQ(x.index({Slice(), tensor<bool>({false})[0]}).sizes().vec(), (std::vector<int64_t>{3, 0, 4, 5}));
}

TEST(TensorIndexing, BadExpressionsThrow) {
  Tensor x = seq({2, 3}, kFloat32);
  std::string msg = message_of([&] { x.index({0, 5}); });
  EXPECT_TRUE(contains(msg, "index 5 is out of bounds for dimension 1 with size 3")) << msg;
  EXPECT_THROW(x.index({-3}), IndexError);
  EXPECT_THROW(x.index({0, 0, 0}), IndexError);
  EXPECT_THROW(x.index({Ellipsis, 0, Ellipsis}), IndexError);
  EXPECT_THROW(x.index({Slice(0, 2, 0)}), ValueError);
  EXPECT_THROW(x.index({seq({2}, kFloat32)}), DTypeError);
  EXPECT_THROW(seq({}, kFloat32).index({0}), IndexError);
  EXPECT_THROW(x.index({tensor<bool>({true, true, true})}), IndexError);
}

TEST(TensorIndexing, IndexPutThroughExpressions) {
  Tensor x = seq({3, 4}, kFloat32);
  x.index_put_({Slice(), 1}, seq({1, 3}, kFloat32, 100));  // leading 1 dims of the value are dropped
  EXPECT_TRUE(matches(x.index({Slice(), 1}), {3}, {100, 101, 102}));
  x.index_put_({gt(x, 100.5)}, -1.0);
  EXPECT_TRUE(matches(x.index({Slice(), 1}), {3}, {100, -1, -1}));
  x.index_put_({longs({0, 2}), longs({3, 0})}, tensor<float>({7, 8}));
  EXPECT_TRUE(matches(x, {3, 4}, {0, 100, 2, 7, 4, -1, 6, 7, 8, -1, 10, 11}));
  x.index_put_({Ellipsis, 0}, 0.5);
  EXPECT_TRUE(matches(x.index({Slice(), 0}), {3}, {0.5, 0.5, 0.5}));
  uint64_t v = x.version();
  x.index_put_({1, longs({1, 2})}, 9.0);
  EXPECT_GT(x.version(), v);
  EXPECT_TRUE(matches(x.index({1}), {4}, {0.5, 9, 9, 7}));
  EXPECT_THROW(x.index_put_({longs({0})}, seq({4}, kFloat64)), DTypeError);  // like PyTorch
  EXPECT_THROW(x.index_put_({0}, seq({5}, kFloat32)), ShapeError);
}

// ---------------- embedding / one_hot ----------------

TEST(Embedding, LooksUpRowsForAnyIndexShape) {
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    Tensor w = seq({5, 3}, dt, 0, 0.5);
    auto vw = values(w);
    Tensor idx = longs({4, 0, 2, 2, 1, 0}, {2, 3});
    std::vector<double> ref;
    for (int64_t r : {4, 0, 2, 2, 1, 0})
      for (int c = 0; c < 3; ++c) ref.push_back(vw[r * 3 + c]);
    EXPECT_TRUE(matches(embedding(w, idx), {2, 3, 3}, ref)) << dtype_name(dt);
    EXPECT_TRUE(matches(embedding(w, idx.to(kInt32), 0), {2, 3, 3}, ref));
  }
  Tensor wt = seq({3, 5}, kFloat32).t();  // non-contiguous weight (5, 3)
  EXPECT_TRUE(matches(embedding(wt, longs({1})), {1, 3}, {1, 6, 11}));
  EXPECT_TRUE(matches(embedding(wt, tensor<int64_t>({4})[0]), {3}, {4, 9, 14}));
}

TEST(Embedding, BadInputsThrow) {
  Tensor w = seq({5, 3}, kFloat32);
  EXPECT_THROW(embedding(w, longs({5})), IndexError);
  EXPECT_THROW(embedding(w, longs({-1})), IndexError);
  EXPECT_THROW(embedding(w, seq({1}, kFloat32)), DTypeError);
  EXPECT_THROW(embedding(seq({5}, kFloat32), longs({0})), ShapeError);
  EXPECT_THROW(embedding(w, longs({0}), 5), IndexError);
}

TEST(OneHot, InfersOrTakesTheClassCount) {
  EXPECT_TRUE(matches(one_hot(longs({2, 0, 1})), {3, 3}, {0, 0, 1, 1, 0, 0, 0, 1, 0}));
  Tensor r = one_hot(longs({1, 0, 3, 1}, {2, 2}), 5);
  EXPECT_EQ(r.dtype(), kInt64);
  std::vector<double> ref(20, 0);
  int k = 0;
  for (int64_t c : {1, 0, 3, 1}) ref[5 * k++ + c] = 1;
  EXPECT_TRUE(matches(r, {2, 2, 5}, ref));
  EXPECT_TRUE(matches(one_hot(longs({}, {0}), 4), {0, 4}, {}));
}

TEST(OneHot, BadInputsThrow) {
  EXPECT_THROW(one_hot(longs({-1, 0})), IndexError);
  EXPECT_THROW(one_hot(longs({3}), 3), IndexError);
  EXPECT_THROW(one_hot(longs({0}).to(kInt32)), DTypeError);
  EXPECT_THROW(one_hot(longs({}, {0})), ValueError);
}
