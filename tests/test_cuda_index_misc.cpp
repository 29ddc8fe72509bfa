// The CUDA kernels of the indexing ops, nll_loss, the random ops, the range factories, cat and
// constant_pad_nd, against the CPU kernels on the same inputs: bit for bit for moves, random
// streams and ranges, within tolerances for losses. GPU tests skip when no GPU is visible; the
// CudaJit tests compile every generated kernel source with NVRTC for sm_90 without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_helpers.h"
#include "kiln/kiln.h"
#include "kiln/op_table.h"
#include "reference.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/jit.h"
#include "kernels/cuda/misc_kernels.h"

using namespace kiln;
using kiln::testing::op;

namespace {

const std::vector<DType> kAllDTypes = {kBool,    DType::uint8, DType::int8, DType::int32, DType::int64,
                                       kFloat16, kBFloat16,    kFloat32,    kFloat64};

// Values every dtype holds exactly (small integers and halves), so sums do not depend on order.
Tensor sample(std::vector<int64_t> sizes, DType dtype, int seed = 0) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(((i * 37 + seed * 11) % 23) - 11) * 0.5;
  if (dtype == DType::uint8) for (double& x : v) x = std::abs(x);
  return tensor<double>(v, sizes).to(dtype);
}

Tensor longs(std::vector<int64_t> v, std::vector<int64_t> sizes = {}) {
  if (sizes.empty()) sizes = {static_cast<int64_t>(v.size())};
  return tensor<int64_t>(v, sizes);
}

// Bitwise equality of values (NaNs equal, and the signs of zeros), dtype and shape.
::testing::AssertionResult same(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << "shapes differ: " << shape_str(a.sizes()) << " vs " << shape_str(b.sizes());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) && std::isnan(vb[i])) continue;
    if (va[i] != vb[i] || std::signbit(va[i]) != std::signbit(vb[i]))
      return ::testing::AssertionFailure() << "element " << i << ": " << va[i] << " vs " << vb[i];
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult close(const Tensor& got, const Tensor& want, double rtol, double atol) {
  if (got.dtype() != want.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  return kiln::testing::matches(got, want.sizes().vec(), want.to_vector<double>(), kiln::testing::Tolerance{rtol, atol});
}

// The IndexError (or other kiln::Error) message of f(), or "" when it does not throw.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

Tensor dev(const Tensor& t) { return t.cuda(); }

}  // namespace

// ---- without a GPU: every generated source compiles ----

namespace {
void compile_all(const std::vector<std::pair<std::string, std::string>>& sources) {
  ASSERT_FALSE(sources.empty());
  for (const auto& [label, src] : sources) {
    SCOPED_TRACE(label);
    EXPECT_NO_THROW(cuda::detail::compile_cubin(src, 90, label)) << src;
  }
}
}  // namespace

TEST(CudaJit, IndexKernelSourcesCompile) { compile_all(cuda::detail::index_sources_for_test()); }
TEST(CudaJit, LossKernelSourcesCompile) { compile_all(cuda::detail::loss_sources_for_test()); }
TEST(CudaJit, RandomKernelSourcesCompile) { compile_all(cuda::detail::random_sources_for_test()); }
TEST(CudaJit, RangeKernelSourcesCompile) { compile_all(cuda::detail::shape_sources_for_test()); }

// ---- indexing ----

TEST(CudaIndex, IndexSelectAndGatherMatchTheCpuForEveryDType) {
  SKIP_WITHOUT_GPU();
  for (DType t : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor x = sample({5, 6, 7}, t, 1);
    for (int64_t dim : {0, 1, 2, -1}) {
      Tensor idx = longs({4, 0, 4, 2});
      EXPECT_TRUE(same(index_select(dev(x), dim, dev(idx)).cpu(), index_select(x, dim, idx)));
      EXPECT_TRUE(same(index_select(dev(x), dim, dev(idx.to(kInt32))).cpu(), index_select(x, dim, idx.to(kInt32))));
    }
    // Non-contiguous source, a 0-dim source, an empty index.
    Tensor xt = x.transpose(0, 2);
    EXPECT_TRUE(same(index_select(dev(x).transpose(0, 2), 1, dev(longs({5, 1}))).cpu(), index_select(xt, 1, longs({5, 1}))));
    Tensor s = x.flatten()[3];
    EXPECT_TRUE(same(index_select(dev(s), 0, dev(longs({0}))).cpu(), index_select(s, 0, longs({0}))));
    EXPECT_TRUE(same(index_select(dev(x), 1, dev(longs({}))).cpu(), index_select(x, 1, longs({}))));

    Tensor gidx = tensor<int64_t>({0, 4, 1, 3, 3, 2, 0, 0, 1, 4, 2, 2}, {2, 3, 2});
    for (int64_t dim : {0, 1, 2}) {
      Tensor g = remainder(gidx, 5);  // in range for every dim of x and xt
      EXPECT_TRUE(same(gather(dev(x), dim, dev(g)).cpu(), gather(x, dim, g)));
      // Non-contiguous source and index.
      EXPECT_TRUE(same(gather(dev(xt), dim, dev(g).transpose(0, 2)).cpu(), gather(xt, dim, g.transpose(0, 2))));
    }
    Tensor zero_dim = tensor<int64_t>({0}, {});
    EXPECT_TRUE(same(gather(dev(s), 0, dev(zero_dim)).cpu(), gather(s, 0, zero_dim)));
    EXPECT_TRUE(same(gather(dev(x), 1, dev(longs({}, {0, 3, 2}))).cpu(), gather(x, 1, longs({}, {0, 3, 2}))));
  }
}

TEST(CudaIndex, ScatterAndScatterAddMatchTheCpuAndAccumulateDuplicates) {
  SKIP_WITHOUT_GPU();
  for (DType t : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor x = sample({4, 5}, t, 2);
    Tensor src = sample({3, 5}, t, 3);
    // Duplicates along dim 0: scatter_add adds them all (exact values: order does not matter).
    Tensor idx = tensor<int64_t>({1, 1, 3, 0, 2, 1, 1, 0, 0, 2, 1, 3, 1, 1, 2}, {3, 5});
    EXPECT_TRUE(same(scatter_add(dev(x), 0, dev(idx), dev(src)).cpu(), scatter_add(x, 0, idx, src)));
    Tensor unique = tensor<int64_t>({0, 1, 2, 3, 4, 4, 3, 2, 1, 0}, {2, 5});
    EXPECT_TRUE(same(scatter(dev(x), 1, dev(unique), dev(src)).cpu(), scatter(x, 1, unique, src)));
    EXPECT_TRUE(same(scatter(dev(x), 1, dev(unique), 2.5).cpu(), scatter(x, 1, unique, 2.5)));
    // In place through a transposed view.
    Tensor h = x.clone(), d = dev(x);
    h.t().scatter_add_(1, idx.narrow(0, 0, 2).t().contiguous(), src.narrow(0, 0, 2).t());
    d.t().scatter_add_(1, dev(idx.narrow(0, 0, 2).t().contiguous()), dev(src).narrow(0, 0, 2).t());
    EXPECT_TRUE(same(d.cpu(), h));
    // Empty index: a copy of self.
    EXPECT_TRUE(same(scatter_add(dev(x), 0, dev(longs({}, {0, 5})), dev(src)).cpu(), x));
  }
  // float32 sums of inexact values: equal up to the order of the additions.
  Tensor x = rand({50, 8}), src = rand({400, 8});
  Tensor idx = randint(0, 50, {400, 8});
  EXPECT_TRUE(close(scatter_add(dev(x), 0, dev(idx), dev(src)).cpu(), scatter_add(x, 0, idx, src), 1e-5, 1e-5));
}

TEST(CudaIndex, AdvancedIndexAndIndexPutMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (DType t : {kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, DType::int8, kBool}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor x = sample({4, 5, 6}, t, 4);
    Tensor i0 = longs({3, -1, 0, 2}), i1 = longs({4, 0, -5, 1}).view({4, 1}), i2 = longs({4, 0, 1, 1});
    auto both = [&](const std::vector<Tensor>& idx) {
      std::vector<Tensor> d;
      for (const Tensor& i : idx) d.push_back(i.defined() ? dev(i) : i);
      return same(index(dev(x), d).cpu(), index(x, idx));
    };
    EXPECT_TRUE(both({i0}));
    EXPECT_TRUE(both({Tensor(), i0}));                       // adjacent, after a full dim
    EXPECT_TRUE(both({i0.view({4, 1}), i2}));                // broadcast to (4, 4)
    EXPECT_TRUE(both({i0, Tensor(), i2}));                   // separated: index dims first
    EXPECT_TRUE(both({Tensor(), i1, longs({1, 2, 3, 4})}));  // broadcast (4, 1) with (4,)
    EXPECT_TRUE(both({longs({})}));
    // Indices on the CPU next to a CUDA self, int32 indices, a non-contiguous self, a bool mask.
    EXPECT_TRUE(same(index(dev(x), {i0}).cpu(), index(x, {i0})));
    EXPECT_TRUE(same(index(dev(x), {i0.to(kInt32)}).cpu(), index(x, {i0.to(kInt32)})));
    EXPECT_TRUE(same(index(dev(x).transpose(0, 2), {i2}).cpu(), index(x.transpose(0, 2), {i2})));
    Tensor mask = gt(sample({4, 5}, kFloat32, 5), 0.0);
    EXPECT_TRUE(same(index(dev(x), {dev(mask)}).cpu(), index(x, {mask})));

    Tensor v = sample({4, 6}, t, 6);
    EXPECT_TRUE(same(index_put(dev(x), {dev(i0), dev(longs({1, 2, 2, 3}))}, dev(v)).cpu(),  // distinct positions
                     index_put(x, {i0, longs({1, 2, 2, 3})}, v)));
    // Repeated indices accumulate (exact values); values broadcast.
    Tensor rep = longs({1, 1, 3, 1});
    EXPECT_TRUE(same(index_put(dev(x), {dev(rep)}, dev(sample({4, 5, 6}, t, 7)), true).cpu(),
                     index_put(x, {rep}, sample({4, 5, 6}, t, 7), true)));
    EXPECT_TRUE(same(index_put(dev(x), {Tensor(), dev(longs({0, 0, 4}))}, dev(sample({6}, t, 8)), true).cpu(),
                     index_put(x, {Tensor(), longs({0, 0, 4})}, sample({6}, t, 8), true)));
    EXPECT_TRUE(same(index_put(dev(x), {dev(mask)}, dev(sample({6}, t, 9))).cpu(), index_put(x, {mask}, sample({6}, t, 9))));
    // In place through an index expression.
    Tensor h = x.clone(), d = dev(x);
    h.index_put_({TensorIndex(Slice()), TensorIndex(longs({2, 0}))}, sample({4, 2, 6}, t, 10));
    d.index_put_({TensorIndex(Slice()), TensorIndex(dev(longs({2, 0})))}, dev(sample({4, 2, 6}, t, 10)));
    EXPECT_TRUE(same(d.cpu(), h));
  }
  // float32 accumulation of many inexact values into few rows.
  Tensor x = zeros({7, 16}), v = rand({1000, 16});
  Tensor rows = randint(0, 7, {1000});
  EXPECT_TRUE(close(index_put(dev(x), {dev(rows)}, dev(v), true).cpu(), index_put(x, {rows}, v, true), 1e-5, 1e-4));
}

TEST(CudaIndex, EmbeddingForwardAndBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensor idx = tensor<int64_t>({3, 0, 3, 9, 1, 3}, {2, 3});
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor w = sample({10, 4}, t, 11);
    EXPECT_TRUE(same(embedding(dev(w), dev(idx)).cpu(), embedding(w, idx)));
    EXPECT_TRUE(same(embedding(dev(w), dev(idx.to(kInt32))).cpu(), embedding(w, idx.to(kInt32))));
    EXPECT_TRUE(same(embedding(dev(w).t().contiguous().t(), dev(idx)).cpu(), embedding(w, idx)));
    Tensor g = sample({2, 3, 4}, t, 12);
    for (int64_t pad : {-1, 3}) {
      for (bool scale : {false, true}) {
        SCOPED_TRACE("padding_idx " + std::to_string(pad) + (scale ? " scaled" : ""));
        const OpDef& backward = op("embedding_dense_backward");
        Tensor want = call_op1(backward, {g, idx}, {int64_t{10}, pad, scale});
        Tensor got = call_op1(backward, {dev(g), dev(idx)}, {int64_t{10}, pad, scale}).cpu();
        const double tol = t == kFloat16 || t == kBFloat16 ? 1e-2 : 1e-6;
        if (scale) EXPECT_TRUE(close(got, want, tol, tol));  // a * (1/3) summed in another order
        else EXPECT_TRUE(same(got, want));
      }
    }
  }
  // Many repeated indices (embedding's gradient is the atomics' worst case).
  Tensor big = randint(0, 5, {5000});
  Tensor g = rand({5000, 32});
  const OpDef& backward = op("embedding_dense_backward");
  EXPECT_TRUE(close(call_op1(backward, {dev(g), dev(big)}, {int64_t{5}, int64_t{-1}, false}).cpu(),
                    call_op1(backward, {g, big}, {int64_t{5}, int64_t{-1}, false}), 1e-5, 1e-3));
}

TEST(CudaIndex, OneHotMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  Tensor i = tensor<int64_t>({2, 0, 4, 4, 1, 3}, {3, 2});
  EXPECT_TRUE(same(one_hot(dev(i), 6).cpu(), one_hot(i, 6)));
  EXPECT_TRUE(same(one_hot(dev(i)).cpu(), one_hot(i)));
  EXPECT_TRUE(same(one_hot(dev(i).t(), 5).cpu(), one_hot(i.t(), 5)));
  EXPECT_TRUE(same(one_hot(dev(longs({})), 3).cpu(), one_hot(longs({}), 3)));
}

// Out-of-range indices throw the CPU's IndexError before anything is written.
TEST(CudaIndex, OutOfRangeIndicesThrowTheCpuErrorAndWriteNothing) {
  SKIP_WITHOUT_GPU();
  Tensor x = sample({4, 5}, kFloat32, 13);
  Tensor bad = longs({1, 4, 0});
  auto same_error = [](auto cpu_call, auto cuda_call) {
    std::string want = message_of<IndexError>(cpu_call), got = message_of<IndexError>(cuda_call);
    EXPECT_FALSE(want.empty());
    EXPECT_EQ(got, want);
  };
  same_error([&] { index_select(x, 0, bad); }, [&] { index_select(dev(x), 0, dev(bad)); });
  same_error([&] { index_select(x, 1, longs({-1})); }, [&] { index_select(dev(x), 1, dev(longs({-1}))); });
  same_error([&] { gather(x, 0, bad.view({3, 1})); }, [&] { gather(dev(x), 0, dev(bad.view({3, 1}))); });
  same_error([&] { embedding(x, longs({2, 7})); }, [&] { embedding(dev(x), dev(longs({2, 7}))); });
  same_error([&] { index(x, {longs({0, -5})}); }, [&] { index(dev(x), {dev(longs({0, -5}))}); });
  same_error([&] { index(x, {Tensor(), longs({5})}); }, [&] { index(dev(x), {Tensor(), longs({5})}); });
  same_error([&] { one_hot(longs({1, -2}), 3); }, [&] { one_hot(dev(longs({1, -2})), 3); });
  same_error([&] { one_hot(longs({1, 3}), 3); }, [&] { one_hot(dev(longs({1, 3})), 3); });
  const OpDef& backward = op("embedding_dense_backward");
  same_error([&] { call_op1(backward, {ones({2, 5}), longs({0, 4})}, {int64_t{4}, int64_t{-1}, false}); },
             [&] { call_op1(backward, {dev(ones({2, 5})), dev(longs({0, 4}))}, {int64_t{4}, int64_t{-1}, false}); });
  // In-place forms leave self untouched.
  Tensor d = dev(x);
  same_error([&] { x.clone().scatter_(0, bad.view({3, 1}), 1.0); }, [&] { d.scatter_(0, dev(bad.view({3, 1})), 1.0); });
  same_error([&] { x.clone().scatter_add_(1, longs({0, 9}).view({1, 2}), ones({1, 2})); },
             [&] { d.scatter_add_(1, dev(longs({0, 9}).view({1, 2})), dev(ones({1, 2}))); });
  same_error([&] { x.clone().index_put_({TensorIndex(longs({0, 4}))}, ones({5})); },
             [&] { d.index_put_({TensorIndex(dev(longs({0, 4})))}, dev(ones({5}))); });
  EXPECT_TRUE(same(d.cpu(), x));
}

// ---- nll_loss ----

TEST(CudaLoss, NllLossForwardAndBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const OpDef& forward = op("nll_loss_forward");
  const OpDef& backward = op("nll_loss_backward");
  struct Case {
    std::vector<int64_t> input, target;
  };
  for (const Case& c : {Case{{5}, {}}, Case{{6, 5}, {6}}, Case{{3, 5, 4, 2}, {3, 4, 2}}, Case{{0, 5}, {0}},
                        Case{{2000, 7}, {2000}}}) {
    for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
      SCOPED_TRACE(shape_str(c.input) + " " + std::string(dtype_name(t)));
      Tensor x = (randn(c.input) * 2).to(t);
      Tensor target = randint(0, 5, c.target);
      if (target.numel() > 2) target.flatten()[1].fill_(-100);  // ignored
      Tensor weight = (rand({c.input.size() == 1 ? c.input[0] : c.input[1]}) + 0.5).to(t);
      const auto [rtol, atol] = t == kFloat16 ? std::pair{2e-3, 2e-3} : t == kBFloat16 ? std::pair{1.6e-2, 1.6e-2}
                                                                                      : std::pair{1e-6, 1e-6};
      for (int64_t reduction : {0, 1, 2}) {
        for (bool weighted : {false, true}) {
          SCOPED_TRACE("reduction " + std::to_string(reduction) + (weighted ? " weighted" : ""));
          Tensor w = weighted ? weight : Tensor();
          auto want = call_op(forward, {x, target, w}, {reduction, int64_t{-100}});
          auto got = call_op(forward, {dev(x), dev(target), weighted ? dev(w) : w}, {reduction, int64_t{-100}});
          EXPECT_TRUE(close(got[0].cpu(), want[0], rtol, atol));
          EXPECT_TRUE(close(got[1].cpu(), want[1], rtol, atol));
          Tensor g = reduction == 0 ? (rand(c.target) + 0.5).to(t) : tensor<double>({1.5}, {}).to(t);
          Tensor gw = call_op1(backward, {g, target, w, want[1]}, {c.input, reduction, int64_t{-100}});
          Tensor gg = call_op1(backward, {dev(g), dev(target), weighted ? dev(w) : w, dev(want[1])},
                               {c.input, reduction, int64_t{-100}});
          EXPECT_TRUE(same(gg.cpu(), gw));  // the same arithmetic per element
        }
      }
    }
  }
  // The public loss on a non-contiguous input.
  Tensor x = randn({5, 8}), target = randint(0, 5, {8});
  EXPECT_TRUE(close(nll_loss(dev(x).t(), dev(target)).cpu(), nll_loss(x.t(), target), 1e-6, 1e-6));
  EXPECT_TRUE(close(cross_entropy(dev(x).t(), dev(target)).cpu(), cross_entropy(x.t(), target), 1e-5, 1e-6));
}

TEST(CudaLoss, OutOfRangeTargetsThrowTheCpuError) {
  SKIP_WITHOUT_GPU();
  Tensor x = randn({4, 3});
  Tensor target = longs({0, 3, -100, 1});
  std::string want = message_of<IndexError>([&] { nll_loss(x, target); });
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(message_of<IndexError>([&] { nll_loss(dev(x), dev(target)); }), want);
  const OpDef& backward = op("nll_loss_backward");
  Tensor tw = tensor<float>({2.0f}, {});
  want = message_of<IndexError>(
      [&] { call_op1(backward, {ones({}), longs({-1, 0, 0, 0}), Tensor(), tw}, {std::vector<int64_t>{4, 3}, int64_t{1}, int64_t{-100}}); });
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(message_of<IndexError>([&] {
              call_op1(backward, {dev(ones({})), dev(longs({-1, 0, 0, 0})), Tensor(), dev(tw)},
                       {std::vector<int64_t>{4, 3}, int64_t{1}, int64_t{-100}});
            }),
            want);
}

// ---- random ----

// The same generator state gives the same numbers on both devices.
TEST(CudaRandom, StreamsEqualTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  auto both = [](auto make) {
    manual_seed(1234);
    Tensor want = make(kCPU);
    manual_seed(1234);
    Tensor got = make(cuda_device());
    return std::pair{got.cpu(), want};
  };
  for (int64_t n : {1, 3, 4, 7, 1000, 4099}) {
    SCOPED_TRACE("numel " + std::to_string(n));
    for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
      SCOPED_TRACE(std::string(dtype_name(t)));
      auto [u, u_cpu] = both([&](Device d) { return rand({n}, TensorOptions(t, d)); });
      EXPECT_TRUE(same(u, u_cpu));
      auto [z, z_cpu] = both([&](Device d) { return randn({n}, TensorOptions(t, d)); });
      if (t == kFloat64) EXPECT_TRUE(close(z, z_cpu, 1e-14, 1e-14));  // CUDA's log/cos/sin vs glibc's
      else EXPECT_TRUE(same(z, z_cpu));
      auto [b, b_cpu] = both([&](Device d) { return bernoulli(full({n}, 0.3, TensorOptions(t, d))); });
      EXPECT_TRUE(same(b, b_cpu));
      auto [bp, bp_cpu] = both([&](Device d) { return bernoulli(rand({n}, TensorOptions(t, d)).clone()); });
      EXPECT_TRUE(same(bp, bp_cpu));
      auto [dr, dr_cpu] = both([&](Device d) { return dropout(ones({n}, TensorOptions(t, d)) * 3, 0.25); });
      EXPECT_TRUE(same(dr, dr_cpu));
    }
    for (DType t : kAllDTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)));
      const int64_t high = t == kBool ? 2 : t == DType::int8 ? 100 : 120;
      auto [r, r_cpu] = both([&](Device d) { return randint(0, high, {n}, TensorOptions(t, d)); });
      EXPECT_TRUE(same(r, r_cpu));
      auto [bs, bs_cpu] = both([&](Device d) { return bernoulli(zeros({n}, TensorOptions(t, d)), 0.7); });
      EXPECT_TRUE(same(bs, bs_cpu));
    }
    // 64-bit draws for randint ranges past 2^32.
    auto [wide, wide_cpu] = both([&](Device d) {
      return randint(-(int64_t{1} << 40), int64_t{1} << 41, {n}, TensorOptions(kInt64, d));
    });
    EXPECT_TRUE(same(wide, wide_cpu));
  }
  // Parameters, in-place fills of strided views (logical order) and dropout's mask.
  auto [u, u_cpu] = both([](Device d) {
    Tensor x = zeros({6, 5}, TensorOptions(kFloat32, d));
    x.t().narrow(0, 1, 3).uniform_(-2.0, 3.0);
    x.narrow(0, 4, 2).normal_(1.5, 0.25);
    return x;
  });
  EXPECT_TRUE(same(u, u_cpu));
  auto [m, m_cpu] = both([](Device d) {
    auto r = call_op(op("native_dropout"), {ones({33}, TensorOptions(kFloat16, d))}, {0.4, true, int64_t{7}, int64_t{9}});
    return cat({r[0], r[1].to(kFloat16)});
  });
  EXPECT_TRUE(same(m, m_cpu));
  Tensor eval = dropout(dev(ones({4})), 0.5, false);
  EXPECT_TRUE(same(eval.cpu(), ones({4})));
}

TEST(CudaRandom, BernoulliChecksProbabilitiesBeforeWriting) {
  SKIP_WITHOUT_GPU();
  Tensor p = tensor<float>({0.5f, 1.5f, -1.0f}, {3});
  std::string want = message_of<ValueError>([&] { bernoulli(p); });
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(message_of<ValueError>([&] { bernoulli(dev(p)); }), want);
  Tensor nan = tensor<double>({0.25, std::nan("")}, {2});
  want = message_of<ValueError>([&] { bernoulli(nan); });
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(message_of<ValueError>([&] { bernoulli(dev(nan)); }), want);
}

// ---- range factories, cat, constant_pad_nd ----

TEST(CudaRange, ArangeLinspaceEyeMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  auto on = [](DType t, Device d) { return TensorOptions(t, d); };
  for (DType t : {DType::uint8, DType::int8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    EXPECT_TRUE(same(arange(0, 100, 3, on(t, cuda_device())).cpu(), arange(0, 100, 3, on(t, kCPU))));
    if (is_floating_point(t)) {
      EXPECT_TRUE(same(arange(-1.5, 2.7, 0.1, on(t, cuda_device())).cpu(), arange(-1.5, 2.7, 0.1, on(t, kCPU))));
      EXPECT_TRUE(same(arange(0.0, 1.0, 1.0 / 3000, on(t, cuda_device())).cpu(), arange(0.0, 1.0, 1.0 / 3000, on(t, kCPU))));
    }
    for (int64_t steps : {0, 1, 2, 7, 100, 1001}) {
      EXPECT_TRUE(same(linspace(-3.3, 7.9, steps, on(t, cuda_device())).cpu(), linspace(-3.3, 7.9, steps, on(t, kCPU))));
      EXPECT_TRUE(same(linspace(100, 0, steps, on(t, cuda_device())).cpu(), linspace(100, 0, steps, on(t, kCPU))));
    }
  }
  for (DType t : kAllDTypes) {
    EXPECT_TRUE(same(eye(5, 7, on(t, cuda_device())).cpu(), eye(5, 7, on(t, kCPU))));
    EXPECT_TRUE(same(eye(4, {}, on(t, cuda_device())).cpu(), eye(4, {}, on(t, kCPU))));
    EXPECT_TRUE(same(eye(0, 3, on(t, cuda_device())).cpu(), eye(0, 3, on(t, kCPU))));
  }
  EXPECT_THROW(arange(0, 3, 1, on(kBool, cuda_device())), Error);
}

TEST(CudaShape, CatMatchesTheCpuForEveryLayout) {
  SKIP_WITHOUT_GPU();
  for (DType t : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor a = sample({2, 3, 4, 5}, t, 1), b = sample({2, 2, 4, 5}, t, 2), c = sample({2, 1, 4, 5}, t, 3);
    for (int64_t dim : {0, 1, 3}) {
      auto resized = [&](int64_t n) {
        std::vector<int64_t> s = a.sizes().vec();
        s[dim] = n;
        return sample(s, t, static_cast<int>(n));
      };
      Tensor x = resized(2), y = resized(3), z = resized(1);
      EXPECT_TRUE(same(cat({dev(x), dev(y), dev(z)}, dim).cpu(), cat({x, y, z}, dim)));
    }
    // Channels-last inputs give a channels-last output.
    auto cl = [](const Tensor& x) { return x.contiguous(MemoryFormat::channels_last); };
    Tensor got = cat({dev(cl(a)), dev(cl(b)), dev(cl(c))}, 1);
    Tensor want = cat({cl(a), cl(b), cl(c)}, 1);
    EXPECT_EQ(got.strides(), want.strides());
    EXPECT_TRUE(same(got.cpu(), want));
    // Mixed layouts, a transposed input, a legacy empty input, promotion.
    EXPECT_TRUE(same(cat({dev(a), dev(cl(b)), dev(c).transpose(2, 3).contiguous().transpose(2, 3)}, 1).cpu(),
                     cat({a, cl(b), c}, 1)));
    EXPECT_TRUE(same(cat({dev(a), dev(zeros({0}, t))}, 0).cpu(), cat({a, zeros({0}, t)}, 0)));
    EXPECT_TRUE(same(cat({dev(a), dev(b.to(kFloat64))}, 1).cpu(), cat({a, b.to(kFloat64)}, 1)));
  }
  // Many inputs: more than one launch holds (120), in rows of 8 to 24 bytes (2-byte and 4-byte
  // units), and DenseNet's case: channels-last feature maps whose rows take 16-byte units, one
  // of them large enough for its blocks to stride.
  std::vector<Tensor> parts, dparts;
  for (int i = 0; i < 130; ++i) {
    parts.push_back(sample({3, i % 4, 2}, i % 3 == 0 ? kFloat16 : kFloat32, i).to(kFloat32));
    dparts.push_back(dev(parts.back()));
  }
  EXPECT_TRUE(same(cat(dparts, 1).cpu(), cat(parts, 1)));
  std::vector<Tensor> maps, dmaps;
  for (int64_t c : {64, 32, 4, 12}) {
    maps.push_back(sample({16, c, 32, 32}, kFloat32, static_cast<int>(c)).contiguous(MemoryFormat::channels_last));
    dmaps.push_back(dev(maps.back()));
  }
  EXPECT_TRUE(same(cat(dmaps, 1).cpu(), cat(maps, 1)));
}

TEST(CudaShape, ConstantPadMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  for (DType t : {kFloat32, kFloat16, kInt64, kBool}) {
    Tensor x = sample({2, 3, 4, 5}, t, 4);
    for (std::vector<int64_t> p : {std::vector<int64_t>{1, 2}, {0, 0, 2, 1}, {-1, 2, 1, -2}, {1, 1, 1, 1, 1, 1},
                                   {-1, -1}, {2, 0, 0, 0, 0, 0, 0, 1}}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " " + shape_str(p));
      EXPECT_TRUE(same(pad(dev(x), p, "constant", 1.0).cpu(), pad(x, p, "constant", 1.0)));
      EXPECT_TRUE(same(pad(dev(x).transpose(1, 3), p).cpu(), pad(x.transpose(1, 3), p)));
    }
  }
}

#endif  // KILN_WITH_CUDA
