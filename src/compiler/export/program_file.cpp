// A Program as package sections and back (docs/export.md, "Package format"). The reader trusts
// nothing: the package layer has verified the bytes, and this layer checks that every index,
// name, spec and tensor is consistent with the graph before the program exists.
#include <limits>
#include <nlohmann/json.hpp>

#include "compiler/capture/runtime.h"
#include "compiler/export/program.h"
#include "compiler/graph/passes.h"
#include "kiln/compiler/serialize.h"
#include "kiln/cuda.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::detail {

namespace {

using json = nlohmann::json;
using compiler::exporting::Section;

constexpr int kProgramVersion = 1;
constexpr size_t kMaxDims = 6;

json spec_json(const TensorSpec& s) {
  return json{{"name", s.name}, {"dtype", std::string(dtype_name(s.dtype))}, {"device", s.device.str()},
              {"sizes", s.sizes}, {"dims", s.dims}};
}

json option_json(const compiler::OptionValue& v) {
  return std::visit(
      [](const auto& x) -> json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) return json{{"bool", x}};
        else if constexpr (std::is_same_v<T, int64_t>) return json{{"int", x}};
        else if constexpr (std::is_same_v<T, double>) return json{{"float", x}};
        else return json{{"str", x}};
      },
      v);
}

// Errors while reading name the package.
struct Reader {
  const std::string& path;
  [[noreturn]] void fail(const std::string& what) const { throw PackageError("[kiln::load_program] " + path + ": " + what); }
  void check(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
  const std::string& section(const std::map<std::string, std::string>& sections, const std::string& name) const {
    auto it = sections.find(name);
    if (it == sections.end()) fail("the package has no section '" + name + "'.");
    return it->second;
  }
  TensorSpec spec(const json& j, const std::string& where) const {
    TensorSpec s;
    s.name = j.at("name").get<std::string>();
    try {
      s.dtype = dtype_from_name(j.at("dtype").get<std::string>());
      s.device = Device(std::string_view(j.at("device").get_ref<const std::string&>()));
    } catch (const Error& e) {
      fail(where + " '" + s.name + "': " + e.what());
    }
    s.sizes = j.at("sizes").get<std::vector<int64_t>>();
    s.dims = j.at("dims").get<std::vector<std::string>>();
    check(s.dims.size() == s.sizes.size(), where + " '" + s.name + "' has " + std::to_string(s.sizes.size()) +
                                               " sizes but " + std::to_string(s.dims.size()) + " dims.");
    for (int64_t size : s.sizes) check(size >= 0 && size <= (int64_t{1} << 48), where + " '" + s.name + "' has a bad size.");
    return s;
  }
};

bool same_spec(const TensorSpec& s, const compiler::ValueInfo& v) {
  return s.dtype == v.dtype && s.device == v.device && s.sizes == v.sizes;
}

}  // namespace

void write_compile_settings(nlohmann::json& j, const std::optional<Mode>& mode,
                            const std::map<std::string, compiler::OptionValue>& options) {
  j["mode"] = nullptr;
  if (mode) j["mode"] = compiler::detail::mode_name(*mode);
  j["options"] = json::object();
  for (const auto& [k, v] : options) j["options"][k] = option_json(v);
}

void read_compile_settings(const nlohmann::json& j, std::optional<Mode>& mode,
                           std::map<std::string, compiler::OptionValue>& options, const std::string& path) {
  Reader r{path};
  if (!j.at("mode").is_null()) {
    const std::string name = j.at("mode").get<std::string>();
    mode = compiler::detail::mode_from_name(name);
    r.check(mode.has_value(), "unknown mode '" + name + "'.");
  }
  for (const auto& [k, v] : j.at("options").items()) {
    if (v.contains("bool")) options[k] = v.at("bool").get<bool>();
    else if (v.contains("int")) options[k] = v.at("int").get<int64_t>();
    else if (v.contains("float")) options[k] = v.at("float").get<double>();
    else options[k] = v.at("str").get<std::string>();
  }
}

std::vector<Section> program_sections(const Program& p) {
  std::vector<Section> out;
  json j;
  j["format"] = "kiln-program";
  j["version"] = kProgramVersion;
  j["name"] = p.name;
  j["kiln_version"] = p.kiln_version;
  j["created"] = p.created;
  j["compiler"] = p.compiler;
  j["cpu_features"] = p.cpu_features;
  j["gpu"] = p.gpu;
  j["training"] = p.training;
  write_compile_settings(j, p.mode, p.options);
  for (const char* key : {"inputs", "outputs", "weights"}) j[key] = json::array();
  for (const TensorSpec& s : p.inputs) j["inputs"].push_back(spec_json(s));
  for (const TensorSpec& s : p.outputs) j["outputs"].push_back(spec_json(s));
  for (const TensorSpec& s : p.weights) j["weights"].push_back(spec_json(s));
  j["dynamic_dims"] = json::array();
  for (const DynamicDimSpec& d : p.dims)
    j["dynamic_dims"].push_back({{"name", d.name}, {"min", d.min}, {"max", d.max}, {"example", d.example}});
  j["input_dims"] = p.input_dims;
  j["slots"] = json::array();
  for (const IntSlot& s : p.slots) {
    json terms = json::array();
    for (const SymTerm& t : s.expr) terms.push_back({t.mask, t.coef});
    j["slots"].push_back({static_cast<int>(s.kind), s.a, s.b, s.c, terms});
  }
  j["placeholders"] = json::array();
  for (const Binding& b : p.placeholders) j["placeholders"].push_back({static_cast<int>(b.kind), b.index});
  j["results"] = json::array();
  for (const ResultRef& r : p.results) j["results"].push_back({static_cast<int>(r.kind), r.index});
  j["kernels"] = p.libraries.size();
  j["cuda_binaries"] = p.blobs.size();
  out.push_back({"program.json", j.dump(1)});

  compiler::SerializedGraph graph = compiler::serialize_graph(p.graph);
  out.push_back({"graph.json", std::move(graph.text)});
  NamedTensors weights;
  for (size_t w = 0; w < p.weights.size(); ++w) weights.emplace_back(p.weights[w].name, p.weight_tensors[w]);
  out.push_back({"weights.safetensors", safetensors_bytes(weights)});
  out.push_back({"constants.safetensors", safetensors_bytes(NamedTensors(graph.constants.begin(), graph.constants.end()))});

  for (size_t i = 0; i < p.libraries.size(); ++i) {
    const auto& l = *p.libraries[i];
    const std::string dir = "kernels/" + std::to_string(i) + "/";
    json b{{"key", l.key}, {"flags", l.extra_flags}, {"compiler", l.compiler}, {"sources", l.sources.size()}};
    out.push_back({dir + "build.json", b.dump(1)});
    out.push_back({dir + "target_macros.txt", l.target_macros});
    for (size_t s = 0; s < l.sources.size(); ++s) out.push_back({dir + "source_" + std::to_string(s) + ".cpp", l.sources[s]});
    out.push_back({dir + "library.so", l.bytes});
  }
  for (size_t i = 0; i < p.blobs.size(); ++i) {
    const auto& b = *p.blobs[i];
    const std::string base = "cuda/" + std::to_string(i);
    out.push_back({base + ".json", json{{"kind", b.kind}, {"key", b.key}, {"label", b.label}}.dump(1)});
    out.push_back({base + ".bin", b.bytes});
  }
  return out;
}

std::shared_ptr<Program> program_from_sections(std::map<std::string, std::string> sections, const std::string& path,
                                               bool use_bundled_binaries) {
  Reader r{path};
  auto p = std::make_shared<Program>();
  p->origin = path;
  json j;
  try {
    j = json::parse(r.section(sections, "program.json"));
  } catch (const json::exception& e) {
    r.fail(std::string("program.json is not valid JSON: ") + e.what());
  }
  try {
    r.check(j.at("format") == "kiln-program", "program.json is not a Kiln program description.");
    const int version = j.at("version").get<int>();
    r.check(version <= kProgramVersion, "the program format version is " + std::to_string(version) +
                                            "; this Kiln reads versions up to " + std::to_string(kProgramVersion) +
                                            ". Load it with a newer Kiln.");
    p->name = j.at("name").get<std::string>();
    p->kiln_version = j.at("kiln_version").get<std::string>();
    p->created = j.at("created").get<std::string>();
    p->compiler = j.at("compiler").get<std::string>();
    p->cpu_features = j.at("cpu_features").get<std::string>();
    p->gpu = j.at("gpu").get<std::string>();
    p->training = j.at("training").get<bool>();
    read_compile_settings(j, p->mode, p->options, path);
    for (const auto& s : j.at("inputs")) p->inputs.push_back(r.spec(s, "input"));
    for (const auto& s : j.at("outputs")) p->outputs.push_back(r.spec(s, "output"));
    for (const auto& s : j.at("weights")) p->weights.push_back(r.spec(s, "weight"));
    for (const auto& d : j.at("dynamic_dims")) {
      DynamicDimSpec spec{d.at("name").get<std::string>(), d.at("min").get<int64_t>(), d.at("max").get<int64_t>(),
                          d.at("example").get<int64_t>()};
      r.check(spec.min >= 2 && spec.min <= spec.example && spec.example <= spec.max,
              "dynamic dim '" + spec.name + "' has an inconsistent range.");
      p->dims.push_back(std::move(spec));
    }
    r.check(p->dims.size() <= kMaxDims, "too many dynamic dims.");
    p->input_dims = j.at("input_dims").get<std::vector<std::vector<int>>>();
    r.check(p->input_dims.size() == p->inputs.size(), "input_dims does not match the inputs.");
    for (size_t i = 0; i < p->inputs.size(); ++i) {
      r.check(p->input_dims[i].size() == p->inputs[i].sizes.size(), "input_dims of '" + p->inputs[i].name + "' has the wrong rank.");
      for (int d : p->input_dims[i]) r.check(d >= -1 && d < static_cast<int>(p->dims.size()), "input_dims names a dim that does not exist.");
    }
    for (const auto& s : j.at("slots")) {
      IntSlot slot;
      const int kind = s.at(0).get<int>();
      r.check(kind >= 0 && kind <= IntSlot::attr_elem, "a slot has an unknown kind.");
      slot.kind = static_cast<IntSlot::Kind>(kind);
      slot.a = s.at(1).get<int>();
      slot.b = s.at(2).get<int>();
      slot.c = s.at(3).get<int>();
      for (const auto& t : s.at(4)) {
        const uint32_t mask = t.at(0).get<uint32_t>();
        r.check(mask < (1u << p->dims.size()), "a slot's term names a dynamic dim that does not exist.");
        slot.expr.push_back(SymTerm{mask, t.at(1).get<int64_t>()});
      }
      p->slots.push_back(std::move(slot));
    }
    for (const auto& b : j.at("placeholders")) {
      const int kind = b.at(0).get<int>();
      r.check(kind == Binding::input || kind == Binding::weight, "a placeholder has an unknown kind.");
      p->placeholders.push_back(Binding{static_cast<Binding::Kind>(kind), b.at(1).get<int>()});
    }
    for (const auto& b : j.at("results")) {
      const int kind = b.at(0).get<int>();
      r.check(kind == ResultRef::graph_output || kind == ResultRef::input, "a result has an unknown kind.");
      p->results.push_back(ResultRef{static_cast<ResultRef::Kind>(kind), b.at(1).get<int>()});
    }
  } catch (const json::exception& e) {
    r.fail(std::string("program.json is malformed: ") + e.what());
  }

  // The graph and its constants.
  std::map<std::string, Tensor> constants;
  try {
    for (auto& [name, t] : load_safetensors_bytes(r.section(sections, "constants.safetensors"), path + " constants")) constants.emplace(name, t);
    NamedTensors weights = load_safetensors_bytes(r.section(sections, "weights.safetensors"), path + " weights");
    std::map<std::string, Tensor> by_name(weights.begin(), weights.end());
    for (const TensorSpec& w : p->weights) {
      auto it = by_name.find(w.name);
      r.check(it != by_name.end(), "weight '" + w.name + "' is missing from the weights section.");
      r.check(it->second.dtype() == w.dtype && it->second.sizes() == IntArrayRef(w.sizes),
              "weight '" + w.name + "' in the weights section does not match its spec.");
      p->weight_tensors.push_back(it->second);
    }
  } catch (const PackageError&) {
    throw;
  } catch (const Error& e) {
    r.fail(std::string("the weights cannot be read: ") + e.what());
  }
  try {
    p->graph = compiler::deserialize_graph(r.section(sections, "graph.json"), constants);
  } catch (const compiler::GraphFormatError& e) {
    r.fail(e.what());
  }
  const compiler::Graph& g = p->graph;
  r.check(p->dims.empty() || g.dynamic, "a program with dynamic dims has a static graph.");

  // Every index against the graph.
  r.check(p->placeholders.size() == g.inputs.size(), "the placeholders do not match the graph's inputs.");
  for (size_t k = 0; k < p->placeholders.size(); ++k) {
    const Binding& b = p->placeholders[k];
    const compiler::ValueInfo& v = g.values[g.inputs[k]];
    if (b.kind == Binding::input) {
      r.check(b.index >= 0 && static_cast<size_t>(b.index) < p->inputs.size(), "a placeholder names an input that does not exist.");
      const TensorSpec& s = p->inputs[b.index];
      r.check(s.dtype == v.dtype && s.device == v.device && s.sizes.size() == v.sizes.size(),
              "input '" + s.name + "' does not match its placeholder in the graph.");
    } else {
      r.check(b.index >= 0 && static_cast<size_t>(b.index) < p->weights.size(), "a placeholder names a weight that does not exist.");
      r.check(same_spec(p->weights[b.index], v), "weight '" + p->weights[b.index].name + "' does not match its placeholder in the graph.");
    }
  }
  for (const ResultRef& res : p->results) {
    if (res.kind == ResultRef::graph_output)
      r.check(res.index >= 0 && static_cast<size_t>(res.index) < g.outputs.size(), "a result names a graph output that does not exist.");
    else
      r.check(res.index >= 0 && static_cast<size_t>(res.index) < p->inputs.size(), "a result names an input that does not exist.");
  }
  r.check(p->outputs.size() == p->results.size(), "the outputs do not match the results.");
  for (const IntSlot& s : p->slots) {
    bool ok = s.a >= 0 && s.b >= 0 && s.c >= 0;
    if (ok && (s.kind == IntSlot::size || s.kind == IntSlot::stride || s.kind == IntSlot::offset)) {
      ok = static_cast<size_t>(s.a) < g.values.size() && (s.kind == IntSlot::offset || static_cast<size_t>(s.b) < g.values[s.a].sizes.size());
    } else if (ok) {
      ok = static_cast<size_t>(s.a) < g.nodes.size() && static_cast<size_t>(s.b) < g.nodes[s.a].attrs.size();
      if (ok && s.kind == IntSlot::attr) ok = std::holds_alternative<int64_t>(g.nodes[s.a].attrs[s.b]);
      if (ok && s.kind == IntSlot::attr_elem) {
        const auto* l = std::get_if<std::vector<int64_t>>(&g.nodes[s.a].attrs[s.b]);
        ok = l && static_cast<size_t>(s.c) < l->size();
      }
    }
    r.check(ok, "a dynamic slot points outside the graph.");
  }
  // What the graph writes, from the graph itself.
  const std::vector<char> written = compiler::passes::internal::written_memory(g);
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    p->written_placeholders.push_back(written[g.inputs[k]]);
    if (p->placeholders[k].kind == Binding::weight && written[g.inputs[k]]) p->writes_weights = true;
  }
  // Weights on their devices, laid out as the graph's placeholders.
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    const Binding& b = p->placeholders[k];
    if (b.kind != Binding::weight) continue;
    const compiler::ValueInfo& v = g.values[g.inputs[k]];
    r.check(!v.device.is_cuda() || v.device.index < kiln::cuda::device_count(),
            "the program runs on " + v.device.str() + ", which this machine does not have (or this Kiln was built "
            "without CUDA).");
    p->weight_tensors[b.index] = with_layout(p->weight_tensors[b.index], v);
  }

  // Bundled kernels: used when they were built for this Kiln and fit this machine.
  std::string notes;
  for (size_t i = 0;; ++i) {
    const std::string dir = "kernels/" + std::to_string(i) + "/";
    if (!sections.count(dir + "build.json")) break;
    auto lib = std::make_shared<compiler::runtime::BundledLibrary>();
    try {
      json b = json::parse(sections.at(dir + "build.json"));
      lib->key = b.at("key").get<std::string>();
      lib->extra_flags = b.at("flags").get<std::vector<std::string>>();
      lib->compiler = b.at("compiler").get<std::string>();
      const size_t n = b.at("sources").get<size_t>();
      for (size_t s = 0; s < n; ++s) lib->sources.push_back(r.section(sections, dir + "source_" + std::to_string(s) + ".cpp"));
    } catch (const json::exception& e) {
      r.fail(dir + "build.json is malformed: " + e.what());
    }
    lib->target_macros = r.section(sections, dir + "target_macros.txt");
    lib->bytes = r.section(sections, dir + "library.so");
    const std::string here = compiler::runtime::bundle_key({lib->sources, lib->extra_flags, ""});
    if (here != lib->key) {
      notes = "the bundled kernels were built by Kiln " + p->kiln_version + ", whose generated code this Kiln (" +
              KILN_VERSION + ") does not share";
      continue;
    }
    if (std::vector<std::string> lacking = compiler::runtime::cpu_lacks(lib->target_macros); !lacking.empty()) {
      std::string names;
      for (const auto& l : lacking) names += (names.empty() ? "" : ", ") + l;
      notes = "the bundled kernels were built for a CPU with " + compiler::runtime::isa_features(lib->target_macros) + "; this CPU lacks " + names;
      continue;
    }
    if (!use_bundled_binaries) {
      notes = "bundled binaries are turned off (LoadOptions::bundled_binaries)";
      continue;
    }
    compiler::runtime::register_bundled(std::shared_ptr<const compiler::runtime::BundledLibrary>(lib));
    p->libraries.push_back(std::move(lib));
  }
  for (size_t i = 0;; ++i) {
    const std::string base = "cuda/" + std::to_string(i);
    if (!sections.count(base + ".json")) break;
    auto blob = std::make_shared<compiler::runtime::BundledBlob>();
    try {
      json b = json::parse(sections.at(base + ".json"));
      blob->kind = b.at("kind").get<std::string>();
      blob->key = b.at("key").get<std::string>();
      blob->label = b.at("label").get<std::string>();
    } catch (const json::exception& e) {
      r.fail(base + ".json is malformed: " + e.what());
    }
    r.check(blob->kind == "cuda", base + ".json names an unknown kind of binary.");
    blob->bytes = r.section(sections, base + ".bin");
    if (!use_bundled_binaries) continue;
    compiler::runtime::register_bundled(std::shared_ptr<const compiler::runtime::BundledBlob>(blob));
    p->blobs.push_back(std::move(blob));
  }
  p->unusable_binaries = notes;
  return p;
}

}  // namespace kiln::detail
