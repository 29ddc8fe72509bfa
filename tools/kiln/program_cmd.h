// `kiln export-info` and `kiln run`: inspect and run exported programs (docs/export.md).
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

int run_export_info(const std::vector<std::string>& args);
int run_program(const std::vector<std::string>& args);

}  // namespace kiln::cli
