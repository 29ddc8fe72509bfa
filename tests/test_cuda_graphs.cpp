// reduce_overhead on a GPU: compiled graphs replayed as CUDA graphs (src/compiler/runtime/
// cuda_graph.h). Every test checks the counters, so that a silent fallback to normal runs fails.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdlib.h>

#include "core/profiler.h"
#include "cuda_test_helpers.h"
#include "kiln/detail/tensor_impl.h"
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
  // The first replay handed out the graph's buffer; it is still held, so the later replays wrote
  // new tensors: every result survives.
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(near(results[i], fn(xs[i], ys[i]))) << "call " << i;
  auto c = compiler::counters();
  EXPECT_EQ(c.cuda_graph_captures, 1);
  EXPECT_EQ(c.cuda_graph_replays, 4);  // the first call warms up
  EXPECT_EQ(c.cuda_graph_output_copies, 3);
}

// A replay returns the graph's own buffer (nothing allocated, nothing counted as allocated) when
// the caller no longer holds what it got from there; while any view of it lives, a new tensor.
TEST(CudaGraphs, OutputsAreTheGraphsBufferUnlessTheCallerStillHoldsIt) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto fn = [](const Tensor& x) { return (x * 2).sin() + 1; };
  using Compiled = decltype(compile(fn, kReduceOverhead));
  auto compiled = std::make_unique<Compiled>(compile(fn, kReduceOverhead));
  // Warm-up, then record and replay. The two inputs live at once (two addresses): inputs are
  // copied in, not read in place, so any input fits the recording.
  std::vector<Tensor> warm{gpu_randn({128, 100}), gpu_randn({128, 100})};
  for (const Tensor& w : warm) (void)(*compiled)(w);
  Tensor x = gpu_randn({128, 100});
  const Tensor want = fn(x);
  int64_t copies = compiler::counters().cuda_graph_output_copies;

  // Not held: the graph's buffer again, with no allocation at all during the call.
  cuda::synchronize();
  const int64_t before = cuda::memory_allocated();
  cuda::reset_peak_memory_stats();
  const void* buffer = nullptr;
  {
    Tensor a = (*compiled)(x);
    buffer = a.impl().data();
    EXPECT_EQ(cuda::max_memory_allocated(), before) << "the replay allocated";
    EXPECT_TRUE(near(a, want));
  }
  {
    Tensor b = (*compiled)(x);
    EXPECT_EQ(b.impl().data(), buffer);
  }
  EXPECT_EQ(compiler::counters().cuda_graph_output_copies, copies);

  // Held through a view: the next result goes to new memory, and the view keeps its values.
  Tensor x2 = gpu_randn({128, 100});
  Tensor view = (*compiled)(x).narrow(0, 5, 10);
  EXPECT_EQ(view.impl().data(), static_cast<const char*>(buffer) + 5 * 100 * sizeof(float));
  Tensor c = (*compiled)(x2);
  EXPECT_NE(c.impl().data(), buffer);
  EXPECT_EQ(compiler::counters().cuda_graph_output_copies, copies + 1);
  EXPECT_TRUE(near(c, fn(x2)));
  EXPECT_TRUE(near(view, want.narrow(0, 5, 10)));

  // The compiled function goes first: what it handed out stays valid.
  compiled.reset();
  EXPECT_TRUE(near(view, want.narrow(0, 5, 10)));
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 1);
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

TEST(CudaGraphs, IndexChecksRunOnTheDeviceInsideAGraph) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  // index_select checks its indices; while a graph records, on the device (a bad index in a
  // replay is a device-side assert), so the graph records.
  Tensor table = gpu_randn({10, 4});
  auto compiled = compile([&](const Tensor& idx) { return index_select(table, 0, idx) * 2; }, kReduceOverhead);
  Tensor idx = tensor<int64_t>({3, 1, 7}, {3}).cuda();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(near(compiled(idx), index_select(table, 0, idx) * 2));
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 1);
  EXPECT_EQ(compiler::counters().cuda_graph_replays, 3);  // the first call warms up
  // A new signature's first call runs normally: the host check raises the CPU's error.
  EXPECT_THROW(compiled(tensor<int64_t>({3, 11}, {2}).cuda()), IndexError);
}

// A whole training step (zero_grad, forward, backward, Adam) compiled pure with reduce_overhead:
// after the captures it replays one CUDA graph per call, with nll_loss's target check and
// max-pool's backward done on the device, and matches an eager twin step for step. The models
// grow layer by layer, so that a failure names the first layer kind a recording gets wrong.
enum class StepModel { linear, conv, conv_bn, conv_bn_pool };

class CudaGraphTrainingStep : public ::testing::TestWithParam<StepModel> {};

std::shared_ptr<nn::Sequential> step_model(StepModel kind) {
  auto m = std::make_shared<nn::Sequential>();
  int64_t features = 3 * 8 * 8;
  if (kind != StepModel::linear) {
    // No bias before a batch norm: its gradient is rounding noise that Adam would amplify.
    m->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
        .in_channels = 3, .out_channels = 4, .kernel_size = 3, .padding = 1, .bias = kind == StepModel::conv}));
    features = 4 * 8 * 8;
  }
  if (kind == StepModel::conv_bn || kind == StepModel::conv_bn_pool) m->push_back(std::make_shared<nn::BatchNorm2d>(4));
  if (kind != StepModel::linear) m->push_back(std::make_shared<nn::ReLU>());
  if (kind == StepModel::conv_bn_pool) {
    m->push_back(std::make_shared<nn::MaxPool2d>(3, 2, 1));
    features = 4 * 4 * 4;
  }
  m->push_back(std::make_shared<nn::Flatten>());
  m->push_back(std::make_shared<nn::Linear>(features, 5));
  m->to(cuda_device());
  return m;
}

float max_difference(const Tensor& a, const Tensor& b) { return (a.cpu() - b.cpu()).abs().max().item<float>(); }

TEST_P(CudaGraphTrainingStep, PureStepReplaysAsOneCudaGraphAndMatchesEager) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  manual_seed(0);
  auto model = step_model(GetParam()), twin = step_model(GetParam());
  twin->load_state_dict(model->state_dict());
  optim::Adam opt(model->parameters(), {.lr = 0.01});
  optim::Adam twin_opt(twin->parameters(), {.lr = 0.01});
  Tensor y = tensor<int64_t>({0, 4, 1, 3, 2, 2}, {6}).cuda();
  CompileOptions options = kReduceOverhead;
  options.pure = true;
  auto step = compile(
      [&](const Tensor& x) {
        opt.zero_grad();
        Tensor loss = cross_entropy(model->forward(x), y);
        loss.backward();
        opt.step();
        return loss;
      },
      options);
  std::vector<Tensor> inputs;  // kept alive: every call's input has its own address
  for (int i = 0; i < 7; ++i) {
    inputs.push_back(gpu_randn({6, 3, 8, 8}));
    const Tensor& x = inputs.back();
    Tensor loss = step(x);
    twin_opt.zero_grad();
    Tensor expected = cross_entropy(twin->forward(x), y);
    expected.backward();
    twin_opt.step();
    EXPECT_LT(max_difference(loss, expected), 1e-4) << "step " << i;
    const auto params = model->named_parameters(), twin_params = twin->named_parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const auto& [name, p] = params[k];
      const Tensor& q = twin_params[k].second;
      ASSERT_TRUE(p.grad().defined()) << name << ", step " << i;
      EXPECT_LT(max_difference(p.grad(), q.grad()), 1e-4) << name << ".grad, step " << i;
      EXPECT_LT(max_difference(p, q), 1e-4) << name << ", step " << i;
    }
  }
  const auto c = compiler::counters();
  EXPECT_EQ(c.replays, 4) << "calls 1-3 run the body (Adam's state appears on the first)";
  EXPECT_EQ(c.cuda_graph_captures, 1);
  EXPECT_EQ(c.cuda_graph_replays, 5);
}

std::string step_model_name(const ::testing::TestParamInfo<StepModel>& info) {
  switch (info.param) {
    case StepModel::linear: return "Linear";
    case StepModel::conv: return "Conv";
    case StepModel::conv_bn: return "ConvBatchNorm";
    case StepModel::conv_bn_pool: return "ConvBatchNormMaxPool";
  }
  return "Unknown";
}

INSTANTIATE_TEST_SUITE_P(Models, CudaGraphTrainingStep,
                         ::testing::Values(StepModel::linear, StepModel::conv, StepModel::conv_bn,
                                           StepModel::conv_bn_pool),
                         step_model_name);

TEST(CudaGraphs, DefaultModeRecordsNothing) {
  SKIP_WITHOUT_GPU();
  compiler::reset();
  auto compiled = compile([](const Tensor& x) { return x.exp() + 1; }, CompileOptions{.backend = std::string("kiln")});
  Tensor x = gpu_randn({5});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(near(compiled(x), x.exp() + 1));
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 0);
  EXPECT_GE(compiler::counters().graph_runs, 3);
}

// The compile trace (docs/compile-trace.md) of a reduce_overhead graph on a GPU: its CUDA source,
// its NVRTC binary and its CUDA graph recording, each naming the graph.
TEST(CudaGraphs, TheCompileTraceRecordsCudaSourcesBinariesAndTheRecording) {
  SKIP_WITHOUT_GPU();
  std::string dir = (std::filesystem::temp_directory_path() / "kiln_cuda_trace_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  compiler::reset();
  const std::string file = compiler::set_trace_dir(dir);
  auto compiled = compile([](const Tensor& x) { return (x * 3).cos() + x; }, kReduceOverhead);
  std::vector<Tensor> inputs;  // alive at once: new addresses, so one recording serves them all
  for (int i = 0; i < 3; ++i) {
    inputs.push_back(gpu_randn({256, 17}));
    (void)compiled(inputs.back());
  }
  compiler::set_trace_dir("");
  EXPECT_EQ(compiler::counters().cuda_graph_captures, 1);
  std::string graph_id;
  std::set<std::string> kinds;
  int cuda_sources = 0, recorded = 0;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    const std::string kind = e.value("event", "");
    if (kind == "graph") graph_id = e.value("graph", "");
    if (kind == "source" && e.value("language", "") == "cuda") {
      ++cuda_sources;
      EXPECT_EQ(e.value("graph", ""), graph_id);
      EXPECT_NE(e.value("text", "").find("extern \"C\" __global__"), std::string::npos);
    }
    if (kind == "kernel" && e.value("graph", "") == graph_id) kinds.insert(e.value("kind", ""));
    if (kind == "cuda_graph") {
      EXPECT_EQ(e.value("graph", ""), graph_id);
      EXPECT_EQ(e.value("action", ""), "recorded");
      EXPECT_GT(e.value("graph_nodes", 0), 0);
      ++recorded;
    }
  }
  EXPECT_FALSE(graph_id.empty());
  EXPECT_GE(cuda_sources, 1);
  EXPECT_EQ(recorded, 1);
  EXPECT_FALSE(kinds.empty()) << "the NVRTC binary's cache lookup names the graph";
  std::filesystem::remove_all(dir);
}

// The timeline (KILN_PROFILE=<path>.json) on a GPU: the device time of eager ops, of a compiled
// graph's kernels and of graph runs (CUDA graph replays too), on a track of its own per GPU and on
// the host's time axis: a run's device span lies after its host span started, and holds its
// kernels' device spans.
TEST(CudaGraphs, TheTimelineHoldsDeviceTimeOfEagerOpsKernelsAndGraphRuns) {
  SKIP_WITHOUT_GPU();
  std::string dir = (std::filesystem::temp_directory_path() / "kiln_cuda_timeline_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/trace.json";
  compiler::reset();
  auto fn = [](const Tensor& x) { return (x * 2).sin() + x; };
  auto launched = compile(fn, {.backend = std::string("kiln")});  // frame 0: kernels launched per call
  auto replayed = compile(fn, kReduceOverhead);                    // frame 1: one CUDA graph
  Tensor x = gpu_randn({1024, 257});
  for (int i = 0; i < 3; ++i) {  // compiles, warm-up and recording stay out of the timeline
    (void)launched(x);
    (void)replayed(x);
  }
  kiln::detail::start_trace(path);
  Tensor eager = (x * 3).relu();
  for (int i = 0; i < 3; ++i) {
    (void)launched(x);
    (void)replayed(x);
  }
  kiln::detail::write_trace();
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  struct Span {
    double start, end;
  };
  std::map<std::string, std::vector<Span>> host, device;
  std::set<int> gpu_tids;
  std::map<int, std::string> thread_names;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M") {
      thread_names[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
      continue;
    }
    const std::string name = e["name"], category = e["cat"];
    const double start = e["ts"], end = start + e["dur"].get<double>();
    if (category == "gpu") {
      EXPECT_GT(e["dur"].get<double>(), 0) << name;
      gpu_tids.insert(e["tid"].get<int>());
      std::string key = name.rfind("kernel[", 0) == 0 ? "kernel" : name;
      device[key].push_back({start, end});
    } else {
      host[name].push_back({start, end});
    }
  }
  ASSERT_EQ(gpu_tids.size(), 1u);
  EXPECT_EQ(thread_names[*gpu_tids.begin()], "GPU " + std::to_string(cuda_device().index) + ": device time");
  EXPECT_EQ(device["mul"].size(), 1u) << "eager x * 3";
  EXPECT_EQ(device["relu"].size(), 1u);
  ASSERT_EQ(device["graph 0/0"].size(), 3u);
  ASSERT_EQ(host["graph 0/0"].size(), 3u);
  EXPECT_EQ(device["graph 1/0"].size(), 3u) << "CUDA graph replays";
  ASSERT_GE(device["kernel"].size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    const Span run = device["graph 0/0"][r];
    EXPECT_GE(run.start, host["graph 0/0"][r].start - 200) << "device work starts after its launch (us)";
    const auto inside = std::count_if(device["kernel"].begin(), device["kernel"].end(),
                                      [&](const Span& k) { return k.start >= run.start - 1 && k.end <= run.end + 1; });
    EXPECT_GE(inside, 1) << "run " << r;
  }
  std::filesystem::remove_all(dir);
}
