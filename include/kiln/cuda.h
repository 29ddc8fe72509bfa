// CUDA devices: streams, events, the caching allocator's statistics, synchronization.
//
// Tensors on "cuda:N" are allocated by Kiln's caching allocator and computed by kernels that run
// asynchronously on the calling thread's current stream of that device (the default stream
// unless a StreamGuard says otherwise), like PyTorch. Host reads (item(), to(kCPU), printing)
// synchronize. Everything here throws DeviceError when Kiln was built without CUDA or no GPU is
// visible; `kiln::cuda::is_available()` (kiln/device.h) says which.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kiln/device.h"

namespace kiln::cuda {

// The device new CUDA tensors go to when "cuda" names no index; per thread, 0 by default.
int current_device();
void set_device(int index);
// Waits for all work queued on `device` (-1: the current device).
void synchronize(int device = -1);
// Starts and stops the CUDA profilers' collection (cudaProfilerStart/Stop), so that a profiler
// run with collection off at start (`ncu --profile-from-start off`) sees only the code between.
void profiler_start();
void profiler_stop();

// The GPU's name and the numbers kernels are sized by.
struct DeviceProperties {
  std::string name;
  int major = 0, minor = 0;       // compute capability
  int multiprocessors = 0;
  int64_t total_memory = 0;       // bytes
  int64_t l2_cache_bytes = 0;
  int max_shared_memory_per_block = 0;  // bytes, with the opt-in limit
};
DeviceProperties get_device_properties(int device = -1);

// A CUDA stream of one device. Cheap to copy (a handle); streams made by create() live until the
// last copy is gone. The default stream is the legacy stream 0.
class Stream {
 public:
  // The calling thread's current stream on `device` (-1: the current device).
  static Stream current(int device = -1);
  static Stream default_stream(int device = -1);
  // A new non-blocking stream.
  static Stream create(int device = -1);

  int device() const { return device_; }
  // The cudaStream_t, as void* so that this header needs no CUDA headers.
  void* native_handle() const { return handle_; }
  // Whether all work queued so far has finished.
  bool query() const;
  void synchronize() const;
  friend bool operator==(const Stream& a, const Stream& b) { return a.handle_ == b.handle_ && a.device_ == b.device_; }

 private:
  Stream(int device, void* handle, std::shared_ptr<void> owner)
      : device_(device), handle_(handle), owner_(std::move(owner)) {}
  int device_ = 0;
  void* handle_ = nullptr;
  std::shared_ptr<void> owner_;  // set for created streams
};

// Makes `stream` the current stream of its device on this thread, and its device the current
// device, until the guard is destroyed.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
  int previous_device_;
};

// A CUDA event with timing enabled.
class Event {
 public:
  explicit Event(int device = -1);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& stream);
  void record() { record(Stream::current(device_)); }
  // Makes `stream` wait for this event's work without blocking the host.
  void block(const Stream& stream) const;
  bool query() const;
  void synchronize() const;
  // Milliseconds from this event to `end`; both must have been recorded and completed.
  float elapsed_ms(const Event& end) const;

 private:
  int device_;
  void* event_ = nullptr;
  bool recorded_ = false;
};

// The caching allocator's counters for one device, in bytes. "Allocated" counts the blocks that
// tensors hold (rounded up to 512 bytes); "reserved" counts what was taken from the driver,
// cached blocks included. Peaks are since process start or the last reset_peak_memory_stats().
struct MemoryStats {
  int64_t allocated = 0, reserved = 0;
  int64_t peak_allocated = 0, peak_reserved = 0;
  int64_t allocations = 0;     // tensor blocks handed out, in total
  int64_t device_mallocs = 0;  // cudaMalloc calls, in total
  int64_t oom_retries = 0;     // cudaMalloc failures answered by releasing the cache and retrying
};
MemoryStats memory_stats(int device = -1);
int64_t memory_allocated(int device = -1);
int64_t memory_reserved(int device = -1);
int64_t max_memory_allocated(int device = -1);
void reset_peak_memory_stats(int device = -1);
// Returns cached blocks that no tensor holds to the driver (all devices).
void empty_cache();

}  // namespace kiln::cuda
