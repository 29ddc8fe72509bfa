// Constant folding: nodes computable when the graph is compiled run once, and their results
// become Graph::constants (see passes.h for what is never folded).
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "compiler/capture/capture.h"
#include "compiler/graph/passes.h"
#include "kiln/autograd.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/error.h"

namespace kiln::compiler::passes {

namespace {

using internal::valid;

int64_t numel_of(const ValueInfo& v) {
  int64_t n = 1;
  for (int64_t s : v.sizes) n *= s;
  return n;
}

// Readers of a one-element CPU constant read the first constant with the same bytes, dtype and
// promotion kind instead (decompositions bake the same 0.5 or 1 many times).
void merge_equal_scalars(Graph& g) {
  std::map<std::tuple<DType, bool, std::string>, int> first;
  std::unordered_map<int, int> rename;
  for (const auto& [v, t] : g.constants) {
    if (!valid(g, v) || t.numel() != 1 || t.device() != kCPU || t.impl().lazy) continue;
    const char* data = static_cast<const char*>(t.impl().data());
    std::string bytes(data, data + itemsize(t.dtype()));
    auto [it, fresh] = first.try_emplace({t.dtype(), g.values[v].is_wrapped_number, bytes}, v);
    if (!fresh && g.values[it->second].sizes == g.values[v].sizes) rename[v] = it->second;
  }
  if (rename.empty()) return;
  auto apply = [&](int& v) {
    auto it = rename.find(v);
    if (it != rename.end()) v = it->second;
  };
  for (Node& n : g.nodes)
    for (int& v : n.inputs) apply(v);
  for (int& v : g.outputs) apply(v);
}

}  // namespace

void fold_constants(Graph& g, int64_t max_numel) {
  std::vector<Tensor> known(g.values.size());
  for (const auto& [v, t] : g.constants)
    if (valid(g, v)) known[v] = t;
  std::vector<char> has_slot(g.nodes.size(), 0);
  for (const ScalarSlot& s : g.scalars)
    if (s.node >= 0 && static_cast<size_t>(s.node) < has_slot.size()) has_slot[s.node] = 1;
  // A folded value is shared by every call: memory some node writes cannot be one.
  std::vector<char> written = internal::written_memory(g);

  // Graph outputs get a buffer of their own on every call: a fill costs what a copy would.
  std::vector<char> output(g.values.size(), 0);
  for (int v : g.outputs)
    if (valid(g, v)) output[v] = 1;

  std::vector<char> folded(g.nodes.size(), 0);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (!n.op || n.has_side_effects() || has_slot[i] || n.outputs.empty() ||
        internal::is_random(*n.op))
      continue;
    bool foldable = true;
    for (int v : n.inputs) foldable &= v == -1 || (valid(g, v) && known[v].defined());
    for (int v : n.outputs)
      foldable &= valid(g, v) && !written[v] && !output[v] &&
                  (max_numel < 0 || numel_of(g.values[v]) <= max_numel);
    if (!foldable) continue;

    std::vector<Tensor> inputs;
    for (int v : n.inputs) inputs.push_back(v == -1 ? Tensor() : known[v]);
    std::vector<Tensor> results;
    try {
      kiln::compiler::detail::SuspendCapture no_capture;
      NoGradGuard no_grad;
      results = call_op(*n.op, std::move(inputs), n.attrs);
    } catch (const std::exception&) {
      continue;  // no kernel here, or it rejects the values: the node runs at run time
    }
    if (results.size() != n.outputs.size()) continue;
    bool matches = true;
    for (size_t k = 0; k < results.size(); ++k) {
      const ValueInfo& rec = g.values[n.outputs[k]];
      matches &= results[k].defined() && results[k].sizes() == IntArrayRef(rec.sizes) &&
                 results[k].dtype() == rec.dtype && results[k].device() == rec.device;
    }
    if (!matches) continue;
    for (size_t k = 0; k < results.size(); ++k) {
      known[n.outputs[k]] = results[k];
      g.constants.emplace_back(n.outputs[k], results[k]);
    }
    folded[i] = 1;
  }

  // A folded node's inputs were constants, so folding leaves no other node dead: only the folded
  // nodes go, and constants nothing reads.
  const Node* first = g.nodes.data();
  g.erase_nodes_if([&](const Node& n) { return folded[&n - first] != 0; });
  merge_equal_scalars(g);
  std::vector<int> uses = g.use_counts();
  std::erase_if(g.constants, [&](const auto& c) { return !valid(g, c.first) || uses[c.first] == 0; });
}

}  // namespace kiln::compiler::passes
