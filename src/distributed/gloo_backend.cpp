// The Gloo backend: a full mesh of TCP pairs set up through the rendezvous store, and one worker
// thread per group that runs its collectives in the order they were issued (every rank issues the
// same order, so Gloo's per-op tags agree). Reductions are Kiln's own per dtype, so every Kiln
// dtype reduces, float16 and bfloat16 included.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <cstring>
#include <deque>
#include <thread>

#include <fmt/format.h>

#include "distributed/backend.h"
#include "distributed/socket_util.h"
#include "kiln/autograd.h"
#include "kiln/half.h"
#include "kiln/ops.h"

namespace kiln::distributed {
namespace {

// Gloo's rendezvous speaks to our TcpStore under the group's key prefix. Gloo waits with its own
// 30-second default; ranks that start far apart (one still loading a model) get the group's timeout.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(TcpStore& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(prefix_ + key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_.wait(full, std::max(timeout, timeout_));
  }

 private:
  TcpStore& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// ---- reductions: c = a (op) b over n elements of T ----

template <class T, class F>
void reduce_with(void* c, const void* a, const void* b, size_t n, F f) {
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = f(x[i], y[i]);
}

// 16-bit floats reduce in float32 and round once per step, as PyTorch's Gloo reductions do.
template <class T> using Wide = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

template <class T>
gloo::AllreduceOptions::Func reduce_function(ReduceOp op) {
  using W = Wide<T>;
  if constexpr (std::is_same_v<T, bool>) {
    if (op == ReduceOp::min || op == ReduceOp::product)
      return [](void* c, const void* a, const void* b, size_t n) { reduce_with<bool>(c, a, b, n, [](bool x, bool y) { return x && y; }); };
    return [](void* c, const void* a, const void* b, size_t n) { reduce_with<bool>(c, a, b, n, [](bool x, bool y) { return x || y; }); };
  } else {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:  // divided by the group size afterwards
        return [](void* c, const void* a, const void* b, size_t n) {
          reduce_with<T>(c, a, b, n, [](T x, T y) { return T(W(x) + W(y)); });
        };
      case ReduceOp::product:
        return [](void* c, const void* a, const void* b, size_t n) {
          reduce_with<T>(c, a, b, n, [](T x, T y) { return T(W(x) * W(y)); });
        };
      case ReduceOp::max:  // NaN wins, as in PyTorch
        return [](void* c, const void* a, const void* b, size_t n) {
          reduce_with<T>(c, a, b, n, [](T x, T y) { return W(x) != W(x) || W(x) > W(y) ? x : y; });
        };
      case ReduceOp::min:
        return [](void* c, const void* a, const void* b, size_t n) {
          reduce_with<T>(c, a, b, n, [](T x, T y) { return W(x) != W(x) || W(x) < W(y) ? x : y; });
        };
    }
    return nullptr;
  }
}

template <class F>
auto visit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bool_: return f(bool{});
    case DType::uint8: return f(uint8_t{});
    case DType::int8: return f(int8_t{});
    case DType::int32: return f(int32_t{});
    case DType::int64: return f(int64_t{});
    case DType::float16: return f(Half{});
    case DType::bfloat16: return f(BFloat16{});
    case DType::float32: return f(float{});
    case DType::float64: return f(double{});
  }
  throw DTypeError("[kiln::distributed] unknown dtype");
}

// Runs a Gloo collective with `elements` of T in `out` (and `in`, when given).
void gloo_all_reduce(const std::shared_ptr<gloo::Context>& ctx, uint32_t tag, std::chrono::milliseconds timeout,
                     const Tensor& t, ReduceOp op) {
  visit_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    gloo::AllreduceOptions opts(ctx);
    opts.setOutput(static_cast<T*>(t.raw_data_ptr()), size_t(t.numel()));
    opts.setReduceFunction(reduce_function<T>(op));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allreduce(opts);
  });
}

class GlooGroup : public ProcessGroup {
 public:
  explicit GlooGroup(const GroupSetup& setup) : setup_(setup) {
    gloo::transport::tcp::attr attr;
    // GLOO_SOCKET_IFNAME picks an interface, as in PyTorch; else the one that routes to the store
    // (loopback for a single-host job, so nothing listens on the network).
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) attr.iface = ifname;
    else attr.hostname = socket_util::local_address_towards(setup.master_addr);
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(setup.rank, setup.size);
      ctx->setTimeout(setup.timeout);
      GlooStore store(*setup.store, setup.prefix, setup.timeout);
      ctx->connectFullMesh(store, device_);
      context_ = ctx;
    } catch (const DistributedError& e) {
      throw DistributedError(describe_failure(setup_, "init_process_group (gloo rendezvous)", e.what()));
    } catch (const std::exception& e) {
      throw DistributedError(describe_failure(setup_, "init_process_group (gloo rendezvous)", e.what()));
    }
    worker_ = std::thread([this] { run_queue(); });
  }

  ~GlooGroup() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
    context_.reset();
  }

  const std::string& backend() const override {
    static const std::string name = "gloo";
    return name;
  }
  int rank() const override { return setup_.rank; }
  int size() const override { return setup_.size; }
  std::chrono::milliseconds timeout() const override { return setup_.timeout; }
  Device device() const override { return kCPU; }

  Work all_reduce(Tensor tensor, ReduceOp op) override {
    check_backend_tensor(tensor, kCPU, "all_reduce");
    return enqueue("all_reduce", {tensor}, [this, tensor, op](uint32_t tag) {
      if (tensor.numel() == 0) return;
      gloo_all_reduce(context_, tag, setup_.timeout, tensor, op);
      if (op == ReduceOp::avg) divide_by_size(tensor);
    });
  }

  Work broadcast(Tensor tensor, int root) override {
    check_backend_tensor(tensor, kCPU, "broadcast");
    return enqueue("broadcast", {tensor}, [this, tensor, root](uint32_t tag) {
      if (tensor.numel() == 0) return;
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(tensor.raw_data_ptr()), size_t(tensor.nbytes()));
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(setup_.timeout);
      gloo::broadcast(opts);
    });
  }

  Work all_gather(Tensor output, Tensor input) override {
    check_backend_tensor(output, kCPU, "all_gather");
    check_backend_tensor(input, kCPU, "all_gather");
    KILN_CHECK(output.nbytes() == input.nbytes() * setup_.size, ShapeError,
               "[kiln::distributed::all_gather] the output must hold world_size times the input.");
    return enqueue("all_gather", {output, input}, [this, output, input](uint32_t tag) {
      if (input.numel() == 0) return;
      gloo::AllgatherOptions opts(context_);
      opts.setInput(static_cast<uint8_t*>(input.raw_data_ptr()), size_t(input.nbytes()));
      opts.setOutput(static_cast<uint8_t*>(output.raw_data_ptr()), size_t(output.nbytes()));
      opts.setTag(tag);
      opts.setTimeout(setup_.timeout);
      gloo::allgather(opts);
    });
  }

  // Gloo has no reduce-scatter in its options API: all-reduce a copy of the input and keep this
  // rank's slice (twice the traffic of a ring reduce-scatter; DDP does not use it).
  Work reduce_scatter(Tensor output, Tensor input, ReduceOp op) override {
    check_backend_tensor(output, kCPU, "reduce_scatter");
    check_backend_tensor(input, kCPU, "reduce_scatter");
    KILN_CHECK(input.nbytes() == output.nbytes() * setup_.size, ShapeError,
               "[kiln::distributed::reduce_scatter] the input must hold world_size times the output.");
    return enqueue("reduce_scatter", {output, input}, [this, output, input, op](uint32_t tag) {
      if (output.numel() == 0) return;
      Tensor sum = input.clone();
      gloo_all_reduce(context_, tag, setup_.timeout, sum, op);
      if (op == ReduceOp::avg) divide_by_size(sum);
      std::memcpy(output.raw_data_ptr(),
                  static_cast<const uint8_t*>(sum.raw_data_ptr()) + output.nbytes() * setup_.rank,
                  size_t(output.nbytes()));
    });
  }

  Work barrier() override {
    return enqueue("barrier", {}, [this](uint32_t tag) {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(setup_.timeout);
      gloo::barrier(opts);
    });
  }

 private:
  struct Task {
    std::string op;
    std::function<void(uint32_t)> run;
    std::shared_ptr<Work::State> state;
  };

  Work enqueue(const char* op, std::vector<Tensor> tensors, std::function<void(uint32_t)> run) {
    auto state = std::make_shared<Work::State>();
    state->keep_alive = std::move(tensors);
    {
      std::lock_guard lock(mutex_);
      if (!broken_.empty()) {
        state->finish(std::make_exception_ptr(DistributedError(broken_)));
        return Work(state);
      }
      queue_.push_back(Task{op, std::move(run), state});
    }
    cv_.notify_one();
    return Work(state);
  }

  void run_queue() {
    uint32_t tag = 0;
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything issued has run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      std::string broken;
      {
        std::lock_guard lock(mutex_);
        broken = broken_;
      }
      if (!broken.empty()) {
        error = std::make_exception_ptr(DistributedError(broken));
      } else {
        try {
          NoGradGuard no_grad;
          task.run(tag++);
        } catch (const Error& e) {
          error = std::current_exception();
        } catch (const std::exception& e) {
          // A Gloo failure leaves its pairs unusable: the group is broken from here on.
          std::string message = describe_failure(setup_, task.op, fmt::format("gloo: {}", e.what()));
          {
            std::lock_guard lock(mutex_);
            broken_ = message;
          }
          error = std::make_exception_ptr(DistributedError(message));
        }
      }
      task.state->keep_alive.clear();
      task.state->finish(error);
    }
  }

  void divide_by_size(const Tensor& t) const {
    Tensor view = t;
    view.div_(double(setup_.size));
  }

  GroupSetup setup_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::string broken_;
  std::thread worker_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(const GroupSetup& setup) { return std::make_shared<GlooGroup>(setup); }

}  // namespace kiln::distributed
