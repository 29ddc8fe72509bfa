#include "compiler/runtime/kernel_cache.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "compiler/codegen/cpp/cxx_driver.h"
#include "kiln/error.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::compiler::runtime {
namespace {

namespace fs = std::filesystem;

// Bump when the entry layout or the key's contents change.
constexpr std::string_view kKeyFormat = "kiln-cpp-kernel-cache-1";

std::atomic<int64_t> g_hits{0}, g_builds{0}, g_rejected{0};

std::string errno_text(int err) {
  return std::strerror(err);
}

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// ---- SHA-256 (OpenSSL EVP) ----

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {
    KILN_CHECK(ctx_ && EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) == 1, CompileError,
               "[kiln::compile] OpenSSL could not start a SHA-256 digest.");
  }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(std::string_view bytes) { EVP_DigestUpdate(ctx_, bytes.data(), bytes.size()); }
  // A named, length-prefixed field, so that no two different key inputs hash the same bytes.
  void field(std::string_view name, std::string_view value) {
    update(name);
    update(std::string_view("\0", 1));
    update(std::to_string(value.size()));
    update(std::string_view("\0", 1));
    update(value);
  }
  std::string hex() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int size = 0;
    EVP_DigestFinal_ex(ctx_, digest, &size);
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < size; ++i) {
      out.push_back(digits[digest[i] >> 4]);
      out.push_back(digits[digest[i] & 15]);
    }
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

// The hex SHA-256 of everything `fd` holds from its start; empty when a read fails.
std::string sha256_of_fd(int fd) {
  if (::lseek(fd, 0, SEEK_SET) < 0) return {};
  Sha256 sha;
  std::vector<char> buf(1 << 16);
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return {};
    if (n == 0) break;
    sha.update(std::string_view(buf.data(), static_cast<size_t>(n)));
  }
  return sha.hex();
}

// ---- the directory ----

std::string home_dir() {
  if (const char* home = std::getenv("HOME"); home && *home) return home;
  struct passwd pw, *result = nullptr;
  char buf[4096];
  if (::getpwuid_r(::geteuid(), &pw, buf, sizeof buf, &result) == 0 && result && pw.pw_dir)
    return pw.pw_dir;
  return {};
}

std::string root_dir() {
  if (const char* dir = std::getenv("KILN_CACHE_DIR"); dir && *dir) {
    return fs::absolute(dir).lexically_normal().string();
  }
  // The XDG spec says to ignore a relative XDG_CACHE_HOME.
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && xdg[0] == '/') {
    return std::string(xdg) + "/kiln";
  }
  std::string home = home_dir();
  KILN_CHECK(!home.empty(), CompileError,
             "[kiln::compile] cannot place the kernel cache: HOME is not set and this user has "
             "no home directory. Set KILN_CACHE_DIR to a private directory.");
  return home + "/.cache/kiln";
}

// Creates `dir` (0700) if missing, then insists that it is a real directory owned by us that
// nobody else can write to: anyone who could write there could plant code that Kiln would load.
void ensure_private_dir(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    KILN_CHECK(errno == ENOENT, CompileError,
               "[kiln::compile] cannot access the kernel cache directory " + dir + ": " +
                   errno_text(errno) + ". Set KILN_CACHE_DIR to a private directory.");
    std::error_code ec;
    fs::create_directories(fs::path(dir).parent_path(), ec);  // parents as usual (umask)
    if (::mkdir(dir.c_str(), 0700) == 0) {
      ::chmod(dir.c_str(), 0700);  // whatever the umask
    } else {
      KILN_CHECK(errno == EEXIST, CompileError,
                 "[kiln::compile] cannot create the kernel cache directory " + dir + ": " +
                     errno_text(errno) + ". Set KILN_CACHE_DIR to a writable private directory.");
    }
    KILN_CHECK(::lstat(dir.c_str(), &st) == 0, CompileError,
               "[kiln::compile] cannot access the kernel cache directory " + dir + ": " +
                   errno_text(errno) + ". Set KILN_CACHE_DIR to a private directory.");
  }
  const std::string what = "[kiln::compile] the kernel cache directory " + dir;
  const std::string fix = "set KILN_CACHE_DIR to a directory only you can write to (mkdir -m 700 DIR).";
  const std::string fix_sentence = "Set KILN_CACHE_DIR to a directory only you can write to (mkdir -m 700 DIR).";
  KILN_CHECK(!S_ISLNK(st.st_mode), CompileError,
             what + " is a symbolic link; Kiln only loads kernels from a real directory it owns. " +
                 "Replace the link with a directory, or " + fix);
  KILN_CHECK(S_ISDIR(st.st_mode), CompileError, what + " is not a directory. " + fix_sentence);
  KILN_CHECK(st.st_uid == ::geteuid(), CompileError,
             what + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
                 std::to_string(::geteuid()) + "); its kernels could have been written by " +
                 "someone else. " + fix_sentence);
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    detail::throw_error<CompileError>(
        what + " is group- or world-writable (mode " + mode + "); anyone who can write there " +
        "could plant code that Kiln would load. Run `chmod go-w " + dir + "`, or " + fix);
  }
}

// The entries of this Kiln version: <root>/cpp-v<version>.
std::string version_dir() {
  std::string dir = cache_dir() + "/cpp-v" KILN_VERSION;
  ensure_private_dir(dir);
  return dir;
}

void fsync_dir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.fd >= 0) ::fsync(fd.fd);
}

// ---- the key ----

// A digest of every file under <include_dir>/kiln, once per process: generated code includes
// Kiln's headers, so an edited header (a source tree without a version bump) changes the key.
const std::string& headers_digest(const std::string& include_dir) {
  static std::mutex mutex;
  static std::map<std::string, std::string> digests;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = digests.find(include_dir);
  if (it != digests.end()) return it->second;
  std::vector<std::string> files;
  std::error_code ec;
  for (fs::recursive_directory_iterator walk(include_dir + "/kiln", ec), end; !ec && walk != end;
       walk.increment(ec)) {
    if (walk->is_regular_file(ec)) files.push_back(walk->path().string());
  }
  std::sort(files.begin(), files.end());
  Sha256 sha;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    sha.field(file, text.str());
  }
  return digests.emplace(include_dir, sha.hex()).first->second;
}

std::string cache_key(const codegen::CxxCompiler& cxx, const std::vector<std::string>& flags,
                      const std::vector<std::string>& sources) {
  Sha256 sha;
  sha.field("format", kKeyFormat);
  sha.field("kiln", KILN_VERSION);
  sha.field("compiler", cxx.path);
  sha.field("compiler-version", cxx.version);
  sha.field("target", cxx.target_macros);  // the ISA -march resolves to, on this machine
  sha.field("headers", headers_digest(cxx.include_dir));
  for (const auto& flag : flags) sha.field("flag", flag);
  for (const auto& source : sources) sha.field("source", source);
  return sha.hex();
}

// ---- entries ----

enum class EntryState { missing, valid, bad };

// Opens an entry file without following links; -1 with errno ENOENT when absent, -2 when it is
// not a regular file of ours that only we can write.
int open_entry_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? -1 : -2;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      (st.st_mode & (S_IWGRP | S_IWOTH))) {
    ::close(fd);
    return -2;
  }
  return fd;
}

EntryState check_entry(const std::string& so_path, const std::string& sum_path) {
  Fd so(open_entry_file(so_path));
  Fd sum(open_entry_file(sum_path));
  if (so.fd == -1 && sum.fd == -1) return EntryState::missing;
  if (so.fd < 0 || sum.fd < 0) return EntryState::bad;
  char text[130];
  ssize_t n = ::read(sum.fd, text, sizeof text);
  if (n < 64) return EntryState::bad;
  std::string expected(text, static_cast<size_t>(n));
  if (expected.back() == '\n') expected.pop_back();
  if (expected.size() != 64 ||
      expected.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return EntryState::bad;
  }
  return sha256_of_fd(so.fd) == expected ? EntryState::valid : EntryState::bad;
}

void remove_entry(const std::string& so_path, const std::string& sum_path) {
  for (const auto& path : {so_path, sum_path}) {
    std::error_code ec;
    fs::remove_all(path, ec);  // never follows links; a directory in the way goes too
    KILN_CHECK(!ec, CompileError,
               "[kiln::compile] cannot remove the bad kernel cache entry " + path + ": " +
                   ec.message() + ". Remove it by hand.");
  }
}

// An exclusive flock on <key>.lock for this scope. Each open() is its own lock, so it also
// serializes threads of this process.
class EntryLock {
 public:
  explicit EntryLock(const std::string& path)
      : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600)) {
    KILN_CHECK(fd_.fd >= 0, CompileError,
               "[kiln::compile] cannot open the kernel cache lock " + path + ": " +
                   errno_text(errno) +
                   ". Remove it, or set KILN_CACHE_DIR to a private directory.");
    while (::flock(fd_.fd, LOCK_EX) != 0) {
      KILN_CHECK(errno == EINTR, CompileError,
                 "[kiln::compile] cannot lock " + path + ": " + errno_text(errno) + ".");
    }
  }  // the lock goes with the descriptor

 private:
  Fd fd_;
};

void write_all(int fd, std::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n > 0, CompileError,
               "[kiln::compile] cannot write " + path + ": " + errno_text(errno) +
                   ". Check the free space of the kernel cache directory.");
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

void rename_into_place(const std::string& from, const std::string& to) {
  KILN_CHECK(::rename(from.c_str(), to.c_str()) == 0, CompileError,
             "[kiln::compile] cannot move " + from + " to " + to + ": " + errno_text(errno) + ".");
}

// Moves the freshly linked .so into place, then its checksum: each durable (fsync) before an
// atomic rename, so a reader sees either no entry or a whole one. A crash between the two
// renames leaves a .so without a checksum, which the next load rejects and rebuilds.
void install_entry(const std::string& built_so, const std::string& vdir, const std::string& key,
                   const char* suffix = ".so") {
  std::string hex;
  {
    Fd so(::open(built_so.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    KILN_CHECK(so.fd >= 0, CompileError,
               "[kiln::compile] the compiler produced no shared object at " + built_so + ": " +
                   errno_text(errno) + ".");
    ::fchmod(so.fd, 0600);  // the linker's mode follows the umask; entries must be private
    hex = sha256_of_fd(so.fd);
    KILN_CHECK(!hex.empty() && ::fsync(so.fd) == 0, CompileError,
               "[kiln::compile] cannot read back " + built_so + ": " + errno_text(errno) + ".");
  }
  rename_into_place(built_so, vdir + "/" + key + suffix);

  std::string tmp = vdir + "/." + key + ".sha256.XXXXXX";
  Fd sum(::mkostemp(tmp.data(), O_CLOEXEC));  // 0600
  KILN_CHECK(sum.fd >= 0, CompileError,
             "[kiln::compile] cannot create a file in " + vdir + ": " + errno_text(errno) + ".");
  write_all(sum.fd, hex + "\n", tmp);
  KILN_CHECK(::fsync(sum.fd) == 0, CompileError,
             "[kiln::compile] cannot write " + tmp + ": " + errno_text(errno) + ".");
  rename_into_place(tmp, vdir + "/" + key + ".sha256");
  fsync_dir(vdir);
}

std::string dir_safe(const std::string& label) {
  std::string out;
  for (char c : label.substr(0, 40))
    out.push_back(std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
  return out.empty() ? "kernel" : out;
}

// Removes a build directory on scope exit unless told to keep it (a failed compile keeps its
// sources for the user).
struct TempDir {
  std::string path;
  bool keep = false;
  ~TempDir() {
    std::error_code ec;
    if (!keep && !path.empty()) fs::remove_all(path, ec);
  }
};

// Builds the entry for `key` in a private temp dir inside the cache and installs it.
void build_entry(const BuildRequest& req, const codegen::CxxCompiler& cxx,
                 const std::vector<std::string>& flags, const std::string& vdir,
                 const std::string& key) {
  std::string tmpl = vdir + "/tmp-" + dir_safe(req.label) + "-XXXXXX";
  KILN_CHECK(::mkdtemp(tmpl.data()) != nullptr, CompileError,
             "[kiln::compile] cannot create a build directory in " + vdir + ": " +
                 errno_text(errno) + ". Check that the kernel cache directory is writable.");
  TempDir tmp{tmpl};

  codegen::CxxBuild build;
  build.flags = flags;
  build.work_dir = tmp.path;
  build.output_path = tmp.path + "/kernels.so";
  build.label = req.label.empty() ? "a kernel library" : req.label;
  for (size_t i = 0; i < req.sources.size(); ++i) {
    std::string path = tmp.path + "/kernel_" + std::to_string(i) + ".cpp";
    Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    KILN_CHECK(fd.fd >= 0, CompileError,
               "[kiln::compile] cannot create " + path + ": " + errno_text(errno) + ".");
    write_all(fd.fd, req.sources[i], path);
    build.source_paths.push_back(path);
  }
  tmp.keep = true;
  codegen::build_shared_object(cxx, build);
  tmp.keep = false;
  install_entry(build.output_path, vdir, key);
}

// Objects this process has loaded, by entry path: a second request shares the first's handle.
std::mutex g_loaded_mutex;
std::unordered_map<std::string, std::weak_ptr<SharedObject>> g_loaded;

std::shared_ptr<SharedObject> find_loaded(const std::string& so_path) {
  std::lock_guard<std::mutex> lock(g_loaded_mutex);
  auto it = g_loaded.find(so_path);
  if (it == g_loaded.end()) return nullptr;
  auto object = it->second.lock();
  if (!object) g_loaded.erase(it);
  return object;
}

std::shared_ptr<SharedObject> load(const std::string& so_path, const std::string& label) {
  auto object = std::make_shared<SharedObject>(so_path, label);
  std::lock_guard<std::mutex> lock(g_loaded_mutex);
  std::erase_if(g_loaded, [](const auto& entry) { return entry.second.expired(); });
  g_loaded[so_path] = object;
  return object;
}

}  // namespace

// ---- SharedObject ----

SharedObject::SharedObject(const std::string& path, std::string label)
    : path_(path), label_(std::move(label)) {
  handle_ = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) {
    const char* error = ::dlerror();
    detail::throw_error<CompileError>(
        "[kiln::compile] cannot load the kernel library " + path + " built for " + label_ + ": " +
        (error ? error : "unknown error") +
        ". Delete the file to rebuild it; if that does not help, please report it.");
  }
}

SharedObject::~SharedObject() {
  if (handle_) ::dlclose(handle_);
}

void* SharedObject::symbol(const char* name) const {
  void* address = ::dlsym(handle_, name);
  KILN_CHECK(address != nullptr, CompileError,
             "[kiln::compile] the kernel library " + path_ + " (" + label_ + ") has no symbol '" +
                 name + "'. This is a bug in Kiln's code generator; please report it.");
  return address;
}

// ---- the cache ----

std::string cache_dir() {
  std::string dir = root_dir();
  ensure_private_dir(dir);
  return dir;
}

CacheStats cache_stats() {
  return CacheStats{g_hits.load(), g_builds.load(), g_rejected.load()};
}

std::shared_ptr<SharedObject> load_or_build(const BuildRequest& req) {
  std::string label = req.label.empty() ? "a kernel library" : req.label;
  KILN_CHECK(!req.sources.empty(), ValueError,
             "[kiln::compile] nothing to build for " + label + ": the request has no sources.");
  const codegen::CxxCompiler& cxx = codegen::system_compiler();
  std::vector<std::string> flags = cxx.default_flags;
  flags.insert(flags.end(), req.extra_flags.begin(), req.extra_flags.end());
  std::string key = cache_key(cxx, flags, req.sources);
  std::string vdir = version_dir();
  std::string so_path = vdir + "/" + key + ".so";
  std::string sum_path = vdir + "/" + key + ".sha256";

  if (auto object = find_loaded(so_path)) {
    ++g_hits;
    return object;
  }
  // Entries are only read, deleted or written under the lock, so no process ever sees another's
  // half-installed entry (a .so whose checksum is not there yet) and deletes it as bad.
  EntryLock lock(vdir + "/" + key + ".lock");
  if (auto object = find_loaded(so_path)) {  // another thread loaded it while we waited
    ++g_hits;
    return object;
  }
  switch (check_entry(so_path, sum_path)) {
    case EntryState::valid:
      ++g_hits;
      return load(so_path, label);
    case EntryState::bad:
      ++g_rejected;
      remove_entry(so_path, sum_path);
      break;
    case EntryState::missing:
      break;
  }
  build_entry(req, cxx, flags, vdir, key);
  ++g_builds;
  return load(so_path, label);
}

std::string load_or_build_blob(const BlobRequest& req, const std::function<std::string()>& build) {
  Sha256 sha;
  sha.field("format", "kiln-blob-cache-1");
  sha.field("kiln", KILN_VERSION);
  for (const auto& [name, value] : req.key_fields) sha.field(name, value);
  std::string key = sha.hex();
  std::string vdir = cache_dir() + "/" + req.kind + "-v" KILN_VERSION;
  ensure_private_dir(vdir);
  std::string bin_path = vdir + "/" + key + ".bin";
  std::string sum_path = vdir + "/" + key + ".sha256";
  EntryLock lock(vdir + "/" + key + ".lock");
  switch (check_entry(bin_path, sum_path)) {
    case EntryState::valid: {
      Fd fd(open_entry_file(bin_path));
      std::string bytes;
      std::vector<char> buf(1 << 16);
      for (ssize_t n; fd.fd >= 0 && (n = ::read(fd.fd, buf.data(), buf.size())) != 0;) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) break;
        bytes.append(buf.data(), static_cast<size_t>(n));
      }
      // Checked again on the bytes read: the file could have changed since check_entry.
      Sha256 check;
      check.update(bytes);
      Fd sum(open_entry_file(sum_path));
      char text[65] = {};
      if (sum.fd >= 0 && ::read(sum.fd, text, 64) == 64 && check.hex() == std::string(text, 64)) {
        ++g_hits;
        return bytes;
      }
      [[fallthrough]];
    }
    case EntryState::bad:
      ++g_rejected;
      remove_entry(bin_path, sum_path);
      break;
    case EntryState::missing:
      break;
  }
  std::string bytes = build();
  ++g_builds;
  std::string tmp = vdir + "/." + key + ".bin.XXXXXX";
  {
    Fd out(::mkostemp(tmp.data(), O_CLOEXEC));  // 0600
    KILN_CHECK(out.fd >= 0, CompileError,
               "[kiln::compile] cannot create a file in " + vdir + ": " + errno_text(errno) + ".");
    write_all(out.fd, bytes, tmp);
    KILN_CHECK(::fsync(out.fd) == 0, CompileError,
               "[kiln::compile] cannot write " + tmp + ": " + errno_text(errno) + ".");
  }
  install_entry(tmp, vdir, key, ".bin");
  return bytes;
}

}  // namespace kiln::compiler::runtime
