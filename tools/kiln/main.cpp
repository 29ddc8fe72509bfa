// The `kiln` command-line tool: the tour of the examples, the op table, benchmarks, and exported
// programs (export-info, run).
#include <fmt/format.h>

#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "cache_cmd.h"
#include "report_cmd.h"
#include "launch.h"
#include "program_cmd.h"
#include "example.h"
#include "kiln/kiln.h"

namespace {

constexpr const char* kUsage = R"(usage: kiln <command> [options]

commands:
  tour                 run every example in order, with headings
  tour <name>          run one example (see `kiln tour --list`)
  ops [--json]         list the op table: name, schema, devices with kernels, derivative, lowering
  bench MODEL [opts]   time a model: --device cpu --batch 16 --size 128 --modes eager --train
                       (modes: eager, kiln, kiln-ro, kiln-at, kiln-module: the model compiled,
                       backward and Adam outside the compiled call, kiln-per-op: Adam's per-op
                       update captured instead of its fused node)
                       --iters 5 --warmup 2 --threads N --json --profile infer|train
                       --pure (models: densenet121, densenet169, resnet18, resnet50; --profile:
                       one more call per mode inside cuda::profiler_start/stop, for ncu;
                       --pure: compiled inference and step with CompileOptions::pure;
                       --host-profile N: N more calls per mode with the op profiler on, its
                       table on stderr, and bench/host_sampler.cpp's sampler if preloaded)
  bench toy [opts]     compile()'s overhead per call on three 5x5 matmuls: eager, compiled,
                       compiled pure, pure reduce_overhead (us per call). --iters 2000 (calls per batch) --batches 7
                       --warmup 3 --threads N --device cpu|cuda --json
  bench gpt2 [opts]    greedy generation with a growing sequence: eager, compiled with dynamic =
                       false, compiled with automatic dynamic (tokens/s, compiles, compile seconds).
                       --tokens 64 --prompt 8 --layers 4 --heads 4 --embd 128 --vocab 1024 --warm-runs 3
                       --modes eager,static,dynamic[,static-ro,dynamic-ro,dynamic-pure] --device cpu|cuda
                       --json
  bench batch-sizes    one model at every batch size (dynamic shapes): eager, automatic dynamic,
                       with reduce_overhead (cold pass: compiles; warm: ms per call).
                       --model densenet121|resnet18|resnet50 --min-batch 1 --max-batch 32 --size 128
                       --iters 5 --modes eager,dynamic,dynamic-ro[,static-ro] --device cpu|cuda --json
  bench program [opts] an exported program: export/save/load seconds, time per call against
                       compile(model), and calls/s from many threads calling one loaded program.
                       --model mlp|resnet18|densenet121 --device cpu|cuda --batch 8 --size 64
                       --iters 20 --rounds 3 --threads 1,8 --calls 200 --mode default --dynamic --json
  bench ddp [opts]     DistributedDataParallel training: ms per step alone and in DDP, samples/s,
                       scaling efficiency (launches its ranks). --model densenet121 --device cpu|cuda
                       --nproc N --batch 16 (per rank) --size 128 --iters 10 --rounds 5 --warmup 3
                       --modes eager,kiln,kiln-step --bucket-mb 25 --no-broadcast-buffers --json
  export-info PACKAGE  what an exported program (.kpkg) holds: inputs, outputs, dynamic dims,
                       weights, ops, kernels, where it was built
  run PACKAGE --inputs IN.safetensors --out OUT.safetensors [--device cpu|cuda]
                       run an exported program on the named tensors of IN (one per input, by the
                       names export-info lists) and write its outputs to OUT
                       (--no-bundled-binaries: build its kernels here instead)
  cache info [--json]  the kernel cache: where, entries by kind and Kiln version, size, ages
  cache verify         re-check every entry's checksum and ownership, remove bad ones (exit 1 if any)
  cache clear [--older-than DAYS]
                       remove cached kernels (older than DAYS), compiler records, dead builds
  report TRACE -o REPORT.html [--no-graphviz] [--max-draw-nodes N]
                       the compile trace of a run (KILN_TRACE_DIR=TRACE) as one HTML page: summary,
                       functions, graphs (drawn with Graphviz), breaks, recompiles, guards, code
  minify REPRO [--out SMALLEST.kpkg]
                       shrink a repro package (KILN_REPRO=compile|accuracy writes them) to the
                       smallest graph that still fails; print it, the failing op and the pass
                       that broke it
  launch --nproc N [--nnodes M --node-rank R --master-addr A --master-port P] PROGRAM [ARGS]
                       start one process per rank of a distributed job with RANK, WORLD_SIZE,
                       LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (as torchrun); returns the first
                       non-zero exit code (`kiln launch --help` for more)
  version              print the version
  help                 show this message
)";

int run_tour(const std::vector<std::string>& args) {
  const auto& examples = kiln::examples::registry();
  if (!args.empty() && args[0] == "--list") {
    for (const auto& e : examples) std::cout << e.name << "  " << e.title << "\n";
    return 0;
  }
  bool ran = false;
  for (const auto& e : examples) {
    if (!args.empty() && args[0] != e.name) continue;
    std::cout << "=== " << e.title << " (examples/" << e.name << ".cpp) ===\n";
    e.run(std::cout);
    std::cout << "\n";
    ran = true;
  }
  if (!ran) {
    std::cerr << "kiln tour: no example named '" << args[0] << "'. See `kiln tour --list`.\n";
    return 2;
  }
  return 0;
}

std::string devices_of(const kiln::OpDef& op) {
  std::string s;
  if (op.kind == kiln::OpKind::view) return "any (view)";
  if (op.has_kernel(kiln::DeviceType::cpu)) s += "cpu";
  if (op.has_kernel(kiln::DeviceType::cuda)) s += s.empty() ? "cuda" : ",cuda";
  return s.empty() ? "-" : s;
}

int run_ops(const std::vector<std::string>& args) {
  auto ops = kiln::OpTable::instance().all();
  if (!args.empty() && args[0] == "--json") {
    nlohmann::json j = nlohmann::json::array();
    for (const auto* op : ops)
      j.push_back({{"name", op->name}, {"schema", op->schema}, {"devices", devices_of(*op)},
                   {"derivative", op->derivative.formula}, {"lowering", kiln::lowering_name(op->lowering)}});
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  size_t wname = 4, wdev = 7;
  for (const auto* op : ops) {
    wname = std::max(wname, op->name.size());
    wdev = std::max(wdev, devices_of(*op).size());
  }
  std::cout << fmt::format("{:<{}}  {:<{}}  {:<10}  {:<13}  {}\n", "name", wname, "devices", wdev,
                           "derivative", "lowering", "schema");
  for (const auto* op : ops) {
    std::cout << fmt::format("{:<{}}  {:<{}}  {:<10}  {:<13}  {}\n", op->name, wname, devices_of(*op),
                             wdev, op->derivative ? "yes" : "-",
                             kiln::lowering_name(op->lowering), op->schema);
  }
  std::cout << ops.size() << " ops\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  std::string cmd = args[0];
  args.erase(args.begin());
  try {
    if (cmd == "tour") return run_tour(args);
    if (cmd == "ops") return run_ops(args);
    if (cmd == "bench") return kiln::cli::run_bench(args);
    if (cmd == "export-info") return kiln::cli::run_export_info(args);
    if (cmd == "run") return kiln::cli::run_program(args);
    if (cmd == "minify") return kiln::cli::run_minify(args);
    if (cmd == "launch") return kiln::cli::run_launch(args);
    if (cmd == "cache") return kiln::cli::run_cache(args);
    if (cmd == "report") return kiln::cli::run_report(args);
    if (cmd == "version") {
      std::cout << "kiln " << KILN_CLI_VERSION << "\n";
      return 0;
    }
  } catch (const kiln::Error& e) {
    std::cerr << "kiln " << cmd << ": " << e.what() << "\n";
    return 1;
  }
  std::cerr << "kiln: unknown command '" << cmd << "'.\n" << kUsage;
  return 2;
}
