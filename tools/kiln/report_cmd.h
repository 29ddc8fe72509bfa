// `kiln report TRACE_DIR -o report.html`: the compile trace (KILN_TRACE_DIR) as one HTML page
// (docs/compile-trace.md).
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

int run_report(const std::vector<std::string>& args);

}  // namespace kiln::cli
