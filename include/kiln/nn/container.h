// Containers: Sequential, ModuleList, ModuleDict.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kiln/nn/module.h"

namespace kiln::nn {

// Iterates the registered children of a container as `const ModulePtr&`.
class ChildIterator {
 public:
  explicit ChildIterator(std::vector<ModuleSlot>::const_iterator it) : it_(it) {}
  const ModulePtr& operator*() const { return it_->module; }
  ChildIterator& operator++() {
    ++it_;
    return *this;
  }
  bool operator==(const ChildIterator& o) const { return it_ == o.it_; }

 private:
  std::vector<ModuleSlot>::const_iterator it_;
};

// Runs its children in order, each on the previous one's output. Children are named "0",
// "1", ... (or given names with the NamedModules constructor, PyTorch's OrderedDict form).
//   auto net = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(3, 4),
//                                               std::make_shared<nn::ReLU>());
class Sequential : public Module {
 public:
  Sequential() = default;
  template <
      class... Ms,
      std::enable_if_t<(sizeof...(Ms) > 0) && (std::is_base_of_v<Module, Ms> && ...), int> = 0>
  explicit Sequential(std::shared_ptr<Ms>... modules) {
    (push_back(std::move(modules)), ...);
  }
  explicit Sequential(const std::vector<ModulePtr>& modules);
  explicit Sequential(const NamedModules& named_modules);

  Tensor forward(const Tensor& input) override;

  // Appends a module named by its position.
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    return register_module(std::to_string(size()), std::move(module));
  }
  void extend(const std::vector<ModulePtr>& modules);
  size_t size() const { return child_slots().size(); }
  bool empty() const { return size() == 0; }
  // Negative indices count from the end; IndexError when out of range.
  ModulePtr operator[](int64_t index) const;
  // The child at `index` as M (ValueError when it is another type).
  template <class M>
  std::shared_ptr<M> at(int64_t index) const {
    auto m = std::dynamic_pointer_cast<M>((*this)[index]);
    if (!m) throw_wrong_type(index);
    return m;
  }
  ChildIterator begin() const { return ChildIterator(child_slots().begin()); }
  ChildIterator end() const { return ChildIterator(child_slots().end()); }

 private:
  [[noreturn]] void throw_wrong_type(int64_t index) const;
};

// Holds submodules in a list (named "0", "1", ...) without a forward of its own.
class ModuleList : public Module {
 public:
  ModuleList() = default;
  explicit ModuleList(const std::vector<ModulePtr>& modules);

  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    return register_module(std::to_string(size()), std::move(module));
  }
  void extend(const std::vector<ModulePtr>& modules);
  size_t size() const { return child_slots().size(); }
  bool empty() const { return size() == 0; }
  ModulePtr operator[](int64_t index) const;
  template <class M>
  std::shared_ptr<M> at(int64_t index) const {
    auto m = std::dynamic_pointer_cast<M>((*this)[index]);
    if (!m) throw_wrong_type(index);
    return m;
  }
  ChildIterator begin() const { return ChildIterator(child_slots().begin()); }
  ChildIterator end() const { return ChildIterator(child_slots().end()); }

  // Like PyTorch's, folds runs of children that print the same: "(0-2): 3 x Linear(...)".
  std::string str() const override;

 private:
  [[noreturn]] void throw_wrong_type(int64_t index) const;
};

// Holds submodules by name, in insertion order, without a forward of its own.
class ModuleDict : public Module {
 public:
  ModuleDict() = default;
  explicit ModuleDict(const NamedModules& modules);

  // Adds or replaces (keeping its position) the module under `key`.
  template <class M>
  std::shared_ptr<M> insert(const std::string& key, std::shared_ptr<M> module) {
    return register_module(key, std::move(module));
  }
  void update(const NamedModules& modules);
  size_t size() const { return child_slots().size(); }
  bool empty() const { return size() == 0; }
  bool contains(const std::string& key) const;
  // IndexError naming the key when absent.
  ModulePtr operator[](const std::string& key) const;
  template <class M>
  std::shared_ptr<M> at(const std::string& key) const {
    auto m = std::dynamic_pointer_cast<M>((*this)[key]);
    if (!m) throw_wrong_type(key);
    return m;
  }
  std::vector<std::string> keys() const;
  std::vector<ModulePtr> values() const;
  NamedModules items() const;

 private:
  [[noreturn]] void throw_wrong_type(const std::string& key) const;
};

}  // namespace kiln::nn
