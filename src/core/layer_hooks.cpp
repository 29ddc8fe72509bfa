// The hooks core calls into the layers above it (see layer_hooks.h). Constant-initialized, so
// they are null (not garbage) before any static initializer installs them.
#include "core/layer_hooks.h"

#include <iostream>

namespace kiln::detail {

constinit CaptureHooks capture_hooks;
constinit AutogradHooks autograd_hooks;
constinit KernelCacheHooks kernel_cache_hooks;
constinit LogHooks log_hooks;

std::ostream& log_stream() { return log_hooks.stream ? log_hooks.stream() : std::cerr; }

bool perf_hints_enabled() { return log_hooks.perf_hints && log_hooks.perf_hints(); }

void log_warning(const std::string& message) { log_stream() << "[kiln.compile] WARNING: " << message << "\n"; }

}  // namespace kiln::detail
