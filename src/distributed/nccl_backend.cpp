// The NCCL backend: one communicator per group on this rank's GPU, collectives on a stream of the
// group's own so that they overlap the caller's compute, ordered after it by events (as PyTorch's
// ProcessGroupNCCL). Work::wait() makes the caller's current stream wait; the host is not blocked.
//
// A watchdog thread per group retires finished work (releasing the tensors it kept alive: the
// caching allocator may not hand their memory to other streams before NCCL is done with it) and
// enforces the timeout: a collective still running after it, a communicator that reports an
// asynchronous error, or a rank the store saw die, aborts the communicator and fails the group
// with a message naming the rank.
#ifdef KILN_WITH_NCCL  // CMakeLists.txt defines it where NCCL was found

#include <nccl.h>

#include <cstring>
#include <deque>
#include <thread>

#include <fmt/format.h>

#include "distributed/backend.h"
#include "kernels/cuda/cuda_runtime.h"
#include "kiln/ops.h"

namespace kiln::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using cuda::detail::check;

std::string nccl_text(ncclResult_t r) { return fmt::format("NCCL error {}: {}", int(r), ncclGetErrorString(r)); }

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::bool_:
    case DType::uint8: return ncclUint8;
    case DType::int8: return ncclInt8;
    case DType::int32: return ncclInt32;
    case DType::int64: return ncclInt64;
    case DType::float16: return ncclFloat16;
    case DType::bfloat16: return ncclBfloat16;
    case DType::float32: return ncclFloat32;
    case DType::float64: return ncclFloat64;
  }
  throw DTypeError("[kiln::distributed] unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op, DType dtype) {
  if (dtype == kBool) {  // bytes 0/1: or is max, and is min
    return op == ReduceOp::min || op == ReduceOp::product ? ncclMin : ncclMax;
  }
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::product: return ncclProd;
  }
  return ncclSum;
}

// The GPU this rank uses: $LOCAL_RANK modulo the visible GPUs when set, else the current device.
int rank_device() {
  int count = cuda::device_count();
  KILN_CHECK(count > 0, DeviceError, "[kiln::distributed] the nccl backend needs a GPU; none is visible.");
  if (const char* lr = std::getenv("LOCAL_RANK"); lr && *lr) return get_local_rank() % count;
  return cuda::current_device();
}

class NcclGroup : public ProcessGroup {
 public:
  explicit NcclGroup(const GroupSetup& setup) : setup_(setup), device_index_(rank_device()) {
    cuda::set_device(device_index_);  // this thread's tensors go to the rank's GPU from now on
    cuda::detail::DeviceGuard guard(device_index_);
    ncclUniqueId id;
    std::string key = setup.prefix + "nccl_unique_id";
    try {
      if (setup.rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) throw DistributedError(nccl_text(r));
        setup.store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                   reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
      } else {
        auto bytes = setup.store->get(key);
        if (bytes.size() != sizeof(id)) throw DistributedError("the store holds a malformed NCCL id");
        std::memcpy(&id, bytes.data(), sizeof(id));
      }
      ncclResult_t r = ncclCommInitRank(&comm_, setup.size, id, setup.rank);
      if (r != ncclSuccess) throw DistributedError(nccl_text(r));
    } catch (const std::exception& e) {
      throw DistributedError(describe_failure(setup_, "init_process_group (nccl)", e.what()));
    }
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "distributed: stream");
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclGroup() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    watchdog_.join();  // retires (or times out) everything still pending
    cuda::detail::DeviceGuard guard(device_index_);
    if (comm_) {
      if (broken_.empty()) ncclCommDestroy(comm_);
      else ncclCommAbort(comm_);
    }
    cudaStreamDestroy(stream_);
  }

  const std::string& backend() const override {
    static const std::string name = "nccl";
    return name;
  }
  int rank() const override { return setup_.rank; }
  int size() const override { return setup_.size; }
  std::chrono::milliseconds timeout() const override { return setup_.timeout; }
  Device device() const override { return cuda_device(device_index_); }

  Work all_reduce(Tensor tensor, ReduceOp op) override {
    check_backend_tensor(tensor, device(), "all_reduce");
    return launch("all_reduce", {tensor}, [&] {
      return ncclAllReduce(tensor.impl().data(), tensor.impl().data(), size_t(tensor.numel()),
                           nccl_type(tensor.dtype()), nccl_op(op, tensor.dtype()), comm_, stream_);
    });
  }

  Work broadcast(Tensor tensor, int root) override {
    check_backend_tensor(tensor, device(), "broadcast");
    return launch("broadcast", {tensor}, [&] {
      return ncclBroadcast(tensor.impl().data(), tensor.impl().data(), size_t(tensor.numel()),
                           nccl_type(tensor.dtype()), root, comm_, stream_);
    });
  }

  Work all_gather(Tensor output, Tensor input) override {
    check_backend_tensor(output, device(), "all_gather");
    check_backend_tensor(input, device(), "all_gather");
    KILN_CHECK(output.nbytes() == input.nbytes() * setup_.size, ShapeError,
               "[kiln::distributed::all_gather] the output must hold world_size times the input.");
    return launch("all_gather", {output, input}, [&] {
      return ncclAllGather(input.impl().data(), output.impl().data(), size_t(input.numel()),
                           nccl_type(input.dtype()), comm_, stream_);
    });
  }

  Work reduce_scatter(Tensor output, Tensor input, ReduceOp op) override {
    check_backend_tensor(output, device(), "reduce_scatter");
    check_backend_tensor(input, device(), "reduce_scatter");
    KILN_CHECK(input.nbytes() == output.nbytes() * setup_.size, ShapeError,
               "[kiln::distributed::reduce_scatter] the input must hold world_size times the output.");
    return launch("reduce_scatter", {output, input}, [&] {
      return ncclReduceScatter(input.impl().data(), output.impl().data(), size_t(output.numel()),
                               nccl_type(output.dtype()), nccl_op(op, output.dtype()), comm_, stream_);
    });
  }

  // An all-reduce of one element, then the host waits for it (PyTorch's NCCL barrier does the same).
  Work barrier() override {
    Tensor one = ones({1}, TensorOptions(kFloat32, device()));
    Work work = launch("barrier", {one}, [&] {
      return ncclAllReduce(one.impl().data(), one.impl().data(), 1, ncclFloat32, ncclSum, comm_, stream_);
    });
    // The host waits on the group's stream itself (the watchdog retires work lazily). A peer that
    // died leaves this waiting until the watchdog aborts the communicator, which ends the wait.
    cuda::detail::DeviceGuard guard(device_index_);
    cudaError_t err = cudaStreamSynchronize(stream_);
    {
      std::lock_guard lock(mutex_);
      if (!broken_.empty()) throw DistributedError(broken_);
    }
    check(err, "distributed: barrier");
    return work;
  }

 private:
  struct Pending {
    std::string op;
    cudaEvent_t done = nullptr;
    Clock::time_point started;
    std::shared_ptr<Work::State> state;
  };

  // Orders the collective after the caller's queued work, runs it on the group's stream, and hands
  // the watchdog an event to watch.
  template <class F>
  Work launch(const char* op, std::vector<Tensor> tensors, F&& call) {
    std::lock_guard comm_lock(comm_mutex_);  // the watchdog aborts the communicator under it
    {
      std::lock_guard lock(mutex_);
      if (!broken_.empty()) throw DistributedError(broken_);
    }
    cuda::detail::DeviceGuard guard(device_index_);
    cudaStream_t caller = cuda::detail::current_stream(device_index_);
    auto pending = std::make_shared<Pending>();
    pending->op = op;
    pending->state = std::make_shared<Work::State>();
    pending->state->keep_alive = std::move(tensors);
    cudaEvent_t ready;
    check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "distributed: event");
    check(cudaEventRecord(ready, caller), "distributed: event");
    check(cudaStreamWaitEvent(stream_, ready, 0), "distributed: stream wait");
    cudaEventDestroy(ready);
    ncclResult_t r = call();
    if (r != ncclSuccess) {
      std::string message = describe_failure(setup_, op, nccl_text(r));
      fail_group(message);
      throw DistributedError(message);
    }
    check(cudaEventCreateWithFlags(&pending->done, cudaEventDisableTiming), "distributed: event");
    check(cudaEventRecord(pending->done, stream_), "distributed: event");
    pending->state->stream_pending = true;
    pending->state->wait_on_stream = [event = pending->done, device = device_index_] {
      check(cudaStreamWaitEvent(cuda::detail::current_stream(device), event, 0), "distributed: wait");
    };
    pending->started = Clock::now();
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(pending);
    }
    cv_.notify_one();
    return Work(pending->state);
  }

  void fail_group(const std::string& message) {
    std::lock_guard lock(mutex_);
    if (broken_.empty()) broken_ = message;
  }

  void watch() {
    cuda::detail::DeviceGuard guard(device_index_);
    Clock::time_point last_lost_check = Clock::now();
    for (;;) {
      std::shared_ptr<Pending> head;
      {
        std::unique_lock lock(mutex_);
        // Nothing waits on the watchdog (wait() orders streams; barrier() synchronizes itself): it
        // wakes when work is queued and polls gently, so that it never competes with the
        // launching thread for the driver.
        cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) {
          if (stopping_) return;
          continue;
        }
        head = queue_.front();
      }
      cudaError_t q = cudaEventQuery(head->done);
      std::string failure;
      if (q == cudaSuccess) {
        {
          std::lock_guard lock(mutex_);
          queue_.pop_front();
        }
        retire(*head, nullptr);
        continue;
      }
      if (q != cudaErrorNotReady) failure = fmt::format("CUDA error: {}", cudaGetErrorString(q));
      ncclResult_t async = ncclSuccess;
      if (failure.empty() && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress)
        failure = nccl_text(async);
      auto waited = Clock::now() - head->started;
      if (failure.empty() && waited > setup_.timeout)
        failure = fmt::format("timed out after {} s", std::chrono::duration<double>(setup_.timeout).count());
      // A peer that died leaves NCCL waiting for it: ask the store, once a second, whether it saw
      // a rank's connection close.
      if (failure.empty() && waited > std::chrono::seconds(1) && Clock::now() - last_lost_check > std::chrono::seconds(1)) {
        last_lost_check = Clock::now();
        try {
          if (!setup_.store->lost_ranks().empty()) failure = "a peer died while the collective ran";
        } catch (const DistributedError&) {
          failure = "the rendezvous store is gone";
        }
      }
      if (failure.empty()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      std::string message = describe_failure(setup_, head->op, failure);
      fail_group(message);
      {
        std::lock_guard comm_lock(comm_mutex_);
        ncclCommAbort(comm_);  // unblocks the stream's NCCL kernels
        comm_ = nullptr;
      }
      std::deque<std::shared_ptr<Pending>> all;
      {
        std::lock_guard lock(mutex_);
        all.swap(queue_);
      }
      for (auto& p : all) retire(*p, std::make_exception_ptr(DistributedError(message)));
    }
  }

  // Hands a collective's outcome to its Work: from now on wait() finds it done and nobody uses its
  // event; the tensors it kept alive go back to the allocator.
  void retire(Pending& p, std::exception_ptr error) {
    {
      std::lock_guard lock(p.state->mutex);
      p.state->stream_pending = false;
    }
    p.state->keep_alive.clear();
    cudaEventDestroy(p.done);
    p.state->finish(std::move(error));
  }

  GroupSetup setup_;
  int device_index_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex comm_mutex_;  // enqueueing on comm_ vs aborting it
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> queue_;
  bool stopping_ = false;
  std::string broken_;
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(const GroupSetup& setup) { return std::make_shared<NcclGroup>(setup); }

}  // namespace kiln::distributed

#endif  // KILN_WITH_NCCL
