// `kiln bench MODEL`: times a model's eager and compiled inference and training step.
//
//   kiln bench densenet121 --device cpu --batch 16 --size 128 --modes eager,kiln,kiln-ro,kiln-at --train --json
//
// Modes: eager; kiln (compile() with the kiln backend); kiln-ro (mode reduce_overhead: a static
// memory plan); kiln-at (mode max_autotune: convolutions timed direct vs Winograd at their first
// call, the winner cached for the process); kiln-module (the model compiled, the step's loss,
// backward and Adam around it); kiln-per-op (kiln, with Adam's per-op update captured instead of
// its fused node: what the fused update gains, in the same run).
//
// Compiled modes first measure compile times (cold: an empty kernel cache; warm: the disk cache).
// Then every mode is timed in interleaved rounds (eager, kiln, ..., eager, kiln, ...) so that load
// on a shared machine hits each alike: each timing is the median (and min) of --iters rounds after
// --warmup rounds. Inference runs in eval mode under NoGradGuard; the training step is Adam +
// cross-entropy (zero_grad, forward, backward, step) in train mode, one Adam per mode over the
// same model. On the CPU a call is timed by the wall clock until its result is read; on a GPU by
// CUDA events around the call, as bench/torch_baseline.py times PyTorch. `--profile infer|train`
// (GPU) runs one more call per mode between cuda::profiler_start()/stop(), for
// `ncu --profile-from-start off --graph-profiling node kiln bench ... --profile infer`
// (bench/kernel_table.py sums the result per kernel). `--pure` compiles the timed inference and
// training step with CompileOptions::pure: after two identical captures a call replays the graph
// without running the C++ body (whose lazy re-run is most of a compiled call's host time; the
// step's replay sets each parameter's .grad as its backward did).
//
//   kiln bench toy --json --iters 2000 --threads 1
//
// `toy` measures what compile() costs per call on a function too small for kernels to matter:
// the set_stance recipe's three 5x5 matmuls, eager vs compile(fn) vs compile(fn, {.pure = true})
// vs pure with mode = reduce_overhead (one CUDA graph launch per call on a GPU).
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include <filesystem>
#include <cstdlib>

#include "compiler/runtime/kernel_cache.h"
#include "core/profiler.h"
#include "core/progress.h"
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
  bool pure = false;  // compiled inference and training step with CompileOptions::pure
  std::string profile;  // "infer" or "train": one more such call per mode inside cuda::profiler_start()/stop()
  int host_profile = 0;  // > 0: that many more calls per mode with the op profiler (and a preloaded sampler) on
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

// An option's integer value; bad text is a ValueError, not an uncaught std::invalid_argument.
int64_t to_int(const std::string& option, const std::string& text) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KILN_CHECK(used == text.size() && !text.empty(), ValueError,
             "[kiln bench] " + option + " needs an integer, got '" + text + "'.");
  return v;
}

BenchArgs parse(const std::vector<std::string>& args) {
  BenchArgs a;
  KILN_CHECK(!args.empty(), ValueError, "[kiln bench] name a model: densenet121, densenet169, resnet18, resnet50, gpt2, batch-sizes, program, ddp, or toy.");
  a.model = args[0];
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& k = args[i];
    auto value = [&]() -> std::string {
      KILN_CHECK(i + 1 < args.size(), ValueError, "[kiln bench] " + k + " needs a value.");
      return args[++i];
    };
    if (k == "--device") a.device = Device(value());
    else if (k == "--batch") a.batch = to_int(k, value());
    else if (k == "--size") a.size = to_int(k, value());
    else if (k == "--classes") a.num_classes = to_int(k, value());
    else if (k == "--modes") a.modes = split_commas(value());
    else if (k == "--train") a.train = true;
    else if (k == "--json") a.json = true;
    else if (k == "--profile") a.profile = value();
    else if (k == "--host-profile") a.host_profile = static_cast<int>(to_int(k, value()));
    else if (k == "--pure") a.pure = true;
    else if (k == "--warmup") a.warmup = static_cast<int>(to_int(k, value()));
    else if (k == "--iters") a.iters = static_cast<int>(to_int(k, value()));
    else if (k == "--threads") a.threads = static_cast<int>(to_int(k, value()));
    else throw ValueError("[kiln bench] unknown option '" + k + "'. See `kiln help`.");
  }
  KILN_CHECK(a.profile.empty() || a.profile == "infer" || (a.profile == "train" && a.train), ValueError,
             "[kiln bench] --profile takes infer or train (train needs --train).");
  KILN_CHECK(a.batch > 0 && a.size > 0 && a.iters > 0 && a.warmup >= 0 && a.host_profile >= 0, ValueError,
             "[kiln bench] --batch, --size and --iters must be positive.");
  for (const auto& m : a.modes)
    KILN_CHECK(m == "eager" || m == "kiln" || m == "kiln-ro" || m == "kiln-at" || m == "kiln-module" || m == "kiln-per-op",
               ValueError,
               "[kiln bench] unknown mode '" + m +
                   "'. Available modes: eager, kiln (compile() with the kiln backend), kiln-ro (the kiln backend "
                   "with mode reduce_overhead: a static memory plan), kiln-at (the kiln backend with mode "
                   "max_autotune: convolutions timed direct vs Winograd, the winner cached), kiln-module (the "
                   "model compiled with the kiln backend; the training step's loss, backward and Adam outside "
                   "the compiled call), kiln-per-op (kiln with Adam's per-op update, fused = false, in the step's "
                   "graph instead of one fused node).");
  return a;
}

// The Adam of a bench mode's training step: kiln-per-op captures the per-op update.
optim::AdamOptions adam_options(const std::string& mode) {
  return {.lr = 1e-3, .fused = mode == "kiln-per-op" ? std::optional<bool>(false) : std::nullopt};
}

// The compile() mode of a compiled bench mode.
Mode compile_mode(const std::string& mode) {
  if (mode == "kiln-ro") return Mode::reduce_overhead;
  if (mode == "kiln-at") return Mode::max_autotune;
  return Mode::default_;
}

// ---- `kiln bench toy`: per-call overhead of compile() ----

struct ToyArgs {
  bool json = false;
  int warmup = 3;      // calls before timing (the first compiled call captures and compiles)
  int iters = 2000;    // calls per batch
  int batches = 7;     // the result is the median batch
  int threads = 0;
  Device device = kCPU;
};

ToyArgs parse_toy(const std::vector<std::string>& args) {
  ToyArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& k = args[i];
    auto value = [&]() -> std::string {
      KILN_CHECK(i + 1 < args.size(), ValueError, "[kiln bench toy] " + k + " needs a value.");
      return args[++i];
    };
    if (k == "--json") a.json = true;
    else if (k == "--warmup") a.warmup = static_cast<int>(to_int(k, value()));
    else if (k == "--iters") a.iters = static_cast<int>(to_int(k, value()));
    else if (k == "--batches") a.batches = static_cast<int>(to_int(k, value()));
    else if (k == "--threads") a.threads = static_cast<int>(to_int(k, value()));
    else if (k == "--device") a.device = Device(value());
    else throw ValueError("[kiln bench toy] unknown option '" + k + "'. See `kiln help`.");
  }
  KILN_CHECK(a.iters > 0 && a.batches > 0 && a.warmup >= 1, ValueError,
             "[kiln bench toy] --iters and --batches must be positive and --warmup at least 1.");
  return a;
}

// The set_stance recipe's my_gigantic_model: x = x @ y, three times.
Tensor toy_model(const Tensor& x0, const Tensor& y) {
  Tensor x = matmul(x0, y);
  x = matmul(x, y);
  x = matmul(x, y);
  return x;
}

// Mean microseconds per call of one batch of `iters` calls (on a GPU, until the queued work is done).
template <class Fn>
double time_batch_us(int iters, Fn& fn, const Tensor& x, const Tensor& y) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    Tensor out = fn(x, y);
    (void)out;
  }
  if (x.is_cuda()) cuda::synchronize(x.device().index);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_toy_bench(const std::vector<std::string>& args) {
  ToyArgs a = parse_toy(args);
  if (a.threads > 0) set_num_threads(a.threads);
  manual_seed(0);
  Tensor x = randn({5, 5}).to(a.device);
  Tensor y = randn({5, 5}).to(a.device);
  const Tensor expected = toy_model(x, y);
  compiler::reset();

  auto eager = [](const Tensor& p, const Tensor& q) { return toy_model(p, q); };
  auto compiled = compile(toy_model);
  auto compiled_pure = compile(toy_model, {.pure = true});
  // reduce_overhead: on a GPU the replayed graph is one CUDA graph launch (elsewhere the same as
  // compiled_pure).
  auto compiled_pure_ro = compile(toy_model, {.mode = Mode::reduce_overhead, .pure = true});

  // Warm up. The first compiled call captures and compiles; a pure frame replays from its third
  // call on (two identical captures confirm it). Each compiled mode must equal eager.
  for (int i = 0; i < a.warmup; ++i) eager(x, y);
  for (int i = 0; i < std::max(a.warmup, 3); ++i) {
    for (const Tensor& out : {compiled(x, y), compiled_pure(x, y), compiled_pure_ro(x, y)})
      KILN_CHECK(allclose(out.cpu(), expected.cpu(), 1.3e-6, 1e-5), Error,
                 "[kiln bench toy] a compiled mode computed a different result than eager. This is a Kiln bug.");
  }

  // Batches of the three modes alternate, so that load on a shared machine hits each alike.
  // Counter deltas per batch prove the compiled modes ran through the compiler.
  struct ModeRun {
    std::vector<double> us;
    int64_t graph_runs = 0, replays = 0, eager_frames = 0;
  };
  constexpr int kModes = 4;
  ModeRun runs[kModes];
  for (int b = 0; b < a.batches; ++b) {
    for (int m = 0; m < kModes; ++m) {
      compiler::Counters before = compiler::counters();
      double us = m == 0   ? time_batch_us(a.iters, eager, x, y)
                  : m == 1 ? time_batch_us(a.iters, compiled, x, y)
                  : m == 2 ? time_batch_us(a.iters, compiled_pure, x, y)
                           : time_batch_us(a.iters, compiled_pure_ro, x, y);
      compiler::Counters after = compiler::counters();
      runs[m].us.push_back(us);
      runs[m].graph_runs += after.graph_runs - before.graph_runs;
      runs[m].replays += after.replays - before.replays;
      runs[m].eager_frames += after.eager_frames - before.eager_frames;
    }
  }

  const int64_t calls = static_cast<int64_t>(a.iters) * a.batches;
  const char* names[kModes] = {"eager", "compiled", "compiled_pure", "compiled_pure_ro"};
  KILN_CHECK(runs[0].graph_runs == 0, Error, "[kiln bench toy] the eager mode ran compiled graphs. This is a Kiln bug.");
  for (int m = 1; m < kModes; ++m) {
    KILN_CHECK(runs[m].graph_runs == calls && runs[m].eager_frames == 0, Error,
               std::string("[kiln bench toy] mode '") + names[m] + "' did not go through the compiler: " +
                   std::to_string(calls) + " calls ran " + std::to_string(runs[m].graph_runs) + " graphs and " +
                   std::to_string(runs[m].eager_frames) +
                   " eager frames, so its timing would mean nothing. Check the stance and KILN_* settings.");
  }
  KILN_CHECK(runs[1].replays == 0 && runs[2].replays == calls && runs[3].replays == calls, Error,
             "[kiln bench toy] compiled_pure replayed " + std::to_string(runs[2].replays) + " of " +
                 std::to_string(calls) + " calls, compiled_pure_ro " + std::to_string(runs[3].replays) +
                 " (compiled: " + std::to_string(runs[1].replays) +
                 "); a pure one-graph function skips its body on every call after the second. This is a Kiln bug.");

  compiler::Counters total = compiler::counters();
  nlohmann::ordered_json result = {{"model", "toy"},
                           {"function", "x = x @ y three times, x and y randn 5x5 float32"},
                           {"device", a.device.str()},
                           {"threads", get_num_threads()},
                           {"backend", compiler::default_backend()},
                           {"warmup", a.warmup},
                           {"iters", a.iters},
                           {"batches", a.batches},
                           {"graph_compiles", total.graph_compiles}};
  const double eager_us = median(runs[0].us);
  for (int m = 0; m < kModes; ++m) {
    nlohmann::ordered_json j = {{"us_per_call", median(runs[m].us)}};
    if (m > 0) {
      j["overhead_us"] = median(runs[m].us) - eager_us;
      j["graph_runs"] = runs[m].graph_runs;
      j["replays"] = runs[m].replays;
    }
    result["modes"][names[m]] = j;
  }

  if (a.json) {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("toy (x = x @ y three times, 5x5 float32) on {}, backend '{}', {} threads\n"
                           "median of {} batches of {} calls, modes interleaved\n",
                           a.device.str(), result["backend"].get<std::string>(), get_num_threads(), a.batches, a.iters);
  std::cout << fmt::format("{:<16} {:>14} {:>14}\n", "mode", "us per call", "overhead us");
  for (const char* mode : names) {
    const auto& m = result["modes"][mode];
    std::string overhead = m.contains("overhead_us") ? fmt::format("{:+.2f}", m["overhead_us"].get<double>()) : "-";
    std::cout << fmt::format("{:<16} {:>14.2f} {:>14}\n", mode, m["us_per_call"].get<double>(), overhead);
  }
  return 0;
}

}  // namespace

// Seconds since t0.
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The kiln mode: compile() with the kiln backend. Cold compile time is the first call with an
// empty kernel cache (a fresh directory inside the cache, removed afterwards); warm compile time
// is the first call of a new compile() after compiler::reset(), served by the disk cache.
// The training step every mode times: Adam + cross-entropy (zero_grad, forward, backward, step).
auto adam_step(const std::shared_ptr<nn::Module>& model, optim::Adam& opt, const Tensor& labels) {
  return [model, &opt, labels](const Tensor& images) {
    opt.zero_grad();
    Tensor loss = cross_entropy(model->forward(images), labels);
    loss.backward();
    opt.step();
    return loss;
  };
}

// The module-style training step (kiln-module): the model compiled, the loss, backward and Adam
// outside the compiled call, as most training loops are written.
auto module_step(std::function<Tensor(const Tensor&)> forward, optim::Adam& opt, const Tensor& labels) {
  return [forward = std::move(forward), &opt, labels](const Tensor& images) {
    opt.zero_grad();
    Tensor loss = cross_entropy(forward(images), labels);
    loss.backward();
    opt.step();
    return loss;
  };
}

// The training step a compiled mode times: the whole step compiled, or (kiln-module) the model
// compiled and the loss, backward and Adam around it.
std::function<Tensor(const Tensor&)> compiled_training_step(const std::shared_ptr<nn::Module>& model, optim::Adam& opt,
                                                            const Tensor& labels, const CompileOptions& options,
                                                            bool module_style) {
  if (!module_style) return compile(adam_step(model, opt, labels), options);
  auto compiled_model = compile(model, options);
  return module_step([compiled_model](const Tensor& images) mutable { return compiled_model(images); }, opt, labels);
}

nlohmann::json bench_compiled(const BenchArgs& a, const std::shared_ptr<nn::Module>& model, const Tensor& x,
                              const Tensor& y, const std::string& bench_mode) {
  const Mode mode = compile_mode(bench_mode);
  const bool module_style = bench_mode == "kiln-module";
  namespace fs = std::filesystem;
  nlohmann::json m;
  const char* old_dir = std::getenv("KILN_CACHE_DIR");
  const std::string saved = old_dir ? old_dir : "";
  std::string base = compiler::runtime::cache_dir();
  std::string cold_dir = base + "/bench-cold-XXXXXX";
  KILN_CHECK(mkdtemp(cold_dir.data()) != nullptr, Error, "[kiln bench] cannot create " + cold_dir + ".");
  setenv("KILN_CACHE_DIR", cold_dir.c_str(), 1);
  struct Restore {
    std::string dir, saved;
    bool had;
    ~Restore() {
      std::error_code ec;
      fs::remove_all(dir, ec);
      if (had) setenv("KILN_CACHE_DIR", saved.c_str(), 1);
      else unsetenv("KILN_CACHE_DIR");
    }
  } restore{cold_dir, saved, old_dir != nullptr};

  const CompileOptions options{.backend = std::string("kiln"), .mode = mode};
  auto run_inference = [&](auto& compiled) {
    NoGradGuard ng;
    Tensor out = compiled(x);
    out.sum().item<float>();
  };
  model->eval();
  {
    compiler::reset();
    auto compiled = compile(model, options);
    auto t0 = std::chrono::steady_clock::now();
    run_inference(compiled);
    m["inference_compile_cold_s"] = since(t0);
  }
  compiler::reset();
  auto compiled = compile(model, options);
  auto t0 = std::chrono::steady_clock::now();
  run_inference(compiled);
  m["inference_compile_warm_s"] = since(t0);
  const auto before = compiler::counters();
  run_inference(compiled);
  run_inference(compiled);  // reduce_overhead on a GPU records its CUDA graph on the second call
  const auto after = compiler::counters();
  m["inference_generated_kernel_runs"] = after.kernel_runs - before.kernel_runs;
  m["inference_cuda_graph_replays"] = after.cuda_graph_replays - before.cuda_graph_replays;
  // On the CPU every compiled mode runs generated kernels. A GPU graph runs generated CUDA
  // kernels for what the backend lowers, the eager CUDA kernels for the rest, all in one CUDA
  // graph under reduce_overhead (whose replays the runner counts, not each kernel). The counts
  // above say which.
  KILN_CHECK(after.kernel_runs > before.kernel_runs || after.cuda_graph_replays > before.cuda_graph_replays, Error,
             "[kiln bench] the compiled model ran no generated kernel: its timing would mean nothing.");
  if (a.train) {
    model->train();
    optim::Adam opt(model->parameters(), adam_options(bench_mode));
    compiler::reset();
    auto step = compiled_training_step(model, opt, y, options, module_style);
    auto t1 = std::chrono::steady_clock::now();
    step(x).item<float>();
    m["train_compile_cold_s"] = since(t1);
    // Where the cold compile went (seconds per phase, summed over the step's graphs).
    for (const auto& row : compiler::compile_time_table()) {
      double total = 0;
      for (double sec : row.seconds) total += sec;
      m["train_compile_phases_s"][row.phase] = total;
    }
  }
  return m;
}

// One mode's callables for the timing rounds: inference (eval, no grad) and a training step.
struct TimedMode {
  std::string name;
  std::shared_ptr<optim::Adam> opt;  // this mode's own optimizer state
  std::function<void()> infer, train;
  std::vector<double> infer_ms, train_ms;
  std::vector<double> infer_host_ms, train_host_ms;  // GPU: until the call returned (launch work)
  int64_t infer_peak_bytes = -1, train_peak_bytes = -1;  // GPU
  int64_t infer_resident_bytes = -1;  // GPU: allocated before the measured inference
};

// Device bytes the caching allocator holds for an optimizer's state (each tensor's request
// rounded up to the allocator's 512-byte granule, as its statistics count it).
int64_t state_bytes(const nn::Module& model, const optim::Optimizer& opt) {
  int64_t bytes = 0;
  for (const Tensor& p : model.parameters())
    for (const auto& [name, t] : opt.state(p)) bytes += std::max<int64_t>(1, (t.numel() * t.element_size() + 511) / 512) * 512;
  return bytes;
}

// Peak memory of one call of `fn`, as torch.cuda.max_memory_allocated reports it: what was
// allocated before the call (weights, optimizer state) plus the call's own high-water mark.
int64_t peak_bytes(const BenchArgs& a, const std::function<void()>& fn, int64_t* resident = nullptr) {
  cuda::synchronize(a.device.index);
  if (resident) *resident = cuda::memory_allocated(a.device.index);
  cuda::reset_peak_memory_stats(a.device.index);
  fn();
  cuda::synchronize(a.device.index);
  return cuda::max_memory_allocated(a.device.index);
}

// Times every mode's inference, then every mode's training step, in interleaved rounds (mode A,
// mode B, ..., then again), so that load on a shared machine hits every mode alike.
void time_interleaved(const BenchArgs& a, const std::shared_ptr<nn::Module>& model, std::vector<TimedMode>& modes) {
  // On a GPU a call is timed by CUDA events around it, as bench/torch_baseline.py times PyTorch;
  // on the CPU by the wall clock (each call synchronizes on its result).
  // On a GPU the host's share is recorded too: the time until the call returned, i.e. what it
  // spent launching (and waiting on the host); near the event time means the host bounds it.
  auto time_ms = [&](const std::function<void()>& fn, double& host_ms) {
    auto t0 = std::chrono::steady_clock::now();
    auto host_since = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); };
    if (a.device.is_cuda()) {
      cuda::Event start(a.device.index), stop(a.device.index);
      start.record();
      t0 = std::chrono::steady_clock::now();
      fn();
      host_ms = host_since();
      stop.record();
      stop.synchronize();
      return static_cast<double>(start.elapsed_ms(stop));
    }
    fn();
    return host_ms = host_since();
  };
  bool profile_reset = false;
  auto rounds = [&](std::function<void()> TimedMode::*fn, std::vector<double> TimedMode::*ms,
                    std::vector<double> TimedMode::*host) {
    // Past 2 s, the rounds show their progress on stderr (KILN_PROGRESS=0: not).
    kiln::detail::Progress progress("kiln bench " + a.model + ": timing " + (fn == &TimedMode::train ? "training steps" : "inference"),
                                    "calls");
    progress.add_total(static_cast<int64_t>(a.warmup + a.iters) * static_cast<int64_t>(modes.size()));
    // The op profiler (KILN_PROFILE=1) counts the timed rounds only: the warm-up rounds' first-call
    // costs (compiles, first touches of fresh memory, oneDNN's kernel generation) would swamp it.
    // What ran before the first timed round (the modes' compiles) is dropped from it too.
    const bool profiling = kiln::detail::g_op_profiling.load(std::memory_order_relaxed);
    for (int i = 0; i < a.warmup + a.iters; ++i)
      for (TimedMode& m : modes) {
        if (profiling && i == a.warmup && !profile_reset) {
          reset_op_profile();
          profile_reset = true;
        }
        set_op_profiling(profiling && i >= a.warmup);
        double host_ms = 0;
        const double t = time_ms(m.*fn, host_ms);
        progress.advance();
        if (i < a.warmup) continue;
        (m.*ms).push_back(t);
        (m.*host).push_back(host_ms);
      }
    set_op_profiling(profiling);
  };
  model->eval();
  rounds(&TimedMode::infer, &TimedMode::infer_ms, &TimedMode::infer_host_ms);
  if (a.device.is_cuda()) {
    // Inference peaks before any training round, as bench/torch_baseline.py measures them: no
    // gradients and no optimizer state held (the compile-time step left gradients behind).
    model->zero_grad();
    for (TimedMode& m : modes) m.infer_peak_bytes = peak_bytes(a, m.infer, &m.infer_resident_bytes);
  }
  if (a.train) {
    model->train();
    rounds(&TimedMode::train, &TimedMode::train_ms, &TimedMode::train_host_ms);
    if (a.device.is_cuda()) {
      // Each mode keeps its own Adam state alive (the modes alternate); a mode's training peak
      // leaves out the other modes' state, which a program training one way would not hold.
      for (TimedMode& m : modes) {
        int64_t others = 0;
        for (const TimedMode& o : modes)
          if (&o != &m) others += state_bytes(*model, *o.opt);
        m.train_peak_bytes = peak_bytes(a, m.train) - others;
      }
    }
  }
}

// --profile infer|train: one more inference or training step per mode with the CUDA profilers
// collecting, for `ncu --profile-from-start off kiln bench ... --profile infer`.
void profile_once(const BenchArgs& a, const std::shared_ptr<nn::Module>& model, std::vector<TimedMode>& modes) {
  KILN_CHECK(a.device.is_cuda(), ValueError, "[kiln bench] --profile needs --device cuda.");
  const bool train = a.profile == "train";
  if (train) model->train();
  else model->eval();
  for (TimedMode& m : modes) {
    cuda::synchronize(a.device.index);
    cuda::profiler_start();
    if (train) m.train();
    else m.infer();
    cuda::synchronize(a.device.index);
    cuda::profiler_stop();
  }
}

// --host-profile N: N more inference calls (and training steps with --train) per mode with the
// eager op profiler on, whose table goes to stderr; with bench/host_sampler.cpp preloaded, its
// sampler records the same calls, each mode's inference and step under its own section number:
// where host time goes on a machine without perf.
void host_profile(const BenchArgs& a, const std::shared_ptr<nn::Module>& model, std::vector<TimedMode>& modes) {
  using Enable = void (*)(int);
  const auto sampler = reinterpret_cast<Enable>(dlsym(RTLD_DEFAULT, "kiln_host_sampler_enable"));
  int section = 0;
  auto profile = [&](const char* what, std::function<void()> TimedMode::*fn) {
    for (TimedMode& m : modes) {
      ++section;
      if (a.device.is_cuda()) cuda::synchronize(a.device.index);
      reset_op_profile();
      set_op_profiling(true);
      if (sampler) sampler(section);
      for (int i = 0; i < a.host_profile; ++i) (m.*fn)();
      if (sampler) sampler(0);
      set_op_profiling(false);
      if (a.device.is_cuda()) cuda::synchronize(a.device.index);
      std::fputs(fmt::format("\n== {} {}, {} calls (sampler section {}) ==\n", m.name, what, a.host_profile, section).c_str(),
                 stderr);
      std::fputs(op_profile_report().c_str(), stderr);
    }
  };
  model->eval();
  profile("inference", &TimedMode::infer);
  if (a.train) {
    model->train();
    profile("training step", &TimedMode::train);
  }
}

int run_bench(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "toy") return run_toy_bench({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "gpt2") return run_gpt2_bench({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "batch-sizes") return run_batch_sizes_bench({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "program") return run_program_bench({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "ddp") return run_ddp_bench({args.begin() + 1, args.end()});
  BenchArgs a = parse(args);
  if (a.threads > 0) set_num_threads(a.threads);
  manual_seed(0);
  auto model = image_model("", a.model, a.num_classes);
  model->to(a.device);
  Tensor x = randn({a.batch, 3, a.size, a.size}, TensorOptions(kFloat32, a.device));
  Tensor y = randint(0, a.num_classes, {a.batch}, TensorOptions(kInt64, a.device));

  nlohmann::json result = {{"model", a.model},   {"device", a.device.str()}, {"batch", a.batch},
                           {"size", a.size},     {"threads", get_num_threads()},
                           {"warmup", a.warmup}, {"iters", a.iters},
                           {"pure", a.pure}};
  // Compile times first (each compiled mode from an empty cache, then from the disk cache); then
  // every mode's callables, timed in interleaved rounds.
  for (const auto& mode : a.modes) {
    result["modes"][mode] =
        mode == "eager" ? nlohmann::json::object()
                        : bench_compiled(a, model, x, y, mode);
  }
  compiler::reset();
  std::vector<TimedMode> timed;
  for (const auto& mode : a.modes) {
    TimedMode t{.name = mode, .opt = std::make_shared<optim::Adam>(model->parameters(), adam_options(mode))};
    auto step = adam_step(model, *t.opt, y);
    auto forward = [model](const Tensor& images) { return model->forward(images); };
    // On the CPU each call synchronizes on its result; on a GPU the timer's events do.
    const bool sync = !a.device.is_cuda();
    if (mode == "eager") {
      t.infer = [forward, x, sync] {
        NoGradGuard ng;
        Tensor out = forward(x);
        if (sync) out.sum().item<float>();
      };
      t.train = [step, x, sync] {
        Tensor loss = step(x);
        if (sync) loss.item<float>();
      };
    } else {
      const CompileOptions options{.backend = std::string("kiln"), .mode = compile_mode(mode)};
      // --pure: a model's forward, and the training step, are pure functions of the input, the
      // parameters and the optimizer state, so after two identical captures a call replays the
      // compiled graph without running the body (the step's replay sets the .grad tensors).
      CompileOptions pure_options = options;
      pure_options.pure = a.pure;
      auto infer = compile(forward, pure_options);
      auto train = compiled_training_step(model, *t.opt, y, pure_options, mode == "kiln-module");
      t.infer = [infer, x, sync]() mutable {
        NoGradGuard ng;
        Tensor out = infer(x);
        if (sync) out.sum().item<float>();
      };
      t.train = [train, x, sync]() mutable {
        Tensor loss = train(x);
        if (sync) loss.item<float>();
      };
    }
    timed.push_back(std::move(t));
  }
  time_interleaved(a, model, timed);
  if (!a.profile.empty()) profile_once(a, model, timed);
  if (a.host_profile > 0) host_profile(a, model, timed);
  if (a.device.is_cuda()) {
    // Peak memory per mode (weights, optimizer state and caches included, as
    // torch.cuda.max_memory_allocated counts them), measured by time_interleaved.
    result["gpu"] = cuda::get_device_properties(a.device.index).name;
    for (TimedMode& t : timed) {
      nlohmann::json& m = result["modes"][t.name];
      m["inference_peak_bytes"] = t.infer_peak_bytes;
      m["inference_resident_bytes"] = t.infer_resident_bytes;  // what the peak starts from
      if (a.train) m["train_peak_bytes"] = t.train_peak_bytes;
    }
  }
  for (TimedMode& t : timed) {
    nlohmann::json& m = result["modes"][t.name];
    m["inference_ms"] = median(t.infer_ms);
    m["inference_min_ms"] = *std::min_element(t.infer_ms.begin(), t.infer_ms.end());
    if (a.device.is_cuda()) m["inference_host_ms"] = median(t.infer_host_ms);
    if (a.train) {
      m["train_step_ms"] = median(t.train_ms);
      m["train_step_min_ms"] = *std::min_element(t.train_ms.begin(), t.train_ms.end());
      if (a.device.is_cuda()) m["train_step_host_ms"] = median(t.train_host_ms);
    }
  }

  if (a.json) {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("{} on {}, batch {}, 3x{}x{}, {} threads (median of {} interleaved rounds)\n", a.model,
                           a.device.str(), a.batch, a.size, a.size, get_num_threads(), a.iters);
  std::cout << fmt::format("{:<12} {:>16} {:>16} {:>18} {:>18}\n", "mode", "inference ms", "train step ms",
                           "compile cold s", "compile warm s");
  for (auto& [mode, m] : result["modes"].items()) {
    std::string train = m.contains("train_step_ms") ? fmt::format("{:.1f}", m["train_step_ms"].get<double>()) : "-";
    std::string cold = m.contains("inference_compile_cold_s")
                           ? fmt::format("{:.2f}", m["inference_compile_cold_s"].get<double>())
                           : "-";
    std::string warm = m.contains("inference_compile_warm_s")
                           ? fmt::format("{:.2f}", m["inference_compile_warm_s"].get<double>())
                           : "-";
    std::cout << fmt::format("{:<12} {:>16.1f} {:>16} {:>18} {:>18}\n", mode, m["inference_ms"].get<double>(), train,
                             cold, warm);
  }
  return 0;
}

std::shared_ptr<nn::Module> image_model(const std::string& bench, const std::string& name, int64_t num_classes) {
  if (name == "densenet121") return models::densenet121({.num_classes = num_classes});
  if (name == "densenet169") return models::densenet169({.num_classes = num_classes});
  if (name == "resnet18") return models::resnet18({.num_classes = num_classes});
  if (name == "resnet50") return models::resnet50({.num_classes = num_classes});
  throw ValueError("[kiln bench" + (bench.empty() ? "" : " " + bench) + "] unknown model '" + name +
                   "'. Available: densenet121, densenet169, resnet18, resnet50.");
}

int64_t positive_option(const std::string& bench, const std::string& option, const std::string& text) {
  int64_t v = 0;
  try {
    size_t used = 0;
    v = std::stoll(text, &used);
    if (used != text.size()) v = 0;
  } catch (const std::exception&) {
    v = 0;
  }
  KILN_CHECK(v > 0, ValueError,
             "[kiln bench " + bench + "] " + option + " needs a positive integer, got '" + text + "'.");
  return v;
}

std::vector<std::string> parse_modes(const std::string& bench, const std::string& text,
                                     std::initializer_list<const char*> allowed) {
  std::string names;
  for (const char* m : allowed) names += (names.empty() ? "" : ", ") + std::string(m);
  std::vector<std::string> modes;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    std::string m = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    KILN_CHECK(std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return m == a; }), ValueError,
               "[kiln bench " + bench + "] unknown mode '" + m + "': the modes are " + names + ".");
    modes.push_back(std::move(m));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return modes;
}

double backend_compile_seconds() {
  double s = 0;
  for (const auto& p : compiler::compile_time_table())
    if (p.phase.rfind("backend_compile", 0) == 0)
      for (double v : p.seconds) s += v;
  return s;
}

}  // namespace kiln::cli
