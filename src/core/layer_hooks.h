// The calls core and the eager kernels make into the layers above them: compile()'s capture
// (src/compiler/capture), autograd's recording (src/autograd), compile()'s logs and its on-disk
// kernel cache (src/compiler/runtime/kernel_cache.h), which the eager CUDA kernels share. Core defines these hooks and includes neither layer; each
// layer installs its hooks from a static initializer when the library loads (capture/context.cpp,
// autograd/function.cpp, capture/observe.cpp, runtime/kernel_cache.cpp). Unset hooks do nothing: no capture is active,
// nothing records, and logs go to std::cerr with no optional log enabled.
#pragma once

#include <iosfwd>
#include <functional>
#include <memory>
#include <string>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/op_table.h"

namespace kiln::detail {

struct CaptureHooks {
  // This thread's active capture (opaque to core), or nullptr.
  void* (*active)() = nullptr;
  // The dispatcher's calls while a capture is active: the op is recorded, not run.
  std::vector<Tensor> (*run_op)(void* capture, const OpDef& op, std::vector<Tensor>& inputs,
                                std::vector<Attr>& attrs) = nullptr;
  void (*run_op_out)(void* capture, const OpDef& op, std::vector<Tensor>& inputs, std::vector<Attr>& attrs,
                     std::span<Tensor> outputs) = nullptr;
  // A host read of tensor data ("Tensor::item()"): flushes the pending capture (a graph break).
  void (*host_read)(std::string_view what) = nullptr;
  // Sets this thread's capture; returns the previous one (nullptr: suspends capture).
  void* (*exchange)(void* capture) = nullptr;
};

struct AutogradHooks {
  // Whether an op on `inputs` records a node (grad mode on, an input requires grad).
  bool (*recording)(std::span<const Tensor> inputs) = nullptr;
  void (*record)(const OpDef& op, std::span<const Tensor> inputs, std::span<const Attr> attrs,
                 std::span<Tensor> outputs) = nullptr;
  // In-place and out= calls: before the write, what their node needs (nullptr when nothing
  // records); after it, the record.
  std::shared_ptr<void> (*begin_inplace)(const OpDef& op, std::span<const Tensor> inputs,
                                         std::span<const Tensor> outputs) = nullptr;
  void (*finish_inplace)(const std::shared_ptr<void>& state, const OpDef& op, std::span<const Attr> attrs,
                         std::span<Tensor> outputs) = nullptr;
  // requires_grad_(true): creates the tensor's autograd metadata now, on the caller's thread. A
  // leaf that later threads share (a model's parameters) must not have it created lazily by the
  // first op each thread records: two threads would both write the pointer.
  void (*ensure_meta)(const Tensor& t) = nullptr;
};

struct LogHooks {
  // Where logs go (compiler::set_log_stream; std::cerr by default).
  std::ostream& (*stream)() = nullptr;
  // Whether KILN_LOGS / compiler::set_logs enabled perf_hints.
  bool (*perf_hints)() = nullptr;
};

struct KernelCacheHooks {
  // The cached bytes of the blob whose key is `key_fields` (hashed in order, with their names),
  // in the cache's subdirectory `kind`; on a miss, build() makes them and the cache stores them.
  std::string (*load_or_build_blob)(const std::string& kind,
                                    const std::vector<std::pair<std::string, std::string>>& key_fields,
                                    const std::string& label, const std::function<std::string()>& build) = nullptr;
  // Whether export_program is collecting the binaries this thread uses (compiler/runtime's
  // BundleRecorder): the CUDA JIT then hands the blobs it already holds in memory to
  // load_or_build_blob again, which records them.
  bool (*recording)() = nullptr;
};

extern CaptureHooks capture_hooks;
extern KernelCacheHooks kernel_cache_hooks;
extern AutogradHooks autograd_hooks;
extern LogHooks log_hooks;

std::ostream& log_stream();
bool perf_hints_enabled();
// "[kiln.compile] WARNING: <message>" on the log stream.
void log_warning(const std::string& message);

inline void* active_capture_hook() { return capture_hooks.active ? capture_hooks.active() : nullptr; }

inline void host_read_hook(std::string_view what) {
  if (capture_hooks.host_read) capture_hooks.host_read(what);
}

// Capture suspended on this thread while alive: core's own eager work (printing, reading values)
// is not part of the user's graph.
class CaptureSuspended {
 public:
  CaptureSuspended() : saved_(capture_hooks.exchange ? capture_hooks.exchange(nullptr) : nullptr) {}
  ~CaptureSuspended() {
    if (capture_hooks.exchange) capture_hooks.exchange(saved_);
  }
  CaptureSuspended(const CaptureSuspended&) = delete;
  CaptureSuspended& operator=(const CaptureSuspended&) = delete;

 private:
  void* saved_;
};

}  // namespace kiln::detail
