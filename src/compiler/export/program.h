// What an ExportedProgram holds (kiln/export.h), shared by export (program.cpp), the package
// reader and writer (program_file.cpp) and the runner (run.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "compiler/export/package.h"
#include "compiler/runtime/kernel_cache.h"
#include "kiln/export.h"

namespace kiln::detail {

// A product of dynamic sizes times a coefficient: coef * prod(s_i for bit i set in mask).
struct SymTerm {
  uint32_t mask = 0;
  int64_t coef = 0;
};
using SymExpr = std::vector<SymTerm>;  // a sum of terms

// Evaluates `e` at the dynamic sizes `s`; nullopt on int64 overflow.
std::optional<int64_t> eval_sym(const SymExpr& e, const std::vector<int64_t>& s);
// "2*batch + 1", "batch*seq", "768".
std::string sym_text(const SymExpr& e, const std::vector<DynamicDimSpec>& dims);
// "batch=3, seq=17": dynamic sizes `values` by their dims' names.
std::string dims_text(const std::vector<DynamicDimSpec>& dims, const std::vector<int64_t>& values);

// An integer of the graph that depends on the dynamic sizes.
struct IntSlot {
  enum Kind : uint8_t { size, stride, offset, attr, attr_elem };
  Kind kind = size;
  int a = 0;  // the value (size, stride, offset) or the node (attr, attr_elem)
  int b = 0;  // the dimension, or the attr
  int c = 0;  // the element of an int-list attr
  SymExpr expr;
};

// Where a graph placeholder's tensor comes from at run time.
struct Binding {
  enum Kind : uint8_t { input, weight };
  Kind kind = input;
  int index = 0;
};

// Where a result of the program comes from: a graph output, or an input returned as it is.
struct ResultRef {
  enum Kind : uint8_t { graph_output, input };
  Kind kind = graph_output;
  int index = 0;
};

// The code for one set of dynamic sizes (the only one for a static program).
struct ProgramInstance {
  compiler::Graph graph;  // the graph at these sizes
  compiler::CompiledFn fn;
  std::vector<Attr> scalars;  // the scalar slots' values (the export's)
};

struct Program {
  std::string name;
  std::string origin;  // "exported in this process" or the package's path, for messages
  compiler::Graph graph;  // at the example sizes
  std::vector<TensorSpec> inputs, outputs, weights;
  std::vector<Tensor> weight_tensors;  // laid out as the graph's placeholders
  std::vector<DynamicDimSpec> dims;
  std::vector<std::vector<int>> input_dims;  // per input, per dimension: its dynamic dim or -1
  std::vector<IntSlot> slots;
  std::vector<Binding> placeholders;  // per graph input
  std::vector<ResultRef> results;
  bool training = false;
  std::optional<Mode> mode;
  std::map<std::string, compiler::OptionValue> options;
  std::vector<char> written_placeholders;  // per graph input: the graph writes its memory
  bool writes_weights = false;

  // Where it was built, and the kernels built there.
  std::string kiln_version, created, compiler, cpu_features, gpu;
  std::vector<std::shared_ptr<const compiler::runtime::BundledLibrary>> libraries;
  std::vector<std::shared_ptr<const compiler::runtime::BundledBlob>> blobs;
  // Why some bundled binaries cannot be used here (empty: all can), for errors.
  std::string unusable_binaries;

  // Instances by dynamic sizes: looked up under a shared lock, built under build_mutex.
  mutable std::shared_mutex instances_mutex;
  mutable std::map<std::vector<int64_t>, std::shared_ptr<const ProgramInstance>> instances;
  mutable std::deque<std::vector<int64_t>> built_order;  // the keys of `instances`, oldest first
  static constexpr size_t kMaxInstances = 64;
  mutable std::mutex build_mutex;
  mutable std::mutex step_mutex;  // runs that write the program's own weights take turns

  // The instance for dynamic sizes `s` (built on first use). Throws ValueError when the graph
  // does not hold at these sizes, CompileError (with unusable_binaries) when it cannot be built.
  std::shared_ptr<const ProgramInstance> instance(const std::vector<int64_t>& s) const;
};

// Whether `t` has exactly `v`'s sizes, strides and offset.
bool has_layout(const Tensor& t, const compiler::ValueInfo& v);
// `t` laid out as `v` says (sizes, strides, offset), on `v`'s device: `t` itself when it already is
// contiguous there and `v` is the contiguous layout, else a copy.
Tensor with_layout(const Tensor& t, const compiler::ValueInfo& v);
// The same, always a copy (nothing written to it reaches `t`).
Tensor copy_with_layout(const Tensor& t, const compiler::ValueInfo& v);

// The package's sections for `p`, and the program a package's sections describe (the graph is
// validated, the weights checked against their specs, bundled binaries registered when they fit).
std::vector<compiler::exporting::Section> program_sections(const Program& p);
std::shared_ptr<Program> program_from_sections(std::map<std::string, std::string> sections, const std::string& path,
                                               bool use_bundled_binaries);

// The mode and options as "mode" and "options" fields of a JSON object (program.json,
// repro.json), and back (PackageError naming `path` for what this Kiln does not know).
void write_compile_settings(nlohmann::json& j, const std::optional<Mode>& mode,
                            const std::map<std::string, compiler::OptionValue>& options);
void read_compile_settings(const nlohmann::json& j, std::optional<Mode>& mode,
                           std::map<std::string, compiler::OptionValue>& options, const std::string& path);

}  // namespace kiln::detail
