// `kiln bench batch-sizes`: one model called at every batch size from --min-batch to --max-batch,
// the server case dynamic shapes exist for (docs/compiler.md, "Dynamic shapes").
//
//   kiln bench batch-sizes --model densenet121 --device cuda --min-batch 1 --max-batch 32 --size 128
//
// Inference (eval mode, no grad) on random images of --size x --size. Modes, one after the other
// in one process:
//   eager       the model's forward, op by op;
//   dynamic     compile(model): automatic dynamic (static at the first batch size, dynamic from the
//               second; batch size 1 specializes, as sizes 0 and 1 do in torch);
//   dynamic-ro  the same with mode = reduce_overhead (a CUDA graph per batch size on a GPU);
//   static-ro   compile(model, {.dynamic = false, .mode = reduce_overhead}): a compile per batch
//               size until the recompile limit (8), then eager.
// Each mode makes two passes over the batch sizes. The first (cold) calls each size once: its
// seconds include every compile, new size and CUDA graph recording. The second (warm) times
// --iters calls per size after one more call and reports the mean over sizes of the per-call
// time. Also graph compiles, new sizes of dynamic graphs, kernel builds and compile seconds, and
// whether every output matched eager's (float32 tolerance).
#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "kiln/compiler.h"
#include "kiln/cuda.h"
#include "kiln/kiln.h"
#include "kiln/models.h"

namespace kiln::cli {

namespace {

struct BatchSizesArgs {
  std::string model = "densenet121";
  Device device = Device("cpu");
  int64_t min_batch = 1, max_batch = 32, size = 128, iters = 5;
  std::vector<std::string> modes{"eager", "dynamic", "dynamic-ro"};
  bool json = false;
};

BatchSizesArgs parse_batch_sizes(const std::vector<std::string>& args) {
  BatchSizesArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& k = args[i];
    if (k == "--json") {
      a.json = true;
      continue;
    }
    KILN_CHECK(i + 1 < args.size(), ValueError,
               "[kiln bench batch-sizes] " + k + " needs a value. See `kiln help`.");
    const std::string& v = args[++i];
    if (k == "--model") a.model = v;
    else if (k == "--device") a.device = Device(v);
    else if (k == "--min-batch") a.min_batch = positive_option("batch-sizes", k, v);
    else if (k == "--max-batch") a.max_batch = positive_option("batch-sizes", k, v);
    else if (k == "--size") a.size = positive_option("batch-sizes", k, v);
    else if (k == "--iters") a.iters = positive_option("batch-sizes", k, v);
    else if (k == "--modes")
      a.modes = parse_modes("batch-sizes", v, {"eager", "dynamic", "dynamic-ro", "static-ro"});
    else
      throw ValueError("[kiln bench batch-sizes] unknown option '" + k + "'. See `kiln help`.");
  }
  KILN_CHECK(a.min_batch <= a.max_batch, ValueError,
             "[kiln bench batch-sizes] --min-batch must not exceed --max-batch.");
  return a;
}

}  // namespace

int run_batch_sizes_bench(const std::vector<std::string>& args) {
  const BatchSizesArgs a = parse_batch_sizes(args);
  manual_seed(0);
  std::shared_ptr<nn::Module> model = image_model("batch-sizes", a.model, 1000);
  model->to(a.device);
  model->eval();
  NoGradGuard no_grad;
  std::vector<Tensor> images;
  for (int64_t b = a.min_batch; b <= a.max_batch; ++b) images.push_back(randn({b, 3, a.size, a.size}).to(a.device));
  auto sync = [&] {
    if (a.device.is_cuda()) cuda::synchronize();
  };
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };

  nlohmann::ordered_json result = {{"model", a.model},   {"device", a.device.str()}, {"threads", get_num_threads()},
                                   {"min_batch", a.min_batch}, {"max_batch", a.max_batch}, {"size", a.size},
                                   {"iters", a.iters}};
  std::vector<Tensor> eager_out;
  // cuDNN and cuBLAS may pick other algorithms (and TF32) for a graph than for eager calls.
  const double tolerance = a.device.is_cuda() ? 1e-2 : 1e-3;
  double eager_warm_ms = 0;
  for (const std::string& mode : a.modes) {
    compiler::reset();
    const compiler::Counters before = compiler::counters();
    const double compile_before = backend_compile_seconds();
    CompileOptions options;
    if (mode == "static-ro") options.dynamic = false;
    if (mode.ends_with("-ro")) options.mode = Mode::reduce_overhead;
    auto compiled = compile(model, options);
    auto call = [&](const Tensor& x) { return mode == "eager" ? model->forward(x) : compiled(x); };

    // Cold: each size once.
    bool same = true;
    sync();
    const auto t0 = Clock::now();
    for (size_t i = 0; i < images.size(); ++i) {
      Tensor y = call(images[i]);
      if (mode == "eager") {
        eager_out.push_back(y.cpu());
      } else if (!eager_out.empty()) {
        same = same && allclose(y.cpu(), eager_out[i], tolerance, tolerance);
      }
    }
    sync();
    const double cold_seconds = since(t0);
    const compiler::Counters c = compiler::counters();
    const double compile_seconds = backend_compile_seconds() - compile_before;

    // Warm: per size, one more call, then --iters timed calls.
    std::vector<double> per_size_ms;
    for (const Tensor& x : images) {
      call(x);
      sync();
      const auto w0 = Clock::now();
      for (int64_t k = 0; k < a.iters; ++k) call(x);
      sync();
      per_size_ms.push_back(since(w0) * 1e3 / static_cast<double>(a.iters));
    }
    double warm_ms = 0;
    for (double ms : per_size_ms) warm_ms += ms;
    warm_ms /= static_cast<double>(per_size_ms.size());
    if (mode == "eager") eager_warm_ms = warm_ms;
    const compiler::Counters after_warm = compiler::counters();
    nlohmann::ordered_json m = {{"cold_seconds", cold_seconds},
                                {"warm_ms_per_call", warm_ms},
                                {"warm_ms_by_batch", per_size_ms},
                                {"graph_compiles", c.graph_compiles - before.graph_compiles},
                                {"size_specializations", c.size_specializations - before.size_specializations},
                                {"kernel_builds", c.kernel_builds - before.kernel_builds},
                                {"compile_seconds", compile_seconds},
                                {"cuda_graph_captures", after_warm.cuda_graph_captures - before.cuda_graph_captures},
                                {"eager_calls", after_warm.eager_frames - before.eager_frames},
                                {"recompiles_while_warm", after_warm.graph_compiles - c.graph_compiles},
                                {"same_as_eager", same}};
    if (eager_warm_ms > 0) m["warm_speedup_vs_eager"] = eager_warm_ms / warm_ms;
    result["modes"][mode] = m;
  }

  if (a.json) {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("{} on {}, {} threads: batch sizes {}..{}, {}x{} images, inference\n", a.model,
                           a.device.str(), get_num_threads(), a.min_batch, a.max_batch, a.size, a.size);
  std::cout << "cold: every size once (compiles included); warm: mean over sizes of ms per call\n";
  std::cout << fmt::format("{:<11} {:>8} {:>9} {:>9} {:>7} {:>10} {:>7} {:>10} {:>7} {:>6} {:>5}\n", "mode", "cold s",
                           "warm ms", "vs eager", "graphs", "new sizes", "builds", "compile s", "graphs*", "eager",
                           "same");
  for (const std::string& mode : a.modes) {
    const auto& m = result["modes"][mode];
    std::cout << fmt::format(
        "{:<11} {:>8.2f} {:>9.3f} {:>9} {:>7} {:>10} {:>7} {:>10.2f} {:>7} {:>6} {:>5}\n", mode,
        m["cold_seconds"].get<double>(), m["warm_ms_per_call"].get<double>(),
        m.contains("warm_speedup_vs_eager") ? fmt::format("{:.2f}x", m["warm_speedup_vs_eager"].get<double>())
                                            : std::string("-"),
        m["graph_compiles"].get<int64_t>(), m["size_specializations"].get<int64_t>(),
        m["kernel_builds"].get<int64_t>(), m["compile_seconds"].get<double>(),
        m["cuda_graph_captures"].get<int64_t>(), m["eager_calls"].get<int64_t>(),
        m["same_as_eager"].get<bool>() ? "yes" : "no");
  }
  std::cout << "(graphs*: CUDA graphs recorded over both passes)\n";
  return 0;
}

}  // namespace kiln::cli
