// The front end of kiln::distributed: the default group and its rendezvous from torchrun's
// environment, argument checks, staging of tensors a backend cannot take as they are (strided, or
// on another device), and the KILN_DISTRIBUTED_DEBUG=detail cross-rank check.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/dispatch.h"
#include "distributed/backend.h"
#include "kiln/autograd.h"
#include "kiln/ops.h"
#ifdef KILN_WITH_CUDA
#include "kernels/cuda/cuda_runtime.h"
#endif

namespace kiln::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::product: return "product";
  }
  return "?";
}

// ---- Work ----

void Work::wait() const {
  if (!state_) return;
  if (state_->inner) Work(state_->inner).wait();
  std::unique_lock lock(state_->mutex);
  if (!state_->done && state_->stream_pending) {
    state_->wait_on_stream();  // later GPU work on this thread's stream sees the result
  } else {
    state_->cv.wait(lock, [&] { return state_->done; });
    if (state_->error) std::rethrow_exception(state_->error);
  }
  if (state_->then && !state_->then_ran) {
    state_->then_ran = true;
    NoGradGuard no_grad;
    state_->then();
  }
}

bool Work::is_completed() const {
  if (!state_) return true;
  if (state_->inner && !Work(state_->inner).is_completed()) return false;
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

// ---- shared by the backends ----

std::string describe_failure(const GroupSetup& setup, const std::string& op, const std::string& detail) {
  // The store's server notices a dead rank's closed connection about when the backend does; give
  // it a moment, so that the message can name the rank.
  std::vector<int> lost;
  bool store_gone = false;
  for (int attempt = 0; attempt < 20 && setup.store; ++attempt) {
    try {
      lost = setup.store->lost_ranks();
    } catch (const DistributedError&) {
      store_gone = true;
      break;
    }
    if (!lost.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string head = fmt::format("[kiln::distributed] {} failed on rank {} of {}", op, setup.rank, setup.size);
  if (!lost.empty()) {
    std::string ranks;
    for (int r : lost) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    return fmt::format("{}: rank{} {} exited or crashed (its connection to the rendezvous store closed). ({})", head,
                       lost.size() > 1 ? "s" : "", ranks, detail);
  }
  if (store_gone)
    return fmt::format("{}: rank 0, which serves the rendezvous store, exited or crashed. ({})", head, detail);
  return fmt::format("{}: {}. If it timed out, a rank did not issue this collective or is stuck: every rank must "
                     "issue the same collectives in the same order (KILN_DISTRIBUTED_DEBUG=detail checks this).",
                     head, detail);
}

void copy_dense(const Tensor& dst, const Tensor& src) {
  KILN_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), ValueError,
             "[kiln::distributed] copy_dense needs tensors of one dtype and size.");
  if (dst.numel() == 0) return;
  if (!dst.is_contiguous() || !src.is_contiguous() || dst.device() != src.device()) {
    NoGradGuard no_grad;
    Tensor d = dst;
    d.copy_(src.reshape(dst.sizes()));
    return;
  }
  if (dst.is_cuda()) {
#ifdef KILN_WITH_CUDA
    const int device = dst.device().index;
    cuda::detail::DeviceGuard guard(device);
    cuda::detail::check(cudaMemcpyAsync(dst.impl().data(), src.impl().data(), size_t(dst.nbytes()),
                                        cudaMemcpyDeviceToDevice, cuda::detail::current_stream(device)),
                        "distributed: copy");
#endif
  } else {
    std::memcpy(dst.impl().data(), src.impl().data(), size_t(dst.nbytes()));
  }
  kiln::detail::bump_version(dst);
}

void check_backend_tensor(const Tensor& t, Device device, const char* op) {
  KILN_CHECK(t.defined() && t.is_contiguous() && t.device() == device, ValueError,
             fmt::format("[kiln::distributed::{}] the backend takes dense tensors on {}; call the free function "
                         "kiln::distributed::{} (it stages other tensors).",
                         op, device.str(), op));
}

// ---- the default group ----

namespace {

struct Global {
  std::mutex mutex;
  std::shared_ptr<TcpStore> store;
  GroupSetup base;
  std::string backend;
  std::shared_ptr<ProcessGroup> group;
  int next_group_id = 0;
};

// Never destroyed: a group still alive at exit is left to the OS (its threads and sockets), not
// torn down by static destructors while Gloo's own statics may be gone.
Global& global() {
  static auto* g = new Global;
  return *g;
}

std::optional<std::string> env(const char* name) {
  if (const char* v = std::getenv(name); v && *v) return std::string(v);
  return std::nullopt;
}

int env_int(const char* name, const char* option) {
  auto v = env(name);
  KILN_CHECK(v.has_value(), ValueError,
             fmt::format("[kiln::distributed::init_process_group] {} is not set. Start the program with `kiln launch "
                         "--nproc N program` (or torchrun), or set InitOptions::{}.",
                         name, option));
  char* end = nullptr;
  long n = std::strtol(v->c_str(), &end, 10);
  KILN_CHECK(end && *end == '\0' && n >= 0 && n < (1 << 24), ValueError,
             fmt::format("[kiln::distributed::init_process_group] {}='{}' is not a valid number.", name, *v));
  return int(n);
}

std::chrono::milliseconds default_timeout() {
  if (auto v = env("KILN_DISTRIBUTED_TIMEOUT")) {
    char* end = nullptr;
    double s = std::strtod(v->c_str(), &end);
    KILN_CHECK(end && *end == '\0' && s > 0 && s < 1e7, ValueError,
               fmt::format("[kiln::distributed] KILN_DISTRIBUTED_TIMEOUT='{}' must be a positive number of seconds.", *v));
    return std::chrono::milliseconds(int64_t(s * 1000));
  }
  return std::chrono::minutes(10);
}

std::shared_ptr<ProcessGroup> make_group(const std::string& backend, const GroupSetup& setup) {
#ifdef KILN_WITH_NCCL
  if (backend == "nccl") return make_nccl_group(setup);
#endif
  (void)backend;  // checked by init_process_group
  return make_gloo_group(setup);
}

constexpr bool kHaveNccl =
#ifdef KILN_WITH_NCCL
    true;
#else
    false;
#endif

bool debug_detail() {
  static const bool on = [] {
    auto v = env("KILN_DISTRIBUTED_DEBUG");
    return v && (*v == "detail" || *v == "DETAIL");
  }();
  return on;
}

std::shared_ptr<ProcessGroup> resolve(std::shared_ptr<ProcessGroup> group) { return group ? group : default_group(); }

// The tensor a backend can take for `t`: t itself when it is dense on `device`, else a dense copy
// there (`staged`).
Tensor dense_on(const Tensor& t, Device device, bool& staged) {
  staged = !(t.device() == device && t.is_contiguous());
  Tensor dense = staged ? t.to(device).contiguous() : t;
  // A value still being captured by compile() is computed here, on the calling thread, before a
  // backend's thread touches its memory.
  (void)dense.impl().data();
  return dense;
}

// A tensor a collective writes. The backend writes `buffer`: the caller's tensor itself when it
// is dense on the group's device (its version is bumped now), else a dense copy whose result
// finish() has the Work write back into the caller's tensor on wait().
struct Written {
  Tensor target, buffer;
  bool staged = false;
  Written(const Tensor& t, Device device, bool writes = true) : target(t) {
    buffer = dense_on(t, device, staged);
    if (writes && !staged) kiln::detail::bump_version(t);
  }
  Work finish(Work work) const {
    if (!staged) return work;
    return Work::State::then_after(work, [target = target, buffer = buffer]() mutable { target.copy_(buffer); });
  }
};

// Every rank describes the collective it is about to run; a mismatch is named instead of hanging.
enum class OpKind : int64_t { all_reduce = 1, broadcast, all_gather, reduce_scatter, barrier };
const char* op_kind_name(int64_t k) {
  static const char* names[] = {"?", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"};
  return k >= 1 && k <= 5 ? names[k] : "?";
}

void check_same_call(ProcessGroup& group, OpKind kind, const Tensor* t, int64_t extra) {
  if (!debug_detail() || group.size() == 1) return;
  constexpr int64_t kFields = 4;
  std::vector<int64_t> mine = {int64_t(kind), t ? int64_t(t->dtype()) : -1, t ? t->numel() : -1, extra};
  Tensor sig = tensor<int64_t>(mine);
  Tensor all = empty({group.size() * kFields}, TensorOptions(kInt64, group.device()));
  group.all_gather(all, sig.to(group.device())).wait();
  std::vector<int64_t> v = all.to_vector<int64_t>();
  for (int r = 0; r < group.size(); ++r) {
    const int64_t* o = v.data() + r * kFields;
    if (std::equal(o, o + kFields, mine.data())) continue;
    auto text = [](const int64_t* f) {
      std::string s = op_kind_name(f[0]);
      if (f[1] >= 0) s += fmt::format("(dtype {}, {} elements, arg {})", dtype_name(DType(f[1])), f[2], f[3]);
      return s;
    };
    throw DistributedError(fmt::format(
        "[kiln::distributed] KILN_DISTRIBUTED_DEBUG=detail: ranks disagree on the next collective: rank {} calls "
        "{}, rank {} calls {}. Every rank must issue the same collectives, with tensors of the same dtype and size, "
        "in the same order.",
        group.rank(), text(mine.data()), r, text(o)));
  }
}

}  // namespace

bool is_nccl_available() { return kHaveNccl; }

void init_process_group(const InitOptions& options) {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  KILN_CHECK(!g.group, distributed::DistributedError,
             "[kiln::distributed::init_process_group] the default process group is already initialized. Call "
             "destroy_process_group() first.");
  std::string backend = options.backend;
  if (backend.empty()) backend = kHaveNccl && cuda::is_available() ? "nccl" : "gloo";
  KILN_CHECK(backend == "gloo" || backend == "nccl", ValueError,
             fmt::format("[kiln::distributed::init_process_group] unknown backend '{}'. Use \"gloo\" (CPU "
                         "tensors) or \"nccl\" (CUDA tensors).",
                         backend));
  KILN_CHECK(backend != "nccl" || kHaveNccl, DeviceError,
             "[kiln::distributed::init_process_group] this Kiln was built without NCCL (it comes with the CUDA "
             "toolkit: configure with KILN_CUDA=ON where libnccl is installed), so only \"gloo\" is available.");
  KILN_CHECK(backend != "nccl" || cuda::is_available(), DeviceError,
             "[kiln::distributed::init_process_group] the nccl backend needs a GPU, and none is visible. Use \"gloo\".");
  int world = options.world_size >= 0 ? options.world_size : env_int("WORLD_SIZE", "world_size");
  int rank = options.rank >= 0 ? options.rank : env_int("RANK", "rank");
  KILN_CHECK(world >= 1 && rank >= 0 && rank < world, ValueError,
             fmt::format("[kiln::distributed::init_process_group] rank {} is not in [0, world_size={}).", rank, world));
  std::chrono::milliseconds timeout = options.timeout.value_or(default_timeout());
  KILN_CHECK(timeout.count() > 0, ValueError, "[kiln::distributed::init_process_group] the timeout must be positive.");

  std::string host;
  int port = 0;
  if (options.init_method.empty() || options.init_method == "env://") {
    host = env("MASTER_ADDR").value_or(world == 1 ? "127.0.0.1" : "");
    KILN_CHECK(!host.empty(), ValueError,
               "[kiln::distributed::init_process_group] MASTER_ADDR is not set. Start the program with `kiln launch`, "
               "or set MASTER_ADDR and MASTER_PORT, or pass InitOptions::init_method = \"tcp://host:port\".");
    port = env("MASTER_PORT") ? env_int("MASTER_PORT", "init_method") : (world == 1 ? 0 : -1);
    KILN_CHECK(port >= 0, ValueError, "[kiln::distributed::init_process_group] MASTER_PORT is not set.");
  } else if (options.init_method.rfind("tcp://", 0) == 0) {
    std::string rest = options.init_method.substr(6);
    size_t colon = rest.rfind(':');
    char* end = nullptr;
    long p = colon == std::string::npos ? -1 : std::strtol(rest.c_str() + colon + 1, &end, 10);
    KILN_CHECK(colon != std::string::npos && colon > 0 && end && *end == '\0' && p > 0 && p < 65536, ValueError,
               fmt::format("[kiln::distributed::init_process_group] init_method '{}' is not tcp://host:port.",
                           options.init_method));
    host = rest.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    port = int(p);
  } else {
    throw ValueError(fmt::format(
        "[kiln::distributed::init_process_group] init_method '{}' is not supported: use \"env://\" or "
        "\"tcp://host:port\".",
        options.init_method));
  }

  TcpStore::Options so;
  so.host = host;
  so.port = port;
  so.is_server = rank == 0;
  so.rank = rank;
  so.timeout = timeout;
  auto store = std::make_shared<TcpStore>(so);

  GroupSetup setup;
  setup.rank = rank;
  setup.size = world;
  setup.store = store;
  setup.master_addr = host;
  setup.timeout = timeout;
  setup.prefix = "/kiln/pg/0/";
  auto group = make_group(backend, setup);
  g.store = std::move(store);
  g.base = setup;
  g.backend = backend;
  g.group = std::move(group);
  g.next_group_id = 1;
}

bool is_initialized() {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  return g.group != nullptr;
}

void destroy_process_group() {
  Global& g = global();
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<TcpStore> store;
  {
    std::lock_guard lock(g.mutex);
    KILN_CHECK(g.group, ValueError,
               "[kiln::distributed::destroy_process_group] no process group is initialized.");
    group = std::move(g.group);
    store = std::move(g.store);
    g.base = GroupSetup{};
  }
  // Groups made by new_group() keep the store alive through their setup until they are dropped.
  group.reset();
  store.reset();
}

std::shared_ptr<ProcessGroup> default_group() {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  KILN_CHECK(g.group, ValueError,
             "[kiln::distributed] no process group is initialized. Call kiln::distributed::init_process_group() "
             "first.");
  return g.group;
}

std::shared_ptr<ProcessGroup> new_group() {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  KILN_CHECK(g.group, ValueError,
             "[kiln::distributed::new_group] no process group is initialized. Call init_process_group() first.");
  GroupSetup setup = g.base;
  setup.prefix = fmt::format("/kiln/pg/{}/", g.next_group_id++);
  return make_group(g.backend, setup);
}

int get_rank() { return default_group()->rank(); }
int get_world_size() { return default_group()->size(); }
int get_local_rank() {
  auto v = env("LOCAL_RANK");
  return v ? env_int("LOCAL_RANK", "rank") : 0;
}

// ---- collectives ----

namespace {

void check_defined(const Tensor& t, const char* op, const char* what) {
  KILN_CHECK(t.defined(), ValueError, fmt::format("[kiln::distributed::{}] {} is undefined.", op, what));
}

// Each of `list` (one tensor per rank) must be defined, with `like`'s shape and dtype.
void check_each_like(const std::vector<Tensor>& list, const Tensor& like, int world, const char* op,
                     const char* each, const char* like_name) {
  KILN_CHECK(list.size() == size_t(world), ValueError,
             fmt::format("[kiln::distributed::{}] needs one {} per rank ({}), got {}.", op, each, world, list.size()));
  for (const Tensor& t : list) {
    check_defined(t, op, (std::string("an ") + each).c_str());
    KILN_CHECK(t.dtype() == like.dtype() && t.sizes() == like.sizes(), ShapeError,
               fmt::format("[kiln::distributed::{}] every {} must have the {}'s shape {} and dtype {}; one has {} and "
                           "{}.",
                           op, each, like_name, shape_str(like.sizes()), dtype_name(like.dtype()), shape_str(t.sizes()),
                           dtype_name(t.dtype())));
  }
}

void check_reduce_op(ReduceOp op, DType dtype, const char* name) {
  KILN_CHECK(op != ReduceOp::avg || is_floating_point(dtype), DTypeError,
             fmt::format("[kiln::distributed::{}] avg needs a floating-point tensor, not {}. Sum, then divide.", name,
                         dtype_name(dtype)));
}

}  // namespace

Work all_reduce_async(Tensor& tensor, ReduceOp op, std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_defined(tensor, "all_reduce", "the tensor");
  check_reduce_op(op, tensor.dtype(), "all_reduce");
  NoGradGuard no_grad;
  check_same_call(*group, OpKind::all_reduce, &tensor, int64_t(op));
  Written t(tensor, group->device());
  return t.finish(group->all_reduce(t.buffer, op));
}

void all_reduce(Tensor& tensor, ReduceOp op, std::shared_ptr<ProcessGroup> group) {
  all_reduce_async(tensor, op, std::move(group)).wait();
}

Work broadcast_async(Tensor& tensor, int root, std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_defined(tensor, "broadcast", "the tensor");
  KILN_CHECK(root >= 0 && root < group->size(), ValueError,
             fmt::format("[kiln::distributed::broadcast] root {} is not a rank of a group of {}.", root, group->size()));
  NoGradGuard no_grad;
  check_same_call(*group, OpKind::broadcast, &tensor, root);
  const bool receives = group->rank() != root;
  Written t(tensor, group->device(), receives);
  Work w = group->broadcast(t.buffer, root);
  return receives ? t.finish(w) : w;
}

void broadcast(Tensor& tensor, int root, std::shared_ptr<ProcessGroup> group) {
  broadcast_async(tensor, root, std::move(group)).wait();
}

Work all_gather_async(std::vector<Tensor>& outputs, const Tensor& input, std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_defined(input, "all_gather", "the input");
  check_each_like(outputs, input, group->size(), "all_gather", "output", "input");
  NoGradGuard no_grad;
  check_same_call(*group, OpKind::all_gather, &input, 0);
  bool staged = false;
  Tensor in = dense_on(input, group->device(), staged);
  Tensor flat = empty({group->size() * input.numel()}, TensorOptions(input.dtype(), group->device()));
  Work w = group->all_gather(flat, in);
  int64_t n = input.numel();
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
  return Work::State::then_after(w, [outputs, flat, n, sizes] {
    for (size_t r = 0; r < outputs.size(); ++r) {
      Tensor out = outputs[r];
      out.copy_(flat.narrow(0, int64_t(r) * n, n).view(sizes));
    }
  });
}

void all_gather(std::vector<Tensor>& outputs, const Tensor& input, std::shared_ptr<ProcessGroup> group) {
  all_gather_async(outputs, input, std::move(group)).wait();
}

void all_gather_into_tensor(Tensor& output, const Tensor& input, std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_defined(input, "all_gather_into_tensor", "the input");
  check_defined(output, "all_gather_into_tensor", "the output");
  KILN_CHECK(output.dtype() == input.dtype() && output.numel() == group->size() * input.numel(), ShapeError,
             fmt::format("[kiln::distributed::all_gather_into_tensor] the output must hold world_size ({}) times the "
                         "input's {} elements of {}; it holds {} of {}.",
                         group->size(), input.numel(), dtype_name(input.dtype()), output.numel(),
                         dtype_name(output.dtype())));
  NoGradGuard no_grad;
  check_same_call(*group, OpKind::all_gather, &input, 0);
  bool in_staged = false;
  Tensor in = dense_on(input, group->device(), in_staged);
  Written out(output, group->device());
  out.finish(group->all_gather(out.buffer, in)).wait();
}

Work reduce_scatter_tensor_async(Tensor& output, const Tensor& input, ReduceOp op,
                                 std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_defined(input, "reduce_scatter", "the input");
  check_defined(output, "reduce_scatter", "the output");
  check_reduce_op(op, input.dtype(), "reduce_scatter");
  KILN_CHECK(output.dtype() == input.dtype() && input.numel() == group->size() * output.numel(), ShapeError,
             fmt::format("[kiln::distributed::reduce_scatter] the input must hold world_size ({}) times the "
                         "output's {} elements of {}; it holds {} of {}.",
                         group->size(), output.numel(), dtype_name(output.dtype()), input.numel(),
                         dtype_name(input.dtype())));
  NoGradGuard no_grad;
  check_same_call(*group, OpKind::reduce_scatter, &output, int64_t(op));
  bool in_staged = false;
  Tensor in = dense_on(input, group->device(), in_staged);
  Written out(output, group->device());
  return out.finish(group->reduce_scatter(out.buffer, in, op));
}

void reduce_scatter_tensor(Tensor& output, const Tensor& input, ReduceOp op, std::shared_ptr<ProcessGroup> group) {
  reduce_scatter_tensor_async(output, input, op, std::move(group)).wait();
}

void reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op,
                    std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_defined(output, "reduce_scatter", "the output");
  check_each_like(inputs, output, group->size(), "reduce_scatter", "input", "output");
  TensorList flat;
  for (const Tensor& t : inputs) flat.push_back(t.reshape({-1}));
  Tensor joined;
  {
    NoGradGuard no_grad;
    joined = cat(flat, 0);
  }
  reduce_scatter_tensor(output, joined, op, std::move(group));
}

void barrier(std::shared_ptr<ProcessGroup> group) {
  group = resolve(std::move(group));
  check_same_call(*group, OpKind::barrier, nullptr, 0);
  group->barrier().wait();
}

}  // namespace kiln::distributed
