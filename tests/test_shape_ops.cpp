// Shape ops that copy or split: cat, stack, split, chunk, pad — checked against float64
// references built with plain loops over row-major values.
#include <numeric>

#include "reference.h"

using namespace kiln;
using kiln::testing::numel_of;
using kiln::testing::matches;
using kiln::testing::values;

namespace {

// offset + step * i in row-major order, converted to `dtype`.
Tensor seq(const std::vector<int64_t>& sizes, DType dtype, double offset = 0, double step = 1) {
  std::vector<double> v(numel_of(sizes));
  for (size_t i = 0; i < v.size(); ++i) v[i] = offset + step * static_cast<double>(i);
  return tensor<double>(v, sizes).to(dtype);
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) st[d] = st[d + 1] * sizes[d + 1];
  return st;
}

// Reference cat of row-major values along `dim`.
std::vector<double> cat_ref(const std::vector<Tensor>& ts, int64_t dim, std::vector<int64_t>* out_sizes) {
  std::vector<int64_t> sizes = ts[0].sizes().vec();
  sizes[dim] = 0;
  for (const Tensor& t : ts) sizes[dim] += t.sizes()[dim];
  *out_sizes = sizes;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= sizes[d];
  for (size_t d = dim + 1; d < sizes.size(); ++d) inner *= sizes[d];
  std::vector<double> out;
  for (int64_t o = 0; o < outer; ++o)
    for (const Tensor& t : ts) {
      auto v = values(t);
      int64_t slab = t.sizes()[dim] * inner;
      out.insert(out.end(), v.begin() + o * slab, v.begin() + (o + 1) * slab);
    }
  return out;
}

// A tensor on a CUDA device without touching a GPU: metadata only, never read.
Tensor fake_cuda_tensor(std::vector<int64_t> sizes) {
  static float storage[64];
  return from_blob(storage, sizes, {}, kFloat32, cuda_device(0));
}

}  // namespace

// ---------------- cat ----------------

TEST(Cat, MatchesReferenceForEveryDimAndDtype) {
  for (DType dt : {kFloat32, kFloat64, kInt64, kBool, kFloat16}) {
    for (int64_t dim : {0, 1, 2, -1}) {
      Tensor a = seq({2, 3, 4}, dt, 0, 0.5);
      std::vector<int64_t> bs = {2, 3, 4};
      int64_t d = dim < 0 ? dim + 3 : dim;
      bs[d] = 2;
      Tensor b = seq(bs, dt, 100, -1);
      std::vector<int64_t> sizes;
      auto ref = cat_ref({a, b}, d, &sizes);
      Tensor out = cat({a, b}, dim);
      EXPECT_EQ(out.dtype(), dt);
      EXPECT_TRUE(matches(out, sizes, ref)) << dtype_name(dt) << " dim " << dim;
    }
  }
}

TEST(Cat, NonContiguousInputsTakeTheStridedPath) {
  Tensor a = seq({4, 3}, kFloat32).t();            // (3, 4), transposed
  Tensor b = seq({3, 10}, kFloat32, 50).slice(1, 0, 10, 3);  // (3, 4), step 3
  ASSERT_FALSE(a.is_contiguous());
  ASSERT_FALSE(b.is_contiguous());
  std::vector<int64_t> sizes;
  for (int64_t dim : {0, 1}) {
    auto ref = cat_ref({a.contiguous(), b.contiguous()}, dim, &sizes);
    EXPECT_TRUE(matches(cat({a, b}, dim), sizes, ref));
  }
}

TEST(Cat, PromotesDtypesLikePyTorch) {
  Tensor i = seq({2, 2}, kInt64);
  Tensor f = seq({1, 2}, kFloat32, 0.5);
  Tensor h = seq({1, 2}, kFloat16, 0.25);
  Tensor bo = seq({1, 2}, kBool);
  EXPECT_EQ(cat({i, f}).dtype(), kFloat32);
  EXPECT_EQ(cat({h, f}).dtype(), kFloat32);
  EXPECT_EQ(cat({bo, i}).dtype(), kInt64);
  EXPECT_EQ(cat({i, seq({1, 2}, kInt32)}).dtype(), kInt64);
  std::vector<int64_t> sizes;
  EXPECT_TRUE(matches(cat({i, f}), {3, 2}, {0, 1, 2, 3, 0.5, 1.5}));
  EXPECT_TRUE(matches(cat({bo, i}), {3, 2}, {0, 1, 0, 1, 2, 3}));
}

TEST(Cat, LargeInputsUseEveryCopyPathCorrectly) {
  // Few big blocks (split across threads), many small blocks (row by row), and a mix with a
  // converting input.
  Tensor a = seq({2, 300, 64}, kFloat32), b = seq({2, 200, 64}, kFloat32, -7);
  std::vector<int64_t> sizes;
  auto ref = cat_ref({a, b}, 1, &sizes);
  EXPECT_TRUE(matches(cat({a, b}, 1), sizes, ref));
  Tensor c = seq({5000, 3}, kFloat64), d = seq({5000, 2}, kFloat64, 1e6);
  ref = cat_ref({c, d, c}, 1, &sizes);
  EXPECT_TRUE(matches(cat({c, d, c}, -1), sizes, ref));
  Tensor e = seq({5000, 2}, kFloat32, 3);
  ref = cat_ref({c, e}, 1, &sizes);
  EXPECT_TRUE(matches(cat({c, e}, 1), sizes, ref));
}

TEST(Cat, DenseNetStyleChannelConcat) {
  std::vector<Tensor> feats = {seq({2, 16, 5, 5}, kFloat32)};
  for (int i = 0; i < 4; ++i) {
    Tensor f = seq({2, 8, 5, 5}, kFloat32, 1000.0 * (i + 1), 0.5);
    std::vector<int64_t> sizes;
    auto ref = cat_ref({cat(feats, 1), f}, 1, &sizes);
    feats.push_back(f);
    EXPECT_TRUE(matches(cat(feats, 1), sizes, ref));
  }
}

TEST(Cat, EmptyTensorsAndLegacyEmptyVectors) {
  Tensor a = seq({2, 3}, kFloat32);
  Tensor z = seq({0, 3}, kFloat32);
  Tensor legacy = seq({0}, kFloat32);  // 1-D empty: skipped whatever the other shapes
  EXPECT_TRUE(matches(cat({a, z}), {2, 3}, values(a)));
  EXPECT_TRUE(matches(cat({legacy, a, legacy}, 1), {2, 3}, values(a)));
  EXPECT_TRUE(matches(cat({legacy, legacy}), {0}, {}));
  EXPECT_TRUE(matches(cat({seq({2, 0}, kFloat32), seq({2, 0}, kFloat32)}, 1), {2, 0}, {}));
  EXPECT_TRUE(matches(cat({seq({2, 0}, kFloat32), seq({2, 0}, kFloat32)}, 0), {4, 0}, {}));
}

TEST(Cat, OutputIsANewTensorNotAView) {
  Tensor a = seq({2}, kFloat32);
  Tensor out = cat({a});
  EXPECT_FALSE(out.is_alias_of(a));
  EXPECT_TRUE(matches(out, {2}, {0, 1}));
}

TEST(Cat, BadInputsThrowTheRightErrors) {
  EXPECT_THROW(cat({}), ValueError);
  try {
    cat({seq({2, 3}, kFloat32), seq({2, 4}, kFloat32)}, 0);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("Sizes of tensors must match except in dimension 0. Expected size 3 but "
                                         "got size 4 for tensor number 1 in the list."),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(cat({seq({2, 3}, kFloat32), seq({3}, kFloat32)}), ShapeError);
  EXPECT_THROW(cat({seq({}, kFloat32)}), ShapeError);
  EXPECT_THROW(cat({seq({2}, kFloat32)}, 1), IndexError);
  EXPECT_THROW(cat({seq({1}, kFloat32), fake_cuda_tensor({1})}), DeviceError);
}

// ---------------- stack ----------------

TEST(Stack, InsertsANewDimAtEveryPosition) {
  Tensor a = seq({2, 3}, kFloat64), b = seq({2, 3}, kFloat64, 10);
  auto va = values(a), vb = values(b);
  // dim 0: a then b.
  std::vector<double> ref0 = va;
  ref0.insert(ref0.end(), vb.begin(), vb.end());
  EXPECT_TRUE(matches(stack({a, b}), {2, 2, 3}, ref0));
  // dim 1: rows interleaved.
  std::vector<double> ref1;
  for (int i = 0; i < 2; ++i) {
    ref1.insert(ref1.end(), va.begin() + 3 * i, va.begin() + 3 * i + 3);
    ref1.insert(ref1.end(), vb.begin() + 3 * i, vb.begin() + 3 * i + 3);
  }
  EXPECT_TRUE(matches(stack({a, b}, 1), {2, 2, 3}, ref1));
  // dim -1: elements interleaved.
  std::vector<double> ref2;
  for (int i = 0; i < 6; ++i) {
    ref2.push_back(va[i]);
    ref2.push_back(vb[i]);
  }
  EXPECT_TRUE(matches(stack({a, b}, -1), {2, 3, 2}, ref2));
  EXPECT_TRUE(matches(stack({seq({}, kInt64, 4), seq({}, kInt64, 5)}), {2}, {4, 5}));
}

TEST(Stack, BadInputsThrow) {
  EXPECT_THROW(stack({}), ValueError);
  EXPECT_THROW(stack({seq({2, 3}, kFloat32), seq({2, 4}, kFloat32)}), ShapeError);
  EXPECT_THROW(stack({seq({2, 3}, kFloat32)}, 4), IndexError);
}

// ---------------- split / chunk ----------------

TEST(Split, BySizeReturnsViewsWithAShorterLastPiece) {
  Tensor x = seq({7, 2}, kFloat32);
  auto parts = split(x, 3);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_TRUE(matches(parts[0], {3, 2}, {0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(matches(parts[1], {3, 2}, {6, 7, 8, 9, 10, 11}));
  EXPECT_TRUE(matches(parts[2], {1, 2}, {12, 13}));
  for (const Tensor& p : parts) EXPECT_TRUE(p.is_alias_of(x));
  parts[2].fill_(-1.0);
  EXPECT_EQ(values(x)[12], -1.0);
  auto cols = x.split(1, -1);
  ASSERT_EQ(cols.size(), 2u);
  EXPECT_TRUE(matches(cols[1], {7, 1}, {1, 3, 5, 7, 9, 11, -1}));
  EXPECT_FALSE(cols[1].is_contiguous());
}

TEST(Split, BySizesAndEdgeCases) {
  Tensor x = seq({5}, kInt64);
  auto parts = split(x, std::vector<int64_t>{1, 0, 4});
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_TRUE(matches(parts[0], {1}, {0}));
  EXPECT_TRUE(matches(parts[1], {0}, {}));
  EXPECT_TRUE(matches(parts[2], {4}, {1, 2, 3, 4}));
  EXPECT_EQ(split(seq({0, 3}, kFloat32), 2).size(), 1u);
  EXPECT_EQ(split(seq({0, 3}, kFloat32), 0).size(), 1u);
  EXPECT_EQ(split(x, 10).size(), 1u);
}

TEST(Split, BadInputsThrow) {
  Tensor x = seq({5}, kInt64);
  EXPECT_THROW(split(x, -1), ValueError);
  EXPECT_THROW(split(x, 0), ValueError);
  EXPECT_THROW(split(x, std::vector<int64_t>{2, 2}), ShapeError);
  EXPECT_THROW(split(x, std::vector<int64_t>{-1, 6}), ValueError);
  EXPECT_THROW(split(seq({}, kFloat32), 1), ShapeError);
  EXPECT_THROW(split(x, 1, 1), IndexError);
}

TEST(Chunk, SplitsIntoCeilSizedViews) {
  Tensor x = seq({5, 2}, kFloat32);
  auto c = chunk(x, 3);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].size(0), 2);
  EXPECT_EQ(c[1].size(0), 2);
  EXPECT_EQ(c[2].size(0), 1);
  EXPECT_TRUE(c[2].is_alias_of(x));
  EXPECT_TRUE(matches(c[2], {1, 2}, {8, 9}));
  // 6 rows in 4 chunks: chunks of ceil(6/4) = 2, so only 3 of them (as in PyTorch).
  EXPECT_EQ(chunk(seq({6}, kFloat32), 4).size(), 3u);
  auto empties = seq({0, 2}, kFloat32).chunk(3);
  ASSERT_EQ(empties.size(), 3u);
  for (const Tensor& e : empties) EXPECT_EQ(e.sizes().vec(), (std::vector<int64_t>{0, 2}));
  auto cols = x.chunk(2, -1);
  EXPECT_TRUE(matches(cols[0], {5, 1}, {0, 2, 4, 6, 8}));
}

TEST(Chunk, BadInputsThrow) {
  EXPECT_THROW(chunk(seq({5}, kFloat32), 0), ValueError);
  EXPECT_THROW(chunk(seq({}, kFloat32), 1), ShapeError);
}

// ---------------- pad ----------------

namespace {

// Reference pad: every output position maps to input index o - left, which is replaced by
// `value` (constant), mirrored (reflect) or clamped (replicate) when it falls outside.
std::vector<double> pad_ref(const Tensor& x, const std::vector<int64_t>& pad, const std::string& mode,
                            double value, std::vector<int64_t>* out_sizes) {
  std::vector<int64_t> in = x.sizes().vec(), out = in;
  int64_t nd = static_cast<int64_t>(in.size()), k = static_cast<int64_t>(pad.size()) / 2;
  for (int64_t i = 0; i < k; ++i) out[nd - 1 - i] += pad[2 * i] + pad[2 * i + 1];
  *out_sizes = out;
  auto v = values(x);
  auto in_st = contiguous_strides(in);
  std::vector<double> r(numel_of(out));
  std::vector<int64_t> coord(nd, 0);
  for (size_t lin = 0; lin < r.size(); ++lin) {
    int64_t rem = static_cast<int64_t>(lin), off = 0;
    bool outside = false;
    for (int64_t d = nd - 1; d >= 0; --d) {
      coord[d] = rem % out[d];
      rem /= out[d];
    }
    for (int64_t d = 0; d < nd; ++d) {
      int64_t p = nd - 1 - d;  // pad pair index
      int64_t idx = coord[d] - (p < k ? pad[2 * p] : 0);
      int64_t n = in[d];
      if (idx < 0 || idx >= n) {
        if (mode == "constant") outside = true;
        else if (mode == "replicate") idx = std::clamp<int64_t>(idx, 0, n - 1);
        else {
          if (idx < 0) idx = -idx;
          if (idx >= n) idx = 2 * (n - 1) - idx;
        }
      }
      off += idx * in_st[d];
    }
    r[lin] = outside ? value : v[off];
  }
  return r;
}

}  // namespace

TEST(Pad, ConstantPadsAndCropsAnyTrailingDims) {
  struct Case {
    std::vector<int64_t> sizes, pad;
    double value;
  };
  for (const Case& c : std::vector<Case>{{{5}, {2, 1}, 0.0},
                                         {{3, 4}, {1, 2, 0, 1}, -1.5},
                                         {{3, 4}, {-1, 2}, 7.0},
                                         {{2, 3, 4}, {1, -2, -1, 0, 2, 1}, 3.0},
                                         {{2, 3}, {0, 0}, 1.0},
                                         {{2, 3}, {-2, -1}, 1.0}}) {
    for (DType dt : {kFloat32, kFloat64, kInt64, kBFloat16}) {
      Tensor x = seq(c.sizes, dt, 1);
      std::vector<int64_t> sizes;
      double v = dt == kInt64 ? std::trunc(c.value) : c.value;
      auto ref = pad_ref(x, c.pad, "constant", v, &sizes);
      EXPECT_TRUE(matches(pad(x, c.pad, "constant", v), sizes, ref)) << shape_str(c.sizes) << " " << dtype_name(dt);
    }
  }
}

TEST(Pad, ReflectAndReplicateIn1d2d3d) {
  struct Case {
    std::vector<int64_t> sizes, pad;
  };
  for (const std::string mode : {"reflect", "replicate"}) {
    for (const Case& c : std::vector<Case>{{{2, 5}, {2, 3}},
                                           {{2, 3, 5}, {4, 1}},
                                           {{1, 4, 4}, {1, 2, 3, 0}},
                                           {{2, 2, 3, 4}, {2, 2, 1, 1}},
                                           {{3, 3, 4, 3}, {1, 1, 2, 0, 1, 2}},
                                           {{1, 2, 3, 4, 5}, {1, 2, 1, 0, 2, 1}},
                                           {{1, 6}, {-2, 3}}}) {
      for (DType dt : {kFloat32, kFloat64, kInt64}) {
        Tensor x = seq(c.sizes, dt, 0, 3);
        std::vector<int64_t> sizes;
        auto ref = pad_ref(x, c.pad, mode, 0, &sizes);
        EXPECT_TRUE(matches(pad(x, c.pad, mode), sizes, ref)) << mode << " " << shape_str(c.sizes);
      }
    }
  }
}

TEST(Pad, NonContiguousInputs) {
  Tensor x = seq({4, 3}, kFloat32).t().unsqueeze(0);  // (1, 3, 4), non-contiguous
  for (const std::string mode : {"constant", "reflect", "replicate"}) {
    std::vector<int64_t> sizes;
    auto ref = pad_ref(x.contiguous(), {2, 1, 1, 2}, mode, 0, &sizes);
    EXPECT_TRUE(matches(pad(x, {2, 1, 1, 2}, mode), sizes, ref)) << mode;
  }
}

TEST(Pad, BadInputsThrow) {
  Tensor x = seq({1, 2, 3}, kFloat32);
  EXPECT_THROW(pad(x, {1, 1, 1}), ValueError);               // odd length
  EXPECT_THROW(pad(x, {1, 1, 1, 1, 1, 1, 1, 1}), ValueError);  // more pairs than dims
  EXPECT_THROW(pad(x, {3, 0}, "reflect"), ValueError);        // pad >= input size
  EXPECT_THROW(pad(x, {1, 1}, "circular"), ValueError);
  EXPECT_THROW(pad(x, {1, 1}, "reflect", 2.0), ValueError);
  EXPECT_THROW(pad(seq({5}, kFloat32), {1, 1}, "reflect"), ShapeError);  // 1-D input
  EXPECT_THROW(pad(x, {-3, -1}, "replicate"), ShapeError);               // empty output
  EXPECT_THROW(pad(x, {-2, -2}), ShapeError);                            // negative size
}
