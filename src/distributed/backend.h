// What process_group.cpp (the front end: checks, staging, the default group) and the backends
// (gloo_backend.cpp, nccl_backend.cpp) share.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "kiln/distributed.h"

namespace kiln::distributed {

struct Work::State {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  // Runs once, in the first wait() after the backend finished: writes a staged result back into
  // the caller's tensor (a strided or other-device tensor was given).
  std::function<void()> then;
  bool then_ran = false;
  std::vector<Tensor> keep_alive;  // the tensors the backend reads or writes until done
  std::shared_ptr<State> inner;    // then_after: the backend's work this one waits for first
  // GPU work (nccl): while `stream_pending`, wait() makes the caller's current stream wait for the
  // collective (wait_on_stream) instead of blocking the host, as PyTorch's NCCL work does. The
  // backend clears stream_pending, under `mutex`, before it retires the event.
  bool stream_pending = false;
  std::function<void()> wait_on_stream;

  void finish(std::exception_ptr e = nullptr) {
    {
      std::lock_guard lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
  // A Work that is done when `work` is, and then runs `then` (once, in the first wait()).
  static Work then_after(const Work& work, std::function<void()> then) {
    auto s = std::make_shared<State>();
    s->inner = work.state_;
    s->done = true;
    s->then = std::move(then);
    return Work(s);
  }
  static Work finished() {
    auto s = std::make_shared<State>();
    s->done = true;
    return Work(s);
  }
};

// How a backend's group was set up: everything it needs to meet its peers.
struct GroupSetup {
  int rank = 0;
  int size = 1;
  std::shared_ptr<TcpStore> store;
  std::string prefix;       // store keys of this group start with it
  std::string master_addr;  // where the store is: picks the interface peers reach us by
  std::chrono::milliseconds timeout{600000};
};

// The backends. Each op takes dense tensors on the backend's device (the front end stages others).
std::shared_ptr<ProcessGroup> make_gloo_group(const GroupSetup& setup);
#ifdef KILN_WITH_NCCL
std::shared_ptr<ProcessGroup> make_nccl_group(const GroupSetup& setup);  // nccl_backend.cpp
#endif

// A failed collective's message: which op on which rank, and which peer ranks the store saw die.
std::string describe_failure(const GroupSetup& setup, const std::string& op, const std::string& detail);

// Copies src into dst (same dtype and element count): one memcpy (cudaMemcpyAsync on the current
// stream) when both are dense on one device, else dst.copy_(src) through the dispatcher. Bumps dst's
// version. DDP moves hundreds of small gradients and buffers in and out of flat buffers per step,
// where an op dispatch each would cost more than the copies.
void copy_dense(const Tensor& dst, const Tensor& src);

// Throws ValueError unless `t` is dense (row-major contiguous) on `device` — what backends take.
void check_backend_tensor(const Tensor& t, Device device, const char* op);

}  // namespace kiln::distributed
