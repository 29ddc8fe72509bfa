// Intra-op parallelism (OpenMP) settings.
#pragma once

#include <string>

namespace kiln {
// Threads used by CPU kernels. Default: OpenMP's default (OMP_NUM_THREADS or the core count).
int get_num_threads();
void set_num_threads(int n);

// The eager op profiler: per-op call counts and wall time, measured in the dispatcher. Also
// enabled by KILN_PROFILE=1, which prints the table to stderr at exit. Nested ops (ops a kernel
// or a composite calls) are counted under their own names too, so shares can exceed 100%.
void set_op_profiling(bool enabled);
void reset_op_profile();
std::string op_profile_report();
}  // namespace kiln
