// The machine's ceilings, measured in the same run as the kernels: memory bandwidth (a STREAM
// triad over arrays far larger than the caches) and peak FP32 FLOP/s (independent FMA chains).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdlib>
#include <memory>
#include <vector>

namespace {

void Limit_StreamTriad(benchmark::State& state) {
  const int64_t n = int64_t{1} << 25;  // 3 arrays x 128 MiB
  auto alloc = [n] { return static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))); };
  std::unique_ptr<float, decltype(&std::free)> a(alloc(), std::free), b(alloc(), std::free), c(alloc(), std::free);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    a.get()[i] = 0.f;
    b.get()[i] = 1.f;
    c.get()[i] = 2.f;
  }
  float* pa = a.get();
  const float* pb = b.get();
  const float* pc = c.get();
  for (auto _ : state) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.f * pc[i];
    benchmark::DoNotOptimize(pa);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 3 * int64_t{sizeof(float)});
}
BENCHMARK(Limit_StreamTriad)->Unit(benchmark::kMillisecond)->UseRealTime();

volatile float g_fma_sink;
volatile float g_fma_mul = 0.9999999f, g_fma_add = 1e-7f;

void Limit_PeakFma(benchmark::State& state) {
  constexpr int kChains = 16, kWidth = 16, kIters = 1 << 16;
  int threads = omp_get_max_threads();
  for (auto _ : state) {
#pragma omp parallel
    {
      // Independent FMA chains, one 16-lane vector each, enough to cover the FMA latency.
      float acc[kChains][kWidth];
      for (int c = 0; c < kChains; ++c)
        for (int w = 0; w < kWidth; ++w) acc[c][w] = 1.0f + 1e-7f * static_cast<float>(c + w);
      const float m = g_fma_mul, add = g_fma_add;  // volatile loads: no constant folding
      for (int it = 0; it < kIters; ++it) {
        for (int c = 0; c < kChains; ++c) {
#pragma omp simd
          for (int w = 0; w < kWidth; ++w) acc[c][w] = acc[c][w] * m + add;
        }
      }
      float total = 0;
      for (int c = 0; c < kChains; ++c)
        for (int w = 0; w < kWidth; ++w) total += acc[c][w];
      g_fma_sink = total;  // the result escapes, so the loop must run
    }
  }
  double flops = 2.0 * kChains * kWidth * kIters * threads;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(Limit_PeakFma)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
