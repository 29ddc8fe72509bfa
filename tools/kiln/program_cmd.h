// `kiln export-info`, `kiln run` and `kiln minify`: inspect and run exported programs, shrink
// compiler repros (docs/export.md).
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

int run_export_info(const std::vector<std::string>& args);
int run_program(const std::vector<std::string>& args);
int run_minify(const std::vector<std::string>& args);

}  // namespace kiln::cli
