// Device time on the timeline (core/profiler.h, DeviceTimerHooks): a pair of CUDA events around a
// span's work on the device's current stream, read when the trace is written.
//
// A device's clock is tied to the host's once, when its first span starts: an event recorded and
// waited for there marks "now" on both. A span's start on the host clock is that moment plus the
// events' elapsed time, so spans of all devices and of host threads share one time axis.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/profiler.h"
#include "kernels/cuda/cuda_runtime.h"

namespace kiln::cuda::detail {
namespace {

using Clock = std::chrono::steady_clock;

struct Span {
  int device = -1;
  cudaEvent_t start = nullptr, stop = nullptr;
};

// Per device: the reference event and the host time it completed at; spent events for reuse.
struct DeviceClock {
  cudaEvent_t reference = nullptr;
  Clock::time_point host_at_reference;
  std::vector<cudaEvent_t> spare;
};

// Never destroyed: the trace is written by a static destructor at exit, which may run after this
// file's statics would have been destroyed.
std::mutex& g_mutex = *new std::mutex;
std::vector<DeviceClock>& g_clocks = *new std::vector<DeviceClock>;

// Caller holds g_mutex. False when the device's clock cannot be tied to the host's.
bool ensure_clock(int device) {
  if (static_cast<size_t>(device) >= g_clocks.size()) g_clocks.resize(static_cast<size_t>(device) + 1);
  DeviceClock& c = g_clocks[static_cast<size_t>(device)];
  if (c.reference) return true;
  cudaEvent_t reference = nullptr;
  if (cudaEventCreate(&reference) != cudaSuccess) return false;
  if (cudaEventRecord(reference, current_stream(device)) != cudaSuccess ||
      cudaEventSynchronize(reference) != cudaSuccess) {
    cudaEventDestroy(reference);
    cudaGetLastError();
    return false;
  }
  c.reference = reference;
  c.host_at_reference = Clock::now();
  // CUDA is running now, so this exit handler runs before CUDA's own teardown does.
  static const bool collect_at_exit = [] { return std::atexit([] { kiln::detail::collect_device_spans(); }) == 0; }();
  (void)collect_at_exit;
  return true;
}

cudaEvent_t take_event(DeviceClock& c) {
  if (!c.spare.empty()) {
    cudaEvent_t e = c.spare.back();
    c.spare.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  return cudaEventCreate(&e) == cudaSuccess ? e : nullptr;
}

void* begin(int device) {
  try {
    if (capturing(device)) return nullptr;  // an event in a CUDA graph's recording times nothing now
    DeviceGuard guard(device);
    std::lock_guard lock(g_mutex);
    if (!ensure_clock(device)) return nullptr;
    DeviceClock& c = g_clocks[static_cast<size_t>(device)];
    auto* span = new Span{device, take_event(c), take_event(c)};
    if (!span->start || !span->stop || cudaEventRecord(span->start, current_stream(device)) != cudaSuccess) {
      if (span->start) c.spare.push_back(span->start);
      if (span->stop) c.spare.push_back(span->stop);
      delete span;
      cudaGetLastError();
      return nullptr;
    }
    return span;
  } catch (...) {  // the timeline never fails the work it watches
    return nullptr;
  }
}

void end(void* handle) {
  auto* span = static_cast<Span*>(handle);
  try {
    DeviceGuard guard(span->device);
    if (cudaEventRecord(span->stop, current_stream(span->device)) != cudaSuccess) cudaGetLastError();
  } catch (...) {
  }
}

kiln::detail::DeviceTimerHooks::Read read(void* handle, bool wait, Clock::time_point* start, double* seconds) {
  using Read = kiln::detail::DeviceTimerHooks::Read;
  auto* span = static_cast<Span*>(handle);
  Read result = Read::failed;
  if (!wait && cudaEventQuery(span->stop) == cudaErrorNotReady) return Read::pending;
  float from_reference_ms = 0, duration_ms = 0;
  std::lock_guard lock(g_mutex);
  DeviceClock& c = g_clocks[static_cast<size_t>(span->device)];
  if (cudaEventSynchronize(span->stop) == cudaSuccess &&
      cudaEventElapsedTime(&from_reference_ms, c.reference, span->start) == cudaSuccess &&
      cudaEventElapsedTime(&duration_ms, span->start, span->stop) == cudaSuccess) {
    *start = c.host_at_reference + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double, std::milli>(from_reference_ms));
    *seconds = duration_ms * 1e-3;
    result = Read::done;
  }
  cudaGetLastError();
  c.spare.push_back(span->start);
  c.spare.push_back(span->stop);
  delete span;
  return result;
}

[[maybe_unused]] const bool g_installed = [] {
  kiln::detail::device_timer_hooks.begin = &begin;
  kiln::detail::device_timer_hooks.end = &end;
  kiln::detail::device_timer_hooks.read = &read;
  return true;
}();

}  // namespace
}  // namespace kiln::cuda::detail
