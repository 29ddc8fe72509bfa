// The executor of the kiln backend's programs (executable.h).
#include "compiler/runtime/executable.h"
#include "core/progress.h"

#include "compiler/graph/known_ops.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "kernels/autotune_scope.h"
#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "core/profiler.h"
#include "core/tensor_factory.h"
#include "kiln/autograd.h"
#include "kiln/detail/tensor_impl.h"

#ifdef KILN_WITH_CUDA
#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/jit.h"
#endif

namespace kiln::compiler::runtime {
namespace {

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
// its run-time scalars as doubles and as int64s, then a dynamic graph's size arguments.
void launch_cuda(const Executable& ex, const lower::Step& step, const std::vector<Tensor>& env,
                 const std::vector<double>& scalars, const std::vector<int64_t>& int_scalars) {
  const CudaKernel& ck = ex.cuda_kernels[step.kernel];
  KILN_CHECK(ck.function, CompileError, "[kiln::compile] a generated kernel has no compiled function. This is a Kiln bug.");
  if (ck.numel == 0) return;
  const size_t nscalars = std::max<size_t>(ck.scalars.size(), 1);
  const size_t nsizes = std::max<size_t>(ck.size_args.size(), 1);
  std::vector<uint64_t> block(ck.buffers + 2 * nscalars + nsizes, 0);
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
  if (!ck.size_args.empty())
    std::memcpy(&block[ck.buffers + 2 * nscalars], ck.size_args.data(), ck.size_args.size() * sizeof(int64_t));
  launch_generated(ck, block, ex.autotune, env, step.bindings);
}

}  // namespace

namespace {

// A view node the graph's metadata already describes: its output is a view of its input with the
// sizes, strides and offset recorded when the graph was captured (at this instance's sizes), so
// the run makes it directly instead of through call_op and the op's meta function, which cost more
// than the view itself (a GPT-2 block dispatches some forty). Only when the input has the layout
// the graph recorded for it (then the recorded output layout is exactly what meta would give) and
// no attr is filled at run time (flatten_steps); otherwise nullopt, and the node is dispatched.
std::optional<Tensor> view_from_plan(const Executable& ex, const FlatStep& step, const std::vector<Tensor>& env) {
  if (step.view_in < 0) return std::nullopt;
  const Tensor& in = env[step.view_in];
  if (!in.defined() || in.dtype() != step.view_dtype) return std::nullopt;
  const int64_t* from = ex.step_numbers.data() + step.layout;
  const int64_t* to = from + 2 * step.in_rank;
  const IntArrayRef from_sizes(from, step.in_rank), from_strides(from + step.in_rank, step.in_rank);
  if (!(in.sizes() == from_sizes) || !(in.strides() == from_strides)) return std::nullopt;
  return kiln::detail::make_view(in, std::vector<int64_t>(to, to + step.out_rank),
                                 std::vector<int64_t>(to + step.out_rank, to + 2 * step.out_rank),
                                 in.storage_offset() + step.offset_delta);
}

}  // namespace

void flatten_steps(Executable& ex) {
  const Graph& g = ex.program.graph;
  ex.steps.clear();
  ex.step_ints.clear();
  ex.step_numbers.clear();
  auto ints = [&](const std::vector<int>& list) { ex.step_ints.insert(ex.step_ints.end(), list.begin(), list.end()); };
  auto numbers = [&](const std::vector<int64_t>& list) {
    ex.step_numbers.insert(ex.step_numbers.end(), list.begin(), list.end());
  };
  auto offset = [](size_t n) { return static_cast<uint32_t>(n); };
  for (const lower::Step& step : ex.program.steps) {
    FlatStep& f = ex.steps.emplace_back();
    f.kind = step.kind;
    f.kernel = step.kernel;
    f.node = step.node;
    f.inputs = offset(ex.step_ints.size());
    if (step.kind == lower::Step::Kind::node) ints(g.nodes[step.node].inputs);
    else f.size_args = ex.program.kernels[step.kernel].size_args.data();
    f.bindings = offset(ex.step_ints.size());
    ints(step.bindings);
    f.allocate = offset(ex.step_ints.size());
    ints(step.allocate);
    f.write_into = offset(ex.step_ints.size());
    for (auto [v, input] : step.write_into) ex.step_ints.insert(ex.step_ints.end(), {v, input});
    f.release = offset(ex.step_ints.size());
    ints(step.release);
    f.end = offset(ex.step_ints.size());
    f.buffers = offset(ex.step_numbers.size());
    for (int v : step.allocate) {
      const ValueInfo& vi = g.values[v];
      ex.step_numbers.insert(ex.step_numbers.end(), {static_cast<int64_t>(vi.sizes.size()), static_cast<int64_t>(vi.dtype),
                                                     static_cast<int64_t>(vi.device.type), vi.device.index});
      numbers(vi.sizes);
      numbers(vi.strides);
    }
    if (step.kind != lower::Step::Kind::node) continue;
    const Node& n = g.nodes[step.node];
    if (!ex.slots[step.node].empty() || n.inplace || n.op->kind != OpKind::view || n.outputs.size() != 1 ||
        n.inputs.empty() || n.inputs[0] < 0)
      continue;
    const ValueInfo& from = g.values[n.inputs[0]];
    const ValueInfo& to = g.values[n.outputs[0]];
    if (from.strides.size() != from.sizes.size() || to.strides.size() != to.sizes.size() || from.sizes.size() > 255 ||
        to.sizes.size() > 255)
      continue;
    f.view_in = n.inputs[0];
    f.view_out = n.outputs[0];
    f.view_dtype = to.dtype;
    f.layout = offset(ex.step_numbers.size());
    f.in_rank = static_cast<uint8_t>(from.sizes.size());
    f.out_rank = static_cast<uint8_t>(to.sizes.size());
    f.offset_delta = to.storage_offset - from.storage_offset;
    numbers(from.sizes);
    numbers(from.strides);
    numbers(to.sizes);
    numbers(to.strides);
  }
}

std::vector<Tensor> run(const Executable& ex, const Arguments& args) {
  const Graph& g = ex.program.graph;
  KILN_CHECK(args.tensors.size() == g.inputs.size() && args.scalars.size() == g.scalars.size(), CompileError,
             "[kiln::compile] the compiled graph takes " + std::to_string(g.inputs.size()) + " tensors and " +
                 std::to_string(g.scalars.size()) + " scalars, but got " + std::to_string(args.tensors.size()) +
                 " and " + std::to_string(args.scalars.size()) + ".");
  NoGradGuard no_grad;
  detail::SuspendCapture no_capture;
  // A graph that writes its inputs invalidates packed weight copies when it is done (even when it
  // throws half way): its kernels' writes bump no version counter (packed_gemm.h).
  struct NoteInputWrites {
    bool writes;
    ~NoteInputWrites() {
      if (writes) note_graph_input_writes();
    }
  } note_input_writes{ex.writes_inputs};
  std::optional<kiln::kernels::AutotuneScope> autotune;
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
  const int* lists = ex.step_ints.data();
  for (size_t i = 0; i < ex.steps.size(); ++i) {
    const FlatStep& step = ex.steps[i];
    if (step.kind == lower::Step::Kind::kernel) {
      const int64_t* layout = ex.step_numbers.data() + step.buffers;
      for (uint32_t j = step.allocate; j < step.write_into; ++j) {
        const int v = lists[j];
        const auto rank = static_cast<size_t>(layout[0]);
        const int64_t* sizes = layout + 4;
        layout = sizes + 2 * rank;  // the next value's
        if (const Tensor* t = arena.tensor(ex, v)) {
          env[v] = *t;
          continue;
        }
        const Device device(static_cast<DeviceType>(sizes[-2]), static_cast<int>(sizes[-1]));
        env[v] = kiln::detail::make_empty_strided(std::vector<int64_t>(sizes, sizes + rank),
                                                  std::vector<int64_t>(sizes + rank, sizes + 2 * rank),
                                                  static_cast<DType>(sizes[-3]), device);
      }
      for (uint32_t j = step.write_into; j < step.release; j += 2) env[lists[j]] = env[lists[j + 1]];
      pointers.clear();
      for (uint32_t j = step.bindings; j < step.allocate; ++j) pointers.push_back(env[lists[j]].impl().data());
      kiln::detail::OpTimer timer(ex.program.kernels[step.kernel].profile_name);
      kiln::detail::DeviceSpan device_time("gpu", ex.program.kernels[step.kernel].profile_name,
                                           ex.kernels[step.kernel] ? -1 : ex.cuda_kernels[step.kernel].device);
      if (ex.kernels[step.kernel])
        ex.kernels[step.kernel](pointers.data(), scalars.data(), int_scalars.data(), step.size_args);
      else launch_cuda(ex, ex.program.steps[i], env, scalars, int_scalars);
      ++kernels;
    } else {
      ++dispatched;
      if (std::optional<Tensor> view = view_from_plan(ex, step, env)) {
        env[step.view_out] = std::move(*view);
        for (uint32_t j = step.release; j < step.end; ++j) env[lists[j]] = Tensor();
        continue;
      }
      const Node& n = g.nodes[step.node];
      std::vector<Tensor> inputs;
      inputs.reserve(step.bindings - step.inputs);
      for (uint32_t j = step.inputs; j < step.bindings; ++j) inputs.push_back(lists[j] >= 0 ? env[lists[j]] : Tensor());
      std::vector<Attr> attrs = n.attrs;
      for (auto [attr, k] : ex.slots[step.node]) attrs[attr] = as_kind(n.attrs[attr], args.scalars[k]);
      if (PackedGemm* packed = static_cast<size_t>(step.node) < ex.packed_gemms.size() ? ex.packed_gemms[step.node].get() : nullptr) {
        const bool planned = arena.held() && ex.plan.out_node[step.node];
        Tensor out = planned ? *arena.tensor(ex, n.outputs[0]) : Tensor();
        static const std::string packed_addmm = "addmm (packed weight)", packed_mm = "mm (packed weight)";
        kiln::detail::OpTimer timer(n.op == &known_ops().mm ? packed_mm : packed_addmm);
        if (run_packed_gemm(*packed, inputs, attrs, out)) {
          env[n.outputs[0]] = std::move(out);
          for (uint32_t j = step.release; j < step.end; ++j) env[lists[j]] = Tensor();
          continue;
        }
      }
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
    for (uint32_t j = step.release; j < step.end; ++j) env[lists[j]] = Tensor();
  }
  detail::counter_set().kernel_runs.fetch_add(kernels, std::memory_order_relaxed);
  detail::counter_set().dispatched_nodes.fetch_add(dispatched, std::memory_order_relaxed);
  std::vector<Tensor> out;
  out.reserve(g.outputs.size());
  for (int v : g.outputs) out.push_back(env[v]);
  return out;
}

void prepare_cuda_kernels(Executable& ex, const std::vector<codegen::CudaKernelSource>& sources) {
  ex.kernels.assign(ex.program.kernels.size(), nullptr);
  ex.cuda_kernels.assign(ex.program.kernels.size(), CudaKernel{});
  for (size_t i = 0; i < ex.program.kernels.size(); ++i) {
    const lower::Kernel& k = ex.program.kernels[i];
    if (k.device.is_cpu()) continue;
    const codegen::CudaKernelSource& src = sources[i];
    if (detail::log_options().output_code) detail::log_stream() << "[kiln.compile] output code (CUDA):\n" << src.source;
    if (detail::compile_trace_on())
      detail::trace_event("source", {{"language", "cuda"}, {"kernel", k.name}, {"text", src.source}});
    CudaKernel& ck = ex.cuda_kernels[i];
    ck.device = k.device.index;
    ck.scalars = src.scalars;
    ck.size_args = src.size_args;
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
    for (size_t i = 0; i < ex.program.kernels.size(); ++i)
      if (!ex.program.kernels[i].device.is_cpu())
        by_source[{ex.cuda_kernels[i].device, sources[i].source}].push_back(i);
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
    BundleRecorder* recorder = BundleRecorder::current();  // export_program bundles the cubins
    kiln::detail::Progress* progress = kiln::detail::Progress::current();  // the compile's line counts modules
    if (progress) progress->add_total(static_cast<int64_t>(batches.size()));
    const std::string graph_id = detail::trace_graph_id();  // the workers' trace events name the graph
    auto work = [&] {
      BundleRecorder::Scope record_here(recorder);
      detail::TraceGraphScope traced(graph_id);
      for (size_t j; (j = next.fetch_add(1)) < batches.size();) {
        try {
          std::vector<const codegen::CudaKernelSource*> members;
          for (const std::vector<size_t>* same : batches[j]) members.push_back(&sources[same->front()]);
          const codegen::CudaModuleSource module = codegen::batch_cuda(members);
          const int device = ex.cuda_kernels[batches[j].front()->front()].device;
          std::vector<cuda::detail::JitFunction> fns =
              cuda::detail::jit_functions(device, module.source, module.names, [&] { return module.source; });
          for (size_t m = 0; m < batches[j].size(); ++m)
            for (size_t i : *batches[j][m]) ex.cuda_kernels[i].function = fns[m];
          if (progress) progress->advance();
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
}

}  // namespace kiln::compiler::runtime
