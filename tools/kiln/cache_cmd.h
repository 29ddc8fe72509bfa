// `kiln cache info|verify|clear`: the kernel cache (docs/compiler.md, "The kernel cache").
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

int run_cache(const std::vector<std::string>& args);

}  // namespace kiln::cli
