// One call of a compiled callable: stance, frame guards, capture, graph cache, pure replay
// (DESIGN §2.3-2.4; the per-stance table of spec §1.3).
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <unordered_map>

#include "autograd/node.h"
#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "core/dispatch.h"
#include "core/profiler.h"
#include "core/progress.h"
#include "compiler/export/repro.h"
#include "compiler/graph/format.h"
#include "compiler/graph/passes.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/autograd.h"

namespace kiln::compiler::detail {

namespace {

std::atomic<int> g_next_frame_id{0};
thread_local const CompileOptions* t_compiling_options = nullptr;
thread_local int t_disabled_depth = 0;  // inside disable(fn, recursive=true)

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

std::string relative_path(const std::string& path) {
  std::error_code ec;
  auto rel = std::filesystem::relative(path, std::filesystem::current_path(ec), ec);
  if (ec || rel.empty() || rel.native().rfind("..", 0) == 0) return path;
  return rel.string();
}

namespace {

void run_eager(CallHooks& hooks) {
  counter_set().eager_frames.fetch_add(1, std::memory_order_relaxed);
  SuspendCapture eager;
  hooks.body();
}

std::string fail_on_recompile_message(const FunctionState& st, const std::vector<std::string>& reasons) {
  std::string m = "Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: '" + st.file +
                  "', function name: '" + st.name + "', line number: " + std::to_string(st.line);
  if (!reasons.empty()) {
    m += "\n    triggered by the following guard failure(s):";
    for (const auto& r : reasons) m += "\n    - " + r;
  }
  return m;
}

// Entries compiled for the same module/optimizer objects as this call (Dynamo counts the
// recompile limit per ID_MATCH'd object group, so each module instance gets its own budget).
int entries_for_same_objects(const FunctionState& st, const std::vector<Leaf>& leaves) {
  int n = 0;
  for (const auto& e : st.entries) {
    const auto& g = e->guards.leaves;
    bool same = g.size() == leaves.size();
    for (size_t i = 0; same && i < g.size(); ++i)
      if ((leaves[i].kind == Leaf::module || leaves[i].kind == Leaf::optimizer) && g[i].object != leaves[i].object)
        same = false;
    n += same;
  }
  return n;
}

void check_epoch(FunctionState& st) {
  uint64_t epoch = reset_epoch();
  if (st.reset_epoch == epoch) return;
  st.entries.clear();
  st.backward_entry.reset();
  st.graphs.clear();
  st.families.clear();
  st.seen_sizes.clear();
  st.changed_dims.clear();
  st.graph_counter = 0;
  st.sightings = 0;
  st.limit_warned = false;
  st.graph_limit_warned = false;
  st.reset_epoch = epoch;
  st.frame_id = g_next_frame_id.fetch_add(1, std::memory_order_relaxed);  // numbered afresh after reset()
}

}  // namespace

// ---- pure replay ----

namespace {
// The value of a wrapped host scalar (a 0-dim CPU tensor), read without a graph break.
Scalar read_scalar(const Tensor& t) {
  SuspendCapture eager;
  return t.item();
}
}  // namespace

namespace {
// A tensor the call left behind, as a graph output: the output itself or a view of its storage
// (a bias gradient is `sum_to`'s [1, C] result viewed as [C]).
struct OutputRef {
  int output = -1;
  bool view = false;  // then sizes, strides and the storage offset relative to the output's
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  bool operator==(const OutputRef&) const = default;
};
}  // namespace

struct FrameEntry::Replay {
  std::shared_ptr<CompiledGraph> graph;
  struct Input {
    int leaf = -1;          // an argument leaf, or
    Tensor fixed;           // a tensor the body captured from elsewhere (closure, module), or
    bool constant = false;  // a host scalar the body wrapped (fixed holds its value)
    // An argument the body wrote in place with autograd recording (it left the call with a
    // grad_fn, which a backward inside the call spent): a replay gives it a stand-in with that
    // name and marks it as requiring grad, as the body did.
    std::shared_ptr<autograd::SpentNode> history;
    // The graph writes this input's memory: a replay bumps its version counter, as the body's
    // in-place calls did when they were captured (generated kernels that store into an input
    // count nothing themselves).
    bool written = false;
  };
  std::vector<Input> inputs;
  std::vector<Attr> scalars;
  struct Result {
    OutputRef output;  // a graph output (or a view of one), or
    int leaf = -1;    // an argument leaf, or
    Tensor fixed;     // a fixed tensor; non-tensor leaves come from `consts`
    // A graph output whose captured tensor had a grad_fn (a backward inside the call freed it):
    // the replayed result gets a stand-in with its name.
    std::shared_ptr<autograd::SpentNode> spent;
  };
  std::vector<Result> results;
  // The .grad each input leaf that requires grad had when the call returned (a training step:
  // zero_grad, backward, optimizer step). A replay sets them again.
  struct GradSet {
    int input = -1;  // index into `inputs`
    // none: no gradient (zero_grad(set_to_none)); keep: the tensor it held before (accumulated
    // in place); output: the graph output (or view) `output`.
    enum class Kind { none, keep, output } kind = Kind::none;
    OutputRef output;
    bool operator==(const GradSet&) const = default;
  };
  std::vector<GradSet> grads;
  std::vector<Leaf> consts;
  std::vector<std::string> strings;
  bool confirmed = false;  // seen twice in a row: later calls replay

  // The same plan up to sizes: what a dynamic entry's capture at another size makes of a body
  // already confirmed stable (the instance, integer attrs and output view shapes may differ; which
  // inputs, results and gradients come from where may not).
  bool same_structure(const Replay& o) const {
    if (inputs.size() != o.inputs.size() || results.size() != o.results.size() || scalars.size() != o.scalars.size() ||
        grads.size() != o.grads.size())
      return false;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Input& a = inputs[i];
      const Input& b = o.inputs[i];
      if (a.leaf != b.leaf || a.constant != b.constant || !a.history != !b.history) return false;
      if (a.constant ? !(read_scalar(a.fixed) == read_scalar(b.fixed)) : !a.fixed.same(b.fixed)) return false;
    }
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& a = results[i];
      const Result& b = o.results[i];
      if (a.output.output != b.output.output || a.output.view != b.output.view || a.leaf != b.leaf ||
          !a.fixed.same(b.fixed) || !a.spent != !b.spent)
        return false;
    }
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i].input != o.grads[i].input || grads[i].kind != o.grads[i].kind ||
          grads[i].output.output != o.grads[i].output.output)
        return false;
    return true;
  }

  // The same plan exactly: the same structure, instance, scalar values, gradients and output views.
  bool same_plan(const Replay& o) const {
    if (graph != o.graph || scalars != o.scalars || grads != o.grads || !same_structure(o)) return false;
    for (size_t i = 0; i < results.size(); ++i)
      if (results[i].output != o.results[i].output) return false;
    return true;
  }
};

namespace {

// What a dynamic entry's plans are keyed by: each tensor argument's sizes, strides and offset,
// each number argument's value.
std::vector<int64_t> replay_key(const std::vector<Leaf>& leaves) {
  std::vector<int64_t> key;
  for (const Leaf& l : leaves) {
    switch (l.kind) {
      case Leaf::tensor: {
        if (!l.t.defined()) {
          key.push_back(-1);
          break;
        }
        const IntArrayRef sizes = l.t.sizes(), strides = l.t.strides();
        key.push_back(static_cast<int64_t>(sizes.size()));
        key.insert(key.end(), sizes.begin(), sizes.end());
        key.insert(key.end(), strides.begin(), strides.end());
        key.push_back(l.t.storage_offset());
        break;
      }
      case Leaf::integer:
      case Leaf::boolean: key.push_back(l.i); break;
      case Leaf::floating: key.push_back(std::bit_cast<int64_t>(l.d)); break;
      default: break;
    }
  }
  return key;
}

}  // namespace

namespace {

// The elements [first, last] a layout reaches in its storage (nothing when it has none).
std::optional<std::pair<int64_t, int64_t>> extent(const std::vector<int64_t>& sizes,
                                                  const std::vector<int64_t>& strides, int64_t offset) {
  int64_t lo = offset, hi = offset;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return std::nullopt;
    const int64_t reach = (sizes[d] - 1) * strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  return std::pair{lo, hi};
}

// Which graph output `t` is, or which output's elements it views. `found`: false when `t` is
// not on any output's storage; a view reaching past its output's elements is not replayable
// (the replay's copy of the output would not hold them).
std::optional<OutputRef> find_output(const CaptureContext& ctx, const Graph& g, const Tensor& t, bool& found) {
  const kiln::detail::TensorImpl* impl = t.unsafe_impl();
  found = false;
  std::optional<OutputRef> view;
  for (size_t k = 0; k < ctx.last_output_storages.size(); ++k) {
    if (impl->storage.get() != ctx.last_output_storages[k]) continue;
    found = true;
    const ValueInfo& v = g.values[g.outputs[k]];
    if (impl->sizes == v.sizes && impl->strides == v.strides && impl->storage_offset == v.storage_offset)
      return OutputRef{.output = static_cast<int>(k)};
    auto inner = extent(impl->sizes, impl->strides, impl->storage_offset);
    auto outer = extent(v.sizes, v.strides, v.storage_offset);
    if (!view && inner && outer && inner->first >= outer->first && inner->second <= outer->second &&
        impl->storage_offset >= v.storage_offset)
      view = OutputRef{.output = static_cast<int>(k), .view = true, .sizes = impl->sizes,
                       .strides = impl->strides, .offset = impl->storage_offset - v.storage_offset};
  }
  return view;
}

// The replay's tensor for `ref`: the output, or the view of it. An output returned with other
// strides than captured is first copied into the captured layout.
Tensor resolve_output(const std::vector<Tensor>& outs, const Graph& g, const OutputRef& ref) {
  const Tensor& out = outs.at(ref.output);
  if (!ref.view) return out;
  const ValueInfo& v = g.values[g.outputs[ref.output]];
  Tensor base = out;
  if (!(out.strides() == IntArrayRef(v.strides))) {
    base = kiln::detail::make_empty_strided(v.sizes, v.strides, v.dtype, v.device);
    base.copy_(out);
  }
  return kiln::detail::make_view(base, ref.sizes, ref.strides, base.storage_offset() + ref.offset);
}

// Whether a backward inside the call freed every autograd node the call recorded (or they are
// gone): then no history is left for a backward after the call, and replays need none.
bool history_consumed(const CaptureContext& ctx) {
  for (const auto& w : ctx.recorded_nodes) {
    std::shared_ptr<autograd::Node> n = w.lock();
    if (!n) continue;
    auto* op = dynamic_cast<autograd::OpNode*>(n.get());
    if (!op || !op->released) return false;
  }
  return true;
}

// Whether this call's capture recorded autograd node `n`.
bool recorded_by(const CaptureContext& ctx, const std::shared_ptr<autograd::Node>& n) {
  for (const auto& w : ctx.recorded_nodes)
    if (w.lock() == n) return true;
  return false;
}

// After a pure call: can later calls with the same guards skip the body? Only a capture of one
// graph with no host reads, no autograd history left for later (a backward inside the call may
// consume it: a training step), no random ops, whose every live output is part of the result or
// an input leaf's .grad, and the same plan on two calls in a row.
void analyze_for_replay(CaptureContext& ctx, FrameEntry& entry, const std::vector<Leaf>& leaves,
                        CallHooks& hooks) {
  std::lock_guard lock(entry.replay_mutex);
  auto reject = [&](const char* why) {
    if (log_options().perf_hints && !entry.hinted) {
      entry.hinted = true;
      log_stream() << "[kiln.compile] perf hint: " << ctx.fn->where()
                   << " is pure=true but cannot replay without running its body: " << why << "\n";
    }
    entry.replay.reset();
    entry.sized_replays.clear();
  };
  if (ctx.breaks != 0 || ctx.host_reads) return reject("the body has graph breaks or host reads");
  if (ctx.flushes != 1 || !ctx.last_graph) return reject("the body captured no single graph");
  if (ctx.autograd && !history_consumed(ctx))
    return reject("the body leaves autograd history for a backward after the call");
  if (ctx.random) return reject("the body draws random numbers");
  if (ctx.last_graph->id == "eager") return reject("the graph ran uncompiled (stance or limit)");
  auto plan = std::make_shared<FrameEntry::Replay>();
  plan->graph = ctx.last_graph;
  const Graph& g = ctx.last_graph->graph;
  std::unordered_map<const kiln::detail::TensorImpl*, int> leaf_of;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].kind == Leaf::tensor) leaf_of.emplace(leaves[i].t.unsafe_impl(), static_cast<int>(i));
  for (const Tensor& t : ctx.last_inputs) {
    FrameEntry::Replay::Input in;
    if (auto it = leaf_of.find(t.unsafe_impl()); it != leaf_of.end()) {
      in.leaf = it->second;
      if (std::shared_ptr<autograd::Node> fn = t.grad_fn(); fn && recorded_by(ctx, fn)) {
        in.history = std::make_shared<autograd::SpentNode>();
        in.history->label = fn->name();
        in.history->output_shapes = fn->output_shapes;
      }
    } else {
      in.fixed = t;  // a host scalar made into a tensor by the body is new each call: compared by value
      in.constant = t.impl().is_wrapped_number;
    }
    plan->inputs.push_back(std::move(in));
  }
  {
    const std::vector<char> written = passes::internal::written_memory(g);
    for (size_t k = 0; k < plan->inputs.size() && k < g.inputs.size(); ++k)
      plan->inputs[k].written = g.inputs[k] >= 0 && written[g.inputs[k]];
  }
  plan->scalars = ctx.last_scalars;  // this capture's values (the cached graph holds the first capture's)
  std::vector<Leaf> result_leaves;
  if (hooks.result_leaves) hooks.result_leaves(result_leaves);
  std::vector<bool> output_used(g.outputs.size(), false);
  for (const Leaf& l : result_leaves) {
    FrameEntry::Replay::Result r;
    if (l.kind == Leaf::tensor) {
      const kiln::detail::TensorImpl* impl = l.t.unsafe_impl();
      bool on_output = false;
      if (std::optional<OutputRef> ref = find_output(ctx, g, l.t, on_output)) {
        r.output = *ref;
        output_used[ref->output] = true;
        if (std::shared_ptr<autograd::Node> fn = l.t.grad_fn()) {
          r.spent = std::make_shared<autograd::SpentNode>();
          r.spent->label = fn->name();
          r.spent->output_shapes = fn->output_shapes;
        }
      } else {
        if (auto it = leaf_of.find(impl); it != leaf_of.end()) {
          r.leaf = it->second;
        } else if (!on_output && !l.t.impl().lazy) {
          r.fixed = l.t;
        } else {
          return reject("the result holds a view past a graph output's elements");
        }
      }
    }
    plan->results.push_back(std::move(r));
    plan->consts.push_back(l);
    plan->strings.push_back(l.kind == Leaf::string ? *l.s : std::string());
  }
  for (size_t k = 0; k < ctx.last_inputs.size(); ++k) {
    const Tensor& t = ctx.last_inputs[k];
    if (!t.requires_grad() || !t.is_leaf()) continue;
    FrameEntry::Replay::GradSet set{.input = static_cast<int>(k)};
    const Tensor grad = t.grad();
    if (grad.defined()) {
      bool on_output = false;
      if (std::optional<OutputRef> ref = find_output(ctx, g, grad, on_output)) {
        set.kind = FrameEntry::Replay::GradSet::Kind::output;
        set.output = *ref;
        output_used[ref->output] = true;
      } else if (on_output || grad.impl().lazy) {
        return reject("a .grad holds a view past a graph output's elements");
      } else {
        set.kind = FrameEntry::Replay::GradSet::Kind::keep;
      }
    }
    plan->grads.push_back(set);
  }
  for (bool used : output_used)
    if (!used) return reject("a graph output is kept somewhere other than the result or a .grad");
  for (Leaf& c : plan->consts) {
    c.t = Tensor();
    c.s = nullptr;
  }
  if (!entry.dynamic) {
    if (entry.replay && entry.replay->same_plan(*plan)) {
      entry.replay->confirmed = true;
    } else {
      entry.replay = std::move(plan);
    }
    return;
  }
  // A dynamic entry: this size's plan is confirmed by a second identical capture at this size, or
  // by a capture at another size that made a plan of the same structure (both are then confirmed:
  // two captures agreed, which is what confirming asks of a static entry's plan).
  std::vector<int64_t> key = replay_key(leaves);
  auto& plans = entry.sized_replays;
  auto it = std::find_if(plans.begin(), plans.end(), [&](const auto& p) { return p.first == key; });
  if (it != plans.end() && it->second->same_plan(*plan)) {
    it->second->confirmed = true;
    std::rotate(it, it + 1, plans.end());
    return;
  }
  for (auto& [other_key, other] : plans) {
    if (other_key != key && other->same_structure(*plan)) {
      other->confirmed = true;
      plan->confirmed = true;
    }
  }
  if (it != plans.end()) plans.erase(it);
  plans.emplace_back(std::move(key), std::move(plan));
  if (plans.size() > FrameEntry::kMaxSizedReplays) plans.erase(plans.begin());
}

// Runs a confirmed plan. Returns false when a fixed input changed (the caller runs the body).
bool replay(FrameEntry& entry, std::vector<Leaf>& leaves, CallHooks& hooks) {
  std::shared_ptr<FrameEntry::Replay> plan;
  if (entry.dynamic) {
    const std::vector<int64_t> key = replay_key(leaves);
    std::lock_guard lock(entry.replay_mutex);
    auto& plans = entry.sized_replays;
    auto it = std::find_if(plans.begin(), plans.end(), [&](const auto& p) { return p.first == key; });
    if (it == plans.end() || !it->second->confirmed) return false;
    plan = it->second;
    std::rotate(it, it + 1, plans.end());
  } else {
    std::lock_guard lock(entry.replay_mutex);
    if (!entry.replay || !entry.replay->confirmed) return false;
    plan = entry.replay;
  }
  const Graph& g = plan->graph->graph;
  std::vector<Tensor> inputs;
  inputs.reserve(plan->inputs.size());
  for (size_t k = 0; k < plan->inputs.size(); ++k) {
    const auto& in = plan->inputs[k];
    if (in.leaf >= 0) {
      // A dynamic entry's plan is its size's (replay_key); this only double-checks that the
      // instance's placeholders have these sizes.
      const Tensor& t = leaves[in.leaf].t;
      const ValueInfo& v = g.values[g.inputs[k]];
      if (entry.dynamic && (!(t.sizes() == IntArrayRef(v.sizes)) || !(t.strides() == IntArrayRef(v.strides))))
        return false;
      inputs.push_back(t);
    } else {
      const ValueInfo& v = g.values[g.inputs[k]];
      const Tensor& t = in.fixed;
      if (!(t.sizes() == IntArrayRef(v.sizes)) || !(t.strides() == IntArrayRef(v.strides)) || t.dtype() != v.dtype)
        return false;
      inputs.push_back(t);
    }
  }
  std::vector<Tensor> outs;
  {
    SuspendCapture suspend;
    NoGradGuard no_grad;
    kiln::detail::GraphRunSpans timeline(plan->graph->id, " (replay)", inputs);
    outs = plan->graph->fn(Arguments{inputs, plan->scalars});
  }
  for (size_t k = 0; k < plan->inputs.size(); ++k)
    if (plan->inputs[k].written) kiln::detail::bump_version(inputs[k]);
  for (size_t k = 0; k < plan->inputs.size(); ++k) {
    if (const auto& history = plan->inputs[k].history) {
      inputs[k].impl().requires_grad = true;
      autograd::meta(inputs[k]).grad_fn = history;
    }
  }
  using GradKind = FrameEntry::Replay::GradSet::Kind;
  for (const auto& set : plan->grads) {
    if (set.kind == GradKind::output) inputs[set.input].set_grad(resolve_output(outs, g, set.output));
    else if (set.kind == GradKind::none) inputs[set.input].set_grad(Tensor());
  }
  std::vector<Tensor> tensors(plan->results.size());
  for (size_t i = 0; i < plan->results.size(); ++i) {
    const auto& r = plan->results[i];
    if (r.output.output >= 0) {
      tensors[i] = resolve_output(outs, g, r.output);
      if (r.spent) {
        // Each call's result gets its own handle (an earlier result may still be held).
        tensors[i] = tensors[i].detach();
        tensors[i].impl().requires_grad = true;
        autograd::meta(tensors[i]).grad_fn = r.spent;
      }
    } else if (r.leaf >= 0) {
      tensors[i] = leaves[r.leaf].t;
    } else {
      tensors[i] = r.fixed;
    }
  }
  std::vector<Leaf> consts = plan->consts;
  std::vector<std::string> strings = plan->strings;
  hooks.replay(tensors, consts, strings);
  counter_set().replays.fetch_add(1, std::memory_order_relaxed);
  counter_set().graph_runs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Runs the body under a capture context for `entry` and flushes at the end. On an exception the
// pending work still runs (as it would have in eager), unless the exception is the capture's own.
void capture_body(CaptureContext& ctx, const std::function<void()>& body) {
  CaptureScope scope(&ctx);
  try {
    body();
  } catch (const GraphBreakError&) {
    ctx.abandon("fullgraph=true found a graph break");
    throw;
  } catch (...) {
    try {
      ctx.flush(true, "", nullptr);
    } catch (...) {
      ctx.abandon("an exception left the compiled function");
    }
    throw;
  }
  ctx.flush(true, "", nullptr);
}

}  // namespace

std::string FunctionState::where() const { return "'" + name + "' (" + file + ":" + std::to_string(line) + ")"; }
int FunctionState::limit() const { return options.recompile_limit.value_or(recompile_limit()); }

std::shared_ptr<FunctionState> make_function_state(CompileOptions options, std::string default_name,
                                                   std::source_location loc, const void* fn_address) {
  check_log_settings();
  if (options.mode && !options.options.empty()) {
    throw CompileError(
        "[kiln::compile] Either mode or options can be specified, but both can't be specified at the same time.");
  }
  if (options.recompile_limit && *options.recompile_limit < 1) {
    throw ValueError("[kiln::compile] recompile_limit must be at least 1, got " +
                     std::to_string(*options.recompile_limit) + ".");
  }
  for (const auto& [key, value] : options.options) {
    if (key != "fallback_to_eager" && key != "layout_optimization") {
      throw CompileError("[kiln::compile] Unexpected optimization option " + key +
                         ", known options are [fallback_to_eager, layout_optimization].");
    }
    if (!std::holds_alternative<bool>(value)) {
      throw CompileError("[kiln::compile] Unexpected type of attr " + key + ", should be bool.");
    }
  }
  auto st = std::make_shared<FunctionState>();
  if (auto* fn = std::get_if<BackendFn>(&options.backend)) {
    KILN_CHECK(static_cast<bool>(*fn), ValueError, "[kiln::compile] the backend function is empty.");
    st->backend_fn = *fn;
    st->backend_name = "custom";
  } else {
    st->backend_name = std::get<std::string>(options.backend);
    if (st->backend_name.empty()) st->backend_name = default_backend();
    if (st->backend_name == "inductor") st->backend_name = "kiln";
    lookup_backend(st->backend_name);  // throws "Invalid backend: ..." now, not at the first call
  }
  if (options.name.empty() && fn_address) {
    // A plain function: its symbol names it ("bar", "ns::model").
    RawStack at;
    at.pcs[0] = const_cast<char*>(static_cast<const char*>(fn_address)) + 1;  // resolved as a return address
    at.size = 1;
    std::string symbol = user_call_site(at).function;
    if (size_t sep = symbol.rfind("::"); sep != std::string::npos) symbol = symbol.substr(sep + 2);
    if (!symbol.empty()) default_name = symbol;
  }
  st->name = options.name.empty() ? std::move(default_name) : options.name;
  st->file = relative_path(loc.file_name());
  st->line = static_cast<int>(loc.line());
  st->frame_id = g_next_frame_id.fetch_add(1, std::memory_order_relaxed);
  st->options = std::move(options);
  st->reset_epoch = reset_epoch();
  return st;
}

bool pure(const FunctionState& state) { return state.options.pure; }

void reset_frame_ids() { g_next_frame_id.store(0, std::memory_order_relaxed); }

void run_call(FunctionState& st, std::vector<Leaf>& leaves, CallHooks& hooks) {
  CounterSet& counters = counter_set();
  counters.calls.fetch_add(1, std::memory_order_relaxed);
  if (active_capture()) {  // a nested compiled call inlines into the outer capture
    hooks.body();
    return;
  }
  if (t_disabled_depth > 0) return run_eager(hooks);
  StanceState stance = effective_stance();
  if (stance.stance == Stance::force_eager) return run_eager(hooks);
  std::string backend = st.backend_name;
  if (stance.stance == Stance::default_ && !stance.options.force_backend.empty())
    backend = stance.options.force_backend == "inductor" ? "kiln" : stance.options.force_backend;

  std::shared_ptr<FrameEntry> entry;
  {
    std::unique_lock lock(st.mutex);
    check_epoch(st);
    // skip_guard_eval_unsafe: only the checks that have told some entries apart (failed at least
    // once, in any entry), like Dynamo's diff guard manager.
    std::vector<char> differentiating;
    if (stance.options.skip_guard_eval_unsafe) {
      for (auto& e : st.entries) {
        size_t n = e->guards.leaves.size() + 1;
        if (differentiating.size() < n) differentiating.resize(n, 0);
        for (size_t i = 0; i < n; ++i)
          if (e->guards.fail_counts[i].load(std::memory_order_relaxed) > 0) differentiating[i] = 1;
      }
    }
    for (auto& e : st.entries) {
      if (check_guards(e->guards, leaves, backend, stance.options.skip_guard_eval_unsafe ? &differentiating : nullptr) < 0) {
        entry = e;
        break;
      }
    }
    if (!entry) {
      std::vector<std::string> names;
      if (hooks.leaf_names) hooks.leaf_names(names);
      std::vector<std::string> reasons;
      for (auto& e : st.entries) {
        int f = check_guards(e->guards, leaves, backend);
        if (f < 0) continue;  // only possible with skip_guard_eval_unsafe: count it as a miss anyway
        e->guards.fail_counts[f].fetch_add(1);  // f <= leaves + 1: the array has leaves + 2 slots
        reasons.push_back(std::to_string(st.frame_id) + "/" + std::to_string(e->id) + ": " +
                          describe_failure(e->guards, f, leaves, names));
      }
      const std::vector<std::vector<char>> dynamic = dynamic_dims(st, leaves, names);
      switch (stance.stance) {
        case Stance::eager_on_recompile:
          lock.unlock();
          return run_eager(hooks);
        case Stance::fail_on_recompile: throw RecompileError(fail_on_recompile_message(st, reasons));
        case Stance::eager_then_compile:
          if (st.sightings++ == 0) {
            lock.unlock();
            return run_eager(hooks);
          }
          break;
        case Stance::aot_eager_then_compile:
          if (st.sightings++ == 0) backend = "aot_eager";
          break;
        default: break;
      }
      if (entries_for_same_objects(st, leaves) >= st.limit()) {
        std::string msg = "kiln.compile hit config.recompile_limit (" + std::to_string(st.limit()) +
                          ")\n   function: " + st.where() + "\n   last reason: " +
                          (reasons.empty() ? std::string("Unable to find recompilation reasons") : reasons.front()) +
                          "\nTo log all recompilation reasons, use KILN_LOGS=recompiles.";
        if (st.options.fullgraph) {
          throw RecompileError("[kiln::compile] recompile_limit reached with fullgraph=true. " + msg);
        }
        notify_recompile(st, reasons);
        if (compile_trace_on()) {
          nlohmann::json event = function_json(st);
          event["limit"] = st.limit();
          event["reasons"] = reasons;
          trace_event("recompile_limit", std::move(event));
        }
        if (!st.limit_warned) {
          st.limit_warned = true;
          lock.unlock();
          warn(msg);
        } else {
          lock.unlock();
        }
        return run_eager(hooks);
      }
      entry = std::make_shared<FrameEntry>();
      entry->id = static_cast<int>(st.entries.size());
      entry->guards = build_guards(leaves, st.options.pure, backend, dynamic);
      check_marks_honoured(entry->guards, leaves, names);
      entry->dynamic = st.options.dynamic == true;
      for (const LeafGuard& lg : entry->guards.leaves) entry->dynamic |= !lg.dynamic.empty();
      st.entries.push_back(entry);
      counters.frame_compiles.fetch_add(1, std::memory_order_relaxed);
      if (!reasons.empty()) {
        notify_recompile(st, reasons);
        if (log_options().recompiles) {
          std::string m = "[kiln.compile] Recompiling function " + st.name + " in " + st.file + ":" +
                          std::to_string(st.line) + "\n    triggered by the following guard failure(s):";
          for (const auto& r : reasons) m += "\n    - " + r;
          log_stream() << m << "\n";
        }
      }
      if (log_options().guards) {
        std::string m = "[kiln.compile] [" + std::to_string(st.frame_id) + "/" + std::to_string(entry->id) +
                        "] guards for " + st.where() + ":";
        for (const auto& gtext : describe_guards(entry->guards, names)) m += "\n| +- " + gtext;
        log_stream() << m << "\n";
      }
      if (ExplainRecorder* ex = active_explain()) {
        std::lock_guard elock(ex->mutex);
        for (auto& gtext : describe_guards(entry->guards, names)) ex->out.out_guards.push_back(std::move(gtext));
      }
      if (compile_trace_on()) {
        nlohmann::json event = function_json(st);
        event["entry"] = entry->id;
        event["backend"] = backend;
        event["dynamic"] = entry->dynamic;
        event["recompile_reasons"] = reasons;
        event["guards"] = describe_guards(entry->guards, names);
        trace_event("frame_entry", std::move(event));
      }
    }
  }

  if (st.options.pure && replay(*entry, leaves, hooks)) return;

  CaptureContext ctx;
  ctx.fn = &st;
  ctx.entry = entry.get();
  ctx.backend = backend;
  ctx.stance = stance;
  ctx.leaves = &leaves;
  ctx.leaf_names = hooks.leaf_names;
  ctx.explain = active_explain();
  ctx.trace_ops = compile_trace_on();
  ctx.record_stacks = ctx.explain != nullptr || log_options().graph_breaks || st.options.fullgraph || ctx.trace_ops;
  capture_body(ctx, hooks.body);
  if (st.options.pure) analyze_for_replay(ctx, *entry, leaves, hooks);
}

void run_captured_backward(const std::shared_ptr<void>& owner, const std::function<void()>& run) {
  auto st = std::static_pointer_cast<FunctionState>(owner);
  StanceState stance = effective_stance();
  if (stance.stance == Stance::force_eager || t_disabled_depth > 0) {
    SuspendCapture eager;
    run();
    return;
  }
  std::shared_ptr<FrameEntry> entry;
  {
    std::lock_guard lock(st->mutex);
    check_epoch(*st);
    if (!st->backward_entry) {
      st->backward_entry = std::make_shared<FrameEntry>();
      st->backward_entry->backward = true;
      st->backward_entry->id = -1;
      if (compile_trace_on()) {
        nlohmann::json event = function_json(*st);
        event["entry"] = -1;
        event["backward"] = true;
        event["backend"] = st->backend_name;
        trace_event("frame_entry", std::move(event));
      }
    }
    entry = st->backward_entry;
  }
  CaptureContext ctx;
  ctx.fn = st.get();
  ctx.entry = entry.get();
  ctx.backend = st->backend_name;
  if (stance.stance == Stance::default_ && !stance.options.force_backend.empty())
    ctx.backend = stance.options.force_backend;
  ctx.stance = stance;
  ctx.explain = active_explain();
  ctx.trace_ops = compile_trace_on();
  ctx.record_stacks = ctx.explain != nullptr || log_options().graph_breaks || ctx.trace_ops;
  capture_body(ctx, run);
}

// ---- the graph cache ----

namespace {

// Placeholder names: the argument a tensor came from ("x", "arg1[0]"), a module's parameter or
// buffer ("self.lin.weight"), else "input_<k>".
void name_inputs(CaptureContext& ctx, Graph& g, const Arguments& example) {
  std::unordered_map<const kiln::detail::TensorImpl*, std::string> names;
  if (ctx.leaves) {
    std::vector<std::string> leaf_names;
    if (ctx.leaf_names) ctx.leaf_names(leaf_names);
    for (size_t i = 0; i < ctx.leaves->size(); ++i) {
      const Leaf& l = (*ctx.leaves)[i];
      std::string n = leaf_name(leaf_names, static_cast<int>(i));
      if (l.kind == Leaf::tensor) names.emplace(l.t.unsafe_impl(), n);
      if (l.kind == Leaf::module) {
        auto* m = static_cast<const nn::Module*>(l.object);
        for (auto& [pn, t] : m->named_parameters()) names.emplace(t.unsafe_impl(), n + "." + pn);
        for (auto& [bn, t] : m->named_buffers()) names.emplace(t.unsafe_impl(), n + "." + bn);
      }
    }
  }
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    ValueInfo& v = g.values[g.inputs[k]];
    if (!v.name.empty()) continue;
    const Tensor& t = example.tensors[k];
    if (auto it = names.find(t.unsafe_impl()); it != names.end()) v.name = it->second;
    else if (t.impl().is_wrapped_number) v.name = "scalar_" + std::to_string(k);
    else v.name = "input_" + std::to_string(k);
  }
}

// The compile trace's "graph" event: the captured graph as print_tabular shows it, each op with
// the file:line of the user's code that called it.
nlohmann::json graph_json(const CaptureContext& ctx, const CompiledGraph& cg, bool instance,
                          const std::vector<RawStack>* node_stacks) {
  const FunctionState& st = *ctx.fn;
  nlohmann::json event = function_json(st);
  if (ctx.entry) event["entry"] = ctx.entry->id;
  event["graph"] = cg.id;
  event["backend"] = cg.backend;
  event["mode"] = mode_name(st.options.mode.value_or(Mode::default_));
  event["dynamic"] = cg.graph.dynamic;
  event["new_size_of_dynamic_graph"] = instance;
  nlohmann::json rows = nlohmann::json::array();
  // Stacks through the same calls resolve once (a loop body's ops, a layer called many times).
  std::map<std::vector<void*>, nlohmann::json> sites;
  for (detail::TabularRow& r : tabular_rows(cg.graph)) {
    nlohmann::json row = {{"opcode", r.opcode}, {"name", r.name},     {"target", r.target},
                          {"args", r.args},     {"kwargs", r.kwargs}, {"type", r.type},
                          {"inputs", r.inputs}, {"outputs", r.outputs}};
    if (r.node >= 0 && node_stacks && static_cast<size_t>(r.node) < node_stacks->size()) {
      const RawStack& stack = (*node_stacks)[r.node];
      if (stack.size > 0) {
        std::vector<void*> key(stack.pcs, stack.pcs + stack.size);
        auto it = sites.find(key);
        if (it == sites.end()) it = sites.emplace(std::move(key), call_site_json(user_call_site(stack))).first;
        for (const auto& [k, v] : it->second.items()) row[k] = v;
      }
    }
    rows.push_back(std::move(row));
  }
  event["ops"] = static_cast<int64_t>(cg.graph.nodes.size());
  if (!cg.graph.free_layout_outputs.empty()) event["free_layout_outputs"] = cg.graph.free_layout_outputs;
  event["rows"] = std::move(rows);
  return event;
}

std::shared_ptr<CompiledGraph> uncached(const Graph& graph) {
  auto cg = std::make_shared<CompiledGraph>();
  cg->graph = graph;
  cg->fn = interpreter(graph);
  cg->backend = "eager";
  cg->id = "eager";
  cg->ready = true;
  counter_set().eager_frames.fetch_add(1, std::memory_order_relaxed);
  return cg;
}

}  // namespace

std::shared_ptr<CompiledGraph> find_or_compile(CaptureContext& ctx, Graph& graph, uint64_t hash,
                                               const Arguments& example, const std::vector<RawStack>* node_stacks) {
  FunctionState& st = *ctx.fn;
  std::shared_ptr<CompiledGraph> cg;
  std::shared_ptr<GraphFamily> family;  // the dynamic graph `graph` is an instance of
  bool compile_here = false;
  bool instance = false;  // compile_here: a new size of `family` (else a new graph)
  {
    std::unique_lock lock(st.mutex);
    auto [lo, hi] = st.graphs.equal_range(hash);
    for (auto it = lo; it != hi; ++it) {
      if (it->second->backend == ctx.backend && same_structure(it->second->graph, graph)) {
        cg = it->second;
        break;
      }
    }
    // Dynamic shapes: a graph that is a compiled dynamic graph at other sizes is one of its
    // instances (the same sizes: a cache hit; new sizes: the backend runs again, kernels cached).
    uint64_t fhash = 0;
    std::vector<int64_t> signature;  // size_signature(graph), when `graph` is of a family
    if (!cg && !st.families.empty()) {  // (dynamic = false has families only from mark_dynamic)
      fhash = family_hash(graph);
      auto [flo, fhi] = st.families.equal_range(fhash);
      for (auto it = flo; it != fhi && !family; ++it)
        if (it->second->first->backend == ctx.backend && same_family(it->second->first->graph, graph)) family = it->second;
      if (family) {
        // same_family held against the first graph: an instance with these numbers is this graph.
        signature = size_signature(graph);
        auto& inst = family->instances;
        for (size_t i = 0; i < inst.size(); ++i) {
          if (inst[i]->hash == hash && inst[i]->sizes == signature) {
            cg = inst[i];
            std::rotate(inst.begin() + static_cast<std::ptrdiff_t>(i), inst.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                        inst.end());  // most recently used last
            break;
          }
        }
      }
    }
    if (cg) {
      counter_set().graph_cache_hits.fetch_add(1, std::memory_order_relaxed);
    } else if (family) {
      // A new size of a dynamic graph: not a recompile (its guards passed), so no stance refuses it.
      cg = std::make_shared<CompiledGraph>();
      cg->graph = graph;
      cg->graph.dynamic = true;
      cg->hash = hash;
      cg->family = fhash;
      cg->sizes = std::move(signature);
      cg->dynamic_graph = family;
      cg->backend = ctx.backend;
      cg->id = family->id;
      family->instances.push_back(cg);
      if (family->instances.size() > GraphFamily::kMaxInstances) family->instances.erase(family->instances.begin());
      compile_here = true;
      instance = true;
    } else {
      switch (ctx.stance.stance) {
        case Stance::fail_on_recompile:
          throw RecompileError(fail_on_recompile_message(
              st, {std::to_string(st.frame_id) + "/" + std::to_string(ctx.entry->id) +
                   ": a graph not compiled before (the body took a new path after a graph break, or ran "
                   "different ops)"}));
        case Stance::eager_on_recompile: lock.unlock(); return uncached(graph);
        default: break;
      }
      if (static_cast<int>(st.graphs.size() + st.families.size()) >= 256) {  // Dynamo's accumulated_recompile_limit
        bool first = !st.graph_limit_warned;
        st.graph_limit_warned = true;
        lock.unlock();
        if (first)
          warn("kiln.compile hit config.accumulated_recompile_limit (256)\n   function: " + st.where() +
               "\n   New graphs of this function now run op by op without compiling.");
        return uncached(graph);
      }
      cg = std::make_shared<CompiledGraph>();
      cg->graph = graph;
      cg->hash = hash;
      cg->backend = ctx.backend;
      cg->id = std::to_string(st.frame_id) + "/" + std::to_string(st.graph_counter++);
      // Compile it dynamic when sizes are dynamic from the start (dynamic=true, or the frame entry
      // has dynamic sizes), or when automatic dynamic sees a graph compiled before at other sizes.
      bool dynamic = st.options.dynamic == true || (ctx.entry && ctx.entry->dynamic);
      if (!fhash) fhash = family_hash(graph);
      std::shared_ptr<CompiledGraph> static_instance;  // the graph compiled static at other sizes
      if (!dynamic && st.options.dynamic != false) {
        for (const auto& [h, other] : st.graphs) {
          if (other->family == fhash && other->backend == ctx.backend && same_family(other->graph, graph)) {
            dynamic = true;
            static_instance = other;
            if (log_options().dynamic)
              log_stream() << "[kiln.compile] automatic dynamic: graph " << cg->id << " of " << st.where()
                           << " is graph " << other->id << " at other sizes; compiling it dynamic\n";
            break;
          }
        }
      }
      cg->family = fhash;
      if (dynamic) {  // a new dynamic graph: this compile is its first instance
        cg->graph.dynamic = true;
        cg->sizes = size_signature(graph);
        auto created = std::make_shared<GraphFamily>();
        created->id = cg->id;
        created->first = cg;
        // The static graph serves its own sizes as an instance of the dynamic one, so that a call
        // at those sizes finds it there (guided capture looks there).
        if (static_instance) {
          created->instances.push_back(static_instance);
          static_instance->dynamic_graph = created;
        }
        created->instances.push_back(cg);
        cg->dynamic_graph = created;
        st.families.emplace(cg->family, std::move(created));
      } else {
        cg->sizes = size_signature(graph);
        st.graphs.emplace(hash, cg);
      }
      compile_here = true;
    }
  }
  if (!compile_here) {
    std::unique_lock wait(cg->mutex);
    cg->ready_cv.wait(wait, [&] { return cg->ready; });
    if (cg->error) std::rethrow_exception(cg->error);
    return cg;
  }

  auto finish = [&](std::exception_ptr error) {
    std::lock_guard l(cg->mutex);
    cg->ready = true;
    cg->error = error;
    cg->ready_cv.notify_all();
  };
  std::optional<TraceGraphScope> traced;  // the compile's events (passes, sources, kernels) name the graph
  try {
    name_inputs(ctx, cg->graph, example);
    name_graph(cg->graph);
    if (compile_trace_on()) {
      traced.emplace(cg->id);
      trace_event("graph", graph_json(ctx, *cg, instance, node_stacks));
    }
    BackendFn backend = ctx.backend == st.backend_name && st.backend_fn ? st.backend_fn : lookup_backend(ctx.backend);
    Graph working = cg->graph;  // the backend may rewrite its copy; the cache compares against cg->graph
    auto t0 = Clock::now();
    CompilingOptionsScope options_scope(&st.options);
    const exporting::ReproMode repro = exporting::repro_mode();
    // A compile past 2 s shows itself on stderr (core/progress.h); the kernel builds count into it.
    kiln::detail::Progress progress("compiling graph " + cg->id + " of " + st.where() + " (" +
                                        std::to_string(cg->graph.nodes.size()) + " ops)",
                                    "kernels built");
    try {
      cg->fn = backend(working, example);
    } catch (const std::exception& e) {
      if (repro != exporting::ReproMode::compile) throw;
      // KILN_REPRO=compile: the graph and its inputs, for `kiln minify`.
      exporting::ReproCase c;
      c.kind = "compile";
      c.backend = ctx.backend;
      c.mode = st.options.mode;
      c.options = st.options.options;
      c.failure = e.what();
      c.graph = exporting::with_scalars_baked(cg->graph, example.scalars);
      c.inputs.assign(example.tensors.begin(), example.tensors.end());
      const std::string path = exporting::write_repro(c);
      throw CompileError(std::string(e.what()) + "\n[kiln.repro] Repro written to " + path + "; `kiln minify " + path +
                         "` shrinks it to the smallest graph that still fails.");
    }
    if (repro == exporting::ReproMode::accuracy && cg->fn && ctx.backend != "eager")
      cg->fn = exporting::accuracy_checked(cg->fn, cg->graph, ctx.backend, cg->id + " of " + st.where(), st.options);
    cg->compile_seconds = seconds_since(t0);
    if (!cg->fn) {
      throw CompileError("[kiln::compile] backend '" + ctx.backend + "' returned an empty callable for graph " +
                         cg->id + ". A backend must return a callable (e.g. kiln::compiler::interpreter(graph)).");
    }
    record_phase("backend_compile (" + ctx.backend + ")", cg->compile_seconds);
    if (instance) {
      counter_set().size_specializations.fetch_add(1, std::memory_order_relaxed);
      if (log_options().dynamic) {
        // The inputs whose sizes differ from the dynamic graph's first compile (a module's
        // parameters would bury them).
        std::string sizes;
        const Graph& first = family->first->graph;
        for (size_t k = 0; k < cg->graph.inputs.size(); ++k) {
          const ValueInfo& info = cg->graph.values[cg->graph.inputs[k]];
          if (info.is_wrapped_number) continue;
          if (k < first.inputs.size() && first.values[first.inputs[k]].sizes == info.sizes) continue;
          sizes += (sizes.empty() ? "" : ", ") + info.name + "[";
          for (size_t d = 0; d < info.sizes.size(); ++d) sizes += (d ? ", " : "") + std::to_string(info.sizes[d]);
          sizes += "]";
        }
        log_stream() << "[kiln.compile] [" << cg->id << "] dynamic graph of " << st.where() << " at new sizes ("
                     << sizes << ") in " << cg->compile_seconds * 1e3 << " ms\n";
      }
    } else {
      counter_set().graph_compiles.fetch_add(1, std::memory_order_relaxed);
    }
    if (!instance && log_options().graph) {
      log_stream() << "[kiln.compile] [" << cg->id << "] graph of " << st.where() << ":\n" << cg->graph.tabular();
    }
    if (compile_trace_on()) trace_event("graph_compiled", {{"seconds", cg->compile_seconds}, {"ok", true}});
  } catch (const std::exception& e) {
    if (compile_trace_on()) trace_event("graph_compiled", {{"ok", false}, {"error", e.what()}});
    bool fallback = false;
    if (auto it = st.options.options.find("fallback_to_eager"); it != st.options.options.end())
      fallback = std::get<bool>(it->second);
    if (fallback) {
      warn("kiln.compile: backend '" + ctx.backend + "' failed to compile graph " + cg->id + " of " + st.where() +
           "; running it op by op (fallback_to_eager). The error was: " + e.what());
      cg->fn = interpreter(cg->graph);
      finish(nullptr);
      return cg;
    }
    std::exception_ptr error;
    if (dynamic_cast<const CompileError*>(&e)) {
      error = std::current_exception();
    } else {
      error = std::make_exception_ptr(CompileError("[kiln::compile] backend '" + ctx.backend +
                                                   "' failed to compile graph " + cg->id + ": " + e.what()));
    }
    {
      std::lock_guard lock(st.mutex);
      auto [lo, hi] = st.graphs.equal_range(hash);
      for (auto it = lo; it != hi; ++it)
        if (it->second == cg) {
          st.graphs.erase(it);
          break;
        }
      for (auto it = st.families.begin(); it != st.families.end();) {  // a failed dynamic compile
        auto& inst = it->second->instances;
        inst.erase(std::remove(inst.begin(), inst.end(), cg), inst.end());
        it = it->second->first == cg ? st.families.erase(it) : std::next(it);
      }
    }
    finish(error);
    std::rethrow_exception(error);
  }
  finish(nullptr);
  return cg;
}

// ---- escape hatches that live next to the frame state ----

bool in_recursive_disable() { return t_disabled_depth > 0; }

DisabledScope::DisabledScope(bool recursive, std::string_view reason, std::source_location loc)
    : recursive_(recursive) {
  if (CaptureContext* cap = active_capture()) {
    // Where the disabled function is called: the first user frame (the wrapper lives in a Kiln
    // header); `loc` (where the wrapper was made) when the stack has no line information.
    CallSite site;
    if (cap->record_stacks) site = user_call_site(capture_stack());
    if (!site.known()) site = CallSite{relative_path(loc.file_name()), static_cast<int>(loc.line()), loc.function_name()};
    cap->flush(false,
               "call to a function wrapped in compiler::disable" + (reason.empty() ? std::string() : ": " + std::string(reason)),
               &site);
  }
  // The disabled function's own ops run eagerly; the capture resumes when it returns.
  saved_capture_ = exchange_capture(nullptr);
  if (recursive_) ++t_disabled_depth;
}

DisabledScope::~DisabledScope() {
  if (recursive_) --t_disabled_depth;
  exchange_capture(static_cast<CaptureContext*>(saved_capture_));
}

}  // namespace kiln::compiler::detail

namespace kiln::detail {
void materialize_lazy(const TensorImpl& impl) { compiler::detail::materialize(impl); }
}  // namespace kiln::detail

namespace kiln::compiler::detail {

CompilingOptionsScope::CompilingOptionsScope(const CompileOptions* options)
    : saved_(std::exchange(t_compiling_options, options)) {}
CompilingOptionsScope::~CompilingOptionsScope() { t_compiling_options = saved_; }

}  // namespace kiln::compiler::detail

namespace kiln::compiler {

bool is_compiling() { return detail::active_capture() != nullptr; }

const CompileOptions* compiling_options() { return detail::t_compiling_options; }

void graph_break(std::string_view reason, std::source_location loc) {
  detail::CaptureContext* cap = detail::active_capture();
  if (!cap) return;
  detail::CallSite site{detail::relative_path(loc.file_name()), static_cast<int>(loc.line()), loc.function_name()};
  cap->flush(false, "call to compiler::graph_break()" + (reason.empty() ? std::string() : ": " + std::string(reason)),
             &site);
}

}  // namespace kiln::compiler
