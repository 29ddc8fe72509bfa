// Drives the system C++ compiler that turns generated kernel source into a shared object
// (DESIGN §2.5). No shell is involved: the compiler is started directly, its output goes to a
// file, and it dies with the process that started it (PR_SET_PDEATHSIG).
#pragma once

#include <string>
#include <vector>

#include "kiln/error.h"

namespace kiln::compiler::codegen {

// What a compiler is and the flags Kiln builds generated code with. Probing runs the compiler
// twice; the kernel cache remembers the result per compiler binary (kernel_cache.cpp), so a
// process whose kernels are all cached never starts a compiler.
struct CxxCompiler {
  std::string path;     // as configured: $KILN_CXX, else the compiler that built Kiln
  std::string version;  // its `--version` output
  // Its predefined macros under the default flags (`-E -dM`): which ISA `-march=native` means on
  // this machine, and the exact compiler version. Part of the cache key.
  std::string target_macros;
  // -std=c++20 -O3 -fPIC -fopenmp -fno-math-errno -march=..., and -fno-tree-slp-vectorize on
  // GCC < 13. Kiln's headers are not among them: each build writes its own copies of the
  // embedded headers and adds their directory (kernel_cache.cpp).
  std::vector<std::string> default_flags;
};

// The compiler generated code is built with: $KILN_CXX (read on every call), else the compiler
// that built Kiln.
std::string configured_compiler();
// The -march value generated code is built for (the build's KILN_CPU_ARCH; "native" by default).
std::string target_arch();
// The file that running `program` starts: itself when it holds a slash, else the first
// executable of that name on $PATH; empty when there is none.
std::string find_executable(const std::string& program);

// Runs `path --version` and `path <flags> -E -dM`. Throws CompileError when the compiler cannot
// be run or rejects the flags.
CxxCompiler probe_compiler(const std::string& path);
// The default flags for a compiler whose predefined macros are `target_macros` (no process).
std::vector<std::string> default_flags_for(const std::string& target_macros);

// Runs `argv` (argv[0] is looked up in PATH when it has no slash) with stdin from /dev/null and
// stdout and stderr to `output_fd`, and waits for it. The child gets SIGKILL if the calling
// thread's process dies first. Returns the exit code, or 128 + the signal that killed it. Throws
// CompileError when the program cannot be found.
int run_process(const std::vector<std::string>& argv, int output_fd);

struct CxxBuild {
  std::vector<std::string> source_paths;  // one translation unit each, already written
  std::vector<std::string> flags;         // the compiler's flags (default + extra + -I)
  std::string work_dir;                   // objects and compiler logs go here
  std::string output_path;                // the shared object to link
  std::string label;                      // for messages, e.g. "graph 0/3"
};

// A build that failed because a disk filled up (the compiler said "No space left on device", or
// the build or temp directory has almost no room left): the sources are not worth keeping.
class DiskFullError : public CompileError {
  using CompileError::CompileError;
};

// Compiles each source with `-c` (up to hardware_concurrency at once) and links them with
// `-shared`; a single source is compiled and linked in one step. On failure throws CompileError
// with the first ~40 lines of the compiler's output and the failing source's path, or
// DiskFullError.
void build_shared_object(const CxxCompiler& compiler, const CxxBuild& build);

}  // namespace kiln::compiler::codegen
