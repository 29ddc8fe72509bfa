// The on-disk kernel cache and the system-compiler driver (DESIGN §2.5).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <spawn.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <sstream>
#include <thread>

#include "compiler/runtime/cache_admin.h"
#include "compiler/runtime/kernel_cache.h"
#include "kiln/error.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace rt = kiln::compiler::runtime;

const std::string kAnswerSource = "extern \"C\" int kiln_answer() { return 42; }\n";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::string sha256_hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr);
  std::string hex;
  char buf[3];
  for (unsigned int i = 0; i < size; ++i) {
    std::snprintf(buf, sizeof buf, "%02x", digest[i]);
    hex += buf;
  }
  return hex;
}

rt::CacheStats delta(const rt::CacheStats& before) {
  auto now = rt::cache_stats();
  return {now.hits - before.hits, now.builds - before.builds, now.rejected - before.rejected};
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const kiln::CompileError& e) {
    return e.what();
  }
  return "(no CompileError)";
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Starts the worker program (tests/kernel_cache_worker.cpp) with its output in `out_path`; as
// user `uid` when given (the test runs as root then).
pid_t spawn_worker(const std::vector<std::string>& args, const std::string& out_path,
                   std::optional<uid_t> uid = std::nullopt) {
  std::vector<std::string> argv = {KILN_KERNEL_CACHE_WORKER};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& arg : argv) cargv.push_back(arg.data());
  cargv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (out < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0) _exit(126);
    if (uid && (setgid(*uid) != 0 || setuid(*uid) != 0)) _exit(125);
    execve(cargv[0], cargv.data(), environ);
    _exit(127);
  }
  EXPECT_GT(pid, 0) << "cannot start " << argv[0];
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A script standing in for the C++ compiler at `path`: it answers the probe (--version, -E -dM)
// with the real compiler and runs `build` (shell) for builds. Returns `path`.
fs::path fake_compiler(const fs::path& path, const std::string& build) {
  write_file(path, "#!/bin/sh\ncase \" $* \" in *' --version '*|*' -dM '*) exec " KILN_TEST_CXX
                   " \"$@\";; esac\n" + build + "\n");
  EXPECT_EQ(chmod(path.c_str(), 0755), 0);
  return path;
}

// A compiler that appends each command line to `log` and runs the real one.
fs::path logging_compiler(const fs::path& path, const fs::path& log) {
  write_file(path, "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '" + log.string() + "'\nexec " KILN_TEST_CXX
                   " \"$@\"\n");
  EXPECT_EQ(chmod(path.c_str(), 0755), 0);
  return path;
}

size_t line_count(const std::string& text) {
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

// Whether process `pid` is gone (or a zombie nobody reaped yet).
bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  size_t paren = text.rfind(')');
  return text.empty() || (paren != std::string::npos && text.substr(paren + 2, 1) == "Z");
}

class KernelCache : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = "/tmp/kiln-kernel-cache-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    tmp_ = tmpl;
    cache_ = tmp_ / "cache";
    setenv("KILN_CACHE_DIR", cache_.c_str(), 1);
  }
  void TearDown() override {
    unsetenv("KILN_CACHE_DIR");
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }

  // The one entry directory of this Kiln version.
  fs::path version_dir() {
    for (const auto& entry : fs::directory_iterator(cache_)) {
      if (entry.path().filename().string().rfind("cpp-v", 0) == 0) return entry.path();
    }
    ADD_FAILURE() << "no cpp-v* directory in " << cache_;
    return {};
  }
  // The .so of the single entry in the cache.
  fs::path only_entry() {
    fs::path found;
    int count = 0;
    for (const auto& entry : fs::directory_iterator(version_dir())) {
      if (entry.path().extension() == ".so") {
        found = entry.path();
        ++count;
      }
    }
    EXPECT_EQ(count, 1) << "entries in " << version_dir();
    return found;
  }
  static fs::path checksum_of(const fs::path& so) {
    return fs::path(so).replace_extension(".sha256");
  }
  // Runs the worker on `source` in a fresh process; returns its output line.
  std::string run_worker(const std::string& source, int expected_status = 0,
                         const std::vector<std::string>& options = {}) {
    fs::path src = tmp_ / "worker_source.cpp";
    write_file(src, source);
    std::string out = (tmp_ / "worker.out").string();
    std::vector<std::string> args = options;
    args.push_back(src.string());
    int status = wait_for(spawn_worker(args, out));
    std::string text = read_file(out);
    EXPECT_EQ(status, expected_status) << text;
    return text;
  }
  // The build directories (tmp-*) in the version directory.
  std::vector<fs::path> build_dirs() {
    std::vector<fs::path> dirs;
    for (const auto& entry : fs::directory_iterator(version_dir())) {
      if (entry.path().filename().string().rfind("tmp-", 0) == 0) dirs.push_back(entry.path());
    }
    return dirs;
  }
  void expect_valid_entry(const fs::path& so) {
    std::string bytes = read_file(so);
    ASSERT_FALSE(bytes.empty()) << so;
    EXPECT_EQ(read_file(checksum_of(so)), sha256_hex(bytes) + "\n");
    struct stat st;
    ASSERT_EQ(lstat(so.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 077, 0u) << "entries are private";
  }

  fs::path tmp_, cache_;
};

TEST_F(KernelCache, BuildsLoadsAndThenHitsInMemoryAndOnDisk) {
  auto before = rt::cache_stats();
  auto start = std::chrono::steady_clock::now();
  auto first = rt::load_or_build({.sources = {kAnswerSource}, .label = "answer"});
  double cold_ms = ms_since(start);
  EXPECT_EQ(first->function<int()>("kiln_answer")(), 42);
  EXPECT_EQ(delta(before).builds, 1);
  EXPECT_EQ(delta(before).hits, 0);

  // The same request again: the loaded object is shared, nothing is built.
  start = std::chrono::steady_clock::now();
  auto second = rt::load_or_build({.sources = {kAnswerSource}, .label = "answer"});
  double memory_ms = ms_since(start);
  EXPECT_EQ(second.get(), first.get());
  EXPECT_EQ(delta(before).builds, 1);
  EXPECT_EQ(delta(before).hits, 1);

  // Once released, the next load comes from disk (verified, dlopen'ed), still without building.
  fs::path so = first->path();
  first.reset();
  second.reset();
  start = std::chrono::steady_clock::now();
  auto third = rt::load_or_build({.sources = {kAnswerSource}, .label = "answer"});
  double disk_ms = ms_since(start);
  EXPECT_EQ(third->function<int()>("kiln_answer")(), 42);
  EXPECT_EQ(third->path(), so.string());
  EXPECT_EQ(delta(before).builds, 1);
  EXPECT_EQ(delta(before).hits, 2);
  EXPECT_EQ(delta(before).rejected, 0);

  // The layout: <cache>/cpp-v<version>/<sha256 key>.so + .sha256, all private; no build dirs left.
  EXPECT_EQ(so.parent_path(), version_dir());
  EXPECT_EQ(so.stem().string().size(), 64u);
  expect_valid_entry(so);
  struct stat st;
  ASSERT_EQ(lstat(cache_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(lstat(version_dir().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  for (const auto& entry : fs::directory_iterator(version_dir())) {
    EXPECT_NE(entry.path().filename().string().rfind("tmp-", 0), 0u) << entry.path();
  }

  // A fresh process loads from disk without building.
  start = std::chrono::steady_clock::now();
  EXPECT_EQ(run_worker(kAnswerSource), "answer=42 hits=1 builds=0 rejected=0\n");
  double process_ms = ms_since(start);
  std::printf(
      "[ timing   ] cold build+load %.1f ms, in-memory hit %.3f ms, disk hit %.2f ms, "
      "fresh process (start, probe compiler, verify, dlopen, exit) %.1f ms\n",
      cold_ms, memory_ms, disk_ms, process_ms);
}

TEST_F(KernelCache, KeyCoversFlagsAndSources) {
  const std::string source = "extern \"C\" int kiln_answer() { return ANSWER; }\n";
  auto seven = rt::load_or_build({.sources = {source}, .extra_flags = {"-DANSWER=7"}});
  auto eight = rt::load_or_build({.sources = {source}, .extra_flags = {"-DANSWER=8"}});
  auto other = rt::load_or_build(
      {.sources = {source + "// another source\n"}, .extra_flags = {"-DANSWER=9"}});
  EXPECT_EQ(seven->function<int()>("kiln_answer")(), 7);
  EXPECT_EQ(eight->function<int()>("kiln_answer")(), 8);
  EXPECT_EQ(other->function<int()>("kiln_answer")(), 9);
  EXPECT_NE(seven->path(), eight->path());
  EXPECT_NE(eight->path(), other->path());
}

TEST_F(KernelCache, LinksSeveralTranslationUnits) {
  auto before = rt::cache_stats();
  auto object = rt::load_or_build(
      {.sources = {"int kiln_helper() { return 40; }\n",
                   "int kiln_helper();\nint kiln_other() { return 2; }\n",
                   "int kiln_helper(); int kiln_other();\n"
                   "extern \"C\" int kiln_answer() { return kiln_helper() + kiln_other(); }\n"},
       .label = "three units"});
  EXPECT_EQ(object->function<int()>("kiln_answer")(), 42);
  EXPECT_EQ(delta(before).builds, 1);
}

// Each way an entry can go bad: it is rejected (counted, deleted, never dlopen'ed), rebuilt, and
// the rebuilt entry is valid.
TEST_F(KernelCache, BadEntriesAreRejectedAndRebuilt) {
  struct Damage {
    const char* name;
    std::function<void(const fs::path& so, const fs::path& sum)> apply;
  };
  const std::vector<Damage> damages = {
      {"flipped byte in .so",
       [](const fs::path& so, const fs::path&) {
         std::string bytes = read_file(so);
         bytes[bytes.size() / 2] ^= 0x5a;
         write_file(so, bytes);
       }},
      {"truncated .so",
       [](const fs::path& so, const fs::path&) { fs::resize_file(so, fs::file_size(so) / 2); }},
      {"empty .so", [](const fs::path& so, const fs::path&) { fs::resize_file(so, 0); }},
      {"missing .so", [](const fs::path& so, const fs::path&) { fs::remove(so); }},
      {"missing .sha256", [](const fs::path&, const fs::path& sum) { fs::remove(sum); }},
      {"garbage .sha256",
       [](const fs::path&, const fs::path& sum) { write_file(sum, "not a checksum\n"); }},
      {"checksum of other bytes",
       [](const fs::path&, const fs::path& sum) { write_file(sum, sha256_hex("x") + "\n"); }},
      {"world-writable .so",
       [](const fs::path& so, const fs::path&) { ASSERT_EQ(chmod(so.c_str(), 0666), 0); }},
      {"group-writable .sha256",
       [](const fs::path&, const fs::path& sum) { ASSERT_EQ(chmod(sum.c_str(), 0620), 0); }},
      {".so owned by another user",
       [](const fs::path& so, const fs::path&) { ASSERT_EQ(chown(so.c_str(), 65534, 65534), 0); }},
      {".so is a symlink to a valid copy",
       [](const fs::path& so, const fs::path&) {
         fs::path copy = so.parent_path().parent_path() / "copy.so";
         fs::copy_file(so, copy, fs::copy_options::overwrite_existing);
         fs::remove(so);
         fs::create_symlink(copy, so);
       }},
      {".so is a directory",
       [](const fs::path& so, const fs::path&) {
         fs::remove(so);
         fs::create_directory(so);
       }},
  };
  for (const auto& damage : damages) {
    SCOPED_TRACE(damage.name);
    if (std::string(damage.name) == ".so owned by another user" && geteuid() != 0) continue;
    // A source of its own per case, built in this process and released so it is read from disk.
    std::string source = kAnswerSource + "// " + damage.name + "\n";
    fs::path so = rt::load_or_build({.sources = {source}})->path();
    damage.apply(so, checksum_of(so));

    auto before = rt::cache_stats();
    auto object = rt::load_or_build({.sources = {source}});
    EXPECT_EQ(object->function<int()>("kiln_answer")(), 42);
    EXPECT_EQ(delta(before).rejected, 1);
    EXPECT_EQ(delta(before).builds, 1);
    EXPECT_EQ(delta(before).hits, 0);
    expect_valid_entry(so);
  }
  // And a fresh process trusts the rebuilt entries.
  std::string last = kAnswerSource + "// .so is a directory\n";
  EXPECT_EQ(run_worker(last), "answer=42 hits=1 builds=0 rejected=0\n");
}

TEST_F(KernelCache, UnsafeCacheDirectoryIsRefused) {
  auto refused = [&](const std::string& expected) {
    std::string message = error_of([] { rt::cache_dir(); });
    EXPECT_NE(message.find("[kiln::compile] the kernel cache directory " + cache_.string()),
              std::string::npos)
        << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_NE(message.find("KILN_CACHE_DIR"), std::string::npos) << message;
    // load_or_build refuses too, without building anything.
    auto before = rt::cache_stats();
    EXPECT_NE(error_of([] { rt::load_or_build({.sources = {kAnswerSource}}); }).find(expected),
              std::string::npos);
    EXPECT_EQ(delta(before).builds, 0);
  };
  ASSERT_EQ(rt::cache_dir(), cache_.string());  // created 0700

  ASSERT_EQ(chmod(cache_.c_str(), 0770), 0);
  refused("is group- or world-writable (mode 0770)");
  ASSERT_EQ(chmod(cache_.c_str(), 0702), 0);
  refused("is group- or world-writable (mode 0702)");
  ASSERT_EQ(chmod(cache_.c_str(), 0755), 0);  // readable by others is fine
  EXPECT_EQ(rt::cache_dir(), cache_.string());

  if (geteuid() == 0) {
    ASSERT_EQ(chown(cache_.c_str(), 65534, 65534), 0);
    refused("is owned by uid 65534, not by this user (uid 0)");
    ASSERT_EQ(chown(cache_.c_str(), 0, 0), 0);
  }

  fs::path real = tmp_ / "real";
  fs::create_directory(real);
  fs::permissions(real, fs::perms::owner_all, fs::perm_options::replace);
  fs::remove_all(cache_);
  fs::create_directory_symlink(real, cache_);
  refused("is a symbolic link");

  fs::remove(cache_);
  write_file(cache_, "a file");
  refused("is not a directory");
  fs::remove(cache_);

  // The per-version subdirectory is checked the same way.
  rt::load_or_build({.sources = {kAnswerSource}});
  fs::path vdir = version_dir();
  ASSERT_EQ(chmod(vdir.c_str(), 0777), 0);
  std::string message = error_of([] { rt::load_or_build({.sources = {kAnswerSource + "//"}}); });
  EXPECT_NE(message.find(vdir.string() + " is group- or world-writable"), std::string::npos)
      << message;
}

TEST_F(KernelCache, DirectoryDefaultsToXdgCacheHomeThenHome) {
  const char* old_home = std::getenv("HOME");
  std::string saved_home = old_home ? old_home : "";
  const char* old_xdg = std::getenv("XDG_CACHE_HOME");
  std::string saved_xdg = old_xdg ? old_xdg : "";
  unsetenv("KILN_CACHE_DIR");

  setenv("XDG_CACHE_HOME", (tmp_ / "xdg").c_str(), 1);
  EXPECT_EQ(rt::cache_dir(), (tmp_ / "xdg" / "kiln").string());
  struct stat st;
  ASSERT_EQ(lstat((tmp_ / "xdg" / "kiln").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  setenv("XDG_CACHE_HOME", "relative/ignored", 1);  // the XDG spec: ignore a relative path
  setenv("HOME", (tmp_ / "home").c_str(), 1);
  EXPECT_EQ(rt::cache_dir(), (tmp_ / "home" / ".cache" / "kiln").string());
  unsetenv("XDG_CACHE_HOME");
  EXPECT_EQ(rt::cache_dir(), (tmp_ / "home" / ".cache" / "kiln").string());

  if (old_home)
    setenv("HOME", saved_home.c_str(), 1);
  else
    unsetenv("HOME");
  if (old_xdg) setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
}

TEST_F(KernelCache, TwoProcessesBuildingTheSameKeyBothSucceed) {
  // A source no process has built, so both workers find no entry and race to build it.
  fs::path src = tmp_ / "race.cpp";
  write_file(src, kAnswerSource + "// race\n");
  fs::path go = tmp_ / "go";
  std::string out_a = (tmp_ / "a.out").string(), out_b = (tmp_ / "b.out").string();
  pid_t a = spawn_worker({src.string(), go.string()}, out_a);
  pid_t b = spawn_worker({src.string(), go.string()}, out_b);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // both started and waiting
  write_file(go, "");
  int status_a = wait_for(a), status_b = wait_for(b);
  std::string text_a = read_file(out_a), text_b = read_file(out_b);
  EXPECT_EQ(status_a, 0) << text_a;
  EXPECT_EQ(status_b, 0) << text_b;
  // The entry lock lets one build while the other waits and then loads the result.
  std::vector<std::string> outputs = {text_a, text_b};
  std::sort(outputs.begin(), outputs.end());
  EXPECT_EQ(outputs[0], "answer=42 hits=0 builds=1 rejected=0\n");
  EXPECT_EQ(outputs[1], "answer=42 hits=1 builds=0 rejected=0\n");
  expect_valid_entry(only_entry());
  EXPECT_EQ(run_worker(kAnswerSource + "// race\n"), "answer=42 hits=1 builds=0 rejected=0\n");
}

TEST_F(KernelCache, ThreadsLoadingTheSameKeyShareOneBuild) {
  auto before = rt::cache_stats();
  std::vector<std::shared_ptr<rt::SharedObject>> objects(6);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < objects.size(); ++i) {
    threads.emplace_back(
        [&, i] { objects[i] = rt::load_or_build({.sources = {kAnswerSource + "// threads\n"}}); });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& object : objects) EXPECT_EQ(object.get(), objects[0].get());
  EXPECT_EQ(delta(before).builds, 1);
  EXPECT_EQ(delta(before).hits, 5);
}

TEST_F(KernelCache, CompilerErrorNamesTheMessageAndKeepsTheSource) {
  const std::string broken = "extern \"C\" int kiln_answer() { return 42 }\n";
  auto before = rt::cache_stats();
  std::string message =
      error_of([&] { rt::load_or_build({.sources = {broken}, .label = "graph 0/3"}); });
  EXPECT_NE(message.find("[kiln::compile] the C++ compiler failed to build graph 0/3"),
            std::string::npos)
      << message;
  // GCC's own words (its quotes follow the locale).
  EXPECT_NE(message.find("error: expected"), std::string::npos) << message;
  EXPECT_NE(message.find("return 42 }"), std::string::npos) << message;
  size_t at = message.find("Source: ");
  ASSERT_NE(at, std::string::npos) << message;
  std::string path = message.substr(at + 8, message.find(' ', at + 8) - at - 8);
  EXPECT_EQ(read_file(path), broken) << "the source is kept at " << path;
  EXPECT_NE(path.find("/tmp-graph_0_3-"), std::string::npos) << path;
  EXPECT_TRUE(fs::exists(fs::path(path).parent_path() / "KEPT")) << "marked as kept for a week";
  EXPECT_EQ(delta(before).builds, 0);
  for (const auto& entry : fs::directory_iterator(version_dir())) {
    EXPECT_NE(entry.path().extension(), ".so") << "no entry for a failed build";
  }

  // With several units, the failing one is named.
  message = error_of([&] {
    rt::load_or_build({.sources = {kAnswerSource, "int broken( {}\n"}, .label = "graph 1/3"});
  });
  EXPECT_NE(message.find("failed to build graph 1/3"), std::string::npos) << message;
  EXPECT_NE(message.find("kernel_1.cpp"), std::string::npos) << message;
}

TEST_F(KernelCache, LongCompilerOutputIsCut) {
  std::string broken;
  for (int i = 0; i < 100; ++i) broken += "int f" + std::to_string(i) + "() { return x; }\n";
  std::string message = error_of([&] { rt::load_or_build({.sources = {broken}}); });
  EXPECT_NE(message.find("more lines in "), std::string::npos) << message;
  EXPECT_LT(std::count(message.begin(), message.end(), '\n'), 50) << message;
}

TEST_F(KernelCache, MissingSymbolNamesTheSymbolAndLibrary) {
  auto object = rt::load_or_build({.sources = {kAnswerSource}, .label = "graph 2/3"});
  std::string message = error_of([&] { object->symbol("kiln_no_such_kernel"); });
  EXPECT_NE(message.find("'kiln_no_such_kernel'"), std::string::npos) << message;
  EXPECT_NE(message.find(object->path()), std::string::npos) << message;
  EXPECT_NE(message.find("graph 2/3"), std::string::npos) << message;
}

TEST_F(KernelCache, UnloadableLibraryIsAClearError) {
  // Links (a shared object may have undefined symbols) but fails dlopen(RTLD_NOW).
  std::string message = error_of([] {
    rt::load_or_build(
        {.sources = {"extern \"C\" int kiln_undefined_helper();\n"
                     "extern \"C\" int kiln_answer() { return kiln_undefined_helper(); }\n"},
         .label = "graph 3/3"});
  });
  EXPECT_NE(message.find("[kiln::compile] cannot load the kernel library"), std::string::npos)
      << message;
  EXPECT_NE(message.find("graph 3/3"), std::string::npos) << message;
  EXPECT_NE(message.find("kiln_undefined_helper"), std::string::npos) << message;
}

TEST_F(KernelCache, MissingCompilerIsAClearError) {
  setenv("KILN_CXX", "/nonexistent/kiln-test-c++", 1);
  std::string message = error_of([] { rt::load_or_build({.sources = {kAnswerSource}}); });
  unsetenv("KILN_CXX");
  EXPECT_NE(message.find("cannot run the C++ compiler '/nonexistent/kiln-test-c++'"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("KILN_CXX"), std::string::npos) << message;
  // And the real compiler works again.
  EXPECT_EQ(rt::load_or_build({.sources = {kAnswerSource}})->function<int()>("kiln_answer")(), 42);
}

// Issue 18.1/18.3: generated kernels include Kiln's headers from copies the library writes into
// the build's own private directory: never from the source tree or the install prefix, which
// someone else may be able to write (and which may not exist any more).
TEST_F(KernelCache, KernelsIncludeOnlyHeadersWrittenIntoTheirBuildDirectory) {
  fs::path log = tmp_ / "cxx.log";
  setenv("KILN_CXX", logging_compiler(tmp_ / "logging-c++", log).c_str(), 1);
  const std::string source =
      "#include \"kiln/math/functors.h\"\n"
      "extern \"C\" int kiln_answer() { return static_cast<int>(kiln::math::Add{}(40.0f, 2.0f)); }\n";
  auto object = rt::load_or_build({.sources = {source}, .label = "headers"});
  unsetenv("KILN_CXX");
  EXPECT_EQ(object->function<int()>("kiln_answer")(), 42);
  const std::string commands = read_file(log);
  std::istringstream words(commands);
  int includes = 0;
  for (std::string word; words >> word;) {
    if (word.rfind("-I", 0) != 0) continue;
    ++includes;
    EXPECT_EQ(word.rfind("-I" + version_dir().string() + "/tmp-headers-", 0), 0u) << word;
  }
  EXPECT_EQ(includes, 1) << commands;
  EXPECT_EQ(commands.find(KILN_SOURCE_DIR), std::string::npos) << commands;
}

// Issue 18.2: the library is dlopen'ed through the descriptor whose bytes were hashed, so a file
// swapped in at the entry's path after the check is never what runs.
TEST_F(KernelCache, LoadsTheBytesItVerifiedEvenIfThePathIsSwappedAfterwards) {
  fs::path seven = rt::load_or_build({.sources = {"extern \"C\" int kiln_answer() { return 7; }\n"}})->path();
  fs::path answer = rt::load_or_build({.sources = {kAnswerSource}})->path();  // released: from disk
  fs::path planted = tmp_ / "planted.so";
  fs::copy_file(seven, planted);
  bool swapped = false;
  rt::set_entry_verified_hook_for_testing([&](const std::string& path) {
    if (path == answer.string() && !swapped) {
      fs::rename(planted, answer);
      swapped = true;
    }
  });
  auto object = rt::load_or_build({.sources = {kAnswerSource}});
  rt::set_entry_verified_hook_for_testing(nullptr);
  ASSERT_TRUE(swapped);
  EXPECT_EQ(object->function<int()>("kiln_answer")(), 42);
}

// Libraries are known to the loader as /proc/self/fd/N: loading and releasing one after another
// (reusing descriptor numbers) must load each one's own code.
TEST_F(KernelCache, LibrariesLoadedOneAfterAnotherAreEachTheirOwn) {
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 5; ++i) {
      std::string source = "extern \"C\" int kiln_answer() { return " + std::to_string(i) + "; }\n";
      auto object = rt::load_or_build({.sources = {source}});
      EXPECT_EQ(object->function<int()>("kiln_answer")(), i) << "round " << round;
    }
  }
}

// Issue 18.2: every directory above the cache must be safe from other users, or they could swap
// the cache (or a directory holding it) between the checks and the loads.
TEST_F(KernelCache, DirectoriesAboveTheCacheMustBeWritableOnlyByThisUserAndRoot) {
  fs::path shared = tmp_ / "shared";
  fs::create_directory(shared);
  ASSERT_EQ(chmod(shared.c_str(), 0777), 0);
  setenv("KILN_CACHE_DIR", (shared / "cache").c_str(), 1);
  auto refused = [&](const std::string& expected) {
    std::string message = error_of([] { rt::cache_dir(); });
    EXPECT_NE(message.find("[kiln::compile] the kernel cache directory " + (shared / "cache").string() +
                           " is inside " + shared.string() + expected),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("another user can change"), std::string::npos) << message;
    auto before = rt::cache_stats();
    EXPECT_NE(error_of([] { rt::load_or_build({.sources = {kAnswerSource}}); }).find(" is inside "),
              std::string::npos);
    EXPECT_EQ(delta(before).builds, 0);
  };
  refused(" (mode 0777)");
  // Sticky, like /tmp: others cannot rename or delete what is ours.
  ASSERT_EQ(chmod(shared.c_str(), 01777), 0);
  EXPECT_EQ(rt::cache_dir(), (shared / "cache").string());
  // Through a link, the directories checked are the real ones, and the path returned is real.
  fs::create_directory_symlink(shared, tmp_ / "link");
  setenv("KILN_CACHE_DIR", (tmp_ / "link" / "cache").c_str(), 1);
  EXPECT_EQ(rt::cache_dir(), (shared / "cache").string());
  ASSERT_EQ(chmod(shared.c_str(), 0775), 0);
  refused(" (mode 0775)");
  if (geteuid() == 0) {
    ASSERT_EQ(chmod(shared.c_str(), 0755), 0);
    ASSERT_EQ(chown(shared.c_str(), 65534, 65534), 0);
    refused(", owned by uid 65534");
  }
}

// Issue 18.6: a FIFO where an entry's file should be is rejected like any bad entry, at once.
TEST_F(KernelCache, AFifoAtAnEntryPathIsRejectedWithoutBlocking) {
  for (const char* which : {".so", ".sha256"}) {
    SCOPED_TRACE(which);
    std::string source = kAnswerSource + "// fifo " + which + "\n";
    fs::path so = rt::load_or_build({.sources = {source}})->path();
    fs::path target = std::string(which) == ".so" ? so : checksum_of(so);
    fs::remove(target);
    ASSERT_EQ(mkfifo(target.c_str(), 0600), 0);
    auto before = rt::cache_stats();
    auto answer = std::async(std::launch::async, [&] {
      return rt::load_or_build({.sources = {source}})->function<int()>("kiln_answer")();
    });
    if (answer.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      std::fprintf(stderr, "load_or_build blocked on a FIFO at %s\n", target.c_str());
      std::_Exit(1);
    }
    EXPECT_EQ(answer.get(), 42);
    EXPECT_EQ(delta(before).rejected, 1);
    expect_valid_entry(so);
  }
}

// Issue 18.4: a process whose kernels are all cached starts no compiler, and needs none
// installed; a changed compiler binary is probed again.
TEST_F(KernelCache, AWarmCacheStartsNoCompilerAndNeedsNone) {
  fs::path log = tmp_ / "cxx.log";
  fs::path cxx = logging_compiler(tmp_ / "logging-c++", log);
  setenv("KILN_CXX", cxx.c_str(), 1);
  EXPECT_EQ(run_worker(kAnswerSource), "answer=42 hits=0 builds=1 rejected=0\n");
  const size_t cold = line_count(read_file(log));
  EXPECT_EQ(cold, 3u) << "--version, -E -dM, the build:\n" << read_file(log);
  EXPECT_EQ(run_worker(kAnswerSource), "answer=42 hits=1 builds=0 rejected=0\n");
  EXPECT_EQ(line_count(read_file(log)), cold) << "a warm process ran the compiler";

  fs::remove(cxx);  // no compiler at all
  EXPECT_EQ(run_worker(kAnswerSource), "answer=42 hits=1 builds=0 rejected=0\n");
  std::string message = error_of([] { rt::load_or_build({.sources = {kAnswerSource + "// new\n"}}); });
  EXPECT_NE(message.find("cannot run the C++ compiler '" + cxx.string() + "'"), std::string::npos)
      << message;

  // Reinstalled (a new binary): probed again, and the kernels of the same compiler still serve.
  logging_compiler(cxx, log);
  EXPECT_EQ(run_worker(kAnswerSource), "answer=42 hits=1 builds=0 rejected=0\n");
  EXPECT_EQ(line_count(read_file(log)), cold + 2) << read_file(log);
  unsetenv("KILN_CXX");
}

// Issue 18 (rough edges): a build killed with its process takes its compiler along, the next
// build removes the directory it left, and a waiter for its lock says whom it waits for and gives
// up at KILN_CACHE_LOCK_TIMEOUT.
TEST_F(KernelCache, AKilledBuildLeavesNothingBehindAndWaitersGiveUp) {
  fs::path pid_file = tmp_ / "compiler.pid";
  setenv("KILN_CXX",
         fake_compiler(tmp_ / "slow-c++", "echo $$ > '" + pid_file.string() + "'\nexec sleep 300")
             .c_str(),
         1);
  const std::string source = kAnswerSource + "// slow\n";
  fs::path src = tmp_ / "slow.cpp";
  write_file(src, source);
  pid_t worker = spawn_worker({src.string()}, (tmp_ / "slow.out").string());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (read_file(pid_file).empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const std::string pid_text = read_file(pid_file);
  ASSERT_FALSE(pid_text.empty()) << "the worker never started its compiler";
  const pid_t compiler = static_cast<pid_t>(std::stol(pid_text));

  setenv("KILN_CACHE_LOCK_TIMEOUT", "1", 1);
  std::string message = error_of([&] { rt::load_or_build({.sources = {source}, .label = "slow"}); });
  unsetenv("KILN_CACHE_LOCK_TIMEOUT");
  EXPECT_NE(message.find("gave up building slow after waiting 1 s for process " +
                         std::to_string(worker) + ", which is building the same kernels"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("KILN_CACHE_LOCK_TIMEOUT"), std::string::npos) << message;

  ASSERT_EQ(kill(worker, SIGKILL), 0);
  wait_for(worker);
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!process_gone(compiler) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(process_gone(compiler)) << "the compiler outlived the process that started it";
  if (!process_gone(compiler)) kill(compiler, SIGKILL);
  EXPECT_EQ(build_dirs().size(), 1u);

  unsetenv("KILN_CXX");
  EXPECT_EQ(rt::load_or_build({.sources = {source}})->function<int()>("kiln_answer")(), 42);
  EXPECT_TRUE(build_dirs().empty()) << build_dirs()[0];
}

// Issue 18 (rough edges): a full disk is reported as one, not as a code generator bug, and the
// build directory goes.
TEST_F(KernelCache, AFullDiskIsReportedAsOneAndLeavesNoBuildDirectory) {
  setenv("KILN_CXX",
         fake_compiler(tmp_ / "full-c++",
                       "echo 'cc1plus: fatal error: error writing to /tmp/ccQ1.s: No space left "
                       "on device' >&2\nexit 1")
             .c_str(),
         1);
  std::string message = error_of([] { rt::load_or_build({.sources = {kAnswerSource}, .label = "full"}); });
  unsetenv("KILN_CXX");
  EXPECT_NE(message.find("[kiln::compile] the C++ compiler could not build full"), std::string::npos)
      << message;
  EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
  EXPECT_NE(message.find("KILN_CACHE_DIR"), std::string::npos) << message;
  EXPECT_EQ(message.find("bug in Kiln"), std::string::npos) << message;
  EXPECT_TRUE(build_dirs().empty());
}

// Issue 18 (rough edges): a cache that cannot be written serves the entries it holds, and says
// plainly why it cannot add one.
TEST_F(KernelCache, AReadOnlyCacheServesItsEntries) {
  EXPECT_EQ(rt::load_or_build({.sources = {kAnswerSource}})->function<int()>("kiln_answer")(), 42);
  ASSERT_EQ(chmod(version_dir().c_str(), 0500), 0);
  ASSERT_EQ(chmod(cache_.c_str(), 0500), 0);
  // Root ignores file modes: the worker gives up that power first.
  std::vector<std::string> options;
  if (geteuid() == 0) options.push_back("--no-file-override");
  EXPECT_EQ(run_worker(kAnswerSource, 0, options), "answer=42 hits=1 builds=0 rejected=0\n");
  std::string message = run_worker(kAnswerSource + "// new\n", 1, options);
  EXPECT_NE(message.find("[kiln::compile] the kernel cache " + version_dir().string() +
                         " cannot be written (Permission denied) and holds no valid entry for worker"),
            std::string::npos)
      << message;
  ASSERT_EQ(chmod(cache_.c_str(), 0700), 0);
  ASSERT_EQ(chmod(version_dir().c_str(), 0700), 0);
}

// ---- kiln cache info / verify / clear (cache_admin.h) ----

// Three CUDA-style blob entries of a kind of their own (no compiler needed), one of them made old.
class KernelCacheAdmin : public KernelCache {
 protected:
  fs::path blob_dir() { return cache_ / (std::string("testkind-v") + rt::cache_info().version); }
  fs::path entry_of(const std::string& label) {
    std::string bytes = rt::load_or_build_blob({"testkind", {{"label", label}}, label}, [&] { return "bytes of " + label; });
    EXPECT_EQ(bytes, "bytes of " + label);
    for (const auto& e : fs::directory_iterator(blob_dir())) {
      if (e.path().extension() != ".bin") continue;
      std::ifstream in(e.path(), std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text == "bytes of " + label) return e.path();
    }
    ADD_FAILURE() << "no entry holds " << label;
    return {};
  }
  // The testkind row of `info` (which must outlive the pointer), or nullptr.
  const rt::CacheKindInfo* kind(const rt::CacheInfo& info) {
    for (const rt::CacheKindInfo& k : info.kinds)
      if (k.kind == "testkind") return &k;
    return nullptr;
  }
  const rt::CacheKindInfo* kind(rt::CacheInfo&&) = delete;
};

TEST_F(KernelCacheAdmin, InfoCountsEntriesByKindWithTheirSizeAndAge) {
  entry_of("a");
  fs::path b = entry_of("b");
  const struct timespec times[2] = {{0, UTIME_OMIT}, {time(nullptr) - 3 * 86400, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, b.c_str(), times, AT_SYMLINK_NOFOLLOW), 0);
  const rt::CacheInfo info = rt::cache_info();
  EXPECT_EQ(fs::path(info.root), fs::canonical(cache_));
  const rt::CacheKindInfo* k = kind(info);
  ASSERT_NE(k, nullptr);
  EXPECT_TRUE(k->current);
  EXPECT_EQ(k->entries, 2);
  EXPECT_EQ(k->locks, 2);
  EXPECT_NEAR(k->oldest_days, 3.0, 0.01);
  EXPECT_LT(k->newest_days, 0.01);
  EXPECT_GE(k->bytes, int64_t(2 * (64 + 10)));  // two checksums of 64 hex digits and two entries
}

TEST_F(KernelCacheAdmin, VerifyRemovesTamperedForeignAndOrphanedEntriesOnly) {
  fs::path good = entry_of("good"), tampered = entry_of("tampered"), open_to_all = entry_of("open");
  fs::path orphan = entry_of("orphan");
  { std::ofstream(tampered, std::ios::binary | std::ios::app) << "x"; }
  ASSERT_EQ(chmod(open_to_all.c_str(), 0666), 0);
  fs::remove(orphan);  // its checksum stays
  const rt::CacheVerifyReport r = rt::verify_cache();
  EXPECT_EQ(r.checked, 4);
  EXPECT_EQ(r.valid, 1);
  ASSERT_EQ(r.removed.size(), 3u);
  std::string all;
  for (const std::string& line : r.removed) all += line + "\n";
  EXPECT_NE(all.find(tampered.string() + ": its bytes do not match the checksum"), std::string::npos) << all;
  EXPECT_NE(all.find(open_to_all.string() + ": the entry is writable by others"), std::string::npos) << all;
  EXPECT_NE(all.find("its checksum has no entry file"), std::string::npos) << all;
  EXPECT_TRUE(fs::exists(good));
  for (const fs::path& p : {tampered, open_to_all})
    EXPECT_FALSE(fs::exists(p) || fs::exists(fs::path(p).replace_extension(".sha256"))) << p;
  EXPECT_FALSE(fs::exists(fs::path(orphan).replace_extension(".sha256")));
  const rt::CacheVerifyReport again = rt::verify_cache();
  EXPECT_EQ(again.checked, 1);
  EXPECT_TRUE(again.removed.empty());
}

TEST_F(KernelCacheAdmin, ClearByAgeKeepsNewerEntriesAndClearAllEmptiesTheCache) {
  fs::path old_entry = entry_of("old"), new_entry = entry_of("new");
  const struct timespec times[2] = {{0, UTIME_OMIT}, {time(nullptr) - 10 * 86400, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, old_entry.c_str(), times, AT_SYMLINK_NOFOLLOW), 0);
  const int64_t old_size = static_cast<int64_t>(fs::file_size(old_entry));
  const rt::CacheClearReport by_age = rt::clear_cache(5.0);
  EXPECT_EQ(by_age.removed_entries, 1);
  EXPECT_EQ(by_age.removed_bytes, old_size);
  EXPECT_EQ(by_age.kept_entries, 1);
  EXPECT_FALSE(fs::exists(old_entry));
  EXPECT_FALSE(fs::exists(fs::path(old_entry).replace_extension(".lock")));
  EXPECT_TRUE(fs::exists(new_entry));
  // A file of another kind the cache does not know stays, and keeps its directory.
  { std::ofstream(blob_dir() / "notes.txt") << "mine"; }
  const rt::CacheClearReport all = rt::clear_cache(std::nullopt);
  EXPECT_EQ(all.removed_entries, 1);
  EXPECT_EQ(all.kept_entries, 0);
  EXPECT_FALSE(fs::exists(new_entry));
  EXPECT_TRUE(fs::exists(blob_dir() / "notes.txt"));
  const rt::CacheInfo after = rt::cache_info();
  const rt::CacheKindInfo* k = kind(after);
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->entries, 0);
  EXPECT_EQ(k->locks, 0);
  EXPECT_EQ(k->other, 1);
  fs::remove(blob_dir() / "notes.txt");
  rt::clear_cache(std::nullopt);
  EXPECT_FALSE(fs::exists(blob_dir()));  // an emptied directory goes too
}

// `kiln cache` prints the reports; verify's exit status says whether anything was bad.
TEST_F(KernelCacheAdmin, TheKilnCacheCommand) {
  fs::path tampered = entry_of("tampered");
  entry_of("fine");
  { std::ofstream(tampered, std::ios::binary | std::ios::app) << "x"; }
  auto run = [&](const std::string& args, int& status) {
    const std::string command = "KILN_CACHE_DIR='" + cache_.string() + "' '" + std::string(KILN_BINARY_DIR) +
                                "/bin/kiln' cache " + args + " 2>&1";
    FILE* p = popen(command.c_str(), "r");
    std::string out;
    char buf[512];
    while (p && fgets(buf, sizeof buf, p)) out += buf;
    status = p ? pclose(p) : -1;
    return out;
  };
  int status = 0;
  std::string out = run("info", status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("testkind"), std::string::npos) << out;
  out = run("verify", status);
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_NE(out.find("bad: " + tampered.string() + ": its bytes do not match the checksum"), std::string::npos) << out;
  EXPECT_NE(out.find("checked 2 entries: 1 valid, 1 bad"), std::string::npos) << out;
  out = run("verify", status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  out = run("clear --older-than soon", status);
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_NE(out.find("--older-than needs a number of days"), std::string::npos) << out;
  out = run("clear", status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("removed 1 entries"), std::string::npos) << out;
}

}  // namespace
