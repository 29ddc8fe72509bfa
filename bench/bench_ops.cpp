// Eager kernel throughput at the sizes of the DenseNet-121 workload (batch 16, 3x128x128):
// pointwise and reduction ops report bytes/s, GEMM and convolution GFLOP/s. Run it beside
// machine_limits.cpp's Limit_* benchmarks (same binary) to read each figure as a fraction of the
// machine's ceiling. JSON: --benchmark_out=FILE --benchmark_out_format=json.
#include <benchmark/benchmark.h>

#include <kiln/kiln.h>
#include <kiln/op_table.h>

namespace {

using namespace kiln;

void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops_per_iter * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

// Dense block activations: 16 x 256 x 32 x 32 float32 (16 MiB).
const std::vector<int64_t> kAct = {16, 256, 32, 32};

void Pointwise_Relu(benchmark::State& state) {
  Tensor x = randn(kAct);
  for (auto _ : state) benchmark::DoNotOptimize(relu(x));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 2);
}
BENCHMARK(Pointwise_Relu)->Unit(benchmark::kMillisecond)->UseRealTime();

void Pointwise_Add(benchmark::State& state) {
  Tensor x = randn(kAct), y = randn(kAct);
  for (auto _ : state) benchmark::DoNotOptimize(x + y);
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 3);
}
BENCHMARK(Pointwise_Add)->Unit(benchmark::kMillisecond)->UseRealTime();

void Pointwise_Exp(benchmark::State& state) {
  Tensor x = randn(kAct);
  for (auto _ : state) benchmark::DoNotOptimize(exp(x));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 2);
}
BENCHMARK(Pointwise_Exp)->Unit(benchmark::kMillisecond)->UseRealTime();

// Per-channel affine (inference batch norm): x * scale[c] + shift[c], broadcast over N, H, W.
void Pointwise_ChannelAffine(benchmark::State& state) {
  Tensor x = randn(kAct), s = randn({256, 1, 1}), b = randn({256, 1, 1});
  for (auto _ : state) benchmark::DoNotOptimize(addcmul(b, x, s));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 2);
}
BENCHMARK(Pointwise_ChannelAffine)->Unit(benchmark::kMillisecond)->UseRealTime();

void Reduce_SumAll(benchmark::State& state) {
  Tensor x = randn(kAct);
  for (auto _ : state) benchmark::DoNotOptimize(x.sum());
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
BENCHMARK(Reduce_SumAll)->Unit(benchmark::kMillisecond)->UseRealTime();

// Batch-norm statistics: mean and variance per channel over N, H, W.
void Reduce_PerChannelVarMean(benchmark::State& state) {
  Tensor x = randn(kAct);
  for (auto _ : state) benchmark::DoNotOptimize(var_mean(x, {0, 2, 3}, 0));
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
BENCHMARK(Reduce_PerChannelVarMean)->Unit(benchmark::kMillisecond)->UseRealTime();

void Reduce_SoftmaxLastDim(benchmark::State& state) {
  Tensor x = randn({16 * 64, 1024});
  for (auto _ : state) benchmark::DoNotOptimize(softmax(x, -1));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 2);
}
BENCHMARK(Reduce_SoftmaxLastDim)->Unit(benchmark::kMillisecond)->UseRealTime();

void Norm_BatchNormTrain(benchmark::State& state) {
  Tensor x = randn(kAct), rm = zeros({256}), rv = ones({256}), w = ones({256}), b = zeros({256});
  for (auto _ : state) benchmark::DoNotOptimize(batch_norm(x, rm, rv, w, b, /*training=*/true));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 3);
}
BENCHMARK(Norm_BatchNormTrain)->Unit(benchmark::kMillisecond)->UseRealTime();

// The training batch-norm backward (native_batch_norm_backward, all three gradients) on
// channels-last activations at each dense block's plane and width of DenseNet-121 at 128x128:
// 16 x 256 x 32 x 32, 16 x 512 x 16 x 16, 16 x 1024 x 8 x 8 and 16 x 1024 x 4 x 4 (the last two
// have few rows: 1024 and 256 of 1024 channels each). Bytes: x and dy read twice, dx written.
void Norm_BatchNormBackwardChannelsLast(benchmark::State& state) {
  const int64_t plane = state.range(0), channels = state.range(1);
  const std::vector<int64_t> sizes = {16, channels, plane, plane};
  Tensor x = randn(sizes).contiguous(channels_last), dy = randn(sizes).contiguous(channels_last);
  Tensor w = ones({channels}), rm = zeros({channels}), rv = ones({channels});
  const OpDef& forward = *OpTable::instance().find("native_batch_norm");
  const OpDef& backward = *OpTable::instance().find("native_batch_norm_backward");
  std::vector<Tensor> stats = call_op(forward, {x, w, Tensor(), rm, rv}, {true, 0.1, 1e-5});
  for (auto _ : state)
    benchmark::DoNotOptimize(call_op(backward, {dy, x, w, stats[1], stats[2]}, {true, std::vector<int64_t>{1, 1, 1}}));
  state.SetBytesProcessed(state.iterations() * x.nbytes() * 5);
}
BENCHMARK(Norm_BatchNormBackwardChannelsLast)
    ->Args({32, 256})
    ->Args({16, 512})
    ->Args({8, 1024})
    ->Args({4, 1024})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void Matmul_Square1024(benchmark::State& state) {
  Tensor a = randn({1024, 1024}), b = randn({1024, 1024});
  for (auto _ : state) benchmark::DoNotOptimize(matmul(a, b));
  set_flops(state, 2.0 * 1024 * 1024 * 1024);
}
BENCHMARK(Matmul_Square1024)->Unit(benchmark::kMillisecond)->UseRealTime();

// The classifier: (16, 1024) x (1024, 1000) + bias.
void Matmul_Classifier(benchmark::State& state) {
  Tensor x = randn({16, 1024}), w = randn({1000, 1024}), b = randn({1000});
  for (auto _ : state) benchmark::DoNotOptimize(linear(x, w, b));
  set_flops(state, 2.0 * 16 * 1024 * 1000);
}
BENCHMARK(Matmul_Classifier)->Unit(benchmark::kMillisecond)->UseRealTime();

void conv_bench(benchmark::State& state, std::vector<int64_t> in, std::vector<int64_t> w, int64_t stride,
                int64_t pad) {
  Tensor x = randn(in), wt = randn(w);
  Tensor y = conv2d(x, wt, Tensor(), {stride, stride}, {pad, pad});
  for (auto _ : state) benchmark::DoNotOptimize(conv2d(x, wt, Tensor(), {stride, stride}, {pad, pad}));
  double flops = 2.0 * static_cast<double>(y.numel()) * static_cast<double>(w[1] * w[2] * w[3]);
  set_flops(state, flops);
}

void Conv_Stem7x7(benchmark::State& s) { conv_bench(s, {16, 3, 128, 128}, {64, 3, 7, 7}, 2, 3); }
void Conv_Bottleneck1x1(benchmark::State& s) { conv_bench(s, {16, 256, 32, 32}, {128, 256, 1, 1}, 1, 0); }
void Conv_Growth3x3(benchmark::State& s) { conv_bench(s, {16, 128, 32, 32}, {32, 128, 3, 3}, 1, 1); }
void Conv_Growth3x3Block3(benchmark::State& s) { conv_bench(s, {16, 128, 8, 8}, {32, 128, 3, 3}, 1, 1); }
BENCHMARK(Conv_Stem7x7)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Conv_Bottleneck1x1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Conv_Growth3x3)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Conv_Growth3x3Block3)->Unit(benchmark::kMillisecond)->UseRealTime();

void Pool_MaxPool3x3s2(benchmark::State& state) {
  Tensor x = randn({16, 64, 64, 64});
  for (auto _ : state) benchmark::DoNotOptimize(max_pool2d(x, {3, 3}, {2, 2}, {1, 1}));
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
BENCHMARK(Pool_MaxPool3x3s2)->Unit(benchmark::kMillisecond)->UseRealTime();

void Shape_CatChannels(benchmark::State& state) {
  Tensor a = randn({16, 224, 32, 32}), b = randn({16, 32, 32, 32});
  for (auto _ : state) benchmark::DoNotOptimize(cat({a, b}, 1));
  state.SetBytesProcessed(state.iterations() * (a.nbytes() + b.nbytes()) * 2);
}
BENCHMARK(Shape_CatChannels)->Unit(benchmark::kMillisecond)->UseRealTime();

// One optimizer step over DenseNet-121's 364 parameters (8.0M elements), each with a gradient:
// the fused update (docs/optim.md) streams every array once, so its floor is the bytes below at
// DRAM speed (Adam: param, grad and both moments read, param and moments written).
template <class Optimizer, class Options>
void optimizer_step_bench(benchmark::State& state, const Options& options, int64_t arrays_moved) {
  auto model = models::densenet121();
  std::vector<Tensor> params = model->parameters();
  int64_t numel = 0;
  for (const Tensor& p : params) {
    p.set_grad(randn(p.sizes()));
    numel += p.numel();
  }
  Optimizer opt(params, options);
  opt.step();  // creates the state
  for (auto _ : state) opt.step();
  state.SetBytesProcessed(state.iterations() * numel * arrays_moved * static_cast<int64_t>(sizeof(float)));
}
void Optim_AdamStepDenseNet121(benchmark::State& s) {
  optimizer_step_bench<optim::Adam>(s, optim::AdamOptions{.lr = 1e-3}, 7);
}
void Optim_SgdMomentumStepDenseNet121(benchmark::State& s) {
  optimizer_step_bench<optim::SGD>(s, optim::SGDOptions{.lr = 1e-2, .momentum = 0.9}, 5);
}
BENCHMARK(Optim_AdamStepDenseNet121)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Optim_SgdMomentumStepDenseNet121)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
