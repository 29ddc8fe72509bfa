// See packed_gemm.h.
#include "compiler/runtime/packed_gemm.h"

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <shared_mutex>
#include <atomic>
#include <unordered_map>
#include <vector>

#include "compiler/graph/known_ops.h"
#include "core/tensor_factory.h"
#include "kernels/cpu/onednn.h"
#include "kiln/detail/tensor_impl.h"

namespace kiln::compiler::runtime {

using dnnl::memory;

struct PackedGemm {
  bool bias = false;          // addmm (else mm)
  int64_t m = 0, k = 0, n = 0;
  // The primitive, made at the second run: a dynamic graph lowers every new size it meets, and
  // a size met once (a generation's growing sequence) would pay oneDNN's kernel generation and
  // the packing for one call; its first run goes through the dispatcher. `ready` false when
  // oneDNN has no implementation.
  std::atomic<int> runs{0};
  std::once_flag made;
  bool ready = false;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  // A weight that changes between calls (a training step's) would be packed on every call, which
  // is what dnnl_sgemm does anyway, plus a copy: after three calls in a row that had to pack (the
  // first, and two that found the weight changed), the node goes back to the dispatcher for good.
  std::atomic<int> packs_in_a_row{0};
  std::atomic<bool> unstable{false};
};

namespace {

// Runs of compiled graphs that write their inputs (see packed_gemm.h).
std::atomic<uint64_t> g_input_write_epoch{0};

// Packed copies of weights, process-wide, one per weight and packed layout: the instances of a
// dynamic graph (one per size) and graphs that share a module share its copies. An entry lives
// while its weight's storage does, and is replaced when the weight changes (data pointer or
// version). Held copies are shared_ptrs: a call keeps the one it runs with alive.
class PackedWeights {
 public:
  static PackedWeights& instance() {
    static PackedWeights* cache = new PackedWeights();  // leaked: used until exit
    return *cache;
  }

  // The packed copy of w (read as [k, n] with strides (1, k)) in layout `md`; `packed_now`: it
  // had to be packed (first use, or the weight changed).
  std::shared_ptr<const memory> get(const kiln::detail::TensorImpl& w, const memory::desc& md, int64_t k, int64_t n,
                                    bool& packed_now) {
    const void* data = w.data();
    const uint64_t version = w.storage->version.load(std::memory_order_acquire);
    const uint64_t epoch = g_input_write_epoch.load(std::memory_order_acquire);
    {
      // The common case, an unchanged weight, under a shared lock: callers of one program on many
      // threads (and of one model) look their weights up side by side.
      std::shared_lock lock(mutex_);
      if (auto it = entries_.find(data); it != entries_.end())
        for (const Entry& e : it->second)
          if (e.storage_address == w.storage.get() && !e.storage.expired() && e.md == md && e.version == version &&
              e.epoch == epoch) {
            packed_now = false;
            return e.packed;
          }
    }
    std::unique_lock lock(mutex_);
    std::vector<Entry>& list = entries_[data];
    std::erase_if(list, [](const Entry& e) { return e.storage.expired(); });
    for (Entry& e : list) {
      if (e.storage_address != w.storage.get() || !(e.md == md)) continue;
      packed_now = e.version != version || e.epoch != epoch;
      if (packed_now) {
        e.packed = pack(data, md, k, n);
        e.version = version;
        e.epoch = epoch;
      }
      return e.packed;
    }
    packed_now = true;
    list.push_back(Entry{w.storage, w.storage.get(), version, epoch, md, pack(data, md, k, n)});
    if (++inserts_ % 256 == 0) sweep();
    return list.back().packed;
  }

 private:
  struct Entry {
    std::weak_ptr<kiln::detail::Storage> storage;
    const kiln::detail::Storage* storage_address;  // compared without locking the weak_ptr
    uint64_t version;
    uint64_t epoch;  // g_input_write_epoch when packed
    memory::desc md;
    std::shared_ptr<const memory> packed;
  };

  static std::shared_ptr<const memory> pack(const void* data, const memory::desc& md, int64_t k, int64_t n) {
    dnnl::engine& engine = cpu::onednn::cpu_engine();
    auto packed = std::make_shared<memory>(md, engine);
    memory user(memory::desc({k, n}, memory::data_type::f32, memory::dims{1, k}), engine, const_cast<void*>(data));
    dnnl::reorder(user, *packed).execute(cpu::onednn::thread_stream(), user, *packed);
    cpu::onednn::thread_stream().wait();
    return packed;
  }

  // Drops the entries of weights that are gone (their data pointers may come back for others).
  void sweep() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      std::erase_if(it->second, [](const Entry& e) { return e.storage.expired(); });
      it = it->second.empty() ? entries_.erase(it) : std::next(it);
    }
  }

  std::shared_mutex mutex_;
  std::unordered_map<const void*, std::vector<Entry>> entries_;
  size_t inserts_ = 0;
};

bool is_f32_cpu(const ValueInfo& v) { return v.dtype == DType::float32 && v.device.is_cpu(); }

bool row_major(const ValueInfo& v, int64_t rows, int64_t cols) {
  return v.sizes == std::vector<int64_t>{rows, cols} && (rows <= 1 || v.strides[0] == cols) && (cols <= 1 || v.strides[1] == 1);
}

// w read as [K, N] over a row-major [N, K] weight: strides (1, K).
bool transposed_weight(const ValueInfo& v, int64_t k, int64_t n) {
  return v.sizes == std::vector<int64_t>{k, n} && (k <= 1 || v.strides[0] == 1) && (n <= 1 || v.strides[1] == k);
}

// Whether value `v` is a graph input or a view of one (the weight a call after call sees again).
bool of_graph_input(const Graph& g, int v) {
  for (int guard = 0; guard < 8; ++guard) {
    if (std::find(g.inputs.begin(), g.inputs.end(), v) != g.inputs.end()) return true;
    const Node* producer = nullptr;
    for (const Node& n : g.nodes)
      if (std::find(n.outputs.begin(), n.outputs.end(), v) != n.outputs.end()) producer = &n;
    if (!producer || !producer->is_view() || producer->inplace || producer->inputs.empty()) return false;
    v = producer->inputs[0];
    if (v < 0) return false;
  }
  return false;
}

bool is_one(const Attr& a) {
  if (auto* s = std::get_if<Scalar>(&a)) return s->to_double() == 1.0;
  if (auto* d = std::get_if<double>(&a)) return *d == 1.0;
  if (auto* i = std::get_if<int64_t>(&a)) return *i == 1;
  return false;
}

memory::desc matrix_desc(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  return memory::desc({rows, cols}, memory::data_type::f32, memory::dims{row_stride, col_stride});
}

}  // namespace

void note_graph_input_writes() { g_input_write_epoch.fetch_add(1, std::memory_order_acq_rel); }

std::shared_ptr<PackedGemm> plan_packed_gemm(const Graph& g, const Node& node, const std::vector<char>& written) {
  const KnownOps& ops = known_ops();
  const bool addmm = node.op == &ops.addmm;
  if ((!addmm && node.op != &ops.mm) || node.inplace || node.outputs.size() != 1) return nullptr;
  const size_t first = addmm ? 1 : 0;
  if (node.inputs.size() != first + 2) return nullptr;
  for (int v : node.inputs)
    if (v < 0) return nullptr;
  const ValueInfo& x = g.values[node.inputs[first]];
  const ValueInfo& w = g.values[node.inputs[first + 1]];
  const ValueInfo& out = g.values[node.outputs[0]];
  if (!is_f32_cpu(x) || !is_f32_cpu(w) || !is_f32_cpu(out) || x.sizes.size() != 2 || w.sizes.size() != 2) return nullptr;
  const int64_t m = x.sizes[0], k = x.sizes[1], n = w.sizes[1];
  if (m < 1 || k < 1 || n < 1 || !row_major(x, m, k) || !transposed_weight(w, k, n) || !row_major(out, m, n)) return nullptr;
  if (!of_graph_input(g, node.inputs[first + 1])) return nullptr;
  for (size_t v = 0; v < g.values.size() && v < written.size(); ++v)  // the graph updates the weight itself
    if (written[v] && (static_cast<int>(v) == node.inputs[first + 1] || (w.storage >= 0 && g.values[v].storage == w.storage)))
      return nullptr;
  if (addmm) {
    const ValueInfo& b = g.values[node.inputs[0]];
    if (!is_f32_cpu(b) || b.sizes != std::vector<int64_t>{n} || (n > 1 && b.strides[0] != 1)) return nullptr;
  }
  auto p = std::make_shared<PackedGemm>();
  p->bias = addmm;
  p->m = m;
  p->k = k;
  p->n = n;
  return p;
}

namespace {

// A thread's scratch memory for the primitives it runs (user scratchpad mode: calls of one
// primitive from several threads never share it).
void* thread_scratch(size_t bytes) {
  struct Buffer {
    void* data = nullptr;
    size_t capacity = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (bytes > buffer.capacity) {
    std::free(buffer.data);
    buffer.capacity = (bytes + 63) / 64 * 64;
    buffer.data = std::aligned_alloc(64, buffer.capacity);
    if (!buffer.data) {
      buffer.capacity = 0;
      throw std::bad_alloc();
    }
  }
  return buffer.data;
}

void make_primitive(PackedGemm& p) {
  try {
    const memory::desc src = matrix_desc(p.m, p.k, p.k, 1), dst = matrix_desc(p.m, p.n, p.n, 1);
    const memory::desc weights({p.k, p.n}, memory::data_type::f32, memory::format_tag::any);
    dnnl::engine& engine = cpu::onednn::cpu_engine();
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    p.pd = p.bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, matrix_desc(1, p.n, p.n, 1), dst), attr, engine)
                  : dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), attr, engine);
    p.primitive = dnnl::matmul(p.pd);
    p.ready = true;
  } catch (const dnnl::error&) {
    p.ready = false;  // no implementation here: the dispatcher runs the node
  }
}

}  // namespace

bool run_packed_gemm(PackedGemm& p, std::span<const Tensor> inputs, std::span<const Attr> attrs, Tensor& out) {
  const size_t first = p.bias ? 1 : 0;
  if (inputs.size() != first + 2) return false;
  if (p.bias && (attrs.size() < 2 || !is_one(attrs[0]) || !is_one(attrs[1]))) return false;  // beta, alpha
  const Tensor& x = inputs[first];
  const Tensor& w = inputs[first + 1];
  // The layouts planned (a dynamic graph's instance runs at its own sizes; checked anyway).
  const auto& xi = x.impl();
  const auto& wi = w.impl();
  if (xi.sizes != std::vector<int64_t>{p.m, p.k} || wi.sizes != std::vector<int64_t>{p.k, p.n} ||
      (p.m > 1 && xi.strides[0] != p.k) || (p.k > 1 && xi.strides[1] != 1) || (p.k > 1 && wi.strides[0] != 1) ||
      (p.n > 1 && wi.strides[1] != p.k) || xi.dtype != DType::float32 || wi.dtype != DType::float32)
    return false;
  if (p.bias) {
    const auto& bi = inputs[0].impl();
    if (bi.sizes != std::vector<int64_t>{p.n} || (p.n > 1 && bi.strides[0] != 1) || bi.dtype != DType::float32) return false;
  }
  if (out.defined() && (out.impl().sizes != std::vector<int64_t>{p.m, p.n} || !out.impl().is_contiguous ||
                        out.dtype() != DType::float32))
    return false;

  if (p.unstable.load(std::memory_order_relaxed)) return false;
  if (p.runs.fetch_add(1, std::memory_order_relaxed) == 0) return false;
  std::call_once(p.made, [&] { make_primitive(p); });
  if (!p.ready) return false;
  dnnl::engine& engine = cpu::onednn::cpu_engine();
  bool packed_now = false;
  std::shared_ptr<const memory> packed = PackedWeights::instance().get(wi, p.pd.weights_desc(), p.k, p.n, packed_now);
  if (!packed_now) {
    p.packs_in_a_row.store(0, std::memory_order_relaxed);
  } else if (p.packs_in_a_row.fetch_add(1, std::memory_order_relaxed) + 1 >= 3) {
    p.unstable.store(true, std::memory_order_relaxed);  // (this call still runs packed)
  }
  if (!out.defined()) out = kiln::detail::make_empty_strided({p.m, p.n}, {p.n, 1}, DType::float32, Device("cpu"));
  memory src(p.pd.src_desc(), engine, xi.data());
  memory dst(p.pd.dst_desc(), engine, out.impl().data());
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, *packed}, {DNNL_ARG_DST, dst}};
  if (p.bias) args.emplace(DNNL_ARG_BIAS, memory(p.pd.bias_desc(), engine, inputs[0].impl().data()));
  const memory::desc scratch = p.pd.scratchpad_desc();
  if (scratch.get_size() > 0) args.emplace(DNNL_ARG_SCRATCHPAD, memory(scratch, engine, thread_scratch(scratch.get_size())));
  p.primitive.execute(cpu::onednn::thread_stream(), args);
  cpu::onednn::thread_stream().wait();
  return true;
}

}  // namespace kiln::compiler::runtime
