// Devices, streams and events (kiln/cuda.h) over the CUDA runtime API.
#include "kernels/cuda/cuda_runtime.h"

#include <cuda_profiler_api.h>

#include <array>
#include <memory>
#include <mutex>
#include <vector>

namespace kiln::cuda {

namespace detail {

namespace {
constexpr int kMaxDevices = 64;
thread_local int t_current_device = 0;
thread_local std::array<cudaStream_t, kMaxDevices> t_current_stream{};
}  // namespace

void throw_cuda_error(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear non-sticky errors so the next call starts clean
  std::string msg = std::string("[kiln::") + what + "] CUDA error: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ").";
  if (err == cudaErrorMemoryAllocation)
    msg += " The GPU is out of memory: free tensors, call kiln::cuda::empty_cache(), or use smaller batches.";
  throw DeviceError(msg);
}

void check_device(int index, const char* what) {
  int n = device_count();
  if (n == 0) {
    throw DeviceError(std::string("[kiln::") + what +
                      "] no CUDA GPU is visible (kiln::cuda::is_available() is false). Use the CPU.");
  }
  if (index < 0 || index >= n || index >= kMaxDevices) {
    throw DeviceError(std::string("[kiln::") + what + "] CUDA device " + std::to_string(index) +
                      " does not exist; this machine has " + std::to_string(n) + " (cuda:0 to cuda:" +
                      std::to_string(n - 1) + ").");
  }
}

int resolve_device(int index, const char* what) {
  if (index < 0) index = t_current_device;
  check_device(index, what);
  return index;
}

DeviceGuard::DeviceGuard(int index) {
  int current = -1;
  check(cudaGetDevice(&current), "cuda::DeviceGuard");
  if (current != index) {
    check(cudaSetDevice(index), "cuda::DeviceGuard");
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

cudaStream_t current_stream(int device) { return t_current_stream[device]; }
void set_current_stream(int device, cudaStream_t stream) { t_current_stream[device] = stream; }

const cudaDeviceProp& properties(int device) {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<cudaDeviceProp, kMaxDevices> props;
  check_device(device, "cuda::get_device_properties");
  std::call_once(once[device], [&] { check(cudaGetDeviceProperties(&props[device], device), "cuda::get_device_properties"); });
  return props[device];
}

}  // namespace detail

int current_device() {
  detail::check_device(0, "cuda::current_device");
  return detail::t_current_device;
}

void set_device(int index) {
  detail::check_device(index, "cuda::set_device");
  detail::check(cudaSetDevice(index), "cuda::set_device");
  detail::t_current_device = index;
}

void synchronize(int device) {
  device = detail::resolve_device(device, "cuda::synchronize");
  detail::DeviceGuard guard(device);
  detail::check(cudaDeviceSynchronize(), "cuda::synchronize");
}

namespace detail {
bool capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(current_stream(device), &status), "CUDA graph capture status");
  return status != cudaStreamCaptureStatusNone;
}
}  // namespace detail

void profiler_start() { detail::check(cudaProfilerStart(), "cuda::profiler_start"); }
void profiler_stop() { detail::check(cudaProfilerStop(), "cuda::profiler_stop"); }

DeviceProperties get_device_properties(int device) {
  device = detail::resolve_device(device, "cuda::get_device_properties");
  const cudaDeviceProp& p = detail::properties(device);
  DeviceProperties out;
  out.name = p.name;
  out.major = p.major;
  out.minor = p.minor;
  out.multiprocessors = p.multiProcessorCount;
  out.total_memory = static_cast<int64_t>(p.totalGlobalMem);
  out.l2_cache_bytes = p.l2CacheSize;
  out.max_shared_memory_per_block = static_cast<int>(p.sharedMemPerBlockOptin);
  return out;
}

// ---- streams ----

Stream Stream::current(int device) {
  device = detail::resolve_device(device, "cuda::Stream::current");
  return Stream(device, detail::current_stream(device), nullptr);
}

Stream Stream::default_stream(int device) {
  device = detail::resolve_device(device, "cuda::Stream::default_stream");
  return Stream(device, nullptr, nullptr);
}

Stream Stream::create(int device) {
  device = detail::resolve_device(device, "cuda::Stream::create");
  detail::DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  detail::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cuda::Stream::create");
  std::shared_ptr<void> owner(static_cast<void*>(s), [device](void* p) {
    // Pending work still completes; the handle is released afterwards by the driver.
    detail::DeviceGuard g(device);
    cudaStreamDestroy(static_cast<cudaStream_t>(p));
  });
  return Stream(device, s, std::move(owner));
}

bool Stream::query() const {
  detail::DeviceGuard guard(device_);
  cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(handle_));
  if (e == cudaErrorNotReady) return false;
  detail::check(e, "cuda::Stream::query");
  return true;
}

void Stream::synchronize() const {
  detail::DeviceGuard guard(device_);
  detail::check(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)), "cuda::Stream::synchronize");
}

StreamGuard::StreamGuard(const Stream& stream)
    : previous_(Stream::current(stream.device())), previous_device_(detail::t_current_device) {
  detail::check(cudaSetDevice(stream.device()), "cuda::StreamGuard");
  detail::t_current_device = stream.device();
  detail::set_current_stream(stream.device(), static_cast<cudaStream_t>(stream.native_handle()));
}

StreamGuard::~StreamGuard() {
  detail::set_current_stream(previous_.device(), static_cast<cudaStream_t>(previous_.native_handle()));
  detail::t_current_device = previous_device_;
  cudaSetDevice(previous_device_);
}

// ---- events ----

Event::Event(int device) : device_(detail::resolve_device(device, "cuda::Event")) {
  detail::DeviceGuard guard(device_);
  cudaEvent_t e = nullptr;
  detail::check(cudaEventCreate(&e), "cuda::Event");
  event_ = e;
}

Event::~Event() {
  detail::DeviceGuard guard(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

void Event::record(const Stream& stream) {
  KILN_CHECK(stream.device() == device_, DeviceError,
             "[kiln::cuda::Event::record] the event belongs to cuda:" + std::to_string(device_) +
                 " but the stream to cuda:" + std::to_string(stream.device()) + ".");
  detail::DeviceGuard guard(device_);
  detail::check(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream.native_handle())),
                "cuda::Event::record");
  recorded_ = true;
}

void Event::block(const Stream& stream) const {
  if (!recorded_) return;
  detail::DeviceGuard guard(stream.device());
  detail::check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native_handle()), static_cast<cudaEvent_t>(event_), 0),
                "cuda::Event::block");
}

bool Event::query() const {
  if (!recorded_) return true;
  detail::DeviceGuard guard(device_);
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaErrorNotReady) return false;
  detail::check(e, "cuda::Event::query");
  return true;
}

void Event::synchronize() const {
  if (!recorded_) return;
  detail::DeviceGuard guard(device_);
  detail::check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "cuda::Event::synchronize");
}

float Event::elapsed_ms(const Event& end) const {
  KILN_CHECK(recorded_ && end.recorded_, ValueError,
             "[kiln::cuda::Event::elapsed_ms] both events must be recorded first.");
  float ms = 0;
  detail::DeviceGuard guard(device_);
  detail::check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(event_), static_cast<cudaEvent_t>(end.event_)),
                "cuda::Event::elapsed_ms");
  return ms;
}

}  // namespace kiln::cuda
