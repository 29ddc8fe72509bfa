// Printing: Tensor::str() and operator<< reproduce what PyTorch prints for the same values
// (torch._tensor_str with default options), with "kiln." in place of "torch.".
#include <cmath>
#include <limits>
#include <sstream>

#include "reference.h"

using namespace kiln;

namespace {

Tensor arange_i64(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return tensor(v);
}

}  // namespace

TEST(Printing, FloatVectorUsesFourDecimalsAlignedToTheWidest) {
  EXPECT_EQ(tensor<float>({1.5f, -2.25f, 3.0f}).str(), "tensor([ 1.5000, -2.2500,  3.0000])");
  EXPECT_EQ(tensor<float>({2.0f / 3, 1.0f / 3}).str(), "tensor([0.6667, 0.3333])");
}

TEST(Printing, IntegerValuedFloatsPrintWithATrailingDot) {
  EXPECT_EQ(tensor<float>({1, 2, 3}).str(), "tensor([1., 2., 3.])");
  EXPECT_EQ(tensor<float>({-0.0f, 1.0f}).str(), "tensor([-0., 1.])");
  EXPECT_EQ(tensor<float>({0, 0}).str(), "tensor([0., 0.])");
}

TEST(Printing, ScientificModeForMixedMagnitudes) {
  EXPECT_EQ(tensor<float>({1e-5f, 1e5f}).str(), "tensor([1.0000e-05, 1.0000e+05])");
  EXPECT_EQ(tensor<float>({1.0f, 10000.0f}).str(), "tensor([1.0000e+00, 1.0000e+04])");
  EXPECT_EQ(tensor<double>({0.00001234}).str(), "tensor([1.2340e-05], dtype=kiln.float64)");
}

TEST(Printing, NanAndInfDoNotWidenColumns) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(tensor<float>({nan, inf, -inf, 1.0f}).str(), "tensor([nan, inf, -inf, 1.])");
  EXPECT_EQ(tensor<float>({0.5f, nan}).str(), "tensor([0.5000,    nan])");
  EXPECT_EQ(tensor<float>({-nan}).str(), "tensor([nan])");
}

TEST(Printing, TwoAndThreeDimsNestWithNewlinesAndIndent) {
  EXPECT_EQ(tensor<float>({0, 1, 2, 3, 4, 5}, {2, 3}).str(),
            "tensor([[0., 1., 2.],\n"
            "        [3., 4., 5.]])");
  EXPECT_EQ(arange_i64(8).view({2, 2, 2}).str(),
            "tensor([[[0, 1],\n"
            "         [2, 3]],\n"
            "\n"
            "        [[4, 5],\n"
            "         [6, 7]]])");
}

TEST(Printing, NonContiguousTensorsPrintInLogicalOrder) {
  EXPECT_EQ(arange_i64(6).view({2, 3}).t().str(),
            "tensor([[0, 3],\n"
            "        [1, 4],\n"
            "        [2, 5]])");
}

TEST(Printing, IntegerAndBoolTensors) {
  EXPECT_EQ(tensor<int64_t>({-1, 10, 100}).str(), "tensor([ -1,  10, 100])");
  EXPECT_EQ(tensor<int32_t>({1, 2}).str(), "tensor([1, 2], dtype=kiln.int32)");
  EXPECT_EQ(tensor<uint8_t>({7, 200}).str(), "tensor([  7, 200], dtype=kiln.uint8)");
  EXPECT_EQ(tensor<bool>({true, false, true}).str(), "tensor([ True, False,  True])");
}

TEST(Printing, DtypeSuffixForNonDefaultDtypes) {
  EXPECT_EQ(tensor<double>({1.0, 2.5}).str(), "tensor([1.0000, 2.5000], dtype=kiln.float64)");
  EXPECT_EQ(tensor<float>({0.1f, 0.2f}).to(kFloat16).str(), "tensor([0.1000, 0.2000], dtype=kiln.float16)");
  EXPECT_EQ(tensor<float>({1.0f, 2.0f}).to(kBFloat16).str(), "tensor([1., 2.], dtype=kiln.bfloat16)");
}

TEST(Printing, ZeroDimTensors) {
  EXPECT_EQ(scalar_tensor(3.5).str(), "tensor(3.5000)");
  EXPECT_EQ(scalar_tensor(int64_t{3}).str(), "tensor(3)");
  EXPECT_EQ(scalar_tensor(true).str(), "tensor(True)");
  EXPECT_EQ(scalar_tensor(2.0, kFloat64).str(), "tensor(2., dtype=kiln.float64)");
}

TEST(Printing, EmptyTensorsShowSizeAndDtype) {
  EXPECT_EQ(empty({0}).str(), "tensor([])");
  EXPECT_EQ(empty({0, 3}).str(), "tensor([], size=(0, 3))");
  EXPECT_EQ(empty({0}, kInt64).str(), "tensor([], dtype=kiln.int64)");
  EXPECT_EQ(empty({2, 0}, kFloat64).str(), "tensor([], size=(2, 0), dtype=kiln.float64)");
}

TEST(Printing, LongVectorsWrapAtLinewidth80) {
  std::vector<float> v;
  for (int i = 0; i < 20; ++i) v.push_back(0.5f * static_cast<float>(i));
  EXPECT_EQ(tensor(v).str(),
            "tensor([0.0000, 0.5000, 1.0000, 1.5000, 2.0000, 2.5000, 3.0000, 3.5000, 4.0000,\n"
            "        4.5000, 5.0000, 5.5000, 6.0000, 6.5000, 7.0000, 7.5000, 8.0000, 8.5000,\n"
            "        9.0000, 9.5000])");
}

TEST(Printing, SuffixMovesToItsOwnLineWhenTheLineIsFull) {
  std::vector<double> v;
  for (int i = 0; i < 9; ++i) v.push_back(0.5 * i);
  EXPECT_EQ(tensor(v).str(),
            "tensor([0.0000, 0.5000, 1.0000, 1.5000, 2.0000, 2.5000, 3.0000, 3.5000, 4.0000],\n"
            "       dtype=kiln.float64)");
}

TEST(Printing, MoreThanAThousandElementsAreSummarized) {
  EXPECT_EQ(arange_i64(2000).str(), "tensor([   0,    1,    2,  ..., 1997, 1998, 1999])");
  EXPECT_EQ(arange_i64(2000).to(kFloat32).str(),
            "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n"
            "        1.9990e+03])");
  EXPECT_EQ(arange_i64(2000).view({40, 50}).str(),
            "tensor([[   0,    1,    2,  ...,   47,   48,   49],\n"
            "        [  50,   51,   52,  ...,   97,   98,   99],\n"
            "        [ 100,  101,  102,  ...,  147,  148,  149],\n"
            "        ...,\n"
            "        [1850, 1851, 1852,  ..., 1897, 1898, 1899],\n"
            "        [1900, 1901, 1902,  ..., 1947, 1948, 1949],\n"
            "        [1950, 1951, 1952,  ..., 1997, 1998, 1999]])");
  // Exactly 1000 elements: not summarized.
  EXPECT_EQ(arange_i64(1000).str().find("..."), std::string::npos);
}

TEST(Printing, RequiresGradSuffix) {
  Tensor t = tensor<float>({1.0f, 2.0f});
  t.requires_grad_(true);
  EXPECT_EQ(t.str(), "tensor([1., 2.], requires_grad=True)");
}

TEST(Printing, NonLeafTensorsShowTheirGradFn) {
  Tensor x = tensor<float>({1.0f, 2.0f, 3.0f});
  x.requires_grad_(true);
  EXPECT_EQ(x.slice(0, 1).str(), "tensor([2., 3.], grad_fn=<SliceBackward0>)");  // PyTorch: x[1:]
}

TEST(Printing, StreamOperatorWritesStr) {
  std::ostringstream os;
  os << tensor<float>({1.5f});
  EXPECT_EQ(os.str(), "tensor([1.5000])");
  EXPECT_EQ(Tensor().str(), "Tensor(undefined)");
}
