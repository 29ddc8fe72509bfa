// The on-disk kernel cache and the system-compiler driver (DESIGN §2.5).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

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

// Starts the worker program (tests/kernel_cache_worker.cpp) with its output in `out_path`.
pid_t spawn_worker(const std::vector<std::string>& args, const std::string& out_path) {
  std::vector<std::string> argv = {KILN_KERNEL_CACHE_WORKER};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& arg : argv) cargv.push_back(arg.data());
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  int err = posix_spawn(&pid, cargv[0], &actions, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(err, 0) << "cannot start " << argv[0];
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
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
  std::string run_worker(const std::string& source) {
    fs::path src = tmp_ / "worker_source.cpp";
    write_file(src, source);
    std::string out = (tmp_ / "worker.out").string();
    int status = wait_for(spawn_worker({src.string()}, out));
    std::string text = read_file(out);
    EXPECT_EQ(status, 0) << text;
    return text;
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

}  // namespace
