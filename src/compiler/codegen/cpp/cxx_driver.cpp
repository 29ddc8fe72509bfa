#include "compiler/codegen/cpp/cxx_driver.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "kiln/error.h"

extern char** environ;

// Set by CMake for this file; the fallbacks keep it compiling elsewhere.
#ifndef KILN_CXX_COMPILER
#define KILN_CXX_COMPILER "c++"
#endif
#ifndef KILN_CPU_ARCH
#define KILN_CPU_ARCH "native"
#endif
#ifndef KILN_SOURCE_INCLUDE_DIR
#define KILN_SOURCE_INCLUDE_DIR ""
#endif
#ifndef KILN_INSTALL_INCLUDE_DIR
#define KILN_INSTALL_INCLUDE_DIR ""
#endif

namespace kiln::compiler::codegen {
namespace {

constexpr int kMaxOutputLines = 40;

std::string errno_text(int err) {
  return std::strerror(err);
}

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

std::string read_all(int fd) {
  std::string out;
  if (::lseek(fd, 0, SEEK_SET) < 0) return out;
  char buf[8192];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string command_text(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& arg : argv) {
    if (!out.empty()) out += ' ';
    bool plain = !arg.empty() && arg.find_first_of(" \t\n'\"\\$") == std::string::npos;
    out += plain ? arg : "'" + arg + "'";
  }
  return out;
}

// Runs argv with its output captured in an anonymous in-memory file; returns {status, output}.
std::pair<int, std::string> run_captured(const std::vector<std::string>& argv) {
  int fd = ::memfd_create("kiln-cxx-output", MFD_CLOEXEC);
  KILN_CHECK(fd >= 0, CompileError,
             "[kiln::compile] cannot create a buffer for the compiler's output: " +
                 errno_text(errno) + ".");
  FdCloser closer{fd};
  int status = run_process(argv, fd);
  return {status, read_all(fd)};
}

std::string pick_include_dir() {
  for (const char* dir : {KILN_SOURCE_INCLUDE_DIR, KILN_INSTALL_INCLUDE_DIR}) {
    struct stat st;
    std::string probe = std::string(dir) + "/kiln/math/functors.h";
    if (*dir && ::stat(probe.c_str(), &st) == 0 && S_ISREG(st.st_mode)) return dir;
  }
  detail::throw_error<CompileError>(
      std::string("[kiln::compile] cannot find Kiln's headers (kiln/math/functors.h) in '") +
      KILN_SOURCE_INCLUDE_DIR + "' or '" + KILN_INSTALL_INCLUDE_DIR +
      "', which generated kernels include. Reinstall Kiln (its include/ directory is missing).");
}

// The integer value of `#define name value` in `-E -dM` output, or -1.
int macro_value(const std::string& macros, const std::string& name) {
  std::string needle = "#define " + name + " ";
  size_t at = macros.find(needle);
  if (at == std::string::npos) return -1;
  return std::atoi(macros.c_str() + at + needle.size());
}

CxxCompiler probe(const std::string& path) {
  CxxCompiler cxx;
  cxx.path = path;
  auto [version_status, version] = run_captured({path, "--version"});
  KILN_CHECK(version_status == 0, CompileError,
             "[kiln::compile] the C++ compiler '" + path + "' failed on --version (exit status " +
                 std::to_string(version_status) + "): " + version +
                 "Set KILN_CXX to a working C++ compiler (g++ or clang++).");
  cxx.version = version;

  std::string arch = KILN_CPU_ARCH;
  if (arch.empty()) arch = "native";
  std::vector<std::string> flags = {"-std=c++20",      "-O3",           "-fPIC", "-fopenmp",
                                    "-fno-math-errno", "-march=" + arch};
  std::vector<std::string> argv = {path};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), {"-E", "-dM", "-x", "c++", "/dev/null"});
  auto [macro_status, macros] = run_captured(argv);
  KILN_CHECK(macro_status == 0, CompileError,
             "[kiln::compile] the C++ compiler '" + path + "' rejected Kiln's default flags (" +
                 command_text(argv) + "): " + macros +
                 "Set KILN_CXX to GCC or Clang with C++20 and OpenMP support.");
  cxx.target_macros = macros;

  // Same workaround as the library build (CMakeLists.txt): GCC 12 with AVX-512 miscompiles
  // constant initializer lists under SLP vectorization.
  bool is_gcc = macro_value(macros, "__clang__") < 0 && macro_value(macros, "__GNUC__") > 0;
  if (is_gcc && macro_value(macros, "__GNUC__") < 13) flags.push_back("-fno-tree-slp-vectorize");
  cxx.include_dir = pick_include_dir();
  flags.push_back("-I" + cxx.include_dir);
  cxx.default_flags = std::move(flags);
  return cxx;
}

std::string shorten_output(const std::string& output, const std::string& log_path) {
  std::string head;
  int lines = 0;
  size_t pos = 0;
  while (pos < output.size() && lines < kMaxOutputLines) {
    size_t end = output.find('\n', pos);
    if (end == std::string::npos) end = output.size();
    head.append(output, pos, end - pos).push_back('\n');
    pos = end + 1;
    ++lines;
  }
  if (pos < output.size()) {
    int more = static_cast<int>(std::count(output.begin() + pos, output.end(), '\n'));
    head += "... (" + std::to_string(std::max(more, 1)) + " more lines in " + log_path + ")\n";
  }
  if (head.empty()) head = "(no output)\n";
  return head;
}

[[noreturn]] void throw_build_failure(const CxxBuild& build, int status,
                                      const std::vector<std::string>& argv,
                                      const std::string& log_path, const std::string& source_path) {
  int fd = ::open(log_path.c_str(), O_RDONLY | O_CLOEXEC);
  std::string output;
  if (fd >= 0) {
    FdCloser closer{fd};
    output = read_all(fd);
  }
  std::string label = build.label.empty() ? "a kernel library" : build.label;
  std::string exit_text = status > 128 ? "killed by signal " + std::to_string(status - 128)
                                       : "exit status " + std::to_string(status);
  detail::throw_error<CompileError>(
      "[kiln::compile] the C++ compiler failed to build " + label + " (" + exit_text + "):\n" +
      shorten_output(output, log_path) + "Source: " + source_path +
      " (kept for inspection)\nCommand: " + command_text(argv) +
      "\nThis is a bug in Kiln's code generator unless the compiler setup is at fault (KILN_CXX); "
      "please report it with the source.");
}

// Runs one compiler command with its output in `log_path`; returns the exit status.
int run_logged(const std::vector<std::string>& argv, const std::string& log_path) {
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  KILN_CHECK(fd >= 0, CompileError,
             "[kiln::compile] cannot create the compiler log " + log_path + ": " +
                 errno_text(errno) + ". Check that the kernel cache directory is writable.");
  FdCloser closer{fd};
  return run_process(argv, fd);
}

std::string strip_extension(const std::string& path) {
  size_t slash = path.rfind('/');
  size_t dot = path.rfind('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path;
  return path.substr(0, dot);
}

}  // namespace

const CxxCompiler& system_compiler() {
  static std::mutex mutex;
  // Probed compilers live as long as the process; the map never erases, so references stay valid.
  static std::map<std::string, std::unique_ptr<CxxCompiler>> probed;
  const char* env = std::getenv("KILN_CXX");
  std::string path = env && *env ? env : KILN_CXX_COMPILER;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = probed.find(path);
  if (it == probed.end()) {
    it = probed.emplace(path, std::make_unique<CxxCompiler>(probe(path))).first;
  }
  return *it->second;
}

int run_process(const std::vector<std::string>& argv, int output_fd) {
  std::vector<char*> args;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, output_fd, 1);
  posix_spawn_file_actions_adddup2(&actions, output_fd, 2);
  // The compiler gets default signal handling and no blocked signals, whatever the host set.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t signals;
  sigemptyset(&signals);
  posix_spawnattr_setsigmask(&attr, &signals);
  sigfillset(&signals);
  posix_spawnattr_setsigdefault(&attr, &signals);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  pid_t pid = -1;
  int err = ::posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  KILN_CHECK(err == 0, CompileError,
             "[kiln::compile] cannot run the C++ compiler '" + argv[0] + "': " + errno_text(err) +
                 ". Install g++ or clang++, or set KILN_CXX to a C++ compiler.");

  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    KILN_CHECK(errno == EINTR, CompileError,
               "[kiln::compile] lost track of the C++ compiler (waitpid: " + errno_text(errno) +
                   "). Do not set SIGCHLD to SIG_IGN in a process that compiles kernels.");
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 255;
}

void build_shared_object(const CxxCompiler& compiler, const CxxBuild& build) {
  const auto& sources = build.source_paths;
  KILN_CHECK(!sources.empty(), CompileError,
             "[kiln::compile] nothing to build for " + build.label + ": no sources.");
  auto base_argv = [&] {
    std::vector<std::string> argv = {compiler.path};
    argv.insert(argv.end(), build.flags.begin(), build.flags.end());
    return argv;
  };

  // One translation unit: compile and link in one step (one process instead of two).
  if (sources.size() == 1) {
    auto argv = base_argv();
    argv.insert(argv.end(), {"-shared", sources[0], "-o", build.output_path});
    std::string log = strip_extension(sources[0]) + ".log";
    int status = run_logged(argv, log);
    if (status != 0) throw_build_failure(build, status, argv, log, sources[0]);
    return;
  }

  // Several: compile in parallel, then link.
  size_t n = sources.size();
  std::vector<std::vector<std::string>> commands(n);
  std::vector<std::string> objects(n), logs(n);
  std::vector<int> statuses(n, -1);
  std::vector<std::exception_ptr> errors(n);
  for (size_t i = 0; i < n; ++i) {
    objects[i] = strip_extension(sources[i]) + ".o";
    logs[i] = strip_extension(sources[i]) + ".log";
    commands[i] = base_argv();
    commands[i].insert(commands[i].end(), {"-c", sources[i], "-o", objects[i]});
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        statuses[i] = run_logged(commands[i], logs[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  size_t workers = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t t = 1; t < workers; ++t) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
  for (size_t i = 0; i < n; ++i) {
    if (errors[i]) std::rethrow_exception(errors[i]);
    if (statuses[i] != 0) throw_build_failure(build, statuses[i], commands[i], logs[i], sources[i]);
  }

  auto argv = base_argv();
  argv.push_back("-shared");
  argv.insert(argv.end(), objects.begin(), objects.end());
  argv.insert(argv.end(), {"-o", build.output_path});
  std::string log = build.work_dir + "/link.log";
  int status = run_logged(argv, log);
  if (status != 0) throw_build_failure(build, status, argv, log, build.work_dir);
}

}  // namespace kiln::compiler::codegen
