// Timing for max_autotune on a GPU (see autotune.h).
#include "kernels/cuda/autotune.h"
#include "kernels/autotune_scope.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/jit.h"

namespace kiln::cuda::detail {

namespace {

// Keeps the GPU busy for `cycles` SM clocks, so that launches queued behind it all wait when it
// ends.
void spin(int device, cudaStream_t stream, long long cycles) {
  JitFunction f = jit_function(device, "kiln_spin", "kiln_spin", [] {
    return std::string(R"(extern "C" __global__ void kiln_spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
})");
  });
  void* args[] = {&cycles};
  launch(f, 1, 1, 0, stream, args);
}

// Two timing events, destroyed with the scope.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    check(cudaEventCreate(&start), "max_autotune");
    check(cudaEventCreate(&stop), "max_autotune");
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
};

}  // namespace

float time_queued_runs(int device, cudaStream_t stream, const std::function<bool()>& run, int runs,
                       long long hold_cycles) {
  if (!run()) return -1;
  EventPair events;
  spin(device, stream, hold_cycles);
  check(cudaEventRecord(events.start, stream), "max_autotune");
  bool ok = true;
  for (int rep = 0; rep < runs && ok; ++rep) ok = run();
  check(cudaEventRecord(events.stop, stream), "max_autotune");
  check(cudaEventSynchronize(events.stop), "max_autotune");
  if (!ok) return -1;
  float ms = 0;
  check(cudaEventElapsedTime(&ms, events.start, events.stop), "max_autotune");
  return ms / static_cast<float>(runs);
}

int fastest(const std::vector<float>& ms) {
  int best = -1;
  for (size_t i = 0; i < ms.size(); ++i)
    if (ms[i] >= 0 && (best < 0 || ms[i] < ms[best])) best = static_cast<int>(i);
  if (best > 0 && ms[0] >= 0 && ms[best] > 0.97f * ms[0]) best = 0;
  return best;
}

bool autotune_log() {
  static const bool on = [] {
    const char* v = std::getenv("KILN_CUDA_AUTOTUNE_LOG");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

void log_autotune(const std::string& what, const std::vector<std::string>& labels, const std::vector<float>& ms,
                  int winner) {
  kiln::kernels::note_autotuned();  // the progress line of long autotuning
  if (!autotune_log()) return;
  std::string line = "[kiln.cuda autotune] " + what + ":";
  for (size_t i = 0; i < labels.size() && i < ms.size(); ++i) line += fmt::format(" {}={:.4f}ms", labels[i], ms[i]);
  if (winner >= 0 && static_cast<size_t>(winner) < labels.size()) line += " -> " + labels[winner];
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace kiln::cuda::detail
