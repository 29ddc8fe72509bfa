// `kiln bench MODEL`: times a model's eager inference and training step (later: compiled modes).
//
//   kiln bench densenet121 --device cpu --batch 16 --size 128 --modes eager --train --json
//
// Each timing is the median of --iters runs after --warmup runs. Inference runs in eval mode
// under NoGradGuard; the training step is Adam + cross-entropy (zero_grad, forward, backward,
// step) in train mode.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "kiln/kiln.h"

namespace kiln::cli {

namespace {

struct BenchArgs {
  std::string model;
  Device device = kCPU;
  int64_t batch = 16;
  int64_t size = 128;
  int64_t num_classes = 1000;
  std::vector<std::string> modes = {"eager"};
  bool train = false;
  bool json = false;
  int warmup = 2;
  int iters = 5;
  int threads = 0;
};

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

BenchArgs parse(const std::vector<std::string>& args) {
  BenchArgs a;
  KILN_CHECK(!args.empty(), ValueError, "[kiln bench] name a model: densenet121, densenet169, resnet18, resnet50.");
  a.model = args[0];
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& k = args[i];
    auto value = [&]() -> std::string {
      KILN_CHECK(i + 1 < args.size(), ValueError, "[kiln bench] " + k + " needs a value.");
      return args[++i];
    };
    if (k == "--device") a.device = Device(value());
    else if (k == "--batch") a.batch = std::stoll(value());
    else if (k == "--size") a.size = std::stoll(value());
    else if (k == "--classes") a.num_classes = std::stoll(value());
    else if (k == "--modes") a.modes = split_commas(value());
    else if (k == "--train") a.train = true;
    else if (k == "--json") a.json = true;
    else if (k == "--warmup") a.warmup = std::stoi(value());
    else if (k == "--iters") a.iters = std::stoi(value());
    else if (k == "--threads") a.threads = std::stoi(value());
    else throw ValueError("[kiln bench] unknown option '" + k + "'. See `kiln help`.");
  }
  KILN_CHECK(a.batch > 0 && a.size > 0 && a.iters > 0 && a.warmup >= 0, ValueError,
             "[kiln bench] --batch, --size and --iters must be positive.");
  for (const auto& m : a.modes)
    KILN_CHECK(m == "eager", ValueError,
               "[kiln bench] unknown mode '" + m + "'. Available modes: eager.");
  return a;
}

std::shared_ptr<nn::Module> make_model(const BenchArgs& a) {
  if (a.model == "densenet121") return models::densenet121({.num_classes = a.num_classes});
  if (a.model == "densenet169") return models::densenet169({.num_classes = a.num_classes});
  if (a.model == "resnet18") return models::resnet18({.num_classes = a.num_classes});
  if (a.model == "resnet50") return models::resnet50({.num_classes = a.num_classes});
  throw ValueError("[kiln bench] unknown model '" + a.model +
                   "'. Available: densenet121, densenet169, resnet18, resnet50.");
}

// Median wall time of fn in milliseconds.
double time_ms(int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  BenchArgs a = parse(args);
  if (a.threads > 0) set_num_threads(a.threads);
  manual_seed(0);
  auto model = make_model(a);
  model->to(a.device);
  Tensor x = randn({a.batch, 3, a.size, a.size}, TensorOptions(kFloat32, a.device));
  Tensor y = randint(0, a.num_classes, {a.batch}, TensorOptions(kInt64, a.device));

  nlohmann::json result = {{"model", a.model},   {"device", a.device.str()}, {"batch", a.batch},
                           {"size", a.size},     {"threads", get_num_threads()},
                           {"warmup", a.warmup}, {"iters", a.iters}};
  for (const auto& mode : a.modes) {
    nlohmann::json m;
    model->eval();
    m["inference_ms"] = time_ms(a.warmup, a.iters, [&] {
      NoGradGuard ng;
      Tensor out = model->forward(x);
      out.sum().item<float>();  // synchronize on the result
    });
    if (a.train) {
      model->train();
      optim::Adam opt(model->parameters(), {.lr = 1e-3});
      m["train_step_ms"] = time_ms(a.warmup, a.iters, [&] {
        opt.zero_grad();
        Tensor loss = cross_entropy(model->forward(x), y);
        loss.backward();
        opt.step();
        loss.item<float>();
      });
    }
    result["modes"][mode] = m;
  }

  if (a.json) {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("{} on {}, batch {}, 3x{}x{}, {} threads (median of {} runs)\n", a.model,
                           a.device.str(), a.batch, a.size, a.size, get_num_threads(), a.iters);
  std::cout << fmt::format("{:<12} {:>16} {:>16}\n", "mode", "inference ms", "train step ms");
  for (auto& [mode, m] : result["modes"].items()) {
    std::string train = m.contains("train_step_ms") ? fmt::format("{:.1f}", m["train_step_ms"].get<double>()) : "-";
    std::cout << fmt::format("{:<12} {:>16.1f} {:>16}\n", mode, m["inference_ms"].get<double>(), train);
  }
  return 0;
}

}  // namespace kiln::cli
