// The `kiln` backend (alias "inductor"): graph passes (graph/pipeline.cpp) → scheduler (fusion) →
// C++ code generation → system compiler (cached on disk) → an executable that runs the generated
// kernels and dispatches the remaining nodes (DESIGN §2.5).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include <map>
#include <optional>
#include <thread>

#include "backends/autotune_scope.h"
#include "compiler/capture/runtime.h"
#include "compiler/codegen/cuda/cuda_codegen.h"
#include "compiler/graph/passes.h"
#include "compiler/graph/pipeline.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/lower/memory_plan.h"
#include "compiler/runtime/cuda_graph.h"
#include "compiler/runtime/cuda_launch.h"
#include "compiler/runtime/kernel_cache.h"
#include "core/profiler.h"
#include "core/tensor_factory.h"
#include "kiln/autograd.h"
#include "kiln/detail/tensor_impl.h"

#ifdef KILN_WITH_CUDA
#include "backends/cuda/cuda_runtime.h"
#include "backends/cuda/jit.h"
#endif

namespace kiln::compiler {

namespace {

using KernelFn = void (*)(void* const*, const double*, const int64_t*);

// A generated kernel on a CUDA device: how it launches (its NVRTC-compiled function, work items;
// runtime/cuda_launch.h) and how to fill its parameter block (cuda_codegen.h).
struct CudaKernel : runtime::GeneratedKernel {
  std::vector<int> scalars;  // Graph::scalars indices, in slot order
  size_t buffers = 0;
};

// reduce_overhead's arena: one block per compiled graph, allocated at the first call, and a tensor
// per planned value over it. Each of those tensors has a Storage of its own (not owning memory):
// the dispatcher treats tensors of one Storage as overlapping and would copy through a temporary
// on every out= call. A call takes the arena with `busy`; a concurrent call of the same graph
// finds it taken and allocates as the default mode does.
struct Arena {
  std::atomic<bool> busy{false};
  std::shared_ptr<kiln::detail::Storage> memory;
  std::vector<Tensor> tensors;  // per graph value; undefined where not planned
};

struct Executable {
  lower::Program program;
  std::shared_ptr<runtime::SharedObject> library;
  std::vector<KernelFn> kernels;  // per Program kernel (null for CUDA kernels)
  std::vector<CudaKernel> cuda_kernels;  // per Program kernel (function null for CPU kernels)
  // Per node step: which attrs are scalar slots.
  std::vector<std::vector<std::pair<int, int>>> slots;  // per graph node: (attr, scalar index)
  lower::MemoryPlan plan;         // reduce_overhead; empty otherwise
  std::unique_ptr<Arena> arena;   // set when the plan is not empty
  bool autotune = false;          // max_autotune: library calls and generated CUDA kernels' launch
                                  // shapes are timed (autotune_scope.h, cuda_launch.h)
};

// Holds the executable's arena for one call, or nothing when there is no plan or another call
// holds it.
class ArenaLease {
 public:
  explicit ArenaLease(const Executable& ex) {
    if (!ex.arena) return;
    bool expected = false;
    if (!ex.arena->busy.compare_exchange_strong(expected, true, std::memory_order_acquire)) return;
    arena_ = ex.arena.get();
    if (!arena_->memory) {
      try {
        build(ex);
      } catch (...) {
        arena_->memory.reset();
        arena_->tensors.clear();
        arena_->busy.store(false, std::memory_order_release);
        throw;
      }
    }
  }
  ~ArenaLease() {
    if (arena_) arena_->busy.store(false, std::memory_order_release);
  }
  ArenaLease(const ArenaLease&) = delete;
  ArenaLease& operator=(const ArenaLease&) = delete;
  // The arena tensor of value v, or nullptr when v is not planned (or no arena is held).
  const Tensor* tensor(const Executable& ex, int v) const {
    if (!arena_ || ex.plan.entry_of[v] < 0) return nullptr;
    return &arena_->tensors[v];
  }
  bool held() const { return arena_ != nullptr; }

 private:
  void build(const Executable& ex) {
    const Graph& g = ex.program.graph;
    arena_->memory = kiln::detail::allocate_storage(ex.plan.arena_bytes, kCPU);
    arena_->tensors.assign(g.values.size(), Tensor());
    for (const auto& e : ex.plan.entries) {
      const ValueInfo& vi = g.values[e.value];
      auto storage = std::make_shared<kiln::detail::Storage>();
      storage->data = static_cast<char*>(arena_->memory->data) + e.offset;
      storage->nbytes = e.nbytes;
      storage->device = kCPU;  // free_fn stays null: the arena owns the memory
      auto impl = std::make_shared<kiln::detail::TensorImpl>();
      impl->storage = std::move(storage);
      impl->sizes = vi.sizes;
      impl->strides = vi.strides;
      impl->dtype = vi.dtype;
      impl->device = kCPU;
      impl->refresh_metadata();
      arena_->tensors[e.value] = Tensor(std::move(impl));
    }
  }
  Arena* arena_ = nullptr;
};

double to_double(const Attr& a) {
  if (auto* s = std::get_if<Scalar>(&a)) return s->to_double();
  if (auto* d = std::get_if<double>(&a)) return *d;
  if (auto* i = std::get_if<int64_t>(&a)) return static_cast<double>(*i);
  if (auto* b = std::get_if<bool>(&a)) return *b ? 1.0 : 0.0;
  throw CompileError("[kiln::compile] a run-time scalar of the kiln backend is not a number.");
}

int64_t to_int64(const Attr& a) {
  if (auto* s = std::get_if<Scalar>(&a)) return s->to_int();
  if (auto* i = std::get_if<int64_t>(&a)) return *i;
  if (auto* b = std::get_if<bool>(&a)) return *b;
  if (auto* d = std::get_if<double>(&a)) return static_cast<int64_t>(*d);
  return 0;
}

// The attr a scalar slot fills, in the kind the node's attr has.
Attr as_kind(const Attr& example, const Attr& given) {
  if (given.index() == example.index()) return given;
  double v = to_double(given);
  if (std::holds_alternative<Scalar>(example)) {
    if (auto* i = std::get_if<int64_t>(&given)) return Scalar(*i);
    return Scalar(v);
  }
  if (std::holds_alternative<double>(example)) return v;
  if (std::holds_alternative<int64_t>(example)) return static_cast<int64_t>(v);
  if (std::holds_alternative<bool>(example)) return v != 0;
  return given;
}

// Launches a generated CUDA kernel on the device's current stream (runtime/cuda_launch.h). Its
// parameter block: the buffer pointers (a 0-dim CPU value's bits in place of its pointer), then
// its run-time scalars as doubles and as int64s.
void launch_cuda(const Executable& ex, const lower::Step& step, const std::vector<Tensor>& env,
                 const std::vector<double>& scalars, const std::vector<int64_t>& int_scalars) {
  const CudaKernel& ck = ex.cuda_kernels[step.kernel];
  KILN_CHECK(ck.function, CompileError, "[kiln::compile] a generated kernel has no compiled function. This is a Kiln bug.");
  if (ck.numel == 0) return;
  const size_t nscalars = std::max<size_t>(ck.scalars.size(), 1);
  std::vector<uint64_t> block(ck.buffers + 2 * nscalars, 0);
  for (size_t b = 0; b < step.bindings.size() && b < ck.buffers; ++b) {
    const Tensor& t = env[step.bindings[b]];
    if (t.device().is_cpu()) {
      std::memcpy(&block[b], t.impl().data(), static_cast<size_t>(itemsize(t.dtype())));  // a host scalar, by value
    } else {
      void* ptr = t.impl().data();
      std::memcpy(&block[b], &ptr, sizeof(ptr));
    }
  }
  for (size_t j = 0; j < ck.scalars.size(); ++j) {
    std::memcpy(&block[ck.buffers + j], &scalars[ck.scalars[j]], sizeof(double));
    std::memcpy(&block[ck.buffers + nscalars + j], &int_scalars[ck.scalars[j]], sizeof(int64_t));
  }
  runtime::launch_generated(ck, block, ex.autotune, env, step.bindings);
}

std::vector<Tensor> run(const Executable& ex, const Arguments& args) {
  const Graph& g = ex.program.graph;
  KILN_CHECK(args.tensors.size() == g.inputs.size() && args.scalars.size() == g.scalars.size(), CompileError,
             "[kiln::compile] the compiled graph takes " + std::to_string(g.inputs.size()) + " tensors and " +
                 std::to_string(g.scalars.size()) + " scalars, but got " + std::to_string(args.tensors.size()) +
                 " and " + std::to_string(args.scalars.size()) + ".");
  NoGradGuard no_grad;
  detail::SuspendCapture no_capture;
  std::optional<kiln::backends::AutotuneScope> autotune;
  if (ex.autotune) autotune.emplace();
  std::vector<Tensor> env(g.values.size());
  for (size_t k = 0; k < g.inputs.size(); ++k) env[g.inputs[k]] = args.tensors[k];
  for (const auto& [v, t] : g.constants) env[v] = t;
  // Every run-time scalar both as a double and as an int64 (integer attrs keep all their bits).
  std::vector<double> scalars(args.scalars.size());
  std::vector<int64_t> int_scalars(args.scalars.size());
  for (size_t k = 0; k < scalars.size(); ++k) {
    scalars[k] = to_double(args.scalars[k]);
    int_scalars[k] = to_int64(args.scalars[k]);
  }

  ArenaLease arena(ex);
  std::vector<void*> pointers;
  int64_t kernels = 0, dispatched = 0;
  for (const lower::Step& step : ex.program.steps) {
    if (step.kind == lower::Step::Kind::kernel) {
      for (int v : step.allocate) {
        if (const Tensor* t = arena.tensor(ex, v)) {
          env[v] = *t;
          continue;
        }
        const ValueInfo& vi = g.values[v];
        env[v] = kiln::detail::make_empty_strided(vi.sizes, vi.strides, vi.dtype, vi.device);
      }
      for (auto [v, input] : step.write_into) env[v] = env[input];
      pointers.clear();
      for (int v : step.bindings) pointers.push_back(env[v].impl().data());
      kiln::detail::OpTimer timer(ex.program.kernels[step.kernel].profile_name);
      if (ex.kernels[step.kernel]) ex.kernels[step.kernel](pointers.data(), scalars.data(), int_scalars.data());
      else launch_cuda(ex, step, env, scalars, int_scalars);
      ++kernels;
    } else {
      ++dispatched;
      const Node& n = g.nodes[step.node];
      std::vector<Tensor> inputs;
      inputs.reserve(n.inputs.size());
      for (int v : n.inputs) inputs.push_back(v >= 0 ? env[v] : Tensor());
      std::vector<Attr> attrs = n.attrs;
      for (auto [attr, k] : ex.slots[step.node]) attrs[attr] = as_kind(n.attrs[attr], args.scalars[k]);
      if (n.inplace) {
        std::vector<Tensor> targets;
        for (int v : n.outputs) targets.push_back(env[v]);
        call_op_out(*n.op, std::move(inputs), std::move(attrs), targets);
      } else if (arena.held() && ex.plan.out_node[step.node]) {
        // reduce_overhead: the planned outputs, written in place instead of allocated.
        std::vector<Tensor> targets;
        targets.reserve(n.outputs.size());
        for (int v : n.outputs) targets.push_back(*arena.tensor(ex, v));
        call_op_out(*n.op, std::move(inputs), std::move(attrs), targets);
        for (size_t k = 0; k < targets.size(); ++k) env[n.outputs[k]] = std::move(targets[k]);
      } else {
        std::vector<Tensor> outs = call_op(*n.op, std::move(inputs), std::move(attrs));
        for (size_t k = 0; k < outs.size() && k < n.outputs.size(); ++k) env[n.outputs[k]] = std::move(outs[k]);
      }
    }
    for (int v : step.release) env[v] = Tensor();
  }
  detail::counter_set().kernel_runs.fetch_add(kernels, std::memory_order_relaxed);
  detail::counter_set().dispatched_nodes.fetch_add(dispatched, std::memory_order_relaxed);
  std::vector<Tensor> out;
  out.reserve(g.outputs.size());
  for (int v : g.outputs) out.push_back(env[v]);
  return out;
}

// KILN_COMPILE_DEBUG=1: a folder per compiled graph with the graph, the loop IR and the sources.
void write_debug(const Graph& before, const lower::Program& p, const lower::MemoryPlan& plan,
                 const std::vector<std::string>& sources, const std::vector<lower::CudaKernelSource>& cuda_sources) {
  const char* flag = std::getenv("KILN_COMPILE_DEBUG");
  if (!flag || std::string(flag) == "0") return;
  static std::atomic<int> counter{0};
  namespace fs = std::filesystem;
  const char* root = std::getenv("KILN_COMPILE_DEBUG_DIR");
  fs::path dir = fs::path(root ? root : "kiln_compile_debug") /
                 ("graph_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return;
  std::ofstream(dir / "graph.txt") << before.str();
  std::ofstream(dir / "graph_tabular.txt") << before.tabular();
  std::ofstream(dir / "graph.dot") << before.dot();
  std::ofstream(dir / "graph_after_passes.txt") << p.graph.str();
  std::ofstream(dir / "loop_ir.txt") << lower::describe(p) << lower::describe(plan, p);
  for (size_t i = 0; i < sources.size(); ++i) std::ofstream(dir / ("kernels_" + std::to_string(i) + ".cpp")) << sources[i];
  for (size_t i = 0; i < cuda_sources.size(); ++i) {
    if (!cuda_sources[i].source.empty())
      std::ofstream(dir / ("kernel_" + std::to_string(i) + ".cu")) << cuda_sources[i].source;  // per Program kernel
  }
  detail::log_stream() << "[kiln.compile] debug trace: " << dir.string() << "\n";
}

CompiledFn kiln_backend(Graph& graph, const Arguments&) {
  Graph before = graph;
  passes::PipelineOptions pipeline;
  if (const CompileOptions* o = compiling_options())
    if (auto it = o->options.find("layout_optimization"); it != o->options.end())
      pipeline.layout_optimization = std::get<bool>(it->second);
  passes::run_kiln_pipeline(graph, pipeline);  // compiler/graph/pipeline.cpp: the passes, in order
  auto ex = std::make_shared<Executable>();
  ex->program = lower::schedule(std::move(graph));
  lower::elide_copy_backs(ex->program);
  const Graph& g = ex->program.graph;
  ex->slots.resize(g.nodes.size());
  for (size_t k = 0; k < g.scalars.size(); ++k)
    if (g.scalars[k].node >= 0) ex->slots[g.scalars[k].node].emplace_back(g.scalars[k].attr, static_cast<int>(k));
  for (auto& k : ex->program.kernels) {
    // KILN_PROFILE=1 reports generated kernels by what they fuse: "kernel[cat+sub+mul+...]".
    std::string ops;
    for (size_t i = 0; i < k.ops.size() && i < 6; ++i) {
      std::string op = k.ops[i];
      while (!op.empty() && (std::isdigit(static_cast<unsigned char>(op.back())) || op.back() == '_')) op.pop_back();
      ops += (i ? "+" : "") + op;
    }
    if (k.ops.size() > 6) ops += "+...";
    k.profile_name = "kernel[" + ops + "]";
  }
  std::vector<std::string> sources = lower::generate_cpp(ex->program);
  // Per Program kernel: the CUDA source of a kernel on a GPU (empty for CPU kernels).
  std::vector<lower::CudaKernelSource> cuda_sources(ex->program.kernels.size());
  for (size_t i = 0; i < cuda_sources.size(); ++i)
    if (!ex->program.kernels[i].device.is_cpu()) cuda_sources[i] = lower::generate_cuda(ex->program.kernels[i]);
  // reduce_overhead: a static memory plan, so that a call allocates only its outputs.
  // max_autotune includes it too, as torch's max-autotune includes CUDA graphs (the static plan is
  // the CPU's counterpart); max_autotune_no_cudagraphs does not.
  if (const CompileOptions* opts = compiling_options();
      opts && (opts->mode == Mode::reduce_overhead || opts->mode == Mode::max_autotune)) {
    ex->plan = lower::plan_memory(ex->program);
    if (!ex->plan.empty()) ex->arena = std::make_unique<Arena>();
  }
  if (const CompileOptions* o = compiling_options()) ex->autotune = o->mode == Mode::max_autotune || o->mode == Mode::max_autotune_no_cudagraphs;
  write_debug(before, ex->program, ex->plan, sources, cuda_sources);
  if (detail::log_options().output_code) {
    for (const auto& s : sources) detail::log_stream() << "[kiln.compile] output code:\n" << s;
  }
  // CUDA kernels: CUDA C++ compiled by NVRTC (cached on disk), loaded now so that a call (or a
  // CUDA graph capture) only launches.
  ex->kernels.assign(ex->program.kernels.size(), nullptr);
  ex->cuda_kernels.assign(ex->program.kernels.size(), CudaKernel{});
  for (size_t i = 0; i < ex->program.kernels.size(); ++i) {
    const lower::Kernel& k = ex->program.kernels[i];
    if (k.device.is_cpu()) continue;
    const lower::CudaKernelSource& src = cuda_sources[i];
    if (detail::log_options().output_code) detail::log_stream() << "[kiln.compile] output code (CUDA):\n" << src.source;
    CudaKernel& ck = ex->cuda_kernels[i];
    ck.device = k.device.index;
    ck.scalars = src.scalars;
    ck.buffers = src.buffers;
    ck.numel = src.numel;
    ck.per_block = src.per_block;
    for (const lower::Store& st : k.stores) ck.written.push_back(static_cast<size_t>(st.buffer));
    for (const lower::Store& st : k.epilogue_stores) ck.written.push_back(static_cast<size_t>(st.buffer));
    if (k.result.buffer >= 0) ck.written.push_back(static_cast<size_t>(k.result.buffer));
    std::sort(ck.written.begin(), ck.written.end());
    ck.written.erase(std::unique(ck.written.begin(), ck.written.end()), ck.written.end());
#ifndef KILN_WITH_CUDA
    throw CompileError("[kiln::compile] a graph on a CUDA device, but Kiln was built without CUDA.");
#endif
  }
#ifdef KILN_WITH_CUDA
  // NVRTC spends most of a lone kernel's time (about 70 of 90 ms) parsing the headers, so the
  // kernels compile in batches, one NVRTC program per batch of up to kMaxBatch kernels of one
  // device, and the batches side by side, one worker per core. Identical sources compile once.
  // Errors are rethrown here, in batch order.
  {
    constexpr size_t kMaxBatch = 32;
    auto t0 = std::chrono::steady_clock::now();
    std::map<std::pair<int, std::string>, std::vector<size_t>> by_source;  // (device, source) -> kernels
    for (size_t i = 0; i < ex->program.kernels.size(); ++i)
      if (!ex->program.kernels[i].device.is_cpu())
        by_source[{ex->cuda_kernels[i].device, cuda_sources[i].source}].push_back(i);
    std::map<int, std::vector<const std::vector<size_t>*>> per_device;  // unique sources, by device
    for (const auto& [key, kernels] : by_source) per_device[key.first].push_back(&kernels);
    const size_t cores = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::vector<const std::vector<size_t>*>> batches;
    for (const auto& [device, sources_of_device] : per_device) {
      // Enough batches to keep every core busy, none larger than kMaxBatch.
      const size_t size = std::clamp<size_t>((sources_of_device.size() + cores - 1) / cores, 1, kMaxBatch);
      for (size_t b = 0; b < sources_of_device.size(); b += size)
        batches.emplace_back(sources_of_device.begin() + b,
                             sources_of_device.begin() + std::min(b + size, sources_of_device.size()));
    }
    std::vector<std::exception_ptr> errors(batches.size());
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t j; (j = next.fetch_add(1)) < batches.size();) {
        try {
          std::vector<const lower::CudaKernelSource*> members;
          for (const std::vector<size_t>* same : batches[j]) members.push_back(&cuda_sources[same->front()]);
          const lower::CudaModuleSource module = lower::batch_cuda(members);
          const int device = ex->cuda_kernels[batches[j].front()->front()].device;
          std::vector<cuda::detail::JitFunction> fns =
              cuda::detail::jit_functions(device, module.source, module.names, [&] { return module.source; });
          for (size_t m = 0; m < batches[j].size(); ++m)
            for (size_t i : *batches[j][m]) ex->cuda_kernels[i].function = fns[m];
        } catch (...) {
          errors[j] = std::current_exception();
        }
      }
    };
    size_t workers = std::min(batches.size(), cores);
    std::vector<std::thread> pool;
    for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    if (!batches.empty())
      detail::record_phase("cuda_build (kiln)",
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
#endif
  if (!sources.empty()) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::string> flags;
    if (const char* opt = std::getenv("KILN_CPP_OPT")) flags.push_back(std::string("-O") + opt);  // e.g. 2
    ex->library = runtime::load_or_build({sources, flags, "graph of " + std::to_string(g.nodes.size()) + " ops"});
    detail::record_phase("cpp_build (kiln)",
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (size_t i = 0; i < ex->program.kernels.size(); ++i) {
      const lower::Kernel& k = ex->program.kernels[i];
      if (k.device.is_cpu())
        ex->kernels[i] = ex->library->function<void(void* const*, const double*, const int64_t*)>(k.name.c_str());
    }
  }
  if (const CompileOptions* o = compiling_options();
      o && (o->mode == Mode::reduce_overhead || o->mode == Mode::max_autotune) && runtime::CudaGraphRunner::applies(g)) {
    // On a GPU, reduce_overhead replays the whole graph as one CUDA graph.
    std::vector<char> written = passes::internal::written_memory(g);
    std::vector<bool> written_inputs;
    for (int v : g.inputs) written_inputs.push_back(v >= 0 && written[v]);
    auto runner = std::make_shared<runtime::CudaGraphRunner>([ex](const Arguments& a) { return run(*ex, a); },
                                                             std::move(written_inputs));
    return [runner](const Arguments& args) { return (*runner)(args); };
  }
  return [ex](const Arguments& args) { return run(*ex, args); };
}

[[maybe_unused]] const bool registered = [] {
  register_backend("kiln", kiln_backend, {"aot_autograd"});  // the saved-value partition applies
  register_backend("inductor", kiln_backend, {"aot_autograd"});
  return true;
}();

}  // namespace

}  // namespace kiln::compiler
