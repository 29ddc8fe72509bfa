// The eager op profiler: KILN_PROFILE=1 (or kiln::set_op_profiling(true)) accumulates per-op
// call counts and wall time in the dispatcher, and prints a table at exit (or on demand with
// kiln::op_profile_report()). Disabled, it costs one relaxed atomic load per op call.
#pragma once

#include <atomic>
#include <chrono>
#include <string>

namespace kiln::detail {

extern std::atomic<bool> g_op_profiling;

void record_op_time(const std::string& op, double seconds);

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
    record_op_time(inplace_ ? *op_ + "_" : *op_, s);
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  const std::string* op_;
  bool inplace_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace kiln::detail
