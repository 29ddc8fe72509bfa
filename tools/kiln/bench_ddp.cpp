// `kiln bench ddp`: data-parallel training throughput and scaling efficiency.
//
//   kiln bench ddp --model densenet121 --device cuda --nproc 2 --batch 16 --size 128 --json
//
// Started without RANK in the environment it launches itself with `kiln launch --nproc N` (N:
// the visible GPUs for cuda, 2 for cpu). Each rank trains its replica on its own batch (--batch
// per rank) with Adam + cross-entropy, the step `kiln bench MODEL --train` times, wrapped in
// nn::DistributedDataParallel (nccl on GPUs, gloo on CPUs). Per mode:
//   single:  rank 0 alone, the same step without DDP (the other ranks wait): ms per step
//   ddp:     every rank at once, DDP: ms per step (the slowest rank's), samples/s in all and per rank
// timed in --rounds alternating rounds of --iters steps (medians), so that the host's slow spells
// fall on both.
//   scaling efficiency = ddp samples/s / (world size x single samples/s)
// Modes: eager; kiln (the module's forward compiled with compile(), its backward compiled when it
// runs outside the compiled call, DDP around it); kiln-step (the whole training step compiled
// around the DDP model). In both compiled modes the backward's graphs end at the gradient buckets,
// so each bucket's all-reduce overlaps the rest of the backward.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "launch.h"
#include "kiln/distributed.h"
#include "kiln/kiln.h"

namespace kiln::cli {
namespace {

namespace dist = kiln::distributed;

struct DdpArgs {
  std::string model = "densenet121";
  Device device = kCPU;
  int nproc = 0;  // 0: the visible GPUs (cuda), 2 (cpu)
  int64_t batch = 16, size = 128, iters = 10, warmup = 3, rounds = 5, num_classes = 1000;
  double bucket_mb = 25;
  bool broadcast_buffers = true;
  std::vector<std::string> modes = {"eager", "kiln"};
  bool json = false;
};

DdpArgs parse_ddp(const std::vector<std::string>& args) {
  DdpArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& k = args[i];
    auto value = [&]() -> std::string {
      KILN_CHECK(i + 1 < args.size(), ValueError, "[kiln bench ddp] " + k + " needs a value.");
      return args[++i];
    };
    if (k == "--model") a.model = value();
    else if (k == "--device") a.device = Device(value());
    else if (k == "--nproc") a.nproc = int(positive_option("ddp", k, value()));
    else if (k == "--batch") a.batch = positive_option("ddp", k, value());
    else if (k == "--size") a.size = positive_option("ddp", k, value());
    else if (k == "--iters") a.iters = positive_option("ddp", k, value());
    else if (k == "--warmup") a.warmup = positive_option("ddp", k, value());
    else if (k == "--rounds") a.rounds = positive_option("ddp", k, value());
    else if (k == "--bucket-mb") a.bucket_mb = double(positive_option("ddp", k, value()));
    else if (k == "--modes") a.modes = parse_modes("ddp", value(), {"eager", "kiln", "kiln-step"});
    else if (k == "--no-broadcast-buffers") a.broadcast_buffers = false;
    else if (k == "--json") a.json = true;
    else throw ValueError("[kiln bench ddp] unknown option '" + k + "'. See `kiln help`.");
  }
  return a;
}

// A module whose forward is the compiled forward of `inner` (module-style compiled training: the
// backward runs outside the compiled call and is compiled on its own). DDP wraps it like any module.
class CompiledForward : public nn::Module {
 public:
  explicit CompiledForward(std::shared_ptr<nn::Module> inner) : inner_(register_module("inner", inner)) {
    compiled_ = [c = compile(inner)](const Tensor& x) mutable -> Tensor { return c(x); };
  }
  Tensor forward(const Tensor& x) override { return compiled_(x); }

 private:
  std::shared_ptr<nn::Module> inner_;
  std::function<Tensor(const Tensor&)> compiled_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// `iters` steps back to back, each ending on its loss read on the host, as a training loop runs;
// ms per step.
double time_steps(int64_t warmup, int64_t iters, const std::function<Tensor()>& step) {
  for (int64_t i = 0; i < warmup; ++i) step().item<float>();
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) step().item<float>();
  return seconds_since(t0) * 1000.0 / double(iters);
}

int run_rank(const DdpArgs& a) {
  dist::init_process_group({.backend = a.device.is_cuda() ? "nccl" : "gloo"});
  auto group = dist::default_group();
  const int rank = group->rank(), world = group->size();
  const Device device = a.device.is_cuda() ? group->device() : kCPU;

  manual_seed(100 + uint64_t(rank));
  Tensor x = randn({a.batch, 3, a.size, a.size}, TensorOptions(kFloat32, device));
  Tensor y = randint(0, a.num_classes, {a.batch}, TensorOptions(kInt64, device));

  nlohmann::json result = {{"bench", "ddp"},        {"model", a.model},       {"device", a.device.is_cuda() ? "cuda" : "cpu"},
                           {"world_size", world},   {"batch_per_rank", a.batch}, {"size", a.size},
                           {"iters", a.iters},      {"warmup", a.warmup},     {"rounds", a.rounds},     {"backend", group->backend()},
                           {"bucket_cap_mb", a.bucket_mb}, {"threads_per_rank", get_num_threads()},
                           {"broadcast_buffers", a.broadcast_buffers}};
  if (a.device.is_cuda()) result["gpu"] = cuda::get_device_properties(device.index).name;

  for (const std::string& mode : a.modes) {
    auto build = [&](bool ddp) -> std::pair<std::shared_ptr<nn::Module>, std::shared_ptr<nn::Module>> {
      manual_seed(0);
      std::shared_ptr<nn::Module> model = image_model("ddp", a.model, a.num_classes);
      model->to(device);
      std::shared_ptr<nn::Module> run = mode == "kiln" ? std::make_shared<CompiledForward>(model) : model;
      if (ddp)
        run = std::make_shared<nn::DistributedDataParallel>(
            run, nn::DistributedDataParallelOptions{.bucket_cap_mb = a.bucket_mb,
                                                    .broadcast_buffers = a.broadcast_buffers});
      return {model, run};
    };
    // kiln-step: the whole step (zero_grad, forward, backward, Adam) compiled; under DDP its graphs
    // end at the gradient buckets, whose all-reduces overlap the rest of the backward.
    auto step_of = [&](const std::shared_ptr<nn::Module>& run, optim::Adam& opt) -> std::function<Tensor()> {
      auto body = [run, &opt, y](const Tensor& images) {
        opt.zero_grad();
        Tensor loss = cross_entropy(run->forward(images), y);
        loss.backward();
        opt.step();
        return loss;
      };
      if (mode != "kiln-step") return [body, x] { return body(x); };
      auto compiled = std::make_shared<decltype(compile(body))>(compile(body));
      return [compiled, x] { return (*compiled)(x); };
    };
    nlohmann::json m;
    // Rank 0 alone without DDP (the other ranks wait), and every rank with DDP, in alternating
    // rounds so that a slow spell of the host lands on both; medians over the rounds.
    std::shared_ptr<nn::Module> single_model, single_run;
    std::shared_ptr<optim::Adam> single_opt;
    std::function<Tensor()> single_step;
    if (rank == 0) {
      std::tie(single_model, single_run) = build(false);
      single_opt = std::make_shared<optim::Adam>(single_model->parameters(), optim::AdamOptions{.lr = 1e-3});
      single_step = step_of(single_run, *single_opt);
      auto t0 = std::chrono::steady_clock::now();
      single_step().item<float>();
      m["single_first_step_s"] = seconds_since(t0);
    }
    auto [ddp_model, ddp_run] = build(true);
    optim::Adam ddp_opt(ddp_run->parameters(), {.lr = 1e-3});
    std::function<Tensor()> ddp_step = step_of(ddp_run, ddp_opt);
    {
      auto t0 = std::chrono::steady_clock::now();
      ddp_step().item<float>();
      m["ddp_first_step_s"] = seconds_since(t0);
    }
    std::vector<double> single_ms, ddp_ms;
    for (int64_t round = 0; round < a.rounds; ++round) {
      if (rank == 0) single_ms.push_back(time_steps(round == 0 ? a.warmup : 1, a.iters, single_step));
      dist::barrier();
      Tensor ms = tensor<double>({time_steps(round == 0 ? a.warmup : 1, a.iters, ddp_step)});
      dist::all_reduce(ms, dist::ReduceOp::max);  // the job goes at its slowest rank's pace
      ddp_ms.push_back(ms.item<double>());
      dist::barrier();
    }
    if (rank == 0) {
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      double single = median(single_ms), ddp = median(ddp_ms);
      m["single_step_ms"] = single;
      m["ddp_step_ms"] = ddp;
      m["single_step_ms_rounds"] = single_ms;
      m["ddp_step_ms_rounds"] = ddp_ms;
      m["single_samples_per_s"] = double(a.batch) * 1000.0 / single;
      m["ddp_samples_per_s"] = double(world * a.batch) * 1000.0 / ddp;
      m["ddp_samples_per_s_per_rank"] = double(a.batch) * 1000.0 / ddp;
      m["scaling_efficiency"] = single / ddp;
      result["modes"][mode] = m;
    }
    dist::barrier();
  }
  if (rank == 0) {
    if (a.json) {
      std::cout << result.dump(2) << "\n";
    } else {
      std::cout << fmt::format("{} on {} x {} ({}), batch {} per rank, {}x{}\n", a.model, world,
                               result.value("gpu", std::string("cpu")), group->backend(), a.batch, a.size, a.size);
      std::cout << fmt::format("{:<8} {:>14} {:>12} {:>16} {:>16} {:>11}\n", "mode", "single ms/step", "ddp ms/step",
                               "samples/s (all)", "samples/s/rank", "efficiency");
      for (auto& [mode, m] : result["modes"].items())
        std::cout << fmt::format("{:<8} {:>14.1f} {:>12.1f} {:>16.1f} {:>16.1f} {:>11.2f}\n", mode,
                                 m["single_step_ms"].get<double>(), m["ddp_step_ms"].get<double>(),
                                 m["ddp_samples_per_s"].get<double>(), m["ddp_samples_per_s_per_rank"].get<double>(),
                                 m["scaling_efficiency"].get<double>());
    }
  }
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int run_ddp_bench(const std::vector<std::string>& args) {
  DdpArgs a = parse_ddp(args);
  if (std::getenv("RANK")) return run_rank(a);
  // Not a rank yet: start the ranks.
  int nproc = a.nproc;
  if (nproc == 0) nproc = a.device.is_cuda() ? cuda::device_count() : 2;
  KILN_CHECK(nproc >= 1, DeviceError, "[kiln bench ddp] no GPU is visible.");
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  KILN_CHECK(n > 0, Error, "[kiln bench ddp] cannot find the kiln executable (/proc/self/exe).");
  self[n] = '\0';
  std::vector<std::string> launch = {"--nproc", std::to_string(nproc), self, "bench", "ddp"};
  launch.insert(launch.end(), args.begin(), args.end());
  return run_launch(launch);
}

}  // namespace kiln::cli
