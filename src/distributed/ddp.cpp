// DistributedDataParallel: gradient buckets all-reduced from post-accumulate hooks while the
// backward runs (the Reducer below), in one bucket order on every rank.
#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "autograd/node.h"
#include "compiler/capture/capture.h"
#include "distributed/backend.h"
#include "kiln/autograd.h"
#include "kiln/compiler.h"
#include "kiln/ops.h"

namespace kiln::nn {

namespace dist = kiln::distributed;

struct DistributedDataParallel::Reducer {
  struct Param {
    std::string name;
    Tensor tensor;
    size_t bucket = 0;
    int64_t offset = 0;  // in the bucket's flat buffer, elements
  };
  struct Bucket {
    DType dtype = kFloat32;
    int64_t numel = 0;
    std::vector<size_t> params;
    size_t pending = 0;
    Tensor flat;  // this iteration's gradients, concatenated; after the reduction, .grad() views it
    dist::Work work;
  };

  std::mutex mutex;
  std::shared_ptr<dist::ProcessGroup> group;
  bool find_unused = false;
  std::vector<Param> params;
  std::unordered_map<const detail::TensorImpl*, size_t> index_of;
  std::vector<Bucket> buckets;

  // Per iteration.
  bool sync = true;              // false inside no_sync()
  bool expecting = false;        // a forward prepared a reduction that has not finished
  std::vector<uint8_t> ready;    // per parameter: its gradient is in its bucket
  std::vector<uint8_t> used;     // per parameter: this rank's forward reached it
  size_t next_bucket = 0;        // the next bucket to launch; launches follow bucket order

  void prepare(const Tensor& output) {
    std::lock_guard lock(mutex);
    if (expecting) {
      std::string missing;
      for (size_t i = 0; i < params.size(); ++i)
        if (!ready[i]) missing += (missing.empty() ? "" : ", ") + params[i].name;
      throw ValueError(fmt::format(
          "[kiln::nn::DistributedDataParallel] the previous iteration's gradient reduction did not finish: no "
          "gradient arrived for {}. Every forward must be followed by a backward that reaches every parameter; "
          "if some parameters are not used, construct DistributedDataParallel with "
          "find_unused_parameters = true.",
          missing));
    }
    if (!sync) return;
    expecting = true;
    next_bucket = 0;
    std::fill(ready.begin(), ready.end(), 0);
    std::fill(used.begin(), used.end(), 1);
    for (Bucket& b : buckets) {
      b.pending = b.params.size();
      b.work = dist::Work();
    }
    if (!find_unused) return;
    // The parameters the forward reached: the leaves under the output's graph.
    std::unordered_set<const detail::TensorImpl*> reached;
    std::vector<autograd::Node*> stack;
    std::unordered_set<autograd::Node*> seen;
    if (auto* m = output.defined() ? autograd::meta_if_exists(output) : nullptr; m && m->grad_fn)
      stack.push_back(m->grad_fn.get());
    while (!stack.empty()) {
      autograd::Node* n = stack.back();
      stack.pop_back();
      if (!seen.insert(n).second) continue;
      if (auto* acc = dynamic_cast<autograd::AccumulateGrad*>(n)) reached.insert(acc->leaf.get());
      for (const autograd::Edge& e : n->next_edges)
        if (e.node) stack.push_back(e.node.get());
    }
    if (output.defined() && output.is_leaf()) reached.insert(output.unsafe_impl());
    for (size_t i = 0; i < params.size(); ++i) {
      if (reached.count(params[i].tensor.unsafe_impl())) continue;
      used[i] = 0;  // its slice of the bucket will be zeros
      mark_ready(i);
    }
    launch_ready_buckets();
    if (next_bucket == buckets.size()) finish();  // no parameter was reached at all
  }

  // Called with the mutex held.
  void mark_ready(size_t i) {
    ready[i] = 1;
    --buckets[params[i].bucket].pending;
  }

  // Starts every bucket whose gradients are all in, in bucket order: gathers them into a fresh flat
  // buffer (one memcpy each; zeros for a parameter this rank did not use) and all-reduces it.
  void launch_ready_buckets() {
    NoGradGuard no_grad;
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      // Inside a compiled training step the backward is being captured: the graph ends here, so
      // that this bucket's gradients are computed and its all-reduce overlaps the rest of the
      // backward, which goes on in the next graph (Dynamo's DDPOptimizer splits at the same points).
      if (compiler::is_compiling())
        compiler::detail::library_graph_break(fmt::format(
            "DistributedDataParallel: gradient bucket {} of {} is all-reduced here", next_bucket + 1, buckets.size()));
      compiler::detail::SuspendCapture eager;  // the gather and the collective run now, not in a graph
      Bucket& b = buckets[next_bucket++];
      b.flat = empty({b.numel}, TensorOptions(b.dtype, group->device()));
      for (size_t i : b.params) {
        const Param& p = params[i];
        Tensor slice = b.flat.narrow(0, p.offset, p.tensor.numel());
        Tensor g = used[i] ? p.tensor.grad() : Tensor();
        if (g.defined()) dist::copy_dense(slice, g);
        else slice.zero_();
      }
      b.work = dist::all_reduce_async(b.flat, dist::ReduceOp::avg, group);
    }
  }

  void on_gradient(const Tensor& param) {
    std::lock_guard lock(mutex);
    if (!expecting) return;  // no_sync(), or a backward that no DDP forward prepared
    auto it = index_of.find(param.unsafe_impl());
    if (it == index_of.end()) return;
    size_t i = it->second;
    if (ready[i]) {
      if (!used[i]) return;  // counted as unused; a later gradient would come too late for its bucket
      throw ValueError(fmt::format(
          "[kiln::nn::DistributedDataParallel] parameter {} received a second gradient in one iteration (a "
          "backward through the same forward twice, or two forwards before one backward). Run one forward, "
          "then one backward, per iteration.",
          params[i].name));
    }
    mark_ready(i);
    launch_ready_buckets();
    if (next_bucket == buckets.size()) finish();
  }

  // Every bucket was launched: wait for them, and make each .grad() a view of its bucket's
  // averages (PyTorch's gradient_as_bucket_view: no copy back; a kept reference to an old .grad()
  // sees the next iteration's values).
  void finish() {
    compiler::detail::SuspendCapture eager;  // inside a compiled step: real gradients, not graph values
    for (Bucket& b : buckets) b.work.wait();
    std::vector<uint8_t> used_anywhere(params.size(), 1);
    if (find_unused) {
      Tensor counts = tensor<uint8_t>(used);
      dist::all_reduce(counts, dist::ReduceOp::max, group);
      used_anywhere = counts.to_vector<uint8_t>();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (!used_anywhere[i]) continue;  // no rank used it: its gradient stays as it was
      const Param& p = params[i];
      p.tensor.set_grad(buckets[p.bucket].flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes()));
    }
    for (Bucket& b : buckets) b.work = dist::Work();
    expecting = false;
  }
};

namespace {

// Copies rank 0's buffers to every rank: one broadcast per dtype over a flat copy (PyTorch's
// broadcast_coalesced), not one per buffer.
void broadcast_buffers(const TensorList& buffers, const std::shared_ptr<dist::ProcessGroup>& group) {
  NoGradGuard no_grad;
  std::map<int, std::vector<Tensor>> by_dtype;
  for (const Tensor& b : buffers)
    if (b.defined() && b.numel() > 0) by_dtype[int(b.dtype())].push_back(b);
  for (auto& [dtype, same_dtype] : by_dtype) {
    int64_t total = 0;
    for (const Tensor& b : same_dtype) total += b.numel();
    Tensor flat = empty({total}, TensorOptions(DType(dtype), group->device()));
    int64_t at = 0;
    for (const Tensor& b : same_dtype) {
      dist::copy_dense(flat.narrow(0, at, b.numel()), b);
      at += b.numel();
    }
    dist::broadcast(flat, 0, group);
    at = 0;
    for (const Tensor& b : same_dtype) {
      dist::copy_dense(b, flat.narrow(0, at, b.numel()));
      at += b.numel();
    }
  }
}

// A fingerprint of the parameter shapes: ranks with different models fail at construction, not
// with garbage gradients.
int64_t shape_fingerprint(const NamedTensors& params) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  for (const auto& [name, t] : params) {
    mix(uint64_t(t.dtype()));
    for (int64_t s : t.sizes()) mix(uint64_t(s));
    mix(0xffff);
  }
  return int64_t(h >> 1);
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(ModulePtr module, DistributedDataParallelOptions options)
    : module_(std::move(module)), options_(std::move(options)) {
  KILN_CHECK(module_ != nullptr, ValueError, "[kiln::nn::DistributedDataParallel] the module is null.");
  KILN_CHECK(options_.bucket_cap_mb > 0, ValueError,
             "[kiln::nn::DistributedDataParallel] bucket_cap_mb must be positive.");
  group_ = options_.process_group ? options_.process_group : dist::default_group();
  register_module("module", module_);

  NamedTensors named;
  for (auto& [name, t] : module_->named_parameters())
    if (t.requires_grad()) named.emplace_back(name, t);
  KILN_CHECK(!named.empty(), ValueError,
             "[kiln::nn::DistributedDataParallel] the module has no parameter that requires grad.");
  for (const auto& [name, t] : named)
    KILN_CHECK(t.device() == group_->device() || group_->device().is_cpu(), DeviceError,
               fmt::format("[kiln::nn::DistributedDataParallel] parameter {} is on {}, the {} group's tensors on {}.",
                           name, t.device().str(), group_->backend(), group_->device().str()));

  {
    NoGradGuard no_grad;
    // Same model everywhere: compare the shapes, then start from rank 0's values.
    Tensor mine = tensor<int64_t>({int64_t(named.size()), shape_fingerprint(named)});
    Tensor all = empty({group_->size() * 2}, kInt64);
    dist::all_gather_into_tensor(all, mine, group_);
    std::vector<int64_t> v = all.to_vector<int64_t>();
    for (int r = 0; r < group_->size(); ++r)
      if (v[size_t(2 * r)] != v[0] || v[size_t(2 * r + 1)] != v[1])
        throw dist::DistributedError(fmt::format(
            "[kiln::nn::DistributedDataParallel] rank {}'s model differs from rank 0's ({} vs {} parameters, or "
            "other shapes). Every rank must build the same model.",
            r, v[size_t(2 * r)], v[0]));
    for (auto& [name, t] : named) {
      Tensor p = t;
      dist::broadcast(p, 0, group_);
    }
    broadcast_buffers(module_->buffers(), group_);
  }

  reducer_ = std::make_shared<Reducer>();
  Reducer& r = *reducer_;
  r.group = group_;
  r.find_unused = options_.find_unused_parameters;
  // Buckets in reverse registration order, one dtype per bucket; the first is small so that the
  // first all-reduce starts early in the backward.
  const int64_t cap = std::max<int64_t>(1, int64_t(options_.bucket_cap_mb * 1024 * 1024));
  const int64_t first_cap = std::min<int64_t>(cap, 1 << 20);
  std::unordered_map<int, size_t> open;  // dtype -> bucket being filled
  for (auto it = named.rbegin(); it != named.rend(); ++it) {
    const Tensor& t = it->second;
    auto found = open.find(int(t.dtype()));
    if (found == open.end() ||
        r.buckets[found->second].numel * itemsize(t.dtype()) >= (found->second == 0 ? first_cap : cap)) {
      r.buckets.push_back(Reducer::Bucket{.dtype = t.dtype()});
      found = open.insert_or_assign(int(t.dtype()), r.buckets.size() - 1).first;
    }
    Reducer::Bucket& bucket = r.buckets[found->second];
    r.index_of[t.unsafe_impl()] = r.params.size();
    bucket.params.push_back(r.params.size());
    r.params.push_back(Reducer::Param{it->first, t, found->second, bucket.numel});
    bucket.numel += t.numel();
  }
  r.ready.assign(r.params.size(), 0);
  r.used.assign(r.params.size(), 1);

  std::weak_ptr<Reducer> weak = reducer_;
  for (auto& p : r.params)
    autograd::register_post_accumulate_hook(p.tensor, [weak](const Tensor& param) {
      if (auto reducer = weak.lock()) reducer->on_gradient(param);
    });
}

DistributedDataParallel::~DistributedDataParallel() = default;

Tensor DistributedDataParallel::forward(const Tensor& input) {
  if (options_.broadcast_buffers && group_->size() > 1) {
    TensorList buffers = module_->buffers();
    if (!buffers.empty()) {
      if (compiler::is_compiling())
        compiler::detail::library_graph_break(
            "DistributedDataParallel: rank 0's buffers are broadcast before the forward");
      compiler::detail::SuspendCapture eager;
      broadcast_buffers(buffers, group_);
    }
  }
  Tensor out = module_->forward(input);
  if (is_grad_enabled()) reducer_->prepare(out);
  return out;
}

std::vector<std::vector<std::string>> DistributedDataParallel::buckets() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : reducer_->buckets) {
    out.emplace_back();
    for (size_t i : b.params) out.back().push_back(reducer_->params[i].name);
  }
  return out;
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp) {
  std::lock_guard lock(ddp_.reducer_->mutex);
  previous_ = ddp_.reducer_->sync;
  ddp_.reducer_->sync = false;
}

DistributedDataParallel::NoSync::~NoSync() {
  std::lock_guard lock(ddp_.reducer_->mutex);
  ddp_.reducer_->sync = previous_;
}

}  // namespace kiln::nn
