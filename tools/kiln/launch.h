// `kiln launch`: starts one process per rank of a distributed job (see launch.cpp).
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

int run_launch(std::vector<std::string> args);

}  // namespace kiln::cli
