// reduce_overhead on a GPU: compiled graphs replayed as CUDA graphs (src/compiler/runtime/
// cuda_graph.h). Every test checks the counters, so that a silent fallback to normal runs fails.
#include <gtest/gtest.h>

#include "cuda_test_helpers.h"
#include "kiln/kiln.h"

using namespace kiln;

namespace {

const CompileOptions kReduceOverhead{.backend = std::string("kiln"), .mode = Mode::reduce_overhead};

Tensor gpu_randn(std::vector<int64_t> sizes) { return randn(sizes, TensorOptions(kFloat32, cuda_device())); }

::testing::AssertionResult near(const Tensor& got, const Tensor& want) {
  if (!got.is_cuda()) return ::testing::AssertionFailure() << "not on the GPU";
  if (!allclose(got.cpu(), want.cpu(), 1e-5, 1e-6)) return ::testing::AssertionFailure() << "values differ";
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(CudaGraphs, ReplaysMatchEagerAndEarlierResultsStayValid) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto fn = [](const Tensor& x, const Tensor& y) { return (sin(x) + cos(y)) * 2 - x; };
  auto compiled = compile(fn, kReduceOverhead);
  std::vector<Tensor> xs, ys, results;
  for (int i = 0; i < 5; ++i) {
    xs.push_back(gpu_randn({64, 33}));
    ys.push_back(gpu_randn({64, 33}));
    results.push_back(compiled(xs.back(), ys.back()));
    EXPECT_TRUE(near(results.back(), fn(xs.back(), ys.back())));
  }
  // Outputs are copied out of the graph's memory: the first results survive later replays.
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(near(results[i], fn(xs[i], ys[i]))) << "call " << i;
  auto c = compiler::counters();
  EXPECT_EQ(c.cuda_graph_captures, 1);
  EXPECT_EQ(c.cuda_graph_replays, 4);  // the first call warms up
}

TEST(CudaGraphs, StableInputsAreReadInPlaceAndSeeUpdates) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  Tensor w = gpu_randn({16, 16});  // a closure tensor: the same memory on every call, like a parameter
  auto compiled = compile([&](const Tensor& x) { return x * w + 1; }, kReduceOverhead);
  Tensor x = gpu_randn({16, 16});
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(near(compiled(x), x * w + 1)) << "call " << i;
    w.mul_(0.5);  // an in-place update (an optimizer step) is seen by the next replay
  }
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 1);
  EXPECT_GE(compiler::counters().cuda_graph_replays, 3);
}

TEST(CudaGraphs, InPlaceWritesReachTheCallersTensors) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto compiled = compile(
      [](Tensor buffer, const Tensor& x) {
        buffer.add_(x);
        return buffer * 2;
      },
      kReduceOverhead);
  std::vector<Tensor> keep;  // alive, so that every call gets new addresses (not reused ones)
  for (int i = 0; i < 4; ++i) {
    Tensor buffer = gpu_randn({8, 8}), x = gpu_randn({8, 8});
    keep.push_back(buffer);
    keep.push_back(x);
    Tensor expected_buffer = buffer + x;
    Tensor out = compiled(buffer, x);
    EXPECT_TRUE(near(buffer, expected_buffer)) << "call " << i;
    EXPECT_TRUE(near(out, expected_buffer * 2)) << "call " << i;
  }
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 1);
  EXPECT_EQ(compiler::counters().cuda_graph_replays, 3);
}

TEST(CudaGraphs, ChangingScalarsRecordAgainThenRunNormally) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto compiled = compile([](const Tensor& x, double s) { return x * s + s; }, kReduceOverhead);
  Tensor x = gpu_randn({32});
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(near(compiled(x, 0.5 * i), x * (0.5 * i) + 0.5 * i)) << "call " << i;
  auto c = compiler::counters();
  EXPECT_EQ(c.cuda_graph_captures, 4);  // then the graph gives up recording
  EXPECT_GE(c.cuda_graph_replays, 4);
  // The same scalar on every call replays one recording.
  compiler::reset();
  auto steady = compile([](const Tensor& y, double s) { return y * s; }, kReduceOverhead);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(near(steady(x, 3.0), x * 3.0));
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 1);
  EXPECT_EQ(compiler::counters().cuda_graph_replays, 4);
}

TEST(CudaGraphs, GraphsThatReadBackToTheHostRunNormally) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  // index_select checks its indices on the host: not recordable, and still correct.
  Tensor table = gpu_randn({10, 4});
  auto compiled = compile([&](const Tensor& idx) { return index_select(table, 0, idx) * 2; }, kReduceOverhead);
  Tensor idx = tensor<int64_t>({3, 1, 7}, {3}).cuda();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(near(compiled(idx), index_select(table, 0, idx) * 2));
  EXPECT_EQ(compiler::counters().cuda_graph_replays, 0);
  EXPECT_THROW(compiled(tensor<int64_t>({3, 11}, {2}).cuda()), IndexError);
}

TEST(CudaGraphs, DefaultModeRecordsNothing) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto compiled = compile([](const Tensor& x) { return x.exp() + 1; }, CompileOptions{.backend = std::string("kiln")});
  Tensor x = gpu_randn({5});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(near(compiled(x), x.exp() + 1));
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 0);
  EXPECT_GE(compiler::counters().graph_runs, 3);
}
