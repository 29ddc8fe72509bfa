// C++ for the CPU kernels of a lowered Program (DESIGN §2.5, "codegen"): one loop nest per kernel,
// built by the system compiler (cxx_driver.h) into a shared library.
#pragma once

#include <string>
#include <vector>

#include "compiler/lower/loop_ir.h"

namespace kiln::compiler::codegen {

// The C++ source of every CPU kernel of `p` (one translation unit per chunk of kernels, so that the
// system compiler can build them in parallel). Kernels with identical bodies are emitted once:
// the duplicates' names are set to the first one's.
std::vector<std::string> generate_cpp(lower::Program& p, int max_kernels_per_unit = 24);

}  // namespace kiln::compiler::codegen
