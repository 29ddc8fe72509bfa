#include "compiler/codegen/cpp/cxx_driver.h"
#include "core/progress.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
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

// The integer value of `#define name value` in `-E -dM` output, or -1.
int macro_value(const std::string& macros, const std::string& name) {
  std::string needle = "#define " + name + " ";
  size_t at = macros.find(needle);
  if (at == std::string::npos) return -1;
  return std::atoi(macros.c_str() + at + needle.size());
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

// Why a failed build is a full disk rather than a bad source: the compiler's own words, or a
// file system (the build directory's, or $TMPDIR's) with under 1 MiB left. Empty when neither.
std::string full_disk(const std::string& output, const std::string& work_dir) {
  constexpr unsigned long long kNearlyFull = 1 << 20;
  const char* tmp = std::getenv("TMPDIR");
  for (const std::string& dir : {work_dir, std::string(tmp && *tmp ? tmp : "/tmp")}) {
    struct statvfs fs;
    if (::statvfs(dir.c_str(), &fs) == 0) {
      unsigned long long free_bytes = static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize;
      if (free_bytes < kNearlyFull)
        return "the disk holding " + dir + " is full (" + std::to_string(free_bytes) + " bytes free)";
    }
  }
  if (output.find("No space left on device") != std::string::npos)
    return "a disk is full (the compiler said \"No space left on device\")";
  return {};
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
  if (std::string full = full_disk(output, build.work_dir); !full.empty()) {
    throw DiskFullError("[kiln::compile] the C++ compiler could not build " + label + " (" +
                        exit_text + "): " + full +
                        ". Free some space, or set KILN_CACHE_DIR (and TMPDIR, where the "
                        "compiler writes its temporary files) to a disk with room. Compiler "
                        "output:\n" +
                        shorten_output(output, log_path));
  }
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

std::string configured_compiler() {
  const char* env = std::getenv("KILN_CXX");
  return env && *env ? env : KILN_CXX_COMPILER;
}

std::string target_arch() {
  std::string arch = KILN_CPU_ARCH;
  return arch.empty() ? "native" : arch;
}

std::string find_executable(const std::string& program) {
  auto runnable = [](const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
  };
  if (program.empty()) return {};
  if (program.find('/') != std::string::npos) return runnable(program) ? program : std::string();
  const char* env = std::getenv("PATH");
  std::string path = env ? env : "/usr/local/bin:/usr/bin:/bin";
  for (size_t begin = 0; begin <= path.size();) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(begin, end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (runnable(candidate)) return candidate;
    begin = end + 1;
  }
  return {};
}

std::vector<std::string> default_flags_for(const std::string& target_macros) {
  std::vector<std::string> flags = {"-std=c++20",      "-O3",          "-fPIC", "-fopenmp",
                                    "-fno-math-errno", "-march=" + target_arch()};
  // Same workaround as the library build (CMakeLists.txt): GCC 12 with AVX-512 miscompiles
  // constant initializer lists under SLP vectorization.
  bool is_gcc =
      macro_value(target_macros, "__clang__") < 0 && macro_value(target_macros, "__GNUC__") > 0;
  if (is_gcc && macro_value(target_macros, "__GNUC__") < 13) flags.push_back("-fno-tree-slp-vectorize");
  return flags;
}

CxxCompiler probe_compiler(const std::string& path) {
  CxxCompiler cxx;
  cxx.path = path;
  auto [version_status, version] = run_captured({path, "--version"});
  KILN_CHECK(version_status == 0, CompileError,
             "[kiln::compile] the C++ compiler '" + path + "' failed on --version (exit status " +
                 std::to_string(version_status) + "): " + version +
                 "Set KILN_CXX to a working C++ compiler (g++ or clang++).");
  cxx.version = version;

  std::vector<std::string> argv = {path};
  for (const auto& flag : default_flags_for("")) argv.push_back(flag);
  argv.insert(argv.end(), {"-E", "-dM", "-x", "c++", "/dev/null"});
  auto [macro_status, macros] = run_captured(argv);
  KILN_CHECK(macro_status == 0, CompileError,
             "[kiln::compile] the C++ compiler '" + path + "' rejected Kiln's default flags (" +
                 command_text(argv) + "): " + macros +
                 "Set KILN_CXX to GCC or Clang with C++20 and OpenMP support.");
  cxx.target_macros = macros;
  cxx.default_flags = default_flags_for(macros);
  return cxx;
}

namespace {

// The child side of run_process, between vfork and exec: only system calls, no allocation (it
// shares the parent's memory). Every signal is blocked on entry.
[[noreturn]] void exec_child(const char* file, char* const* argv, int output_fd, pid_t parent) {
  // Die with the parent: a Kiln process killed mid-build leaves no compiler running.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);  // the parent died before prctl took effect
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0 || ::dup2(null_fd, 0) < 0 || ::dup2(output_fd, 1) < 0 || ::dup2(output_fd, 2) < 0)
    ::_exit(127);
  // Default handling for every signal, whatever the host process installed, then unblock.
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &action, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(file, argv, environ);
  ::_exit(127);
}

}  // namespace

int run_process(const std::vector<std::string>& argv, int output_fd) {
  std::string file = find_executable(argv[0]);
  KILN_CHECK(!file.empty(), CompileError,
             "[kiln::compile] cannot run the C++ compiler '" + argv[0] +
                 "': no such executable. Install g++ or clang++, or set KILN_CXX to a C++ "
                 "compiler.");
  std::vector<char*> args;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);

  // No signal handler of the host may run in the child while it shares our memory.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t parent = ::getpid();
  pid_t pid = ::vfork();
  if (pid == 0) exec_child(file.c_str(), args.data(), output_fd, parent);
  int spawn_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  KILN_CHECK(pid > 0, CompileError,
             "[kiln::compile] cannot start the C++ compiler '" + argv[0] + "': " +
                 errno_text(spawn_errno) + ".");

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

  // The compile this build belongs to counts its translation units (core/progress.h).
  kiln::detail::Progress* progress = kiln::detail::Progress::current();
  if (progress) progress->add_total(static_cast<int64_t>(sources.size()));

  // One translation unit: compile and link in one step (one process instead of two).
  if (sources.size() == 1) {
    auto argv = base_argv();
    argv.insert(argv.end(), {"-shared", sources[0], "-o", build.output_path});
    std::string log = strip_extension(sources[0]) + ".log";
    int status = run_logged(argv, log);
    if (status != 0) throw_build_failure(build, status, argv, log, sources[0]);
    if (progress) progress->advance();
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
        if (progress) progress->advance();
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
