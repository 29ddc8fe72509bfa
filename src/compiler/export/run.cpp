// Running exported programs (kiln/export.h): checking inputs against their specs, the code per set
// of dynamic sizes (built once, then shared by every thread), and ExportedProgram's other members.
#include <filesystem>
#include <map>
#include <sstream>

#include "compiler/capture/runtime.h"
#include "compiler/export/package.h"
#include "compiler/export/program.h"
#include "compiler/graph/format.h"
#include "kiln/autograd.h"
#include "kiln/compiler/serialize.h"

namespace kiln {

namespace detail {

namespace {

std::string sizes_text(const Program& p, const std::vector<int64_t>& s) {
  return s.empty() ? "its sizes" : dims_text(p.dims, s);
}

std::string layout_text(IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  std::string out = "sizes " + shape_str(sizes) + ", strides " + shape_str(strides);
  if (offset) out += ", offset " + std::to_string(offset);
  return out;
}

}  // namespace

std::shared_ptr<const ProgramInstance> Program::instance(const std::vector<int64_t>& s) const {
  {
    std::shared_lock lock(instances_mutex);
    if (auto it = instances.find(s); it != instances.end()) return it->second;
  }
  std::lock_guard build(build_mutex);  // one build at a time; runs of built sizes go on meanwhile
  {
    std::shared_lock lock(instances_mutex);
    if (auto it = instances.find(s); it != instances.end()) return it->second;
  }
  auto inst = std::make_shared<ProgramInstance>();
  inst->graph = graph;
  compiler::Graph& g = inst->graph;
  if (!dims.empty()) {
    for (const IntSlot& slot : slots) {
      std::optional<int64_t> v = eval_sym(slot.expr, s);
      KILN_CHECK(v.has_value(), ValueError,
                 "[kiln::ExportedProgram::run] " + origin + ": the sizes " + sizes_text(*this, s) +
                     " overflow a size of the program's graph.");
      switch (slot.kind) {
        case IntSlot::size: g.values[slot.a].sizes[slot.b] = *v; break;
        case IntSlot::stride: g.values[slot.a].strides[slot.b] = *v; break;
        case IntSlot::offset: g.values[slot.a].storage_offset = *v; break;
        case IntSlot::attr: g.nodes[slot.a].attrs[slot.b] = *v; break;
        case IntSlot::attr_elem: std::get<std::vector<int64_t>>(g.nodes[slot.a].attrs[slot.b])[slot.c] = *v; break;
      }
    }
    try {
      g.validate();
    } catch (const CompileError& e) {
      throw ValueError("[kiln::ExportedProgram::run] " + origin + ": the program's graph does not hold at " +
                       sizes_text(*this, s) + ": " + e.what());
    }
  }
  for (const compiler::ScalarSlot& slot : g.scalars)
    inst->scalars.push_back(slot.node >= 0 ? g.nodes[slot.node].attrs[slot.attr] : Attr{});
  CompileOptions co;
  co.mode = mode;
  co.options = options;
  compiler::detail::CompilingOptionsScope scope(&co);
  compiler::Graph working = g;
  try {
    inst->fn = compiler::lookup_backend("kiln")(working, compiler::Arguments{});
  } catch (const CompileError& e) {
    throw CompileError("[kiln::ExportedProgram] " + origin + ": building the program's kernels for " + sizes_text(*this, s) +
                       " failed" +
                       (unusable_binaries.empty() ? std::string(" (the package has no binary for them)")
                                                  : " (the package's binaries cannot be used here: " + unusable_binaries + ")") +
                       ": " + e.what());
  }
  std::unique_lock lock(instances_mutex);
  // At most kMaxInstances sizes stay built (the oldest goes first; a run still using it keeps it
  // alive until it returns), so that a server meeting ever new sizes does not grow without bound.
  if (instances.size() >= kMaxInstances && !built_order.empty()) {
    instances.erase(built_order.front());
    built_order.pop_front();
  }
  built_order.push_back(s);
  return instances.emplace(s, std::move(inst)).first->second;
}

namespace {

std::vector<Tensor> run_program(const Program& p, const std::vector<Tensor>& inputs, const NamedTensors* state) {
  // Messages are built only when a check fails.
  auto api = [&p] { return "[kiln::ExportedProgram::run] " + p.origin + ": "; };
  KILN_CHECK(inputs.size() == p.inputs.size(), ValueError,
             api() + "the program takes " + std::to_string(p.inputs.size()) + " input" + (p.inputs.size() == 1 ? "" : "s") +
                 ", got " + std::to_string(inputs.size()) + ".");
  std::vector<int64_t> s(p.dims.size(), -1);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    const TensorSpec& spec = p.inputs[i];
    auto what = [&] { return api() + "input " + std::to_string(i) + " ('" + spec.name + "')"; };
    KILN_CHECK(t.defined(), ValueError, what() + " is undefined.");
    KILN_CHECK(t.dtype() == spec.dtype, ValueError,
               what() + " has dtype " + std::string(dtype_name(t.dtype())) + "; the program takes " + std::string(dtype_name(spec.dtype)) + ".");
    KILN_CHECK(t.device() == spec.device, ValueError,
               what() + " is on " + t.device().str() + "; the program runs on " + spec.device.str() + ". Move it with .to().");
    KILN_CHECK(t.dim() == static_cast<int64_t>(spec.sizes.size()), ValueError,
               what() + " has " + std::to_string(t.dim()) + " dimensions; the program takes " + std::to_string(spec.sizes.size()) + ".");
    for (size_t d = 0; d < spec.sizes.size(); ++d) {
      const int sym = p.input_dims[i][d];
      const int64_t size = t.size(static_cast<int64_t>(d));
      if (sym < 0) {
        KILN_CHECK(size == spec.sizes[d], ValueError,
                   what() + " has size " + std::to_string(size) + " in dim " + std::to_string(d) + "; the program was exported with " +
                       std::to_string(spec.sizes[d]) + " there, and that dim is static.");
        continue;
      }
      const DynamicDimSpec& dim = p.dims[sym];
      KILN_CHECK(size >= dim.min && size <= dim.max, ValueError,
                 what() + " has size " + std::to_string(size) + " in dim " + std::to_string(d) + " ('" + dim.name +
                     "'), outside its range [" + std::to_string(dim.min) + ", " +
                     (dim.max == std::numeric_limits<int64_t>::max() ? std::string("inf") : std::to_string(dim.max)) + "].");
      KILN_CHECK(s[sym] < 0 || s[sym] == size, ValueError,
                 what() + " has size " + std::to_string(size) + " in dim " + std::to_string(d) + " ('" + dim.name +
                     "'), but another input has " + std::to_string(s[sym]) + " there; dims with one name are one size.");
      s[sym] = size;
    }
  }
  std::shared_ptr<const ProgramInstance> inst = p.instance(s);
  const compiler::Graph& g = inst->graph;

  std::map<std::string, const Tensor*> given;
  if (state) {
    for (const auto& [name, t] : *state) given[name] = &t;
    for (const TensorSpec& w : p.weights)
      KILN_CHECK(given.count(w.name), ValueError, api() + "the state has no tensor '" + w.name + "'; pass every weight the program lists.");
  }
  std::vector<Tensor> tensors;
  tensors.reserve(p.placeholders.size());
  for (size_t k = 0; k < p.placeholders.size(); ++k) {
    const Binding& b = p.placeholders[k];
    const compiler::ValueInfo& v = g.values[g.inputs[k]];
    Tensor t;
    auto what = [&] {
      return b.kind == Binding::input ? "input '" + p.inputs[b.index].name + "'" : "state tensor '" + p.weights[b.index].name + "'";
    };
    if (b.kind == Binding::input) {
      t = inputs[b.index];
    } else if (state) {
      t = *given[p.weights[b.index].name];
      KILN_CHECK(t.defined() && t.dtype() == v.dtype && t.device() == v.device && t.sizes() == IntArrayRef(v.sizes), ValueError,
                 api() + what() + " does not match the weight's spec (" + std::string(dtype_name(v.dtype)) + shape_str(v.sizes) +
                     " on " + v.device.str() + ").");
    } else {
      tensors.push_back(p.weight_tensors[b.index]);
      continue;
    }
    if (!has_layout(t, v)) {
      KILN_CHECK(!p.written_placeholders[k], ValueError,
                 api() + what() + " has " + layout_text(t.sizes(), t.strides(), t.storage_offset()) +
                     "; the program writes it in place, so it must have the exported layout (" +
                     layout_text(v.sizes, v.strides, v.storage_offset) + ").");
      t = with_layout(t, v);  // a copy the program may read
    }
    tensors.push_back(std::move(t));
  }
  // A placeholder the program writes must not share memory with another, unless it did at export.
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (!p.written_placeholders[k]) continue;
    for (size_t j = 0; j < tensors.size(); ++j)
      if (j != k && tensors[j].impl().storage.get() == tensors[k].impl().storage.get() &&
          g.values[g.inputs[j]].storage != g.values[g.inputs[k]].storage)
        throw ValueError(api() + "'" + g.values[g.inputs[k]].name + "', which the program writes, shares memory with '" +
                         g.values[g.inputs[j]].name + "'. Pass separate tensors.");
  }
  std::unique_lock<std::mutex> step;
  if (p.writes_weights && !state) step = std::unique_lock<std::mutex>(p.step_mutex);
  std::vector<Tensor> results;
  {
    NoGradGuard no_grad;
    results = inst->fn(compiler::Arguments{tensors, inst->scalars});
  }
  std::vector<Tensor> out;
  out.reserve(p.results.size());
  for (const ResultRef& r : p.results) out.push_back(r.kind == ResultRef::graph_output ? results[r.index] : inputs[r.index]);
  return out;
}

}  // namespace

}  // namespace detail

const detail::Program& ExportedProgram::program(const char* api) const {
  KILN_CHECK(p_ != nullptr, ValueError,
             std::string("[kiln::ExportedProgram::") + api + "] the program is empty; get one from export_program or load_program.");
  return *p_;
}

std::vector<Tensor> ExportedProgram::run(const std::vector<Tensor>& inputs) const {
  return detail::run_program(program("run"), inputs, nullptr);
}

std::vector<Tensor> ExportedProgram::run(const std::vector<Tensor>& inputs, const NamedTensors& state) const {
  return detail::run_program(program("run"), inputs, &state);
}

void ExportedProgram::save(const std::string& path) const {
  compiler::exporting::write_package(path, detail::program_sections(program("save")));
}

const std::string& ExportedProgram::name() const { return program("name").name; }
const std::vector<TensorSpec>& ExportedProgram::inputs() const { return program("inputs").inputs; }
const std::vector<TensorSpec>& ExportedProgram::outputs() const { return program("outputs").outputs; }
const std::vector<TensorSpec>& ExportedProgram::weights() const { return program("weights").weights; }
const std::vector<DynamicDimSpec>& ExportedProgram::dynamic_dims() const { return program("dynamic_dims").dims; }
const compiler::Graph& ExportedProgram::graph() const { return program("graph").graph; }
bool ExportedProgram::writes_weights() const { return program("writes_weights").writes_weights; }

NamedTensors ExportedProgram::state() const {
  const detail::Program& p = program("state");
  NamedTensors out;
  for (size_t w = 0; w < p.weights.size(); ++w) out.emplace_back(p.weights[w].name, p.weight_tensors[w]);
  return out;
}

std::string ExportedProgram::summary() const {
  const detail::Program& p = program("summary");
  std::ostringstream os;
  auto spec_line = [&](const TensorSpec& s) {
    os << "  " << s.name << ": " << compiler::detail::short_dtype_name(s.dtype) << "[";
    for (size_t d = 0; d < s.dims.size(); ++d) os << (d ? ", " : "") << s.dims[d];
    os << "] on " << s.device.str() << "\n";
  };
  os << "program '" << p.name << "'" << (p.training ? " (a training step)" : "") << "\n";
  os << "built by Kiln " << p.kiln_version << " on " << p.created;
  if (!p.compiler.empty()) os << " with " << p.compiler;
  if (!p.cpu_features.empty()) os << " for " << p.cpu_features;
  if (!p.gpu.empty()) os << " and " << p.gpu;
  os << "\n";
  os << "inputs (" << p.inputs.size() << "):\n";
  for (const TensorSpec& s : p.inputs) spec_line(s);
  os << "outputs (" << p.outputs.size() << "):\n";
  for (const TensorSpec& s : p.outputs) spec_line(s);
  os << "dynamic dims (" << p.dims.size() << "):\n";
  for (const DynamicDimSpec& d : p.dims)
    os << "  " << d.name << ": " << d.min << " to "
       << (d.max == std::numeric_limits<int64_t>::max() ? std::string("inf") : std::to_string(d.max)) << " (exported at "
       << d.example << ")\n";
  int64_t elements = 0, bytes = 0;
  for (const Tensor& t : p.weight_tensors) {
    elements += t.numel();
    bytes += t.nbytes();
  }
  os << "weights (" << p.weights.size() << ", " << elements << " elements, " << bytes << " bytes)"
     << (p.writes_weights ? ", updated by each run" : "") << ":\n";
  for (size_t w = 0; w < p.weights.size() && w < 8; ++w) spec_line(p.weights[w]);
  if (p.weights.size() > 8) os << "  ... and " << p.weights.size() - 8 << " more\n";
  std::map<std::string, int> ops;
  for (const compiler::Node& n : p.graph.nodes) ++ops[n.op->name];
  os << "ops (" << p.graph.nodes.size() << " nodes):";
  for (const auto& [name, count] : ops) os << " " << name << " x" << count;
  os << "\n";
  int64_t sources = 0, library_bytes = 0, blob_bytes = 0;
  for (const auto& l : p.libraries) {
    sources += static_cast<int64_t>(l->sources.size());
    library_bytes += static_cast<int64_t>(l->bytes.size());
  }
  for (const auto& b : p.blobs) blob_bytes += static_cast<int64_t>(b->bytes.size());
  os << "kernels: " << p.libraries.size() << " C++ librar" << (p.libraries.size() == 1 ? "y" : "ies") << " (" << sources
     << (sources == 1 ? " source, " : " sources, ") << library_bytes << " bytes), " << p.blobs.size() << " CUDA binar" << (p.blobs.size() == 1 ? "y" : "ies")
     << " (" << blob_bytes << " bytes)\n";
  if (!p.unusable_binaries.empty()) os << "note: " << p.unusable_binaries << "\n";
  return os.str();
}

ExportedProgram load_program(const std::string& path, const LoadOptions& options) {
  std::shared_ptr<detail::Program> p =
      detail::program_from_sections(compiler::exporting::read_package(path), path, options.bundled_binaries);
  // Build the exported sizes' code now, so that a machine that cannot run the program says so here.
  std::vector<int64_t> example;
  for (const DynamicDimSpec& d : p->dims) example.push_back(d.example);
  p->instance(example);
  return ExportedProgram(std::move(p));
}

}  // namespace kiln
