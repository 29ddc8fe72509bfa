// CUDA graph capture and replay for the kiln backend (see cuda_graph.h).
#include "compiler/runtime/cuda_graph.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <utility>

#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "core/shape.h"
#include "core/tensor_factory.h"

#ifdef KILN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/caching_allocator.h"
#include "kernels/cuda/cuda_runtime.h"
#endif

namespace kiln::compiler::runtime {

#ifndef KILN_WITH_CUDA

struct CudaGraphRunner::Impl {
  RunFn run;
};
bool CudaGraphRunner::applies(const Graph&) { return false; }
CudaGraphRunner::CudaGraphRunner(RunFn run, std::vector<bool>) : impl_(new Impl{std::move(run)}) {}
CudaGraphRunner::~CudaGraphRunner() = default;
std::vector<Tensor> CudaGraphRunner::operator()(const Arguments& args) { return impl_->run(args); }

#else

namespace {

namespace cu = kiln::cuda::detail;

bool same_attr(const Attr& a, const Attr& b) { return a == b; }

// What an input looked like when the graph was recorded.
struct InputRecord {
  bool defined = false;
  const void* data = nullptr;
  std::vector<int64_t> sizes, strides;
  DType dtype = DType::float32;
  Device device;
};

InputRecord record_of(const Tensor& t) {
  if (!t.defined()) return {};
  return {true, t.impl().data(), t.sizes().vec(), t.strides().vec(), t.dtype(), t.device()};
}

// The bytes `t` covers when its elements fill them exactly (no gaps, no overlaps, no negative
// strides), else -1.
int64_t dense_bytes(const Tensor& t) {
  if (!kiln::detail::dense_in(t.sizes(), t.strides(), kiln::detail::memory_order(t.strides()))) return -1;
  return t.numel() * static_cast<int64_t>(itemsize(t.dtype()));
}

// Whose a handed-out output is: the caller holds it until the last view of its storage dies.
struct Hold {
  Tensor buffer;                            // keeps the graph's buffer alive past the runner
  std::shared_ptr<std::atomic<bool>> held;  // cleared when the caller lets go
};

void release_hold(void*, void* context) {
  auto* hold = static_cast<Hold*>(context);
  hold->held->store(false, std::memory_order_release);
  delete hold;
}

// `buffer`'s memory as a tensor of its own storage, whose end clears `held`.
Tensor hand_out(const Tensor& buffer, const std::shared_ptr<std::atomic<bool>>& held) {
  const kiln::detail::TensorImpl& b = buffer.impl();
  held->store(true, std::memory_order_relaxed);
  auto storage = std::make_shared<kiln::detail::Storage>();
  storage->data = b.storage->data;
  storage->nbytes = b.storage->nbytes;
  storage->device = b.storage->device;
  storage->free_context = new Hold{buffer, held};
  storage->free_fn = &release_hold;
  Tensor out = kiln::detail::make_view(buffer, b.sizes, b.strides, b.storage_offset);
  out.impl().storage = std::move(storage);
  return out;
}

}  // namespace

struct CudaGraphRunner::Impl {
  RunFn run;
  std::vector<bool> written_inputs;
  std::mutex mutex;
  int calls = 0;
  int records = 0;
  bool disabled = false;
  std::vector<const void*> previous_data;  // input addresses of the last call

  // The recorded graph.
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;  // orders a replay after and before the caller's work
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::shared_ptr<cu::PrivatePool> pool;  // destroyed after the tensors below (declared first)
  std::vector<bool> in_place;             // per input: read where it is
  std::vector<InputRecord> recorded;      // per input, at recording
  std::vector<Tensor> static_inputs;      // per input: the caller's tensor (in place) or a static buffer
  std::vector<Attr> scalars;
  std::vector<Tensor> static_outputs;
  // Per output: the copy node that ends the graph, writing the output into `buffer` (the graph's
  // own memory, handed to the caller) while the caller no longer holds the last one handed out,
  // else into a new tensor. No node (an output that does not fill its bytes densely): copied
  // out after the replay instead.
  struct OutputCopy {
    cudaGraphNode_t node = nullptr;
    Tensor buffer;
    const void* source = nullptr;
    size_t bytes = 0;
    void* target = nullptr;  // where the node writes now
    std::shared_ptr<std::atomic<bool>> held = std::make_shared<std::atomic<bool>>(false);
  };
  std::vector<OutputCopy> output_copies;

  ~Impl() { release(); }

  void release() {
    output_copies.clear();
    static_outputs.clear();
    static_inputs.clear();
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
    pool.reset();
    if (stream) {
      cu::DeviceGuard guard(device);
      cudaStreamDestroy(stream);
      stream = nullptr;
    }
    for (cudaEvent_t* e : {&ready, &done})
      if (*e) {
        cu::DeviceGuard guard(device);
        cudaEventDestroy(*e);
        *e = nullptr;
      }
  }

  void disable(const std::string& why) {
    disabled = true;
    release();
    if (detail::compile_trace_on()) detail::trace_event("cuda_graph", {{"action", "disabled"}, {"reason", why}});
    if (detail::log_options().perf_hints)
      detail::log_stream() << "[kiln.perf_hints] reduce_overhead: this graph runs without a CUDA graph: " << why << "\n";
  }

  // Records the graph; false (and everything released) when it cannot be recorded.
  bool record(const Arguments& args) {
    release();
    device = -1;
    for (const Tensor& t : args.tensors)
      if (t.defined() && t.is_cuda()) device = t.device().index;
    if (device < 0) device = kiln::cuda::current_device();
    cu::DeviceGuard guard(device);
    // Work queued for the inputs on the caller's stream finishes before recording starts.
    cu::check(cudaStreamSynchronize(cu::current_stream(device)), "compile (CUDA graph)");
    cu::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "compile (CUDA graph)");
    cu::check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "compile (CUDA graph)");
    cu::check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "compile (CUDA graph)");
    pool = cu::create_private_pool(device);
    const size_t n = args.tensors.size();
    in_place.assign(n, false);
    recorded.assign(n, {});
    static_inputs.assign(n, Tensor());
    for (size_t i = 0; i < n; ++i) {
      const Tensor& t = args.tensors[i];
      recorded[i] = record_of(t);
      if (!t.defined()) continue;
      // Stable addresses (parameters) and CPU scalars are read in place; the rest get a buffer.
      in_place[i] = !t.is_cuda() || (i < previous_data.size() && previous_data[i] == t.impl().data());
      if (in_place[i]) {
        static_inputs[i] = t;
      } else {
        static_inputs[i] = kiln::detail::make_empty_strided(t.sizes().vec(), t.strides().vec(), t.dtype(), t.device());
        static_inputs[i].copy_(t);
      }
    }
    cu::check(cudaDeviceSynchronize(), "compile (CUDA graph)");
    scalars.assign(args.scalars.begin(), args.scalars.end());
    Arguments captured{static_inputs, scalars};
    std::string failure;
    {
      cu::PrivatePoolGuard pool_guard(pool);
      cudaStream_t previous = cu::current_stream(device);
      cu::set_current_stream(device, stream);
      cu::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), "compile (CUDA graph)");
      try {
        static_outputs = run(captured);
        add_output_copies();
      } catch (const std::exception& e) {
        failure = e.what();
      }
      cudaGraph_t g = nullptr;
      cudaError_t end = cudaStreamEndCapture(stream, &g);
      cu::set_current_stream(device, previous);
      if (failure.empty() && end != cudaSuccess) failure = cudaGetErrorString(end);
      graph = g;
    }
    cudaGetLastError();
    if (failure.empty() && graph) {
      cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
      if (e != cudaSuccess) {
        cudaGetLastError();
        failure = std::string("instantiation failed: ") + cudaGetErrorString(e);
      }
    }
    if (failure.empty() && exec) find_copy_nodes();
    if (!failure.empty() || !exec) {
      output_copies.clear();
      static_outputs.clear();
      disable("recording failed: " + (failure.empty() ? std::string("no graph") : failure));
      return false;
    }
    // The graph's outputs and their copies' buffers are the graph's own memory from now on, as
    // its intermediates are: reserved, not counted as allocated.
    for (const Tensor& t : static_outputs)
      if (t.defined() && cu::allocated_in(*pool, t.impl().storage->free_context))
        cu::stop_counting(t.impl().storage->free_context);
    for (const OutputCopy& c : output_copies)
      if (c.buffer.defined()) cu::stop_counting(c.buffer.impl().storage->free_context);
    detail::counter_set().cuda_graph_captures.fetch_add(1, std::memory_order_relaxed);
    if (detail::compile_trace_on()) {
      size_t nodes = 0;
      cudaGraphGetNodes(graph, nullptr, &nodes);
      detail::trace_event("cuda_graph", {{"action", "recorded"},
                                         {"recording", records},
                                         {"graph_nodes", nodes},
                                         {"in_place_inputs", std::count(in_place.begin(), in_place.end(), true)},
                                         {"output_copies", output_copies.size()}});
    }
    return true;
  }

  // While recording: a copy of each dense output into a buffer of the pool, the graph's last work.
  void add_output_copies() {
    output_copies.assign(static_outputs.size(), OutputCopy{});
    for (size_t i = 0; i < static_outputs.size(); ++i) {
      const Tensor& t = static_outputs[i];
      const int64_t bytes = t.defined() && t.is_cuda() ? dense_bytes(t) : -1;
      if (bytes <= 0) continue;
      OutputCopy& c = output_copies[i];
      c.buffer = kiln::detail::make_empty_strided(t.sizes().vec(), t.strides().vec(), t.dtype(), t.device());
      c.source = t.impl().data();
      c.bytes = static_cast<size_t>(bytes);
      c.target = c.buffer.impl().data();
      cu::check(cudaMemcpyAsync(c.target, c.source, c.bytes, cudaMemcpyDeviceToDevice, stream),
                "compile (CUDA graph)");
    }
  }

  // After instantiation: the node of each output copy, found by its destination. An output whose
  // node is not found is copied out after each replay.
  void find_copy_nodes() {
    size_t count = 0;
    cu::check(cudaGraphGetNodes(graph, nullptr, &count), "compile (CUDA graph)");
    std::vector<cudaGraphNode_t> nodes(count);
    cu::check(cudaGraphGetNodes(graph, nodes.data(), &count), "compile (CUDA graph)");
    for (OutputCopy& c : output_copies) {
      if (!c.buffer.defined()) continue;
      for (cudaGraphNode_t node : nodes) {
        cudaGraphNodeType type;
        cudaMemcpy3DParms params{};
        if (cudaGraphNodeGetType(node, &type) != cudaSuccess || type != cudaGraphNodeTypeMemcpy ||
            cudaGraphMemcpyNodeGetParams(node, &params) != cudaSuccess)
          continue;
        // A 1-D copy: its addresses are the pointers plus the x offsets.
        const char* dst = static_cast<const char*>(params.dstPtr.ptr) + params.dstPos.x;
        const char* src = static_cast<const char*>(params.srcPtr.ptr) + params.srcPos.x;
        if (dst == c.target && src == c.source && params.extent.width == c.bytes) c.node = node;
      }
      if (!c.node) c.buffer = Tensor();
    }
    cudaGetLastError();
  }

  // Whether a call's inputs and scalars fit the recorded graph.
  bool fits(const Arguments& args) const {
    if (args.tensors.size() != recorded.size() || args.scalars.size() != scalars.size()) return false;
    for (size_t k = 0; k < scalars.size(); ++k)
      if (!same_attr(scalars[k], args.scalars[k])) return false;
    for (size_t i = 0; i < recorded.size(); ++i) {
      const Tensor& t = args.tensors[i];
      const InputRecord& r = recorded[i];
      if (t.defined() != r.defined) return false;
      if (!t.defined()) continue;
      if (t.sizes() != IntArrayRef(r.sizes) || t.strides() != IntArrayRef(r.strides) || t.dtype() != r.dtype ||
          t.device() != r.device)
        return false;
      if (in_place[i] && t.is_cuda() && t.impl().data() != r.data) return false;
      if (in_place[i] && !t.is_cuda() && !same_values(t, static_inputs[i])) return false;
    }
    return true;
  }

  static bool same_values(const Tensor& a, const Tensor& b) {
    // CPU 0-dim inputs are baked into the recorded kernel arguments.
    return a.numel() == 1 && b.numel() == 1 && a.item().to_double() == b.item().to_double();
  }

  std::vector<Tensor> replay(const Arguments& args) {
    cu::DeviceGuard guard(device);
    cudaStream_t caller = cu::current_stream(device);
    for (size_t i = 0; i < static_inputs.size(); ++i)
      if (!in_place[i] && args.tensors[i].defined()) static_inputs[i].copy_(args.tensors[i]);
    // Each output copy writes the graph's buffer unless the caller still holds what it got from
    // there last time; then a new tensor.
    std::vector<Tensor> out(static_outputs.size());
    for (size_t i = 0; i < output_copies.size(); ++i) {
      OutputCopy& c = output_copies[i];
      if (!c.node) continue;
      const Tensor& t = static_outputs[i];
      if (!c.held->load(std::memory_order_acquire)) {
        out[i] = hand_out(c.buffer, c.held);
      } else {
        out[i] = kiln::detail::make_empty_strided(t.sizes().vec(), t.strides().vec(), t.dtype(), t.device());
        detail::counter_set().cuda_graph_output_copies.fetch_add(1, std::memory_order_relaxed);
      }
      void* target = out[i].impl().data();
      if (target != c.target) {
        cu::check(cudaGraphExecMemcpyNodeSetParams1D(exec, c.node, target, c.source, c.bytes, cudaMemcpyDeviceToDevice),
                  "compile (CUDA graph replay)");
        c.target = target;
      }
    }
    // The graph runs on its own stream, ordered after the caller's work and before what the caller
    // queues next.
    cu::check(cudaEventRecord(ready, caller), "compile (CUDA graph replay)");
    cu::check(cudaStreamWaitEvent(stream, ready, 0), "compile (CUDA graph replay)");
    cu::check(cudaGraphLaunch(exec, stream), "compile (CUDA graph replay)");
    cu::check(cudaEventRecord(done, stream), "compile (CUDA graph replay)");
    cu::check(cudaStreamWaitEvent(caller, done, 0), "compile (CUDA graph replay)");
    detail::counter_set().cuda_graph_replays.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 0; i < static_inputs.size(); ++i)
      if (!in_place[i] && i < written_inputs.size() && written_inputs[i] && args.tensors[i].defined()) {
        Tensor target = args.tensors[i];
        target.copy_(static_inputs[i]);
      }
    for (size_t i = 0; i < static_outputs.size(); ++i) {
      const Tensor& t = static_outputs[i];
      if (!t.defined() || out[i].defined()) continue;
      out[i] = kiln::detail::make_empty_strided(t.sizes().vec(), t.strides().vec(), t.dtype(), t.device());
      out[i].copy_(t);
      detail::counter_set().cuda_graph_output_copies.fetch_add(1, std::memory_order_relaxed);
    }
    return out;
  }
};

bool CudaGraphRunner::applies(const Graph& g) {
  if (!kiln::cuda::is_available()) return false;
  for (const auto& v : g.values)
    if (v.device.is_cuda()) return true;
  return false;
}

CudaGraphRunner::CudaGraphRunner(RunFn run, std::vector<bool> written_inputs) : impl_(new Impl) {
  impl_->run = std::move(run);
  impl_->written_inputs = std::move(written_inputs);
}
CudaGraphRunner::~CudaGraphRunner() = default;

std::vector<Tensor> CudaGraphRunner::operator()(const Arguments& args) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mutex, std::try_to_lock);
  if (!lock.owns_lock() || m.disabled) return m.run(args);  // another thread replays: run normally
  ++m.calls;
  std::vector<const void*> data;
  for (const Tensor& t : args.tensors) data.push_back(t.defined() ? t.impl().data() : nullptr);
  if (m.calls == 1) {  // warm-up: compiles kernels and plans library calls outside any recording
    m.previous_data = std::move(data);
    return m.run(args);
  }
  if (!m.exec || !m.fits(args)) {
    // Run-time scalars that change on every call (an optimizer's step count) would mean recording
    // on every call: past a few recordings the graph runs normally.
    if (++m.records > 4) {
      m.disable("its run-time scalars or input addresses change from call to call");
      return m.run(args);
    }
    if (!m.record(args)) return m.run(args);
  }
  m.previous_data = std::move(data);
  return m.replay(args);
}

#endif  // KILN_WITH_CUDA

}  // namespace kiln::compiler::runtime
