// `kiln bench`: model benchmarks (see bench.cpp).
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {
int run_bench(const std::vector<std::string>& args);
// `kiln bench gpt2` (bench_gpt2.cpp): generation with a growing sequence, eager vs static vs dynamic.
int run_gpt2_bench(const std::vector<std::string>& args);
// `kiln bench batch-sizes` (bench_batch_sizes.cpp): one model at every batch size, eager vs dynamic.
int run_batch_sizes_bench(const std::vector<std::string>& args);
}
