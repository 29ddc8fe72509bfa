// Lazy capture: op calls become graph nodes; flushes run the graph and make lazy tensors real.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "autograd/node.h"
#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "core/profiler.h"
#include "compiler/capture/segment.h"
#include "core/dispatch.h"
#include "core/layer_hooks.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/autograd.h"

namespace kiln::compiler::detail {

using kiln::detail::Storage;
using kiln::detail::TensorImpl;

thread_local const FlushObserver* t_flush_observer = nullptr;

namespace {
thread_local CaptureContext* t_capture = nullptr;

// FNV-style 64-bit mixing: the structural key of a segment (structure_hash).
inline void mix(uint64_t& h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h *= 0x100000001b3ull;
}
// A list folds into one word first, its elements through independent multiplies (the serial
// chain of mix() is what a capture of a few hundred ops spent most of its hashing time in); the
// key only has to spread graphs over buckets, since every hit is compared in full.
inline uint64_t fold_ints(const std::vector<int64_t>& v) {
  static constexpr uint64_t kOdd[4] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull,
                                       0xd6e8feb86659fd93ull};
  uint64_t acc = v.size();
  for (size_t i = 0; i < v.size(); ++i) acc += (static_cast<uint64_t>(v[i]) + i) * kOdd[i & 3];
  return acc ^ (acc >> 29);
}
inline void mix_ints(uint64_t& h, const std::vector<int64_t>& v) { mix(h, fold_ints(v)); }
inline void mix_device(uint64_t& h, Device d) { mix(h, static_cast<uint64_t>(d.type) * 1024 + d.index); }
inline uint64_t str_hash(const std::string& s) { return std::hash<std::string>{}(s); }
// A value's metadata, as far as the structural key needs it.
inline void mix_value(uint64_t& h, const ValueInfo& v) {
  mix(h, (v.is_input ? 1u : 0u) | static_cast<uint64_t>(v.is_wrapped_number) << 1 | static_cast<uint64_t>(v.dtype) << 8 |
             static_cast<uint64_t>(v.device.type) << 16 | static_cast<uint64_t>(static_cast<uint32_t>(v.device.index)) << 24);
  mix(h, fold_ints(v.sizes) ^ (fold_ints(v.strides) << 1));
  mix(h, static_cast<uint64_t>(v.storage_offset) * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(v.storage));
}

}  // namespace


CaptureContext* active_capture() { return t_capture; }
CaptureContext* exchange_capture(CaptureContext* ctx) { return std::exchange(t_capture, ctx); }

// The dispatcher's calls into capture (core/layer_hooks.h), installed when the library loads.
[[maybe_unused]] const bool g_capture_hooks_installed = [] {
  kiln::detail::CaptureHooks& h = kiln::detail::capture_hooks;
  h.active = [] { return static_cast<void*>(t_capture); };
  h.run_op = [](void* cap, const OpDef& op, std::vector<Tensor>& inputs, std::vector<Attr>& attrs) {
    return capture_op(*static_cast<CaptureContext*>(cap), op, inputs, attrs);
  };
  h.run_op_out = [](void* cap, const OpDef& op, std::vector<Tensor>& inputs, std::vector<Attr>& attrs,
                    std::span<Tensor> outputs) {
    capture_op_out(*static_cast<CaptureContext*>(cap), op, inputs, attrs, outputs);
  };
  h.host_read = [](std::string_view what) { host_read(what); };
  h.exchange = [](void* cap) { return static_cast<void*>(exchange_capture(static_cast<CaptureContext*>(cap))); };
  return true;
}();

SuspendCapture::SuspendCapture() : saved_(t_capture) { t_capture = nullptr; }
SuspendCapture::~SuspendCapture() { t_capture = saved_; }

CaptureScope::CaptureScope(CaptureContext* ctx) : saved_(t_capture) { t_capture = ctx; }
CaptureScope::~CaptureScope() { t_capture = saved_; }

namespace {
// A finished segment no one else refers to, kept for the thread's next capture (its spare nodes
// and values: Segment::new_node / new_value).
thread_local std::shared_ptr<Segment> t_spare_segment;
}  // namespace

namespace {

// KILN_GUIDED_CAPTURE=0 turns guided capture off (read once; for comparing the two).
bool guided_capture_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KILN_GUIDED_CAPTURE");
    return !env || std::string_view(env) != "0";
  }();
  return enabled;
}

}  // namespace

Segment& CaptureContext::pending() {
  if (!segment) {
    segment = t_spare_segment ? std::move(t_spare_segment) : std::make_shared<Segment>();
    take_guide(*segment);
  }
  return *segment;
}

CaptureContext::~CaptureContext() {
  if (!segment || segment.use_count() != 1 || segment->state != Segment::State::pending) return;
  segment->clear();  // (trace_graph moves its graph out and leaves the rest)
  t_spare_segment = std::move(segment);
}

namespace {

// Sets `v`'s layout, dtype and device to t's (assigning into v's vectors, which keep their
// capacity: Segment::new_value hands out recycled values).
void set_info(ValueInfo& v, const Tensor& t) {
  const TensorImpl& i = t.impl();
  v.sizes.assign(i.sizes.begin(), i.sizes.end());
  v.strides.assign(i.strides.begin(), i.strides.end());
  v.storage_offset = i.storage_offset;
  v.dtype = i.dtype;
  v.device = i.device;
}

[[noreturn]] void throw_unusable(const Segment& seg) {
  if (seg.state == Segment::State::failed) {
    throw CompileError("[kiln::compile] this tensor was never computed: the graph that produces it failed (" +
                       seg.failure + "). Fix that error first; the tensor holds no data.");
  }
  throw Error(
      "[kiln::compile] this tensor is still being captured by another thread's compiled call. Pass tensors "
      "between threads only after the compiled call that produced them has returned.");
}

int replay_recipe(Segment& seg, const Tensor& t);

bool is_dynamic_attr(const OpDef& op, const Attr& a, size_t index) {
  if (std::holds_alternative<Scalar>(a) || std::holds_alternative<double>(a)) return true;
  return std::find(op.runtime_attrs.begin(), op.runtime_attrs.end(), static_cast<int>(index)) !=
         op.runtime_attrs.end();
}

bool size_like(const Attr& a) {
  return std::holds_alternative<int64_t>(a) || std::holds_alternative<std::vector<int64_t>>(a);
}

// Whether attr k of two nodes of `op` agree: run-time scalar slots in kind only (int and float
// scalars promote differently); with `sizes` false, integer attrs in kind (lists in length) only.
bool attr_matches(const OpDef& op, const Attr& p, const Attr& q, size_t k, bool sizes) {
  if (p.index() != q.index()) return false;
  if (is_dynamic_attr(op, p, k)) {
    auto* s = std::get_if<Scalar>(&p);
    auto* t = std::get_if<Scalar>(&q);
    return !s || (s->is_floating_point() == t->is_floating_point() && s->is_boolean() == t->is_boolean());
  }
  if (!sizes && size_like(p)) {
    auto* u = std::get_if<std::vector<int64_t>>(&p);
    return !u || u->size() == std::get<std::vector<int64_t>>(q).size();
  }
  return std::visit(
      [&](const auto& v) -> bool {
        using T = std::decay_t<decltype(v)>;
        const T& w = std::get<T>(q);
        if constexpr (std::is_same_v<T, Scalar>) {
          return v.to_double() == w.to_double() && v.is_floating_point() == w.is_floating_point();
        } else if constexpr (std::is_same_v<T, std::monostate>) {
          return true;
        } else {
          return v == w;
        }
      },
      p);
}

// ---- guided capture (segment.h, Guide) ----

// size_signature's numbers of one value: sizes, strides, rank, storage offset.
void push_value_numbers(std::vector<int64_t>& out, const TensorImpl& i) {
  out.insert(out.end(), i.sizes.begin(), i.sizes.end());
  out.insert(out.end(), i.strides.begin(), i.strides.end());
  out.push_back(static_cast<int64_t>(i.strides.size()));
  out.push_back(i.storage_offset);
}

// Whether a new placeholder for `impl` (alias group `group`) is the guide's next value and input.
bool follow_guide_input(const Segment& seg, const TensorImpl& impl, int group) {
  const Graph& g = seg.guide->graph->graph;
  const size_t id = seg.guided.values, k = seg.inputs.size();
  if (id >= g.values.size() || k >= g.inputs.size() || g.inputs[k] != static_cast<int>(id)) return false;
  const ValueInfo& v = g.values[id];
  return v.is_input && v.dtype == impl.dtype && v.device == impl.device && v.storage == group &&
         v.is_wrapped_number == impl.is_wrapped_number && v.sizes.size() == impl.sizes.size();
}

// Whether the call of `op` (inputs `in_ids`, results `outputs`) is the guide's next node; if so,
// records its numbers and scalars. Values get their ids in order, new buffers their alias groups
// from seg.next_group, as an ordinary capture assigns them.
bool follow_guide(Segment& seg, const OpDef& op, const std::vector<int>& in_ids, const std::vector<Attr>& attrs,
                  const std::vector<Tensor>& outputs) {
  const Graph& g = seg.guide->graph->graph;
  Segment::Guided& gd = seg.guided;
  if (gd.nodes >= g.nodes.size()) return false;
  const Node& n = g.nodes[gd.nodes];
  if (n.op != &op || n.inplace || n.inputs != in_ids || n.attrs.size() != attrs.size() ||
      n.outputs.size() != outputs.size())
    return false;
  for (size_t k = 0; k < attrs.size(); ++k)
    if (!attr_matches(op, attrs[k], n.attrs[k], k, /*sizes=*/false)) return false;
  const bool view = op.kind == OpKind::view;
  if (view && (in_ids.empty() || in_ids[0] < 0)) return false;
  int group = seg.next_group;
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (n.outputs[j] != static_cast<int>(gd.values + j)) return false;
    const ValueInfo& v = g.values[n.outputs[j]];
    const TensorImpl& o = outputs[j].impl();
    const int storage = view ? g.values[in_ids[0]].storage : group++;
    if (v.storage != storage || v.is_input || v.is_wrapped_number || v.dtype != o.dtype || v.device != o.device ||
        v.sizes.size() != o.sizes.size())
      return false;
  }
  for (size_t k = 0; k < attrs.size(); ++k) {
    const Attr& a = attrs[k];
    if (is_dynamic_attr(op, a, k)) gd.scalars.push_back(a);
    else if (auto* i = std::get_if<int64_t>(&a)) gd.attr_numbers.push_back(*i);
    else if (auto* list = std::get_if<std::vector<int64_t>>(&a))
      gd.attr_numbers.insert(gd.attr_numbers.end(), list->begin(), list->end());
  }
  for (const Tensor& o : outputs) push_value_numbers(gd.value_numbers, o.impl());
  ++gd.nodes;
  return true;
}

// Ends guided capture: builds the graph captured so far from the guide's structure and the
// numbers collected (what an ordinary capture would have built), and goes on as one.
void derail(Segment& seg) {
  const Graph& g = seg.guide->graph->graph;
  Segment::Guided& gd = seg.guided;
  size_t at = 0;
  for (size_t i = 0; i < gd.values; ++i) {
    const ValueInfo& from = g.values[i];
    const auto rank = static_cast<std::ptrdiff_t>(from.sizes.size());
    ValueInfo& v = seg.new_value();
    const auto numbers = gd.value_numbers.begin() + static_cast<std::ptrdiff_t>(at);
    v.sizes.assign(numbers, numbers + rank);
    v.strides.assign(numbers + rank, numbers + 2 * rank);
    v.storage_offset = numbers[2 * rank + 1];
    at += static_cast<size_t>(2 * rank + 2);
    v.dtype = from.dtype;
    v.device = from.device;
    v.storage = from.storage;
    v.is_input = from.is_input;
    v.is_wrapped_number = from.is_wrapped_number;
  }
  seg.graph.inputs.assign(g.inputs.begin(), g.inputs.begin() + static_cast<std::ptrdiff_t>(seg.inputs.size()));
  size_t attr_at = 0, scalar_at = 0;
  for (size_t j = 0; j < gd.nodes; ++j) {
    const Node& from = g.nodes[j];
    Node& n = seg.new_node();
    n.op = from.op;
    n.inputs = from.inputs;
    n.outputs = from.outputs;
    n.attrs.resize(from.attrs.size());
    for (size_t k = 0; k < from.attrs.size(); ++k) {
      const Attr& a = from.attrs[k];
      if (is_dynamic_attr(*from.op, a, k)) {
        n.attrs[k] = gd.scalars[scalar_at++];
        seg.graph.scalars.push_back({static_cast<int>(j), static_cast<int>(k)});
      } else if (std::holds_alternative<int64_t>(a)) {
        n.attrs[k] = gd.attr_numbers[attr_at++];
      } else if (auto* list = std::get_if<std::vector<int64_t>>(&a)) {
        const auto first = gd.attr_numbers.begin() + static_cast<std::ptrdiff_t>(attr_at);
        n.attrs[k] = std::vector<int64_t>(first, first + static_cast<std::ptrdiff_t>(list->size()));
        attr_at += list->size();
      } else {
        n.attrs[k] = a;
      }
    }
  }
  seg.guide.reset();
  gd.nodes = gd.values = 0;
  gd.value_numbers.clear();
  gd.attr_numbers.clear();
  gd.scalars.clear();
}

// The value id of `t` in `seg`: its lazy value, a recomputed value's replay, or a (new)
// placeholder for a real tensor.
int value_of(Segment& seg, const Tensor& t) {
  const TensorImpl& impl = t.impl();
  if (impl.lazy && impl.lazy->recipe && !impl.storage->data) {
    if (seg.guide) derail(seg);
    return replay_recipe(seg, t);
  }
  if (impl.lazy && impl.lazy->segment) {  // a recomputed value has no segment: its graph ran
    const Segment& owner = *impl.lazy->segment;
    if (&owner == &seg) return impl.lazy->value;
    if (owner.state != Segment::State::done) throw_unusable(owner);
  }
  auto [it, inserted] = seg.input_ids.try_emplace(&impl, 0);
  if (!inserted) return it->second;
  auto [g, new_group] = seg.input_groups.try_emplace(impl.storage.get(), seg.next_group);
  if (new_group) ++seg.next_group;
  if (seg.guide && !follow_guide_input(seg, impl, g->second)) derail(seg);
  int id = seg.next_value_id();
  if (seg.guide) {
    push_value_numbers(seg.guided.value_numbers, impl);
    ++seg.guided.values;
  } else {
    ValueInfo& v = seg.new_value();
    set_info(v, t);
    v.storage = g->second;
    v.is_input = true;
    v.is_wrapped_number = impl.is_wrapped_number;
    seg.graph.inputs.push_back(id);
  }
  seg.inputs.push_back(t);
  it->second = id;
  return id;
}

// The value ids of `tensors` in `seg`, in order (-1 for undefined tensors, which stand for None).
std::vector<int> value_ids(Segment& seg, std::span<const Tensor> tensors) {
  std::vector<int> ids;
  ids.reserve(tensors.size());
  for (const Tensor& t : tensors) ids.push_back(t.defined() ? value_of(seg, t) : -1);
  return ids;
}

void mix_attr(uint64_t& h, const Attr& a, bool dynamic) {
  mix(h, a.index());
  if (dynamic) {  // only the kind: int and float scalars promote differently
    if (auto* s = std::get_if<Scalar>(&a)) mix(h, s->is_floating_point() ? 2 : s->is_boolean() ? 0 : 1);
    return;
  }
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::monostate>) {
        } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, int64_t>) {
          mix(h, static_cast<uint64_t>(v));
        } else if constexpr (std::is_same_v<T, double>) {
          uint64_t bits;
          std::memcpy(&bits, &v, 8);
          mix(h, bits);
        } else if constexpr (std::is_same_v<T, Scalar>) {
          mix(h, static_cast<uint64_t>(v.to_int()));
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          mix_ints(h, v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          mix(h, str_hash(v));
        } else if constexpr (std::is_same_v<T, DType>) {
          mix(h, static_cast<uint64_t>(v));
        } else if constexpr (std::is_same_v<T, Device>) {
          mix_device(h, v);
        }
      },
      a);
}

// Appends the node for `op`. Returns its index.
int append_node(Segment& seg, const OpDef& op, const std::vector<int>& in_ids, const std::vector<Attr>& attrs,
                bool inplace) {
  int index = static_cast<int>(seg.graph.nodes.size());
  Node& n = seg.new_node();
  n.op = &op;
  n.inputs.assign(in_ids.begin(), in_ids.end());
  n.attrs.resize(attrs.size());
  for (size_t k = 0; k < attrs.size(); ++k) n.attrs[k] = attrs[k];
  n.inplace = inplace;
  for (size_t k = 0; k < attrs.size(); ++k)
    if (is_dynamic_attr(op, attrs[k], k)) seg.graph.scalars.push_back({index, static_cast<int>(k)});
  return index;
}

// Appends a result value laid out as `t` in alias group `storage`.
int add_result_value(Segment& seg, const Tensor& t, int storage) {
  int id = static_cast<int>(seg.graph.values.size());
  ValueInfo& v = seg.new_value();
  set_info(v, t);
  v.storage = storage;
  return id;
}

// A value the forward left to recompute (segment.h), read by a later capture: the recipe's op
// joins this graph (the backward's kernels fuse it). A handle whose layout differs from the
// recipe's value (a view made outside capture) is computed eagerly and read as an input.
int replay_recipe(Segment& seg, const Tensor& t) {
  const TensorImpl& impl = t.impl();
  const std::shared_ptr<Recipe>& r = impl.lazy->recipe;
  if (impl.sizes != r->info.sizes || impl.strides != r->info.strides || impl.storage_offset != r->info.storage_offset) {
    materialize_recipe(impl);
    return value_of(seg, t);
  }
  if (auto it = seg.replayed.find(r.get()); it != seg.replayed.end()) return it->second;
  check_recipe_inputs(*r);
  std::vector<int> ids;
  ids.reserve(r->inputs.size());
  for (const Tensor& in : r->inputs) ids.push_back(in.defined() ? value_of(seg, in) : -1);
  int node = append_node(seg, *r->op, ids, r->attrs, /*inplace=*/false);
  int id = static_cast<int>(seg.graph.values.size());
  ValueInfo& v = seg.new_value();
  v = r->info;
  v.is_input = false;
  v.name.clear();
  v.storage = seg.next_group++;
  seg.graph.nodes[node].outputs.push_back(id);
  seg.replayed[r.get()] = id;
  return id;
}

void set_lazy(Segment& seg, const std::shared_ptr<Segment>& owner, Tensor& t, int value) {
  auto lv = std::make_shared<LazyValue>();
  lv->segment = owner;
  lv->value = value;
  t.impl().lazy = std::move(lv);
  seg.lazy.push_back(t.impl_ptr());
}

// A lazy result: metadata and a pending storage that a flush fills.
Tensor make_pending(TensorMeta&& m) {
  std::vector<int64_t> strides = m.strides.empty() ? kiln::detail::contiguous_strides(m.sizes) : std::move(m.strides);
  auto storage = std::make_shared<Storage>();
  storage->nbytes = kiln::detail::storage_span(m.sizes, strides) * itemsize(m.dtype);
  storage->device = m.device;
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->sizes = std::move(m.sizes);
  impl->strides = std::move(strides);
  impl->dtype = m.dtype;
  impl->device = m.device;
  impl->refresh_metadata();
  return Tensor(std::move(impl));
}

void bump_version(const Tensor& t) { t.impl().storage->version.fetch_add(1, std::memory_order_relaxed); }

std::string graph_break_reason_for_op(const OpDef& op) {
  return "call to '" + op.name + "', which is disallowed in graphs (disallow_in_graph)";
}

bool capturable(const OpDef& op) { return !is_disallowed_in_graph(op); }

// Autograd nodes recorded during capture remember their compiled function, so that a backward()
// run after the call returns is captured as a graph of that function too.
void tag_autograd_nodes(CaptureContext& cap, std::span<Tensor> outputs) {
  std::shared_ptr<autograd::Node> last;
  for (Tensor& o : outputs) {
    auto* m = autograd::meta_if_exists(o);
    if (m && m->grad_fn && m->grad_fn != last) {
      if (cap.segment) cap.segment->autograd_nodes.push_back(m->grad_fn);  // what it saves: the partition's input
      cap.recorded_nodes.push_back(m->grad_fn);
      last = m->grad_fn;
    }
    if (m && m->grad_fn && !m->grad_fn->compiled_owner) {
      m->grad_fn->compiled_owner = cap.fn->shared_from_this();
      autograd::g_compiled_nodes.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

void break_for_op(CaptureContext& cap, const OpDef& op) {
  std::optional<CallSite> site;
  if (cap.record_stacks) site = user_call_site(capture_stack());
  cap.flush(false, graph_break_reason_for_op(op), site ? &*site : nullptr);
}

}  // namespace

std::vector<Tensor> capture_op(CaptureContext& cap, const OpDef& op, std::vector<Tensor>& inputs,
                               std::vector<Attr>& attrs) {
  if (!capturable(op)) {
    break_for_op(cap, op);
    SuspendCapture eager;
    return call_op(op, std::move(inputs), std::move(attrs));
  }
  OpCall call(&op, inputs, attrs);
  std::vector<TensorMeta> metas = op.meta(call);  // shape errors raise here, as in eager

  Segment& seg = cap.pending();
  const std::shared_ptr<Segment>& owner = cap.segment;
  if (seg.guide && autograd::recording(inputs)) derail(seg);  // the partition needs the graph
  const std::vector<int> in_ids = value_ids(seg, inputs);
  if (!op.runtime_attrs.empty()) cap.random = true;

  const bool view = op.kind == OpKind::view;
  std::vector<Tensor> outputs;
  outputs.reserve(metas.size());
  for (auto& m : metas) {
    outputs.push_back(view ? kiln::detail::make_view(inputs[0], std::move(m.sizes), std::move(m.strides), m.storage_offset)
                           : make_pending(std::move(m)));
  }
  if (seg.guide && !follow_guide(seg, op, in_ids, attrs, outputs)) derail(seg);
  const int node = seg.guide ? -1 : append_node(seg, op, in_ids, attrs, /*inplace=*/false);
  if (cap.trace_ops) seg.record_stack(seg.guide ? seg.guided.nodes - 1 : static_cast<size_t>(node));
  for (Tensor& out : outputs) {
    const int storage = view ? -1 : seg.next_group++;
    int id;
    if (seg.guide) {
      id = static_cast<int>(seg.guided.values++);  // follow_guide recorded its layout
    } else {
      id = add_result_value(seg, out, view ? seg.graph.values[in_ids[0]].storage : storage);
      seg.graph.nodes[node].outputs.push_back(id);
    }
    if (!view) seg.pending.push_back({out.impl().storage, id});
    set_lazy(seg, owner, out, id);
  }
  if (op.mutates(OpCall(&op, inputs, attrs)))
    for (int i : op.mutated_input_indices(inputs.size(), attrs))
      if (inputs[i].defined()) bump_version(inputs[i]);
  if (autograd::recording(inputs)) {
    cap.autograd = true;
    autograd::record(op, inputs, attrs, outputs);
    tag_autograd_nodes(cap, outputs);
  }
  return outputs;
}

void capture_op_out(CaptureContext& cap, const OpDef& op, std::vector<Tensor>& inputs,
                    std::vector<Attr>& attrs, std::span<Tensor> outputs) {
  if (!capturable(op)) {
    break_for_op(cap, op);
    SuspendCapture eager;
    call_op_out(op, std::move(inputs), std::move(attrs), outputs);
    return;
  }
  OpCall call(&op, inputs, attrs);
  std::vector<TensorMeta> metas = op.meta(call);
  kiln::detail::check_out_targets(op, metas, outputs);

  // May capture clones of inputs that alias a target.
  autograd::InplaceRecording recording = autograd::begin_inplace_recording(op, inputs, outputs);

  Segment& seg = cap.pending();
  if (seg.guide) derail(seg);  // in-place calls are captured as they are
  std::vector<int> in_ids = value_ids(seg, inputs);
  std::vector<int> out_ids = value_ids(seg, outputs);
  int node = append_node(seg, op, std::move(in_ids), attrs, /*inplace=*/true);
  seg.graph.nodes[node].outputs = std::move(out_ids);
  if (cap.trace_ops) seg.record_stack(static_cast<size_t>(node));
  if (!op.runtime_attrs.empty()) cap.random = true;

  for (Tensor& out : outputs) bump_version(out);
  if (op.mutates(OpCall(&op, inputs, attrs)))
    for (int i : op.mutated_input_indices(inputs.size(), attrs))
      if (inputs[i].defined()) bump_version(inputs[i]);
  if (recording.record) {
    cap.autograd = true;
    autograd::record(op, recording.node_inputs, attrs, outputs, recording.overwritten);
    tag_autograd_nodes(cap, outputs);
  }
}

// ---- flush ----

Tensor tensor_on(std::shared_ptr<Storage> storage, const ValueInfo& v) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->sizes = v.sizes;
  impl->strides = v.strides;
  impl->storage_offset = v.storage_offset;
  impl->dtype = v.dtype;
  impl->device = v.device;
  impl->refresh_metadata();
  return Tensor(std::move(impl));
}

// Moves `result`'s buffer into the pending storage of a lazy value (or copies it there when the
// backend returned memory it does not own exclusively, or in another layout).
void bind(Storage& pending, const ValueInfo& v, const Tensor& result, size_t k) {
  if (!result.defined() || !(result.sizes() == IntArrayRef(v.sizes)) || result.dtype() != v.dtype ||
      result.device() != v.device) {
    throw CompileError("[kiln::compile] the backend returned " +
                       (result.defined() ? std::string(dtype_name(result.dtype())) + shape_str(result.sizes())
                                         : std::string("an undefined tensor")) +
                       " for graph output " + std::to_string(k) + ", which was captured as " +
                       std::string(dtype_name(v.dtype)) + shape_str(v.sizes) +
                       ". A backend must return one tensor per graph output with the captured metadata.");
  }
  const std::shared_ptr<Storage>& rs = result.impl().storage;
  bool same_layout = result.strides() == IntArrayRef(v.strides) && result.storage_offset() == v.storage_offset;
  if (same_layout && rs.use_count() == 1 && rs->free_fn != nullptr && rs->nbytes >= pending.nbytes) {
    pending.data = rs->data;
    pending.nbytes = rs->nbytes;
    pending.free_fn = rs->free_fn;
    pending.free_context = rs->free_context;
    rs->free_fn = nullptr;  // ownership moved
    return;
  }
  auto fresh = kiln::detail::allocate_storage(pending.nbytes, v.device);
  pending.data = fresh->data;
  pending.free_fn = fresh->free_fn;
  pending.free_context = fresh->free_context;
  fresh->free_fn = nullptr;
  SuspendCapture suspend;
  NoGradGuard no_grad;
  kiln::detail::WritesAlreadyCounted counted;  // filling a value's storage creates it; it is not a write
  // A non-owning alias of the pending storage, laid out as recorded.
  tensor_on(std::shared_ptr<Storage>(std::shared_ptr<Storage>(), &pending), v).copy_(result);
}

// bind() for an output whose layout is free (Graph::free_layout_outputs): a result in another dense
// layout (a channels-last activation) is adopted as it is, and the saved handles that hold the
// value take its strides. Only saved tensors of autograd hold those handles (split_recomputed
// checked), so nobody sees the layout change.
void bind_free_layout(const std::vector<std::shared_ptr<TensorImpl>>& handles, Storage& pending,
                      const ValueInfo& v, const Tensor& result, size_t k) {
  const bool other_layout = result.defined() && result.sizes() == IntArrayRef(v.sizes) &&
                            result.dtype() == v.dtype && result.device() == v.device &&
                            (result.strides() != IntArrayRef(v.strides) || result.storage_offset() != v.storage_offset) &&
                            kiln::detail::storage_span(result.sizes(), result.strides()) == result.numel();
  if (!other_layout) return bind(pending, v, result, k);
  ValueInfo adopted = v;
  adopted.strides = result.strides().vec();
  adopted.storage_offset = 0;
  if (result.storage_offset() != 0) {  // a view into a larger buffer: a dense copy of its own
    Tensor dense = kiln::detail::make_empty_strided(result.sizes().vec(), adopted.strides, result.dtype(), result.device());
    {
      SuspendCapture suspend;
      NoGradGuard no_grad;
      kiln::detail::WritesAlreadyCounted counted;
      dense.copy_(result);
    }
    bind(pending, adopted, dense, k);
  } else {
    bind(pending, adopted, result, k);
  }
  for (const auto& impl : handles) {
    impl->strides = adopted.strides;
    impl->storage_offset = 0;
  }
}

void CaptureContext::flush(bool end_of_call, std::string_view reason, const CallSite* site) {
  if (!fn) {  // trace_graph(): a traced function may not read data
    throw CompileError("[kiln::compile] a traced function (a decomposition) broke the graph: " +
                       std::string(reason.empty() ? "end of trace" : reason) +
                       ". Decompositions must be written with tensor ops only.");
  }
  if (!end_of_call) {
    ++breaks;
    counter_set().graph_breaks.fetch_add(1, std::memory_order_relaxed);
    BreakReason br;
    br.reason = std::string(reason);
    if (site) {
      br.file = relative_path(site->file);
      br.line = site->line;
      br.function = site->function;
    }
    if (fn->options.fullgraph) {
      throw GraphBreakError("[kiln::compile] graph break in " + fn->where() + " with fullgraph=true: " + br.reason +
                            (site ? " at " + br.where() : std::string()) +
                            ". Move the break out of the compiled function, or compile without fullgraph.");
    }
    if (log_options().graph_breaks) {
      log_stream() << "[kiln.compile] Graph break in user code at " << (site ? br.where() : "<unknown>")
                   << "\nReason: " << br.reason << "\n";
    }
    if (explain) {
      std::lock_guard lock(explain->mutex);
      explain->out.break_reasons.push_back(br);
    }
    if (compile_trace_on()) {
      nlohmann::json event = function_json(*fn);
      if (site) event.update(call_site_json(*site));
      if (entry) event["entry"] = entry->id;
      event["reason"] = br.reason;
      trace_event("graph_break", std::move(event));
    }
  }
  if (!segment || segment->empty()) return;

  std::shared_ptr<Segment> seg = std::move(segment);
  segment.reset();
  Graph& graph = seg->graph;
  // Outputs: every buffer still referenced from outside the segment.
  std::vector<int> outputs;
  std::vector<std::shared_ptr<Storage>> live;
  for (const auto& p : seg->pending) {
    if (auto s = p.storage.lock()) {
      outputs.push_back(p.value);
      live.push_back(std::move(s));
    }
  }
  // A guided capture that followed its guide to the end runs the compiled graph its numbers name;
  // else it becomes an ordinary capture here.
  std::shared_ptr<CompiledGraph> compiled;
  if (seg->guide) {
    compiled = guided_graph(*fn, *seg, outputs);
    if (!compiled) derail(*seg);
  }
  std::vector<RecomputedValue> recomputed;
  std::vector<std::vector<std::shared_ptr<TensorImpl>>> free_handles;  // per output (free layouts)
  std::vector<Attr> scalars;
  if (compiled) {
    scalars = std::move(seg->guided.scalars);
  } else {
    graph.outputs = std::move(outputs);
    // The min-cut partition: values only autograd saved, cheap to recompute, are not outputs.
    if (!seg->autograd_nodes.empty() && backend_has_tag(backend, "aot_autograd"))
      recomputed = split_recomputed(*seg, live, free_handles);
    scalars.reserve(graph.scalars.size());
    for (const ScalarSlot& s : graph.scalars) scalars.push_back(graph.nodes[s.node].attrs[s.attr]);
  }
  // The values' layouts: the captured graph's, or the compiled graph's (the same numbers).
  const Graph& shapes = compiled ? compiled->graph : graph;
  const std::vector<int>& output_ids = compiled ? outputs : graph.outputs;
  Arguments args{seg->inputs, scalars};

  std::vector<Tensor> results;
  try {
    // Backends and compiled graphs run ordinary ops; none of them belongs to the user's capture.
    SuspendCapture suspend;
    if (!compiled) {
      compiled = find_or_compile(*this, graph, structure_hash(graph), args, &seg->node_stacks);
      remember_guide(compiled);
    }
    {
      NoGradGuard no_grad;
      kiln::detail::WritesAlreadyCounted counted;  // the capture counted the graph's writes
      kiln::detail::GraphRunSpans timeline(compiled->id, "", seg->inputs);
      std::optional<TraceGraphScope> traced;  // events of the run (a CUDA graph's recording) name it
      if (compile_trace_on()) traced.emplace(compiled->id);
      results = compiled->fn(args);
    }
    counter_set().graph_runs.fetch_add(1, std::memory_order_relaxed);
    if (results.size() != output_ids.size()) {
      throw CompileError("[kiln::compile] the compiled graph " + compiled->id + " returned " +
                         std::to_string(results.size()) + " tensors for " + std::to_string(output_ids.size()) +
                         " outputs. A backend's callable must return one tensor per graph output.");
    }
    for (size_t k = 0; k < results.size(); ++k) {
      if (shapes.output_layout_free(k) && k < free_handles.size())
        bind_free_layout(free_handles[k], *live[k], shapes.values[output_ids[k]], results[k], k);
      else bind(*live[k], shapes.values[output_ids[k]], results[k], k);
    }
    if (const FlushObserver* observer = t_flush_observer) {
      std::vector<const Storage*> bound;
      for (const auto& s : live) bound.push_back(s.get());
      (*observer)(bound);
    }
    if (!recomputed.empty()) {
      attach_recipes(seg, recomputed, live);
      const auto saved_values = std::count_if(recomputed.begin(), recomputed.end(),
                                              [](const RecomputedValue& r) { return !r.handles.empty(); });
      counter_set().recomputed_values.fetch_add(saved_values, std::memory_order_relaxed);
    }
    last_graph = std::move(compiled);
  } catch (const std::exception& e) {
    seg->state = Segment::State::failed;
    seg->failure = e.what();
    throw;
  }
  results.clear();
  seg->state = Segment::State::done;
  for (auto& w : seg->lazy)
    if (auto impl = w.lock(); impl && impl->lazy && impl->lazy->segment == seg && !impl->lazy->recipe) impl->lazy.reset();
  last_output_storages.clear();
  for (const auto& s : live) last_output_storages.push_back(s.get());
  last_inputs = std::move(seg->inputs);
  last_scalars = std::move(scalars);
  last_outputs = output_ids;
  ++flushes;
  // Reuse the segment's allocations when nothing else refers to it.
  if (seg.use_count() == 1) {
    seg->clear();
    segment = std::move(seg);
    take_guide(*segment);
  }
}

void CaptureContext::take_guide(Segment& seg) {
  if (!fn || !entry || explain || !guided_capture_enabled()) return;
  std::lock_guard lock(fn->mutex);
  if (static_cast<size_t>(flushes) < entry->guides.size()) {
    const std::shared_ptr<const Guide>& g = entry->guides[flushes];
    if (g && g->graph->backend == backend) seg.guide = g;
  }
}

void CaptureContext::remember_guide(const std::shared_ptr<CompiledGraph>& cg) {
  if (!fn || !entry || cg->id == "eager" || !guided_capture_enabled()) return;
  std::lock_guard lock(fn->mutex);
  std::vector<std::shared_ptr<const Guide>>& guides = entry->guides;
  if (guides.size() <= static_cast<size_t>(flushes)) guides.resize(static_cast<size_t>(flushes) + 1);
  if (guides[flushes] && guides[flushes]->graph == cg) return;
  auto guide = std::make_shared<Guide>();
  guide->graph = cg;
  guide->family = cg->dynamic_graph.lock();
  guides[flushes] = std::move(guide);
}

void CaptureContext::abandon(const std::string& why) {
  if (!segment) return;
  segment->state = Segment::State::failed;
  segment->failure = why;
  segment.reset();
}

void host_read(std::string_view what) {
  CaptureContext* cap = t_capture;
  if (!cap) return;
  cap->host_reads = true;
  // A break even when nothing is pending: fullgraph and explain report it, as Dynamo does.
  std::optional<CallSite> site;
  if (cap->record_stacks) site = user_call_site(capture_stack());
  cap->flush(false, "host read: " + std::string(what), site ? &*site : nullptr);
}

void library_graph_break(std::string_view reason) {
  CaptureContext* cap = t_capture;
  if (!cap) return;
  std::optional<CallSite> site;
  if (cap->record_stacks) site = user_call_site(capture_stack());
  cap->flush(false, std::string(reason), site ? &*site : nullptr);
}

void materialize(const TensorImpl& impl) {
  if (!impl.lazy) return;
  if (impl.lazy->recipe) {
    if (!impl.storage->data) materialize_recipe(impl);
    return;
  }
  Segment& seg = *impl.lazy->segment;
  if (seg.state == Segment::State::done) return;
  CaptureContext* cap = t_capture;
  if (seg.state == Segment::State::pending && cap && cap->segment.get() == &seg) {
    host_read("data access");
    return;
  }
  if (seg.state == Segment::State::pending && seg.thread == std::this_thread::get_id()) {
    throw Error(
        "[kiln::compile] a lazy tensor was read while its compiled call was suspended (inside "
        "compiler::disable or an eager fallback) before its graph ran. This is a Kiln bug; please report it.");
  }
  throw_unusable(seg);
}

// ---- tracing (decompositions) ----

Graph trace_graph(const std::vector<ValueInfo>& inputs,
                  const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn) {
  CaptureContext ctx;  // no FunctionState: nothing may flush
  auto seg = std::make_shared<Segment>();
  ctx.segment = seg;
  std::vector<Tensor> args;
  args.reserve(inputs.size());
  for (const ValueInfo& v : inputs) {
    TensorMeta m{v.sizes, v.strides, v.dtype, v.device, v.storage_offset};
    Tensor t = make_pending(std::move(m));
    t.impl().is_wrapped_number = v.is_wrapped_number;
    value_of(*seg, t);  // placeholder k
    args.push_back(std::move(t));
  }
  std::vector<Tensor> outs;
  {
    NoGradGuard no_grad;
    CaptureScope scope(&ctx);
    outs = fn(args);
  }
  Graph g = std::move(seg->graph);
  // Host scalars the function wrapped into tensors are constants of the graph, not inputs.
  for (size_t k = inputs.size(); k < g.inputs.size(); ++k) {
    const Tensor& t = seg->inputs[k];
    KILN_CHECK(t.impl().is_wrapped_number, CompileError,
               "[kiln::compile] a traced function used a tensor other than its inputs (only host scalars "
               "may be captured in decompositions).");
    g.values[g.inputs[k]].is_input = false;
    g.constants.emplace_back(g.inputs[k], t);
  }
  g.inputs.resize(inputs.size());
  for (const Tensor& t : outs) {
    KILN_CHECK(t.defined(), CompileError, "[kiln::compile] a traced function returned an undefined tensor.");
    const TensorImpl& impl = t.impl();
    int id = -1;
    if (impl.lazy && impl.lazy->segment == seg) id = impl.lazy->value;
    else if (auto it = seg->input_ids.find(&impl); it != seg->input_ids.end()) id = it->second;
    KILN_CHECK(id >= 0, CompileError,
               "[kiln::compile] a traced function returned a tensor it did not compute from its inputs.");
    g.outputs.push_back(id);
  }
  return g;
}

// ---- structural equality (cache hits) ----
//
// Two graphs are one dynamic graph when they differ only in sizes, strides, storage offsets and
// integer attrs (a view's sizes, a slice's bounds, an integer argument): the ops, their order and
// wiring, dtypes, devices, ranks, aliasing and every other attr agree. Compiling one instance per
// concrete size stays correct whatever differs in those numbers; the kiln backend's kernels take
// them as run-time arguments, so the instances share their generated code.

namespace {

// same_structure (sizes: true) and same_family (sizes: false, where sizes, strides, offsets and
// integer attrs may differ, integer lists only in their values).
bool same_graph(const Graph& a, const Graph& b, bool sizes) {
  if (a.nodes.size() != b.nodes.size() || a.values.size() != b.values.size() || a.inputs != b.inputs ||
      a.outputs != b.outputs || a.scalars.size() != b.scalars.size())
    return false;
  for (size_t k = 0; k < a.outputs.size(); ++k)
    if (a.output_layout_free(k) != b.output_layout_free(k)) return false;
  for (size_t i = 0; i < a.values.size(); ++i) {
    const ValueInfo& x = a.values[i];
    const ValueInfo& y = b.values[i];
    if (x.dtype != y.dtype || x.device != y.device || x.storage != y.storage || x.is_input != y.is_input ||
        x.is_wrapped_number != y.is_wrapped_number)
      return false;
    if (sizes ? x.sizes != y.sizes || x.strides != y.strides || x.storage_offset != y.storage_offset
              : x.sizes.size() != y.sizes.size())
      return false;
  }
  for (size_t i = 0; i < a.nodes.size(); ++i) {
    const Node& x = a.nodes[i];
    const Node& y = b.nodes[i];
    if (x.op != y.op || x.inplace != y.inplace || x.inputs != y.inputs || x.outputs != y.outputs ||
        x.attrs.size() != y.attrs.size())
      return false;
    for (size_t k = 0; k < x.attrs.size(); ++k)
      if (!attr_matches(*x.op, x.attrs[k], y.attrs[k], k, sizes)) return false;
  }
  return true;
}

}  // namespace

bool same_structure(const Graph& a, const Graph& b) { return same_graph(a, b, true); }

bool same_family(const Graph& a, const Graph& b) { return same_graph(a, b, false); }

std::vector<int64_t> size_signature(const Graph& g) {
  std::vector<int64_t> sig;
  sig.reserve(g.values.size() * 7 + g.nodes.size() * 2);
  for (const ValueInfo& v : g.values) {
    sig.insert(sig.end(), v.sizes.begin(), v.sizes.end());
    sig.insert(sig.end(), v.strides.begin(), v.strides.end());
    sig.push_back(static_cast<int64_t>(v.strides.size()));  // same_family compares only the rank
    sig.push_back(v.storage_offset);
  }
  for (const Node& n : g.nodes) {
    for (size_t k = 0; k < n.attrs.size(); ++k) {
      const Attr& a = n.attrs[k];
      if (!size_like(a) || is_dynamic_attr(*n.op, a, k)) continue;
      if (auto* i = std::get_if<int64_t>(&a)) sig.push_back(*i);
      else {
        const auto& list = std::get<std::vector<int64_t>>(a);
        sig.insert(sig.end(), list.begin(), list.end());
      }
    }
  }
  return sig;
}

uint64_t family_hash(const Graph& g) {
  uint64_t h = kSegmentHashSeed;
  mix(h, g.values.size());
  for (const ValueInfo& v : g.values) {
    mix(h, static_cast<uint64_t>(v.dtype));
    mix_device(h, v.device);
    mix(h, v.sizes.size());
    mix(h, static_cast<uint64_t>(v.storage + 1));
    mix(h, v.is_input);
  }
  for (const Node& n : g.nodes) {
    mix(h, reinterpret_cast<uintptr_t>(n.op));
    mix(h, n.inplace);
    for (int v : n.inputs) mix(h, static_cast<uint64_t>(v));
    for (int v : n.outputs) mix(h, static_cast<uint64_t>(v));
    for (size_t k = 0; k < n.attrs.size(); ++k) {
      const Attr& a = n.attrs[k];
      if (size_like(a)) mix(h, a.index());
      else mix_attr(h, a, is_dynamic_attr(*n.op, a, k));
    }
  }
  for (int v : g.inputs) mix(h, static_cast<uint64_t>(v));
  for (size_t k = 0; k < g.outputs.size(); ++k) mix(h, static_cast<uint64_t>(g.outputs[k]) * 2 + g.output_layout_free(k));
  return h;
}

uint64_t structure_hash(const Graph& g) {
  uint64_t h = kSegmentHashSeed;
  mix(h, g.values.size());
  for (const ValueInfo& v : g.values) mix_value(h, v);
  for (const Node& n : g.nodes) {
    mix(h, reinterpret_cast<uintptr_t>(n.op) ^ static_cast<uint64_t>(n.inplace) ^ n.attrs.size() << 56);
    uint64_t wiring = n.inputs.size() + (n.outputs.size() << 32);
    for (size_t i = 0; i < n.inputs.size(); ++i) wiring += (static_cast<uint64_t>(n.inputs[i]) + 1) * (0x9e3779b97f4a7c15ull + 2 * i);
    for (size_t i = 0; i < n.outputs.size(); ++i) wiring += (static_cast<uint64_t>(n.outputs[i]) + 1) * (0xc2b2ae3d27d4eb4full + 2 * i);
    mix(h, wiring);
    for (size_t k = 0; k < n.attrs.size(); ++k) mix_attr(h, n.attrs[k], is_dynamic_attr(*n.op, n.attrs[k], k));
  }
  mix(h, 0x3c);
  for (int v : g.inputs) mix(h, static_cast<uint64_t>(v));
  mix(h, 0x3d);
  for (size_t k = 0; k < g.outputs.size(); ++k) mix(h, static_cast<uint64_t>(g.outputs[k]) * 2 + g.output_layout_free(k));
  return h;
}

std::shared_ptr<CompiledGraph> guided_graph(FunctionState& st, const Segment& seg, const std::vector<int>& outputs) {
  const Guide& guide = *seg.guide;
  const Graph& g = guide.graph->graph;
  const Segment::Guided& gd = seg.guided;
  if (gd.nodes != g.nodes.size() || gd.values != g.values.size() || seg.inputs.size() != g.inputs.size() ||
      outputs != g.outputs || !seg.autograd_nodes.empty())
    return nullptr;
  // size_signature's numbers, in the two parts the capture collected them in.
  auto signature_is = [&](const std::vector<int64_t>& sizes) {
    const size_t n = gd.value_numbers.size();
    return sizes.size() == n + gd.attr_numbers.size() && std::equal(gd.value_numbers.begin(), gd.value_numbers.end(), sizes.begin()) &&
           std::equal(gd.attr_numbers.begin(), gd.attr_numbers.end(), sizes.begin() + static_cast<std::ptrdiff_t>(n));
  };
  std::shared_ptr<CompiledGraph> cg;
  {
    std::lock_guard lock(st.mutex);
    if (guide.family) {
      auto& inst = guide.family->instances;
      for (size_t i = inst.size(); i-- > 0;) {  // most recently used last
        if (signature_is(inst[i]->sizes)) {
          cg = inst[i];
          std::rotate(inst.begin() + static_cast<std::ptrdiff_t>(i), inst.begin() + static_cast<std::ptrdiff_t>(i) + 1, inst.end());
          break;
        }
      }
    } else if (signature_is(guide.graph->sizes)) {
      cg = guide.graph;
    }
  }
  if (!cg) return nullptr;
  {
    std::lock_guard lock(cg->mutex);  // (one still compiling, or failed: the ordinary path decides)
    if (!cg->ready || cg->error) return nullptr;
  }
  counter_set().graph_cache_hits.fetch_add(1, std::memory_order_relaxed);
  counter_set().guided_captures.fetch_add(1, std::memory_order_relaxed);
  return cg;
}

}  // namespace kiln::compiler::detail
