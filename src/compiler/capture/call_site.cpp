// Resolving return addresses to the user's file:line with libdwfl (elfutils).
#include "compiler/capture/call_site.h"

#include <cxxabi.h>
#include <dwarf.h>
#include <elfutils/libdw.h>
#include <elfutils/libdwfl.h>
#include <execinfo.h>
#include <link.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::compiler::detail {

namespace {

// --- readable function names ---

// Strips a trailing "(params) const &" and " [clone .cold]", and a template function's leading
// return type: "void ns::f<int>(int) const" -> "ns::f<int>".
std::string strip_signature(std::string name) {
  auto strip_suffix = [&](std::string_view suffix) {
    if (!std::string_view(name).ends_with(suffix)) return false;
    name.resize(name.size() - suffix.size());
    return true;
  };
  while (name.ends_with(']')) {  // " [clone .cold]", " [clone .isra.0]"
    size_t open = name.rfind(" [clone ");
    if (open == std::string::npos) break;
    name.resize(open);
  }
  while (strip_suffix(" const") || strip_suffix(" volatile") || strip_suffix(" &&") ||
         strip_suffix(" &") || strip_suffix(" noexcept")) {
  }
  if (name.ends_with(')')) {
    int depth = 0;
    for (size_t i = name.size(); i-- > 0;) {
      if (name[i] == ')') ++depth;
      if (name[i] == '(' && --depth == 0) {
        if (i > 0) name.resize(i);  // keep "(anonymous namespace)" alone as is
        break;
      }
    }
  }
  // The return type ends at the last space outside brackets before the name; "operator" starts
  // the last component, whose spaces ("operator bool") belong to the name.
  int depth = 0;
  size_t name_start = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    if (depth == 0 && name.compare(i, 8, "operator") == 0 &&
        (i == 0 || name[i - 1] == ':' || name[i - 1] == ' ')) {
      break;
    }
    if (c == '(' || c == '<' || c == '[' || c == '{') ++depth;
    if ((c == ')' || c == '>' || c == ']' || c == '}') && depth > 0) --depth;
    if (c == ' ' && depth == 0) name_start = i + 1;
  }
  return name.substr(name_start);
}

std::string readable_name(const char* symbol) {
  if (symbol == nullptr) return {};
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(
      abi::__cxa_demangle(symbol, nullptr, nullptr, &status), &std::free);
  if (status != 0 || demangled == nullptr) return symbol;  // C symbols, "main"
  return strip_signature(demangled.get());
}

// Name of a DW_TAG_subprogram or DW_TAG_inlined_subroutine (following its abstract origin).
std::string die_function_name(Dwarf_Die* die) {
  Dwarf_Attribute attr;
  const char* linkage = dwarf_formstring(dwarf_attr_integrate(die, DW_AT_linkage_name, &attr));
  if (linkage == nullptr) {
    linkage = dwarf_formstring(dwarf_attr_integrate(die, DW_AT_MIPS_linkage_name, &attr));
  }
  if (linkage != nullptr) return readable_name(linkage);
  const char* name = dwarf_diename(die);
  return name != nullptr ? name : "";
}

// A line table's file name, made absolute with the compilation directory when it is relative
// (sources compiled as "../main.cpp").
std::string source_path(Dwarf_Die* cu, const char* file) {
  std::filesystem::path path(file);
  if (path.is_relative() && cu != nullptr) {
    Dwarf_Attribute attr;
    if (const char* dir = dwarf_formstring(dwarf_attr(cu, DW_AT_comp_dir, &attr))) {
      path = std::filesystem::path(dir) / path;
    }
  }
  // "/build/../src/f.cpp" -> "/src/f.cpp", so that paths compare with the working directory.
  return path.lexically_normal().string();
}

// Where an inlined subroutine was called from (its DW_AT_call_file / DW_AT_call_line).
CallSite inlined_call_site(Dwarf_Die* inlined) {
  CallSite site;
  Dwarf_Attribute attr;
  Dwarf_Word file_index = 0, line = 0;
  if (dwarf_formudata(dwarf_attr(inlined, DW_AT_call_line, &attr), &line) == 0) {
    site.line = static_cast<int>(line);
  }
  Dwarf_Die cu;
  Dwarf_Files* files = nullptr;
  size_t file_count = 0;
  if (dwarf_formudata(dwarf_attr(inlined, DW_AT_call_file, &attr), &file_index) == 0 &&
      dwarf_diecu(inlined, &cu, nullptr, nullptr) != nullptr &&
      dwarf_getsrcfiles(&cu, &files, &file_count) == 0 && file_index < file_count) {
    if (const char* file = dwarf_filesrc(files, file_index, nullptr, nullptr)) {
      site.file = source_path(&cu, file);
    }
  }
  return site;
}

// The source frames at one address, innermost first: the functions inlined there, then the
// function the machine frame belongs to. At least one entry (maybe without file:line).
std::vector<CallSite> source_frames(Dwfl_Module* mod, Dwarf_Addr pc) {
  CallSite innermost;
  if (Dwfl_Line* line = dwfl_module_getsrc(mod, pc)) {
    int lineno = 0;
    if (const char* file = dwfl_lineinfo(line, nullptr, &lineno, nullptr, nullptr, nullptr)) {
      innermost.file = source_path(dwfl_linecu(line), file);
      innermost.line = lineno;
    }
  }
  std::string symbol = readable_name(dwfl_module_addrname(mod, pc));

  std::vector<CallSite> frames;
  Dwarf_Addr bias = 0;
  Dwarf_Die* cudie = dwfl_module_addrdie(mod, pc, &bias);
  Dwarf_Die* scopes = nullptr;
  int scope_count = cudie != nullptr ? dwarf_getscopes(cudie, pc - bias, &scopes) : -1;
  CallSite next = innermost;
  for (int i = 0; i < scope_count; ++i) {
    int tag = dwarf_tag(&scopes[i]);
    if (tag != DW_TAG_inlined_subroutine && tag != DW_TAG_subprogram) continue;
    next.function = die_function_name(&scopes[i]);
    if (tag == DW_TAG_subprogram) {
      if (!symbol.empty()) next.function = symbol;  // qualified even where DWARF is not (lambdas)
      frames.push_back(next);
      break;
    }
    frames.push_back(next);
    next = inlined_call_site(&scopes[i]);
  }
  std::free(scopes);
  if (frames.empty()) {
    innermost.function = symbol;
    frames.push_back(innermost);
  }
  return frames;
}

// --- the process-wide libdwfl session ---

bool is_system_library(std::string_view path) {
  if (path.starts_with('[')) return true;  // [vdso]
  for (std::string_view dir :
       {"/lib/", "/lib32/", "/lib64/", "/usr/lib/", "/usr/lib32/", "/usr/lib64/"}) {
    if (path.starts_with(dir)) return true;
  }
  return false;
}

// Changes whenever the dynamic loader maps or unmaps a library (dlopen, dlclose), so that a
// library unloaded since the last report is never blamed for an address reused by another.
using LibraryGeneration = std::pair<unsigned long long, unsigned long long>;  // (adds, subs)
LibraryGeneration loaded_library_generation() {
  LibraryGeneration generation{0, 0};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        *static_cast<LibraryGeneration*>(out) = {info->dlpi_adds, info->dlpi_subs};
        return 1;  // the counters are the same in every entry
      },
      &generation);
  return generation;
}

// libdwfl is not thread-safe, so every use holds `mutex`. The session lives until exit: tearing
// it down from a static destructor could race with threads still reporting graph breaks.
struct DwflSession {
  std::mutex mutex;
  Dwfl* dwfl = nullptr;
  bool reported = false;
  LibraryGeneration reported_generation{0, 0};

  // (Re)reads /proc/self/maps. Modules already known keep their loaded debug info.
  bool report() {
    if (dwfl == nullptr) {
      static char* debuginfo_path = nullptr;
      static const Dwfl_Callbacks callbacks = {
          .find_elf = dwfl_linux_proc_find_elf,
          .find_debuginfo = dwfl_standard_find_debuginfo,
          .section_address = nullptr,
          .debuginfo_path = &debuginfo_path,
      };
      dwfl = dwfl_begin(&callbacks);
      if (dwfl == nullptr) return false;
    }
    reported_generation = loaded_library_generation();
    dwfl_report_begin(dwfl);
    int failed = dwfl_linux_proc_report(dwfl, getpid());
    reported = dwfl_report_end(dwfl, nullptr, nullptr) == 0 && failed == 0;
    return reported;
  }

  // The module mapping `pc`, re-reporting once per lookup batch when none does.
  Dwfl_Module* module_at(Dwarf_Addr pc, bool& rereported) {
    Dwfl_Module* mod = containing_module(pc);
    if (mod == nullptr && !rereported) {
      rereported = true;
      if (report()) mod = containing_module(pc);
    }
    return mod;
  }

  // dwfl_addrmodule can answer with the module just below an unreported gap (a library
  // dlopen'ed since the last report), so check the module's range.
  Dwfl_Module* containing_module(Dwarf_Addr pc) {
    Dwfl_Module* mod = dwfl_addrmodule(dwfl, pc);
    if (mod == nullptr) return nullptr;
    Dwarf_Addr start = 0, end = 0;
    dwfl_module_info(mod, nullptr, &start, &end, nullptr, nullptr, nullptr, nullptr);
    return pc >= start && pc < end ? mod : nullptr;
  }
};

DwflSession& session() {
  static DwflSession* instance = new DwflSession;  // leaked on purpose, see DwflSession
  return *instance;
}

}  // namespace

__attribute__((noinline)) RawStack capture_stack() {
  RawStack stack;
  stack.size = backtrace(stack.pcs, static_cast<int>(std::size(stack.pcs)));
  return stack;
}

CallSite user_call_site(const RawStack& stack) {
  try {
    DwflSession& s = session();
    std::lock_guard<std::mutex> lock(s.mutex);
    bool rereported = false;
    if (!s.reported || s.reported_generation != loaded_library_generation()) {
      rereported = true;
      if (!s.report()) return {};
    }
    // Kiln is always a shared library, so "inside libkiln" is "in the module holding this code".
    auto self = reinterpret_cast<Dwarf_Addr>(&user_call_site);
    Dwfl_Module* kiln_module = s.module_at(self, rereported);
    for (int i = 0; i < stack.size; ++i) {
      // Return addresses point after the call; pc - 1 lies in the call instruction's line.
      Dwarf_Addr pc = reinterpret_cast<Dwarf_Addr>(stack.pcs[i]) - 1;
      Dwfl_Module* mod = s.module_at(pc, rereported);
      if (mod == nullptr || mod == kiln_module) continue;
      const char* module_name =
          dwfl_module_info(mod, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
      if (module_name != nullptr && is_system_library(module_name)) continue;
      for (CallSite& frame : source_frames(mod, pc)) {
        if (frame.file.find("/include/kiln/") == std::string::npos) return frame;
      }
    }
  } catch (...) {  // symbolization is best effort: a message without file:line beats a throw
  }
  return {};
}

std::string format_call_site(const CallSite& site) {
  if (!site.known()) return "<unknown>";
  std::string_view file = site.file;
  std::error_code error;
  std::string cwd = std::filesystem::current_path(error).string();
  if (!error && !cwd.empty()) {
    if (!cwd.ends_with('/')) cwd += '/';
    if (file.starts_with(cwd)) file.remove_prefix(cwd.size());
  }
  return std::string(file) + ":" + std::to_string(site.line);
}

}  // namespace kiln::compiler::detail
