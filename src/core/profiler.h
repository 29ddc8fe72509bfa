// The eager op profiler: KILN_PROFILE=1 (or kiln::set_op_profiling(true)) accumulates per-op
// call counts and wall time in the dispatcher, and prints a table at exit (or on demand with
// kiln::op_profile_report()). Disabled, it costs one relaxed atomic load per op call.
//
// The timeline: KILN_PROFILE=<path>.json writes a Chrome trace (the Trace Event Format that
// ui.perfetto.dev and chrome://tracing load) at exit: one complete event per eager op (cat "op"),
// generated kernel run ("kernel"), packed GEMM ("extern"), compiled graph run ("graph") and
// compile phase ("compile", the phases of compiler::compile_times()), per thread. On a GPU, the
// device time of eager ops, generated kernels and graph runs goes on a track per device ("gpu"),
// timed with CUDA events on the stream the work went to (DeviceSpan).
#pragma once

#include <atomic>
#include <chrono>
#include <span>
#include <string>

#include "kiln/tensor.h"

namespace kiln::detail {

extern std::atomic<bool> g_op_profiling;
extern std::atomic<bool> g_tracing;

void record_op_time(const std::string& op, double seconds);

// Adds one complete event to the timeline (when tracing): `name` ran from `start` for `seconds`.
void record_trace(const std::string& name, const char* category, std::chrono::steady_clock::time_point start,
                  double seconds);
// Starts recording a timeline to be written to `path` (tests; KILN_PROFILE=<path>.json does this at
// start-up), and writes what was recorded and stops (also at exit).
void start_trace(const std::string& path);
void write_trace();

// Times a scope into the timeline only (a compiled graph's run).
class TraceSpan {
 public:
  TraceSpan(const char* category, std::string name)
      : category_(g_tracing.load(std::memory_order_relaxed) ? category : nullptr), name_(std::move(name)) {
    if (category_) start_ = std::chrono::steady_clock::now();
  }
  ~TraceSpan() {
    if (category_)
      record_trace(name_, category_, start_,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  const char* category_;
  std::string name_;
  std::chrono::steady_clock::time_point start_;
};

// Device time on the timeline. A build with CUDA installs these (kernels/cuda/device_timeline.cpp):
// CUDA events recorded on a device's current stream around a span's work, read back later.
struct DeviceTimerHooks {
  // Records the start of a span on `device`; nullptr when it cannot be timed (the stream is being
  // captured into a CUDA graph, or events are unavailable).
  void* (*begin)(int device) = nullptr;
  void (*end)(void* span) = nullptr;
  // When the span's work ran: false while it has not finished (`wait`: block until it has) or when
  // it cannot be read. A span read successfully or failed is released; pending stays held.
  enum class Read { done, pending, failed };
  Read (*read)(void* span, bool wait, std::chrono::steady_clock::time_point* start, double* seconds) = nullptr;
};
extern DeviceTimerHooks device_timer_hooks;

void record_device_span(const std::string& name, const char* category, int device, void* span);
// Reads every pending GPU span into the timeline, waiting for their work. The CUDA side calls it
// from an exit handler registered after CUDA started, so that it runs before CUDA shuts down
// (the timeline itself is written later, by a static destructor).
void collect_device_spans();

// The GPU a call's work goes to, for the timeline's device track: the device of the first CUDA
// tensor among `inputs` and `outputs`; -1 when no timeline is being recorded or there is none.
int traced_device(std::span<const Tensor> inputs, std::span<const Tensor> outputs = {});

// Times a scope's work on a GPU into the timeline's track of `device` (-1: nothing to time).
class DeviceSpan {
 public:
  DeviceSpan(const char* category, const std::string& name, int device) {
    if (device < 0 || !g_tracing.load(std::memory_order_relaxed) || !device_timer_hooks.begin) return;
    span_ = device_timer_hooks.begin(device);
    if (span_) {
      category_ = category;
      name_ = name;
      device_ = device;
    }
  }
  ~DeviceSpan() {
    if (!span_) return;
    device_timer_hooks.end(span_);
    record_device_span(name_, category_, device_, span_);
  }
  DeviceSpan(const DeviceSpan&) = delete;
  DeviceSpan& operator=(const DeviceSpan&) = delete;

 private:
  void* span_ = nullptr;
  const char* category_ = nullptr;
  std::string name_;
  int device_ = -1;
};

// A compiled graph's run on the timeline: its host span ("graph <id><suffix>") and, when its inputs
// are on a GPU, its device span. The name is built only while a timeline is recorded.
class GraphRunSpans {
 public:
  GraphRunSpans(const std::string& id, const char* suffix, std::span<const Tensor> inputs)
      : name_(g_tracing.load(std::memory_order_relaxed) ? "graph " + id + suffix : std::string()),
        host_("graph", name_),
        device_("gpu", name_, traced_device(inputs)) {}

 private:
  std::string name_;
  TraceSpan host_;
  DeviceSpan device_;
};

// Times a scope when profiling is on.
class OpTimer {
 public:
  // inplace: the in-place/out= form, reported as "op_".
  explicit OpTimer(const std::string& op, bool inplace = false)
      : op_(g_op_profiling.load(std::memory_order_relaxed) ? &op : nullptr), inplace_(inplace) {
    if (op_) start_ = std::chrono::steady_clock::now();
  }
  ~OpTimer() {
    if (!op_) return;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const std::string name = inplace_ ? *op_ + "_" : *op_;
    record_op_time(name, s);
    if (g_tracing.load(std::memory_order_relaxed))
      record_trace(name, name.rfind("kernel[", 0) == 0 ? "kernel" : name.find("(packed") != std::string::npos ? "extern" : "op",
                   start_, s);
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  const std::string* op_;
  bool inplace_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace kiln::detail
