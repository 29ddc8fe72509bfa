// Tensor basics: construction, views and aliasing, copies, type promotion, dtype round trips.
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;

TEST(TensorCore, FullHasShapeDtypeAndValues) {
  Tensor t = full({2, 3}, 1.5);
  EXPECT_EQ(t.dim(), 2);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.dtype(), kFloat32);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(matches(t, {2, 3}, std::vector<double>(6, 1.5)));
  EXPECT_EQ(full({2}, int64_t{7}).dtype(), kInt64);
  EXPECT_EQ(full({2}, true).dtype(), kBool);
}

TEST(TensorCore, CpuStorageIs64ByteAligned) {
  for (int64_t n : {1, 3, 17, 1000}) {
    Tensor t = full({n}, 0.0f);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data_ptr()) % 64, 0u);
  }
}

TEST(TensorCore, ViewsShareStorageAndWritesAreVisible) {
  Tensor base = tensor<float>({0, 1, 2, 3, 4, 5});
  Tensor v = base.view({2, 3});
  Tensor tr = v.t();
  EXPECT_TRUE(tr.is_alias_of(base));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.strides().vec(), (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(matches(tr, {3, 2}, {0, 3, 1, 4, 2, 5}));
  uint64_t before = base.version();
  tr.select(0, 1).fill_(9.0);
  EXPECT_GT(base.version(), before);
  EXPECT_TRUE(matches(base, {6}, {0, 9, 2, 3, 9, 5}));
}

TEST(TensorCore, SliceWithStepAndNegativeBounds) {
  Tensor x = tensor<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_TRUE(matches(x.slice(0, 1, 8, 3), {3}, {1, 4, 7}));
  EXPECT_TRUE(matches(x.slice(0, -3), {3}, {7, 8, 9}));
  EXPECT_TRUE(matches(x.slice(0, 20, 30), {0}, {}));
  EXPECT_TRUE(matches(x.narrow(0, 2, 3), {3}, {2, 3, 4}));
}

TEST(TensorCore, ReshapeCopiesOnlyWhenItMust) {
  Tensor x = tensor<float>({0, 1, 2, 3, 4, 5}).view({2, 3});
  EXPECT_TRUE(x.reshape({3, 2}).is_alias_of(x));
  Tensor y = x.t().reshape({6});
  EXPECT_FALSE(y.is_alias_of(x));
  EXPECT_TRUE(matches(y, {6}, {0, 3, 1, 4, 2, 5}));
  EXPECT_THROW(x.t().view({6}), ShapeError);
  EXPECT_TRUE(matches(x.reshape({-1}), {6}, {0, 1, 2, 3, 4, 5}));
  EXPECT_THROW(x.reshape({4, -1}), ShapeError);
}

TEST(TensorCore, SqueezeUnsqueezeFlattenUnflattenExpand) {
  Tensor x = full({2, 1, 3}, 1.0f);
  EXPECT_EQ(x.squeeze().sizes().vec(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(x.squeeze(0).sizes().vec(), (std::vector<int64_t>{2, 1, 3}));
  EXPECT_EQ(x.unsqueeze(-1).sizes().vec(), (std::vector<int64_t>{2, 1, 3, 1}));
  EXPECT_EQ(x.flatten().sizes().vec(), (std::vector<int64_t>{6}));
  EXPECT_EQ(x.flatten().unflatten(0, {3, -1}).sizes().vec(), (std::vector<int64_t>{3, 2}));
  Tensor e = x.expand({4, 2, 5, 3});
  EXPECT_EQ(e.strides()[0], 0);
  EXPECT_EQ(e.strides()[2], 0);
  EXPECT_THROW(x.expand({3, 1, 3}), ShapeError);
  EXPECT_EQ(x.movedim(2, 0).sizes().vec(), (std::vector<int64_t>{3, 2, 1}));
}

TEST(TensorCore, AsStridedIsBoundsChecked) {
  Tensor x = tensor<float>({0, 1, 2, 3, 4, 5});
  EXPECT_TRUE(matches(x.as_strided({2, 2}, {1, 2}), {2, 2}, {0, 2, 1, 3}));
  EXPECT_THROW(x.as_strided({2, 2}, {3, 3}), IndexError);
  EXPECT_THROW(x.as_strided({2}, {1}, 5), IndexError);
}

// Issue 18.5: sizes x strides that overflow int64 must not wrap around into the storage.
TEST(TensorCore, AsStridedBoundsAreCheckedWithoutOverflow) {
  Tensor x = ones({4});
  auto rejects = [&](std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset) {
    try {
      x.as_strided(sizes, strides, offset);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("[kiln::as_strided]"), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "as_strided accepted sizes " << shape_str(sizes) << " strides " << shape_str(strides);
  };
  rejects({2, 2}, {INT64_MAX, 1}, 0);
  rejects({2, 2}, {int64_t{1} << 61, INT64_MAX - (int64_t{1} << 61) + 1}, 0);
  rejects({3}, {INT64_MAX / 2 + 1}, 0);
  rejects({2}, {1}, INT64_MAX);
  rejects({int64_t{1} << 62, 4}, {1, 1}, 0);
  rejects({2}, {-1}, 1);
  // What fits still works, including size-0 dims whose strides reach nowhere.
  EXPECT_EQ(x.as_strided({0, 2}, {INT64_MAX, 1}).numel(), 0);
  Tensor v = x.as_strided({2, 2}, {2, 1});
  v.fill_(3);
  EXPECT_TRUE(matches(x, {4}, {3, 3, 3, 3}));
}

// Issue 18.7: every tensor has at most kMaxDims dimensions, so nothing (the printer included)
// can recurse without bound.
TEST(TensorCore, DimensionsAreBounded) {
  EXPECT_THROW(ones(std::vector<int64_t>(100000, 1)), ShapeError);
  Tensor deep = ones(std::vector<int64_t>(kMaxDims, 1));
  EXPECT_EQ(deep.dim(), kMaxDims);
  std::ostringstream printed;
  printed << deep;
  EXPECT_NE(printed.str().find("1."), std::string::npos);
  try {
    deep.unsqueeze(0);
    ADD_FAILURE() << "a 65th dimension was accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("at most 64 dimensions"), std::string::npos) << e.what();
  }
}

// Issue 18.8: writing in place into a tensor whose elements share memory is refused, as in
// PyTorch; fill_ (one value everywhere) is allowed, as in PyTorch.
TEST(TensorCore, InPlaceWritesIntoSelfOverlappingTensorsThrow) {
  const std::string message =
      "unsupported operation: more than one element of the written-to tensor refers to a single "
      "memory location. Please clone() the tensor before performing the operation.";
  auto refused = [&](const std::function<void()>& write, const std::string& op) {
    try {
      write();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("[kiln::" + op + "_] " + message), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << op << "_ wrote into a self-overlapping tensor";
  };
  Tensor base = zeros({3});
  refused([&] { base.expand({4, 3}).add_(1); }, "add");
  refused([&] { base.expand({4, 3}).copy_(ones({4, 3})); }, "copy");
  refused([&] { base.expand({4, 3}).mul_(ones({4, 3})); }, "mul");
  Tensor storage = zeros({6});
  refused([&] { storage.as_strided({3, 2}, {1, 1}).add_(1); }, "add");  // overlapping strides
  EXPECT_TRUE(matches(base, {3}, {0, 0, 0})) << "nothing was written";
  base.expand({4, 3}).fill_(2);
  EXPECT_TRUE(matches(base, {3}, {2, 2, 2}));
  base.expand({4, 3}).zero_();
  EXPECT_TRUE(matches(base, {3}, {0, 0, 0}));
  // Views whose elements are distinct, however their strides interleave, are fine.
  storage.as_strided({2, 3}, {1, 2}).add_(1);
  EXPECT_TRUE(matches(storage, {6}, {1, 1, 1, 1, 1, 1}));
  storage.as_strided({3, 2}, {2, 1}).t().mul_(3);
  EXPECT_TRUE(matches(storage, {6}, {3, 3, 3, 3, 3, 3}));
}

// Issue 18.9: a fill value the dtype cannot hold is an error, not garbage.
TEST(TensorCore, FillValuesThatDoNotFitTheDtypeThrow) {
  auto overflow = [](const std::function<void()>& make, const std::string& type) {
    try {
      make();
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("value cannot be converted to type " + type + " without overflow"),
                std::string::npos)
          << e.what();
      return;
    }
    ADD_FAILURE() << "accepted a value " << type << " cannot hold";
  };
  overflow([] { full({2}, 300, kUInt8); }, "uint8_t");
  overflow([] { full({2}, -256, kUInt8); }, "uint8_t");
  overflow([] { full({2}, std::nan(""), kInt64); }, "int64_t");
  overflow([] { full({2}, 1e30, kInt32); }, "int");
  overflow([] { full({2}, 9.3e18, kInt64); }, "int64_t");
  overflow([] { full({2}, 128, kInt8); }, "int8_t");
  overflow([] { full({2}, 1e300, kFloat32); }, "float");
  overflow([] { full({2}, 70000, kFloat16); }, "kiln::Half");
  overflow([] { zeros({2}, kUInt8).fill_(256); }, "uint8_t");
  overflow([] { zeros({2}, kInt32).fill_(-std::numeric_limits<double>::infinity()); }, "int");
  // What fits converts as PyTorch converts it.
  EXPECT_TRUE(matches(full({2}, 255, kUInt8), {2}, {255, 255}));
  EXPECT_TRUE(matches(full({2}, -1, kUInt8), {2}, {255, 255}));  // wraps, as in PyTorch
  EXPECT_TRUE(matches(full({2}, -2.9, kInt32), {2}, {-2, -2}));
  EXPECT_EQ(full({1}, -9.2233720368547758e18, kInt64).item<int64_t>(), INT64_MIN);
  EXPECT_TRUE(std::isinf(full({1}, std::numeric_limits<double>::infinity(), kFloat16).to(kFloat32).item<float>()));
  EXPECT_TRUE(full({1}, std::nan(""), kFloat32).isnan().item<bool>());
  EXPECT_TRUE(matches(full({2}, 7.0, kBool), {2}, {1, 1}));
}

TEST(TensorCore, CopyConvertsDtypesAndBroadcasts) {
  Tensor x = tensor<double>({1.5, -2.25, 3.0});
  Tensor h = x.to(kFloat16);
  EXPECT_EQ(h.dtype(), kFloat16);
  EXPECT_TRUE(matches(h, {3}, {1.5, -2.25, 3.0}));
  EXPECT_TRUE(matches(x.to(kInt32), {3}, {1, -2, 3}));
  EXPECT_TRUE(matches(x.to(kBool), {3}, {1, 1, 1}));
  Tensor dst = full({2, 3}, 0.0f);
  dst.copy_(x);
  EXPECT_TRUE(matches(dst, {2, 3}, {1.5, -2.25, 3, 1.5, -2.25, 3}));
}

TEST(TensorCore, CopyFromOverlappingViewUsesATemporary) {
  Tensor x = tensor<float>({0, 1, 2, 3}).view({2, 2});
  x.copy_(x.t());
  EXPECT_TRUE(matches(x, {2, 2}, {0, 2, 1, 3}));
}

TEST(TensorCore, HalfAndBFloat16RoundTrip) {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1e-5f, 1e-7f}) {
    EXPECT_EQ(static_cast<float>(Half(f)), static_cast<float>(Half(static_cast<float>(Half(f)))));
  }
  EXPECT_EQ(static_cast<float>(Half(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(Half(65520.0f)), INFINITY);
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(Half(0.1f)), 0.0999755859375f);
  EXPECT_EQ(static_cast<float>(BFloat16(3.14159f)), 3.140625f);
}

TEST(TensorCore, ItemAndToVector) {
  Tensor x = full({1}, 2.5);
  EXPECT_EQ(x.item<float>(), 2.5f);
  EXPECT_EQ(x.item<int64_t>(), 2);
  EXPECT_THROW(full({2}, 1.0).item(), ValueError);
  EXPECT_THROW(static_cast<bool>(full({2}, 1.0)), ValueError);
  EXPECT_TRUE(static_cast<bool>(full({}, 1.0)));
  EXPECT_THROW(full({2}, 1.0f).data_ptr<double>(), DTypeError);
}

TEST(TensorCore, DeviceParsing) {
  EXPECT_EQ(Device("cpu"), kCPU);
  EXPECT_EQ(Device("cuda:1").index, 1);
  EXPECT_EQ(Device("cuda").str(), "cuda:0");
  EXPECT_THROW(Device("gpu"), ValueError);
  EXPECT_THROW(Device("cuda:x"), ValueError);
}

TEST(TensorCore, BadSizesAndDimsThrow) {
  EXPECT_THROW(full({-1}, 0.0), ValueError);
  Tensor x = full({2, 3}, 0.0f);
  EXPECT_THROW(x.select(2, 0), IndexError);
  EXPECT_THROW(x.select(0, 2), IndexError);
  EXPECT_THROW(x.permute({0, 0}), ValueError);
  EXPECT_THROW(x.permute({0}), ShapeError);
  EXPECT_THROW(Tensor().dim(), Error);
}

TEST(TypePromotion, PromoteTypesTable) {
  EXPECT_EQ(promote_types(kInt32, kFloat16), kFloat16);
  EXPECT_EQ(promote_types(kFloat16, kBFloat16), kFloat32);
  EXPECT_EQ(promote_types(kUInt8, kInt8), kInt32);
  EXPECT_EQ(promote_types(kBool, kUInt8), kUInt8);
  EXPECT_EQ(promote_types(kInt64, kFloat32), kFloat32);
  EXPECT_EQ(promote_types(kFloat32, kFloat64), kFloat64);
  EXPECT_EQ(promote_types(kInt32, kInt64), kInt64);
  EXPECT_FALSE(can_cast(kFloat32, kInt64));
  EXPECT_FALSE(can_cast(kInt64, kBool));
  EXPECT_TRUE(can_cast(kInt64, kFloat16));
}

TEST(TensorCore, LargeCpuBlocksAreCachedAndReused) {
  detail::empty_cpu_cache();
  void* first = nullptr;
  {
    Tensor big = empty({1 << 16});  // 256 KiB
    first = big.raw_data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
  }
  EXPECT_GE(detail::cpu_cached_bytes(), 256 * 1024);
  Tensor again = empty({1 << 16});
  EXPECT_EQ(again.raw_data_ptr(), first);
  detail::empty_cpu_cache();
  EXPECT_EQ(detail::cpu_cached_bytes(), 0);
}

namespace {
// GCC 12 + AVX-512 + SLP vectorization turned this into {1, 1, 1, 1} (see CMakeLists.txt).
__attribute__((noinline)) std::vector<double> mixed_constant_list() { return {1, 1, 1, 0}; }
}  // namespace

TEST(Toolchain, ConstantInitializerListsSurviveVectorization) {
  auto v = mixed_constant_list();
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[3], 0.0);  // compared element-wise: a miscompiled literal list would agree with itself
}
