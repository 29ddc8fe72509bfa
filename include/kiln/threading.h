// Intra-op parallelism (OpenMP) settings.
#pragma once

namespace kiln {
// Threads used by CPU kernels. Default: OpenMP's default (OMP_NUM_THREADS or the core count).
int get_num_threads();
void set_num_threads(int n);
}  // namespace kiln
