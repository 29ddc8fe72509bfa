// `kiln bench`: model benchmarks (see bench.cpp).
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {
int run_bench(const std::vector<std::string>& args);
}
