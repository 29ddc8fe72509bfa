// The backward engine: dependency counting, then nodes in reverse creation order (a node runs
// once all the gradients flowing into it are summed), on the calling thread.
#include <map>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "autograd/node.h"
#include "compiler/capture/runtime.h"
#include "kiln/ops.h"

namespace kiln::autograd {

std::atomic<int64_t> g_compiled_nodes{0};

namespace {

std::atomic<bool> g_anomaly{false};

struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr < b->sequence_nr; }
};

void accumulate(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? slot + g : g;
}

void check_anomaly(const Node& node, const TensorList& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || !grads[i].is_floating_point()) continue;
    NoGradGuard ng;
    if (isnan(grads[i]).any().item<bool>()) {
      throw Error("[kiln::autograd] Function '" + node.name() + "' returned nan values in its " +
                  std::to_string(i) + "th output. It is the derivative of the forward op '" +
                  node.forward_op() + "'. Check that op's inputs (e.g. log of 0, sqrt of a negative, "
                  "division by zero).");
    }
  }
}

// A leaf's AccumulateGrad node and the gradient it is to accumulate.
using LeafGradients = std::vector<std::pair<std::shared_ptr<Node>, Tensor>>;

// A leaf with post-accumulate hooks (a DistributedDataParallel parameter) gets its gradient in
// the captured backward as soon as it is computed, not after the backward: its hook starts the
// gradient bucket's all-reduce, which breaks the backward graph there so that the rest of the
// backward overlaps the communication (Dynamo's DDPOptimizer split, for a compiled model whose
// backward runs outside the compiled call). Such leaves belong to one training loop, so the
// thread-safety reason for deferring (run_backward below) does not apply to them.
bool wants_gradient_at_once(const AccumulateGrad& acc) {
  AutogradMeta* m = meta_if_exists(Tensor(acc.leaf));
  if (!m) return false;
  std::lock_guard lock(m->mutex);
  return !m->post_accumulate_hooks.empty();
}

// Runs the graph below `roots`. When `capture` is non-empty, gradients arriving at those edges
// are returned (autograd::grad) instead of being accumulated into leaves. With `leaf_grads`, the
// leaves' AccumulateGrad nodes do not run: they are handed back with their gradients.
TensorList run_backward_eager(const TensorList& tensors, const TensorList& grad_tensors, bool keep_graph,
                              bool create_graph, const std::vector<Edge>& capture, bool accumulate_leaves,
                              LeafGradients* leaf_grads = nullptr) {
  KILN_CHECK(grad_tensors.empty() || grad_tensors.size() == tensors.size(), ValueError,
             "[kiln::backward] got " + std::to_string(tensors.size()) + " tensors and " +
                 std::to_string(grad_tensors.size()) + " gradients; give one gradient per tensor.");
  std::vector<std::pair<Edge, Tensor>> roots;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    KILN_CHECK(t.defined() && t.requires_grad(), Error,
               "[kiln::backward] element " + std::to_string(i) +
                   " of tensors does not require grad and does not have a grad_fn. Set "
                   "requires_grad_() on the inputs you want gradients for, outside NoGradGuard.");
    Tensor g = grad_tensors.empty() ? Tensor() : grad_tensors[i];
    if (!g.defined()) {
      KILN_CHECK(t.numel() == 1, Error,
                 "[kiln::backward] grad can be implicitly created only for scalar outputs; this output has "
                 "shape " + shape_str(t.sizes()) + ". Pass a gradient of the same shape.");
      g = ones_like(t);
    } else {
      KILN_CHECK(g.sizes() == t.sizes(), ShapeError,
                 "[kiln::backward] the gradient has shape " + shape_str(g.sizes()) +
                     " but the output has shape " + shape_str(t.sizes()) + ".");
    }
    roots.push_back({gradient_edge(t), g});
  }

  // Dependencies: how many edges point at each node from the reachable graph.
  std::unordered_map<Node*, int> deps;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (auto& [e, g] : roots)
    if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges) {
      if (!e.valid()) continue;
      deps[e.node.get()]++;
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }

  std::unordered_map<const Node*, std::vector<size_t>> capture_slots;  // node -> capture indices
  for (size_t i = 0; i < capture.size(); ++i)
    if (capture[i].valid()) capture_slots[capture[i].node.get()].push_back(i);
  TensorList captured(capture.size());

  std::unordered_map<Node*, TensorList> buffers;
  std::unordered_map<Node*, std::shared_ptr<Node>> owners;
  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready;
  for (auto& [e, g] : roots) {
    auto& buf = buffers[e.node.get()];
    buf.resize(e.node->output_shapes.size());
    accumulate(buf[e.input_nr], g);
    owners[e.node.get()] = e.node;
  }
  for (auto& [e, g] : roots)
    if (deps[e.node.get()] == 0 && buffers.count(e.node.get())) {
      ready.push(e.node.get());
      deps[e.node.get()] = -1;  // queued
    }

  std::optional<NoGradGuard> no_grad;
  std::optional<EnableGradGuard> grad_on;
  if (create_graph) grad_on.emplace();
  else no_grad.emplace();

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::shared_ptr<Node> keep = owners[node];
    TensorList grads = std::move(buffers[node]);
    buffers.erase(node);
    grads.resize(node->output_shapes.size());

    // Tensor hooks and retained grads of the forward outputs.
    for (size_t s = 0; s < grads.size(); ++s) {
      if (!grads[s].defined()) continue;
      if (s < node->pre_hooks.size())
        for (auto& hook : node->pre_hooks[s]) {
          Tensor r = hook(grads[s]);
          if (r.defined()) grads[s] = r;
        }
      if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
        AutogradMeta& m = meta(Tensor(acc->leaf));
        for (auto& hook : m.hooks) {
          Tensor r = hook(grads[s]);
          if (r.defined()) grads[s] = r;
        }
      }
      if (s < node->retained.size())
        if (auto impl = node->retained[s].lock()) {
          AutogradMeta& m = meta(Tensor(impl));
          m.grad = m.grad.defined() ? m.grad + grads[s] : (create_graph ? grads[s] : grads[s].clone());
        }
    }

    if (auto it = capture_slots.find(node); it != capture_slots.end()) {
      for (size_t i : it->second) captured[i] = grads[capture[i].input_nr];
    }

    TensorList out;
    auto* leaf_acc = dynamic_cast<AccumulateGrad*>(node);
    const bool is_leaf_acc = leaf_acc != nullptr;
    if (is_leaf_acc && accumulate_leaves && leaf_grads && !wants_gradient_at_once(*leaf_acc)) {
      leaf_grads->emplace_back(keep, std::move(grads[0]));
    } else if (!is_leaf_acc || accumulate_leaves) {
      out = node->apply(std::move(grads));
      if (g_anomaly.load(std::memory_order_relaxed)) check_anomaly(*node, out);
    }
    if (!keep_graph) node->release_saved();

    for (size_t i = 0; i < node->next_edges.size() && i < out.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.valid()) continue;
      auto& buf = buffers[e.node.get()];
      buf.resize(e.node->output_shapes.size());
      accumulate(buf[e.input_nr], out[i]);
      owners[e.node.get()] = e.node;
    }
    for (const Edge& e : node->next_edges) {
      if (!e.valid()) continue;
      if (--deps[e.node.get()] == 0) {
        ready.push(e.node.get());
        deps[e.node.get()] = -1;
      }
    }
  }
  return captured;
}

// A backward through a graph that a compiled function captured, run outside compiled code, is
// captured and compiled as well (that function's backward graph; AOTAutograd's role in Dynamo).
TensorList run_backward(const TensorList& tensors, const TensorList& grad_tensors, bool keep_graph,
                        bool create_graph, const std::vector<Edge>& capture, bool accumulate_leaves) {
  std::shared_ptr<void> owner;
  if (!compiler::detail::active_capture() && !create_graph &&
      g_compiled_nodes.load(std::memory_order_relaxed) > 0) {
    // The first node below the roots that a compiled function recorded (the roots themselves may
    // be eager ops on compiled outputs, e.g. compiled_fn(x).sum().backward()).
    std::vector<Node*> stack;
    std::unordered_set<Node*> seen;
    for (const Tensor& t : tensors)
      if (auto* m = t.defined() ? meta_if_exists(t) : nullptr; m && m->grad_fn) stack.push_back(m->grad_fn.get());
    while (!stack.empty() && !owner) {
      Node* n = stack.back();
      stack.pop_back();
      if (!seen.insert(n).second) continue;
      if (n->compiled_owner) owner = n->compiled_owner;
      for (const Edge& e : n->next_edges)
        if (e.node) stack.push_back(e.node.get());
    }
  }
  if (!owner) return run_backward_eager(tensors, grad_tensors, keep_graph, create_graph, capture, accumulate_leaves);
  // A leaf's .grad is shared state (the parameters of a model other threads train too): it must
  // only ever hold real tensors, accumulated under the leaf's lock. So the captured backward hands
  // the leaves' gradients out of its graph, and they are accumulated after it ran, as AOTAutograd's
  // compiled backward returns them to eager AccumulateGrad nodes. Accumulated inside the graph,
  // another thread's backward would find the .grad "still being captured", and the write would
  // happen at the flush, outside the lock.
  LeafGradients leaf_grads;
  TensorList result;
  compiler::detail::run_captured_backward(owner, [&] {
    result = run_backward_eager(tensors, grad_tensors, keep_graph, create_graph, capture, accumulate_leaves,
                                &leaf_grads);
  });
  NoGradGuard no_grad;  // create_graph is false on this path
  for (auto& [node, grad] : leaf_grads) node->apply(TensorList{std::move(grad)});
  return result;
}

}  // namespace

void backward(const TensorList& tensors, const TensorList& grad_tensors, std::optional<bool> retain_graph,
              bool create_graph) {
  run_backward(tensors, grad_tensors, retain_graph.value_or(create_graph), create_graph, {}, true);
}

TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs,
                std::optional<bool> retain_graph, bool create_graph, bool allow_unused) {
  std::vector<Edge> capture;
  for (size_t i = 0; i < inputs.size(); ++i) {
    KILN_CHECK(inputs[i].defined() && inputs[i].requires_grad(), Error,
               "[kiln::autograd::grad] input " + std::to_string(i) + " does not require grad.");
    capture.push_back(gradient_edge(inputs[i]));
  }
  TensorList result =
      run_backward(outputs, grad_outputs, retain_graph.value_or(create_graph), create_graph, capture, false);
  for (size_t i = 0; i < result.size(); ++i) {
    KILN_CHECK(result[i].defined() || allow_unused, Error,
               "[kiln::autograd::grad] one of the differentiated tensors (input " + std::to_string(i) +
                   ") appears to not have been used in the graph. Pass allow_unused=true if this is "
                   "the desired behavior.");
  }
  return result;
}

void set_detect_anomaly(bool enabled) { g_anomaly.store(enabled, std::memory_order_relaxed); }
bool is_anomaly_enabled() { return g_anomaly.load(std::memory_order_relaxed); }

std::string node_name(const Node& node) { return node.name(); }

}  // namespace kiln::autograd
