// kiln::nn::Module — the base class of layers and models (torch.nn.Module in C++).
//
// A module owns named parameters, buffers and submodules, in registration order. Modules are
// used through std::shared_ptr (`auto fc = std::make_shared<nn::Linear>(3, 4)`); a submodule is
// registered with register_module and may be shared by several parents. Names of nested entries
// are dotted exactly as PyTorch forms them ("features.denseblock1.denselayer1.norm1.weight").
// Semantics and examples: docs/nn.md.
//
// Thread safety: like any C++ object, concurrent reads (forward in eval mode, parameters()) are
// fine; registration, train()/eval(), to() and load_state_dict need exclusive access.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kiln/io.h"
#include "kiln/tensor.h"

namespace kiln::nn {

class Module;
using ModulePtr = std::shared_ptr<Module>;
using NamedModules = std::vector<std::pair<std::string, ModulePtr>>;

// What load_state_dict(sd, /*strict=*/false) could not match (torch's _IncompatibleKeys).
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;     // in the model, absent from the state dict
  std::vector<std::string> unexpected_keys;  // in the state dict, absent from the model
  bool empty() const { return missing_keys.empty() && unexpected_keys.empty(); }
};

// One registered child: its name and the module (null for an absent submodule).
struct ModuleSlot {
  std::string name;
  ModulePtr module;
};

class Module : public std::enable_shared_from_this<Module> {
 public:
  Module();
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The type name PyTorch prints: "Linear", "Sequential", or a user class's unqualified name.
  virtual std::string name() const;

  // The one-tensor forward. The default throws kiln::Error: modules with other signatures
  // (MultiheadAttention, losses) add their own forward overloads.
  virtual Tensor forward(const Tensor& input);
  Tensor operator()(const Tensor& input) { return forward(input); }

  // ---- registration ----
  // Registers (or replaces, keeping its position) a parameter. An undefined tensor registers an
  // absent optional parameter (PyTorch's register_parameter("bias", None)): it keeps the name
  // but is skipped by parameters() and state_dict(). A tensor with autograd history is detached
  // first (parameters are leaves). Returns the registered handle; its reference stays valid for
  // the module's lifetime. Throws ValueError for an empty name, a name with '.', or a name
  // already used by a buffer or submodule.
  Tensor& register_parameter(std::string name, Tensor tensor, bool requires_grad = true);
  // Registers (or replaces) a buffer: state that is not trained (BatchNorm's running_mean).
  // Non-persistent buffers are moved by to() but left out of state_dict().
  Tensor& register_buffer(std::string name, Tensor tensor, bool persistent = true);
  // Registers (or replaces, keeping its position) a submodule; null registers an absent one.
  template <class M>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> module) {
    static_assert(std::is_base_of_v<Module, M>,
                  "register_module: M must derive from kiln::nn::Module");
    register_module_impl(std::move(name), module);
    return module;
  }

  // ---- traversal (registration order; a tensor or module reachable twice is listed once, at
  // its first name, like PyTorch's remove_duplicate=True) ----
  NamedTensors named_parameters(bool recurse = true) const;
  TensorList parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  TensorList buffers(bool recurse = true) const;
  NamedModules named_children() const;
  std::vector<ModulePtr> children() const;
  // This module first (named `prefix`, "" by default), then every descendant, depth first.
  NamedModules named_modules(const std::string& prefix = "") const;
  std::vector<ModulePtr> modules() const;

  // One entry by dotted path ("features.conv0.weight"). Throws IndexError naming the path part
  // that does not exist.
  Tensor& get_parameter(const std::string& target);
  Tensor& get_buffer(const std::string& target);
  ModulePtr get_submodule(const std::string& target) const;

  // Downcast: `if (auto* conv = m.as<nn::Conv2d>()) ...` (null when the type differs).
  template <class M>
  M* as() {
    return dynamic_cast<M*>(this);
  }
  template <class M>
  const M* as() const {
    return dynamic_cast<const M*>(this);
  }

  // ---- mode ----
  // Sets the training flag of this module and every descendant (Dropout and BatchNorm read it).
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- conversion (in place: every handle to a parameter or buffer, such as Linear::weight,
  // sees the converted tensor; gradients are converted too) ----
  Module& to(Device device);
  // Floating-point parameters and buffers only (integer buffers such as num_batches_tracked
  // keep their dtype). Throws DTypeError for a non-floating dtype.
  Module& to(DType dtype);
  Module& to(Device device, DType dtype);
  // 4-D parameters and buffers (convolution weights) in `format`, e.g.
  // model->to(kiln::channels_last) (torch's module.to(memory_format=...)); preserve: no change.
  Module& to(MemoryFormat format);
  // Sets requires_grad on every parameter (torch's module.requires_grad_()).
  Module& requires_grad_(bool requires_grad = true);
  // Clears (set_to_none) or zeroes every parameter's gradient.
  void zero_grad(bool set_to_none = true);
  // Calls fn on every submodule (children first, depth first) and then on this module.
  Module& apply(const std::function<void(Module&)>& fn);

  // ---- state dict ----
  // Parameters and persistent buffers of the whole tree, detached (sharing storage with the
  // model), in registration order, with PyTorch's key names. Absent (undefined) entries are left
  // out; a tensor reachable under two names appears under both.
  NamedTensors state_dict() const;
  // Copies the values of `state_dict` into the model in place (under no-grad; dtype and device
  // converted as copy_ does). Everything is checked before anything is copied:
  //  - a key whose shape differs from the model's throws ShapeError (strict or not);
  //  - strict: missing or unexpected keys throw ValueError;
  //  - non-strict: they are returned, and every matching key is loaded.
  // Messages name every offending key, in PyTorch's wording. Duplicate keys throw ValueError.
  IncompatibleKeys load_state_dict(const NamedTensors& state_dict, bool strict = true);

  // ---- printing ----
  // The part inside the parentheses of this module's own line: "in_features=3, out_features=4,
  // bias=True" for Linear. Empty by default.
  virtual std::string extra_repr() const;
  // PyTorch's module repr: "Linear(in_features=3, out_features=4, bias=True)", containers with
  // their children indented by two spaces. Virtual for containers that print differently
  // (ModuleList folds repeated children like PyTorch's).
  virtual std::string str() const;

  // ---- structure guard ----
  // A number that increases whenever a parameter, buffer or submodule is registered or replaced,
  // the training flag changes, to() converts a tensor, or requires_grad_() is called anywhere in
  // this module's tree. Equal numbers mean the tree's structure did not change in between
  // (compile() guards on it). Costs one walk over the tree.
  uint64_t structure_version() const;

 protected:
  // Every registered child in order, duplicates and absent ones included (containers index it).
  const std::vector<ModuleSlot>& child_slots() const { return children_; }

  // For subclasses whose forward depends on state this class cannot see (a flag that changes
  // which ops run): call after changing it so compiled callers re-check.
  void mark_structure_changed();

 private:
  struct TensorSlot {
    std::string name;
    Tensor tensor;
    bool persistent = true;  // buffers only
  };
  void register_module_impl(std::string name, ModulePtr module);
  void check_new_name(const std::string& name, const char* kind, const char* caller) const;
  void append_state(const std::string& prefix, NamedTensors& out) const;
  void collect_state_slots(const std::string& prefix,
                           std::vector<std::pair<std::string, Tensor*>>& out);
  void convert(std::optional<Device> device, std::optional<DType> dtype);
  ModulePtr self_ptr() const;

  // Slots live in vectors of unique_ptr so that the Tensor& returned by register_* stays valid.
  std::vector<std::unique_ptr<TensorSlot>> parameters_;
  std::vector<std::unique_ptr<TensorSlot>> buffers_;
  std::vector<ModuleSlot> children_;
  bool training_ = true;
  uint64_t structure_stamp_;
};

std::ostream& operator<<(std::ostream& os, const Module& module);

// Helpers for extra_repr(), which prints values the way Python does:
// python_float_repr(1e-5) == "1e-05", python_float_repr(1.0) == "1.0"; python_bool_repr ->
// "True"/"False".
std::string python_float_repr(double v);
inline const char* python_bool_repr(bool b) {
  return b ? "True" : "False";
}

}  // namespace kiln::nn
