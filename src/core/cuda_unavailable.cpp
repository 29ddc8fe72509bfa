// kiln/cuda.h in a build without CUDA: every entry throws DeviceError, so a program written for
// GPUs links everywhere and says plainly why it cannot run.
#ifndef KILN_WITH_CUDA

#include <string>

#include "kiln/cuda.h"
#include "kiln/error.h"

namespace kiln::cuda {

namespace {
[[noreturn]] void unavailable(const char* what) {
  throw DeviceError(std::string("[kiln::cuda::") + what +
                    "] this build of Kiln has no CUDA support. Rebuild with the CUDA toolkit installed.");
}
}  // namespace

int current_device() { unavailable("current_device"); }
void set_device(int) { unavailable("set_device"); }
void synchronize(int) { unavailable("synchronize"); }
void profiler_start() { unavailable("profiler_start"); }
void profiler_stop() { unavailable("profiler_stop"); }
DeviceProperties get_device_properties(int) { unavailable("get_device_properties"); }
Stream Stream::current(int) { unavailable("Stream::current"); }
Stream Stream::default_stream(int) { unavailable("Stream::default_stream"); }
Stream Stream::create(int) { unavailable("Stream::create"); }
bool Stream::query() const { unavailable("Stream::query"); }
void Stream::synchronize() const { unavailable("Stream::synchronize"); }
StreamGuard::StreamGuard(const Stream&) : previous_(Stream::current(0)), previous_device_(0) {}
StreamGuard::~StreamGuard() = default;
Event::Event(int) : device_(0) { unavailable("Event"); }
Event::~Event() = default;
void Event::record(const Stream&) { unavailable("Event::record"); }
void Event::block(const Stream&) const { unavailable("Event::block"); }
bool Event::query() const { unavailable("Event::query"); }
void Event::synchronize() const { unavailable("Event::synchronize"); }
float Event::elapsed_ms(const Event&) const { unavailable("Event::elapsed_ms"); }
MemoryStats memory_stats(int) { unavailable("memory_stats"); }
int64_t memory_allocated(int) { unavailable("memory_allocated"); }
int64_t memory_reserved(int) { unavailable("memory_reserved"); }
int64_t max_memory_allocated(int) { unavailable("max_memory_allocated"); }
void reset_peak_memory_stats(int) { unavailable("reset_peak_memory_stats"); }
void empty_cache() {}

}  // namespace kiln::cuda

#endif  // KILN_WITH_CUDA
