// Drives the system C++ compiler that turns generated kernel source into a shared object
// (DESIGN §2.5). No shell is involved: the compiler runs with posix_spawn, its output goes to a
// file.
#pragma once

#include <string>
#include <vector>

namespace kiln::compiler::codegen {

// The compiler generated code is built with, probed once per process (per compiler path).
struct CxxCompiler {
  std::string path;     // $KILN_CXX, else the compiler that built Kiln
  std::string version;  // its `--version` output
  // Its predefined macros under the default flags (`-E -dM`): which ISA `-march=native` means on
  // this machine, and the exact compiler version. Part of the cache key.
  std::string target_macros;
  // -std=c++20 -O3 -fPIC -fopenmp -fno-math-errno -march=..., -fno-tree-slp-vectorize on
  // GCC < 13, -I<Kiln's include dir>.
  std::vector<std::string> default_flags;
  std::string include_dir;  // Kiln's headers, as passed with -I
};

// The compiler for this process: reads $KILN_CXX on every call and probes each compiler once.
// Throws CompileError when it cannot be run or Kiln's headers cannot be found.
const CxxCompiler& system_compiler();

// Runs `argv` (argv[0] is looked up in PATH when it has no slash) with stdin from /dev/null and
// stdout and stderr to `output_fd`, and waits for it. Returns the exit code, or 128 + the signal
// that killed it. Throws CompileError when the program cannot be started.
int run_process(const std::vector<std::string>& argv, int output_fd);

struct CxxBuild {
  std::vector<std::string> source_paths;  // one translation unit each, already written
  std::vector<std::string> flags;         // the compiler's flags (default + extra)
  std::string work_dir;                   // objects and compiler logs go here
  std::string output_path;                // the shared object to link
  std::string label;                      // for messages, e.g. "graph 0/3"
};

// Compiles each source with `-c` (up to hardware_concurrency at once) and links them with
// `-shared`; a single source is compiled and linked in one step. On failure throws CompileError
// with the first ~40 lines of the compiler's output and the failing source's path.
void build_shared_object(const CxxCompiler& compiler, const CxxBuild& build);

}  // namespace kiln::compiler::codegen
