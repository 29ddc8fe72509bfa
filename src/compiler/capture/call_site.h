// Where in the user's code a graph break happened, from the raw call stack.
//
// Graph breaks inside conversion operators (`if (x.sum() < 0)` calls Tensor::operator bool) cannot
// take a std::source_location parameter, so capture records return addresses instead and resolves
// them to file:line with elfutils' libdwfl only when a message needs them.
#pragma once

#include <string>

namespace kiln::compiler::detail {

// Raw return addresses of the current thread's stack (cheap: glibc backtrace(), no symbolization).
struct RawStack {
  void* pcs[48];
  int size = 0;
};
RawStack capture_stack();

// Where the user's code is: file, line, function.
struct CallSite {
  std::string file;
  int line = 0;
  std::string function;
  bool known() const { return line > 0; }
};

// The innermost frame that is user code: skips frames inside libkiln.so itself, inside system
// libraries (libstdc++, libc, libgomp, ...), and frames whose source file lies in Kiln's public
// headers (any path containing "/include/kiln/"), since compile()'s templates are instantiated in
// the user's binary. Functions inlined into a frame count as frames of their own.
// Without debug info: file empty, line 0, function = the symbol name if any.
// Never throws; thread-safe (one process-wide libdwfl session behind a mutex; modules are
// re-reported when an address is not found, since libraries can be dlopen'ed later).
CallSite user_call_site(const RawStack& stack);

// "file:line" ("<unknown>" when unknown), file shown relative to the current working directory
// when it is below it, else as is.
std::string format_call_site(const CallSite& site);

}  // namespace kiln::compiler::detail
