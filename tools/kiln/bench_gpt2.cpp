// `kiln bench gpt2`: greedy generation with a growing sequence, the case dynamic shapes exist for
// (docs/compiler.md, "Dynamic shapes").
//
//   kiln bench gpt2 --device cpu --tokens 64 --prompt 8 --json
//
// The zoo's GPT-2-style decoder (a small config by default: 4 layers, 4 heads, 128 channels,
// vocabulary 1024) generates --tokens tokens from a random prompt of --prompt tokens; each step
// runs the whole sequence (no KV cache), so every step is a new sequence length. Modes, run one
// after the other in one process on the same prompt:
//   eager      the model's forward, op by op;
//   static     compile(model, {.dynamic = false}): a compile per length until the recompile limit
//              (8), then eager with a warning;
//   dynamic    compile(model): automatic dynamic (static at the first length, dynamic from the
//              second on; each later length is a new size of that graph, lowered in process);
//   static-ro, dynamic-ro: the same with mode = reduce_overhead (a CUDA graph per size on a GPU);
//   dynamic-pure: automatic dynamic with pure = true (a call at a length seen before replays its
//              graph without running the forward's C++ body).
// Each mode reports tokens per second over the whole generation (compiles included), without the
// backend compile time, and over later generations of the same tokens (warm: every length seen
// once already; the fastest of --warm-runs rounds, 3 by default, in which the modes take turns, so
// that a busy machine's noise falls on all of them alike),
// graph compiles, new sizes of dynamic graphs, kernel builds (system compiler runs) and compile
// seconds of the first generation, and whether it generated the same tokens as eager.
#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "kiln/compiler.h"
#include "kiln/kiln.h"
#include "kiln/models.h"

namespace kiln::cli {

namespace {

struct Gpt2Args {
  Device device = Device("cpu");
  int64_t tokens = 64, prompt = 8;
  models::GPTConfig config{1024, 128, 4, 4, 128, 0.0, true};
  std::vector<std::string> modes{"eager", "static", "dynamic"};
  int64_t warm_runs = 3;
  bool json = false;
};

Gpt2Args parse_gpt2(const std::vector<std::string>& args) {
  Gpt2Args a;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& k = args[i];
    if (k == "--json") {
      a.json = true;
      continue;
    }
    KILN_CHECK(i + 1 < args.size(), ValueError, "[kiln bench gpt2] " + k + " needs a value. See `kiln help`.");
    const std::string& v = args[++i];
    if (k == "--device") a.device = Device(v);
    else if (k == "--tokens") a.tokens = positive_option("gpt2", k, v);
    else if (k == "--prompt") a.prompt = positive_option("gpt2", k, v);
    else if (k == "--layers") a.config.n_layer = positive_option("gpt2", k, v);
    else if (k == "--heads") a.config.n_head = positive_option("gpt2", k, v);
    else if (k == "--embd") a.config.n_embd = positive_option("gpt2", k, v);
    else if (k == "--vocab") a.config.vocab_size = positive_option("gpt2", k, v);
    else if (k == "--warm-runs") a.warm_runs = positive_option("gpt2", k, v);
    else if (k == "--modes")
      a.modes = parse_modes("gpt2", v, {"eager", "static", "dynamic", "static-ro", "dynamic-ro", "dynamic-pure"});
    else
      throw ValueError("[kiln bench gpt2] unknown option '" + k + "'. See `kiln help`.");
  }
  a.config.block_size = a.prompt + a.tokens;
  return a;
}

// Greedy decoding: appends `tokens` argmax tokens to `prompt`, running `forward` on the whole
// sequence each step.
template <class Forward>
Tensor generate(Forward& forward, Tensor idx, int64_t tokens) {
  for (int64_t t = 0; t < tokens; ++t) {
    Tensor logits = forward(idx);
    Tensor next = logits.select(1, -1).argmax(-1, true);
    idx = cat({idx, next}, 1);
  }
  return idx.cpu();
}

}  // namespace

int run_gpt2_bench(const std::vector<std::string>& args) {
  Gpt2Args a = parse_gpt2(args);
  manual_seed(0);
  auto model = models::gpt(a.config);
  model->to(a.device);
  model->eval();
  NoGradGuard no_grad;
  const Tensor prompt = randint(a.config.vocab_size, {1, a.prompt}).to(a.device);

  nlohmann::ordered_json result = {{"model", "gpt2"},
                                   {"config", {{"n_layer", a.config.n_layer}, {"n_head", a.config.n_head},
                                               {"n_embd", a.config.n_embd}, {"vocab_size", a.config.vocab_size}}},
                                   {"device", a.device.str()},
                                   {"threads", get_num_threads()},
                                   {"prompt", a.prompt},
                                   {"new_tokens", a.tokens}};
  Tensor eager_tokens;
  // First generations, mode by mode (each from a reset compiler, so that its compiles are its own).
  std::vector<std::function<Tensor()>> generations;
  for (const std::string& mode : a.modes) {
    compiler::reset();
    const compiler::Counters before = compiler::counters();
    const double compile_before = backend_compile_seconds();
    CompileOptions options;
    if (mode.rfind("static", 0) == 0) options.dynamic = false;
    if (mode.size() > 3 && mode.compare(mode.size() - 3, 3, "-ro") == 0) options.mode = Mode::reduce_overhead;
    if (mode == "dynamic-pure") options.pure = true;
    auto compiled = compile(model, options);
    auto& generation = generations.emplace_back([mode, compiled, model, &prompt, &a]() mutable {
      auto eager_forward = [&](const Tensor& idx) { return model->forward(idx); };
      return mode == "eager" ? generate(eager_forward, prompt, a.tokens) : generate(compiled, prompt, a.tokens);
    });
    const auto t0 = std::chrono::steady_clock::now();
    Tensor out = generation();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const compiler::Counters c = compiler::counters();
    const double compile_seconds = backend_compile_seconds() - compile_before;
    if (mode == "eager") eager_tokens = out;
    result["modes"][mode] = {
        {"seconds", seconds},
        {"tokens_per_s", static_cast<double>(a.tokens) / seconds},
        {"tokens_per_s_without_compiles", static_cast<double>(a.tokens) / std::max(seconds - compile_seconds, 1e-9)},
        {"graph_compiles", c.graph_compiles - before.graph_compiles},
        {"size_specializations", c.size_specializations - before.size_specializations},
        {"kernel_builds", c.kernel_builds - before.kernel_builds},
        {"compile_seconds", compile_seconds},
        {"eager_calls", c.eager_frames - before.eager_frames},
        {"same_tokens_as_eager", eager_tokens.defined() ? equal(out, eager_tokens) : true}};
  }
  // Warm generations (every length seen), the modes taking turns so that a noisy stretch of a
  // shared machine falls on all of them alike: one untimed round (the later modes' resets
  // dropped the earlier modes' caches), then --warm-runs timed rounds; each mode's fastest counts.
  for (auto& generation : generations) generation();
  std::vector<double> warm(a.modes.size(), 0.0);
  for (int64_t r = 0; r < a.warm_runs; ++r) {
    for (size_t i = 0; i < generations.size(); ++i) {
      const auto w0 = std::chrono::steady_clock::now();
      generations[i]();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      warm[i] = r == 0 ? s : std::min(warm[i], s);
    }
  }
  double eager_tps = 0;
  for (size_t i = 0; i < a.modes.size(); ++i)
    if (a.modes[i] == "eager") eager_tps = static_cast<double>(a.tokens) / warm[i];
  for (size_t i = 0; i < a.modes.size(); ++i) {
    auto& m = result["modes"][a.modes[i]];
    m["tokens_per_s_warm"] = static_cast<double>(a.tokens) / warm[i];
    if (eager_tps > 0) m["warm_speedup_vs_eager"] = (static_cast<double>(a.tokens) / warm[i]) / eager_tps;
  }

  if (a.json) {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "gpt2 ({} layers, {} heads, {} channels, vocabulary {}) on {}, {} threads: {} new tokens from a prompt of {}\n",
      a.config.n_layer, a.config.n_head, a.config.n_embd, a.config.vocab_size, a.device.str(), get_num_threads(),
      a.tokens, a.prompt);
  std::cout << "tokens/s: first generation (compiles included), without the compile time, later generations "
               "(warm: the fastest of " << a.warm_runs << " rounds, the modes taking turns; 'vs eager' compares warm runs)\n";
  std::cout << fmt::format("{:<12} {:>9} {:>12} {:>9} {:>9} {:>7} {:>10} {:>7} {:>10} {:>6} {:>5}\n", "mode", "tokens/s",
                           "w/o compile", "warm", "vs eager", "graphs", "new sizes", "builds", "compile s", "eager",
                           "same");
  for (const std::string& mode : a.modes) {
    const auto& m = result["modes"][mode];
    std::cout << fmt::format("{:<12} {:>9.1f} {:>12.1f} {:>9.1f} {:>9} {:>7} {:>10} {:>7} {:>10.2f} {:>6} {:>5}\n", mode,
                             m["tokens_per_s"].get<double>(), m["tokens_per_s_without_compiles"].get<double>(),
                             m["tokens_per_s_warm"].get<double>(),
                             m.contains("warm_speedup_vs_eager")
                                 ? fmt::format("{:.2f}x", m["warm_speedup_vs_eager"].get<double>())
                                 : std::string("-"),
                             m["graph_compiles"].get<int64_t>(),
                             m["size_specializations"].get<int64_t>(), m["kernel_builds"].get<int64_t>(),
                             m["compile_seconds"].get<double>(), m["eager_calls"].get<int64_t>(),
                             m["same_tokens_as_eager"].get<bool>() ? "yes" : "no");
  }
  return 0;
}

}  // namespace kiln::cli
