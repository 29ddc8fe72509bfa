// Repro packages (repro.h).
#include "compiler/export/repro.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "compiler/capture/runtime.h"
#include "compiler/export/package.h"
#include "compiler/export/program.h"
#include "compiler/graph/format.h"
#include "kiln/autograd.h"
#include "kiln/compiler/serialize.h"
#include "kiln/export.h"
#include "kiln/io.h"
#include "kiln/ops.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::compiler::exporting {

namespace {

using json = nlohmann::json;

constexpr int kReproVersion = 1;

std::string repro_dir() {
  const char* env = std::getenv("KILN_REPRO_DIR");
  return env && *env ? env : "kiln_repro";
}

}  // namespace

ReproMode repro_mode() {
  const char* env = std::getenv("KILN_REPRO");
  if (!env || !*env) return ReproMode::off;
  const std::string v = env;
  if (v == "compile") return ReproMode::compile;
  if (v == "accuracy") return ReproMode::accuracy;
  throw CompileError("[kiln::compile] KILN_REPRO=" + v + " is not one of: compile (write a repro when a backend fails), "
                     "accuracy (check each compiled graph against eager).");
}

double repro_tolerance(DType t) {
  return t == kFloat16 || t == kBFloat16 ? 1e-2 : 1e-3;
}

Graph with_scalars_baked(const Graph& g, std::span<const Attr> scalars) {
  Graph out = g;
  for (size_t k = 0; k < out.scalars.size() && k < scalars.size(); ++k) {
    const ScalarSlot& s = out.scalars[k];
    if (s.node < 0) continue;
    Attr& attr = out.nodes[s.node].attrs[s.attr];
    if (std::optional<Attr> value = detail::scalar_in_kind_of(attr, scalars[k])) attr = *value;
  }
  out.scalars.clear();
  return out;
}

std::optional<std::string> first_mismatch(const std::vector<Tensor>& actual, const std::vector<Tensor>& expected) {
  if (actual.size() != expected.size())
    return std::to_string(actual.size()) + " outputs instead of eager's " + std::to_string(expected.size());
  for (size_t k = 0; k < actual.size(); ++k) {
    const Tensor& a = actual[k];
    const Tensor& e = expected[k];
    const std::string what = "output " + std::to_string(k) + " (" +
                             (e.defined() ? detail::type_str(e.dtype(), e.sizes().vec()) : std::string("undefined")) + ")";
    if (a.defined() != e.defined() || (a.defined() && (!(a.sizes() == e.sizes()) || a.dtype() != e.dtype())))
      return what + ": the compiled graph returned " +
             (a.defined() ? detail::type_str(a.dtype(), a.sizes().vec()) : std::string("undefined"));
    if (!a.defined() || a.numel() == 0) continue;
    NoGradGuard no_grad;
    if (!a.is_floating_point()) {
      if (!equal(a.to(kCPU), e.to(kCPU))) return what + ": values differ";
      continue;
    }
    const double tol = repro_tolerance(a.dtype());
    Tensor x = a.to(kCPU).to(kFloat64), y = e.to(kCPU).to(kFloat64);
    if (allclose(x, y, tol, tol, /*equal_nan=*/true)) continue;
    Tensor d = (x - y).abs();
    const double diff = where(d.isnan(), full_like(d, INFINITY), d).max().item<double>();
    char text[64];
    std::snprintf(text, sizeof text, "%.3g", diff);
    return what + ": max abs diff " + text + " (tolerance " + std::to_string(tol).substr(0, 6) + ")";
  }
  return std::nullopt;
}

std::string write_repro(const ReproCase& c, std::string path) {
  namespace fs = std::filesystem;
  if (path.empty()) {
    const fs::path dir = repro_dir();
    std::error_code ec;
    if (fs::create_directories(dir, ec)) fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace, ec);
    static std::atomic<int> counter{0};
    path = (dir / ("repro_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".kpkg")).string();
  }

  json j;
  j["format"] = "kiln-repro";
  j["version"] = kReproVersion;
  j["kind"] = c.kind;
  j["backend"] = c.backend;
  j["failure"] = c.failure;
  j["kiln_version"] = KILN_VERSION;
  kiln::detail::write_compile_settings(j, c.mode, c.options);
  SerializedGraph graph = serialize_graph(c.graph);
  NamedTensors inputs;
  for (size_t k = 0; k < c.inputs.size(); ++k) inputs.emplace_back("input_" + std::to_string(k), c.inputs[k]);
  write_package(path, {{"repro.json", j.dump(1)},
                       {"graph.json", graph.text},
                       {"constants.safetensors", safetensors_bytes(NamedTensors(graph.constants.begin(), graph.constants.end()))},
                       {"inputs.safetensors", safetensors_bytes(inputs)}});
  return path;
}

ReproCase read_repro(const std::string& path) {
  std::map<std::string, std::string> sections = read_package(path);
  auto fail = [&](const std::string& what) -> void { throw PackageError("[kiln::compiler::minify] " + path + ": " + what); };
  for (const char* name : {"repro.json", "graph.json", "constants.safetensors", "inputs.safetensors"})
    if (!sections.count(name)) fail(std::string("not a repro package: it has no section '") + name + "'.");
  ReproCase c;
  try {
    json j = json::parse(sections.at("repro.json"));
    if (j.at("format") != "kiln-repro") fail("not a repro package.");
    if (j.at("version").get<int>() > kReproVersion) fail("the repro format is newer than this Kiln reads.");
    c.kind = j.at("kind").get<std::string>();
    if (c.kind != "compile" && c.kind != "accuracy") fail("unknown repro kind '" + c.kind + "'.");
    c.backend = j.at("backend").get<std::string>();
    c.failure = j.at("failure").get<std::string>();
    kiln::detail::read_compile_settings(j, c.mode, c.options, path);
  } catch (const json::exception& e) {
    fail(std::string("repro.json is malformed: ") + e.what());
  }
  std::map<std::string, Tensor> constants;
  NamedTensors inputs;
  try {
    for (auto& [n, t] : load_safetensors_bytes(sections.at("constants.safetensors"), path + " constants")) constants.emplace(n, t);
    inputs = load_safetensors_bytes(sections.at("inputs.safetensors"), path + " inputs");
  } catch (const PackageError&) {
    throw;
  } catch (const Error& e) {
    fail(std::string("the tensors cannot be read: ") + e.what());
  }
  try {
    c.graph = deserialize_graph(sections.at("graph.json"), constants);
  } catch (const GraphFormatError& e) {
    fail(e.what());
  }
  std::map<std::string, Tensor> by_name(inputs.begin(), inputs.end());
  for (size_t k = 0; k < c.graph.inputs.size(); ++k) {
    auto it = by_name.find("input_" + std::to_string(k));
    if (it == by_name.end()) fail("input_" + std::to_string(k) + " is missing.");
    const ValueInfo& v = c.graph.values[c.graph.inputs[k]];
    if (it->second.dtype() != v.dtype || !(it->second.sizes() == IntArrayRef(v.sizes)))
      fail("input_" + std::to_string(k) + " does not match the graph's placeholder.");
    if (v.device.is_cuda() && v.device.index >= kiln::cuda::device_count())
      fail("the graph runs on " + v.device.str() + ", which this machine does not have.");
    c.inputs.push_back(kiln::detail::with_layout(it->second, v));
  }
  if (!c.graph.scalars.empty()) fail("a repro graph has its scalars in its attrs; this one has scalar slots.");
  return c;
}

CompiledFn accuracy_checked(CompiledFn fn, const Graph& graph, std::string backend, std::string label,
                            const CompileOptions& options) {
  auto checked = std::make_shared<std::atomic<bool>>(false);
  auto reference = std::make_shared<Graph>(graph);
  return [fn = std::move(fn), checked, reference, backend = std::move(backend), label = std::move(label),
          mode = options.mode, settings = options.options](const Arguments& args) {
    if (checked->exchange(true)) return fn(args);
    // Copies of the inputs, laid out as captured: the eager run's, and the repro's (the compiled
    // call may write its inputs).
    std::vector<Tensor> before, for_eager;
    for (size_t k = 0; k < args.tensors.size(); ++k) {
      const ValueInfo& v = reference->values[reference->inputs[k]];
      before.push_back(kiln::detail::copy_with_layout(args.tensors[k], v));
      for_eager.push_back(kiln::detail::copy_with_layout(args.tensors[k], v));
    }
    std::vector<Tensor> results = fn(args);
    std::vector<Tensor> expected = interpreter(*reference)(Arguments{for_eager, args.scalars});
    if (std::optional<std::string> mismatch = first_mismatch(results, expected)) {
      ReproCase c;
      c.kind = "accuracy";
      c.backend = backend;
      c.mode = mode;
      c.options = settings;
      c.failure = "graph " + label + ": " + *mismatch + " against eager";
      c.graph = with_scalars_baked(*reference, args.scalars);
      c.inputs = before;
      const std::string path = write_repro(c);
      detail::log_stream() << "[kiln.repro] " << c.failure << ". Repro written to " << path << "; `kiln minify " << path
                           << "` shrinks it to the smallest graph that still differs.\n";
    }
    return results;
  };
}

}  // namespace kiln::compiler::exporting
