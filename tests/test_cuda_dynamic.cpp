// Dynamic shapes on a GPU (docs/compiler.md, "Dynamic shapes"): a dynamic graph's generated CUDA
// kernels take their sizes as run-time arguments, so later sizes build nothing with NVRTC, and
// reduce_overhead records a CUDA graph per size. Results equal eager at every size.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "compile_helpers.h"
#include "cuda_test_helpers.h"
#include "kernel_cache_dir.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"
#include "kiln/models.h"

namespace {

using namespace kiln;
using namespace kiln::testing;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_cuda_dynamic");

class CudaDynamic : public CompilerTest {};

// check_builds: later sizes build nothing. kernel_builds also counts eager CUDA kernels that NVRTC
// builds on first use, which a graph's extern nodes may need at a new size: graphs with extern
// nodes check compiles and results only.
void check_sizes(const std::function<Tensor(const Tensor&)>& fn, const std::function<Tensor(int64_t)>& make,
                 CompileOptions options, Tolerance tol, const std::vector<int64_t>& sizes, bool check_builds = true) {
  auto compiled = compile(fn, options);
  // Eager first, at every size: the eager CUDA kernels it builds (counted by kernel_builds too)
  // are then built before the compiled calls, whose extern nodes run the same ones.
  std::vector<Tensor> inputs, expected;
  for (int64_t n : sizes) {
    inputs.push_back(make(n));
    expected.push_back(fn(inputs.back()).cpu());
  }
  Delta d;
  int64_t builds_after_first = -1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    Tensor got = compiled(inputs[i]);
    EXPECT_TRUE(got.device().is_cuda());
    EXPECT_TRUE(close(got.cpu(), expected[i], tol)) << "size " << sizes[i];
    if (builds_after_first < 0) builds_after_first = d.now().kernel_builds;
  }
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, static_cast<int64_t>(sizes.size()) - 1);
  if (check_builds) {
    EXPECT_EQ(d.now().kernel_builds, builds_after_first) << "later sizes reuse the first size's CUDA kernels";
  }
  EXPECT_GT(d.now().kernel_runs, 0);
  EXPECT_EQ(d.now().eager_frames, 0);
}

TEST_F(CudaDynamic, PointwiseReductionAndMeanKernelsServeEverySize) {
  SKIP_WITHOUT_GPU();
  check_sizes([](const Tensor& x) { return (x.sin() * 2).sum(1, true) * x.mean(0) + softmax(x, 1); },
              [](int64_t n) { return randn({n, 37}).cuda(); }, {.dynamic = true}, Tolerance{1e-5, 1e-5},
              {2, 3, 5, 9, 17, 33});
}

TEST_F(CudaDynamic, CatAndLayerNormServeEverySize) {
  SKIP_WITHOUT_GPU();
  Tensor g = randn({12}).cuda(), b = randn({12}).cuda();
  check_sizes(
      [=](const Tensor& x) {
        Tensor y = cat({x, x.relu()}, 1);
        return layer_norm(y, {12}, g, b) * 3;
      },
      [](int64_t n) { return randn({n, 6}).cuda(); }, {.dynamic = true}, Tolerance{1e-5, 1e-5}, {2, 4, 7, 30},
      /*check_builds=*/false);
}

// reduce_overhead: each size records its own CUDA graph (one instance each), replayed afterwards.
TEST_F(CudaDynamic, ReduceOverheadRecordsACudaGraphPerSize) {
  SKIP_WITHOUT_GPU();
  auto fn = [](const Tensor& x) { return tanh(x) * 2 + 1; };
  auto compiled = compile(fn, {.dynamic = true, .mode = Mode::reduce_overhead});
  Delta d;
  for (int round = 0; round < 3; ++round) {
    for (int64_t n : {2, 3, 4}) {
      Tensor x = randn({n, 8}).cuda();
      EXPECT_TRUE(close(compiled(x).cpu(), fn(x).cpu())) << "size " << n;
    }
  }
  EXPECT_EQ(d.now().graph_compiles, 1);
  EXPECT_EQ(d.now().size_specializations, 2);
  // A graph per size, recorded again at most once (as a static graph's CUDA graph may be).
  EXPECT_GE(d.now().cuda_graph_captures, 3);
  EXPECT_LE(d.now().cuda_graph_captures, 6);
  EXPECT_GE(d.now().cuda_graph_replays, 3);
}

TEST_F(CudaDynamic, GptForwardWithAGrowingSequence) {
  SKIP_WITHOUT_GPU();
  manual_seed(0);
  auto gpt = models::gpt(models::GPTConfig::tiny());
  gpt->to(Device("cuda"));
  gpt->eval();
  NoGradGuard no_grad;
  auto compiled = compile(gpt);
  Delta d;
  for (int64_t t = 3; t <= 12; ++t) {
    Tensor idx = randint(64, {2, t}).cuda();
    EXPECT_TRUE(close(compiled(idx).cpu(), gpt->forward(idx).cpu(), Tolerance{1e-4, 1e-5})) << "length " << t;
  }
  EXPECT_LE(d.now().graph_compiles, 2);
  EXPECT_GE(d.now().size_specializations, 8);
}

}  // namespace
