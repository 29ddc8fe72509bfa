#include "compiler/runtime/cache_files.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "compiler/codegen/cpp/cxx_driver.h"
#include "kiln/error.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::compiler::runtime::files {
namespace {

namespace fs = std::filesystem;

// A failed build's sources stay this long for the user to inspect.
constexpr auto kKeptBuildLifetime = std::chrono::hours(24 * 7);
// Marks a build directory that is kept for the user to inspect (a failed build).
constexpr const char* kKeptMarker = "KEPT";

// Everything `fd` holds from its start; nullopt when a read fails. Appends to `bytes` when given.
std::optional<std::string> sha256_of_fd(int fd, std::string* bytes = nullptr) {
  if (::lseek(fd, 0, SEEK_SET) < 0) return std::nullopt;
  Sha256 sha;
  std::vector<char> buf(1 << 16);
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    if (n == 0) break;
    std::string_view chunk(buf.data(), static_cast<size_t>(n));
    sha.update(chunk);
    if (bytes) bytes->append(chunk);
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

// The configured cache directory, absolute and normalized (no trailing slash), links not resolved.
std::string configured_root() {
  auto normal = [](const fs::path& p) {
    fs::path n = p.lexically_normal();
    return (n.has_filename() || n == n.root_path() ? n : n.parent_path()).string();
  };
  if (const char* dir = std::getenv("KILN_CACHE_DIR"); dir && *dir) return normal(fs::absolute(dir));
  // The XDG spec says to ignore a relative XDG_CACHE_HOME.
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && xdg[0] == '/') {
    return normal(std::string(xdg) + "/kiln");
  }
  std::string home = home_dir();
  KILN_CHECK(!home.empty(), CompileError,
             "[kiln::compile] cannot place the kernel cache: HOME is not set and this user has "
             "no home directory. Set KILN_CACHE_DIR to a private directory.");
  return normal(fs::absolute(home + "/.cache/kiln"));
}

std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

const std::string kPrivateDirFix =
    "Set KILN_CACHE_DIR to a directory only you can write to (mkdir -m 700 DIR).";

// Creates the missing directories of `dir` (0700: nobody else needs them), stopping at the first
// that exists.
void create_missing(const fs::path& dir) {
  struct stat st;
  if (dir.empty() || ::lstat(dir.c_str(), &st) == 0) return;
  if (dir.has_parent_path() && dir.parent_path() != dir) create_missing(dir.parent_path());
  if (::mkdir(dir.c_str(), 0700) == 0) {
    ::chmod(dir.c_str(), 0700);  // whatever the umask
  } else {
    KILN_CHECK(errno == EEXIST, CompileError,
               "[kiln::compile] cannot create the kernel cache directory " + dir.string() + ": " +
                   errno_text(errno) + ". " + kPrivateDirFix);
  }
}

// Every directory from / down to `real_dir` (which has no symbolic links) must be writable by
// this user and root only, or be sticky (like /tmp, where others cannot rename what is ours):
// otherwise another user could swap the cache, or a directory above it, for their own between
// Kiln's checks and its loads.
void check_ancestors(const fs::path& real_dir, const std::string& cache) {
  fs::path prefix;
  for (const auto& part : real_dir) {
    prefix /= part;
    struct stat st;
    KILN_CHECK(::lstat(prefix.c_str(), &st) == 0, CompileError,
               "[kiln::compile] cannot check " + prefix.string() + ", above the kernel cache " +
                   "directory " + cache + ": " + errno_text(errno) + ". " + kPrivateDirFix);
    const bool trusted_owner = st.st_uid == 0 || st.st_uid == ::geteuid();
    const bool others_write = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    const bool sticky = (st.st_mode & S_ISVTX) != 0;
    if (!trusted_owner || (others_write && !sticky)) {
      detail::throw_error<CompileError>(
          "[kiln::compile] the kernel cache directory " + cache + " is inside " +
          prefix.string() + (trusted_owner ? "" : ", owned by uid " + std::to_string(st.st_uid)) +
          (others_write ? " (mode " + mode_text(st.st_mode) + ")" : "") +
          ", which another user can change: they could swap the cache for one holding their "
          "code. " + kPrivateDirFix.substr(0, kPrivateDirFix.size() - 1) +
          ", under directories that only you and root can write to.");
    }
  }
}

// Insists that `dir` is a real directory owned by us that nobody else can write to: anyone who
// could write there could plant code that Kiln would load. Creates it (0700) when missing.
void ensure_private_dir(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    KILN_CHECK(errno == ENOENT, CompileError,
               "[kiln::compile] cannot access the kernel cache directory " + dir + ": " +
                   errno_text(errno) + ". " + kPrivateDirFix);
    create_missing(dir);
    KILN_CHECK(::lstat(dir.c_str(), &st) == 0, CompileError,
               "[kiln::compile] cannot access the kernel cache directory " + dir + ": " +
                   errno_text(errno) + ". " + kPrivateDirFix);
  }
  const std::string what = "[kiln::compile] the kernel cache directory " + dir;
  KILN_CHECK(!S_ISLNK(st.st_mode), CompileError,
             what + " is a symbolic link; Kiln only loads kernels from a real directory it owns. " +
                 "Replace the link with a directory, or set KILN_CACHE_DIR to a directory only "
                 "you can write to (mkdir -m 700 DIR).");
  KILN_CHECK(S_ISDIR(st.st_mode), CompileError, what + " is not a directory. " + kPrivateDirFix);
  KILN_CHECK(st.st_uid == ::geteuid(), CompileError,
             what + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
                 std::to_string(::geteuid()) + "); its kernels could have been written by " +
                 "someone else. " + kPrivateDirFix);
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    detail::throw_error<CompileError>(
        what + " is group- or world-writable (mode " + mode_text(st.st_mode) + "); anyone who " +
        "can write there could plant code that Kiln would load. Run `chmod go-w " + dir +
        "`, or set KILN_CACHE_DIR to a directory only you can write to (mkdir -m 700 DIR).");
  }
}

void fsync_dir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.fd >= 0) ::fsync(fd.fd);
}

// Seconds to wait for another process's build of the same key: $KILN_CACHE_LOCK_TIMEOUT, else 600.
double lock_timeout_seconds() {
  if (const char* text = std::getenv("KILN_CACHE_LOCK_TIMEOUT"); text && *text) {
    char* end = nullptr;
    double seconds = std::strtod(text, &end);
    KILN_CHECK(end && *end == '\0' && seconds >= 0, ValueError,
               std::string("[kiln::compile] KILN_CACHE_LOCK_TIMEOUT must be a number of seconds, "
                           "got '") + text + "'.");
    return seconds;
  }
  return 600;
}

std::string dir_safe(const std::string& label) {
  std::string out;
  for (char c : label.substr(0, 40))
    out.push_back(std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
  return out.empty() ? "kernel" : out;
}

}  // namespace

std::string errno_text(int err) {
  return std::strerror(err);
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd = std::exchange(other.fd, -1);
  }
  return *this;
}

void Fd::reset() {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  KILN_CHECK(ctx_ && EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) == 1, CompileError,
             "[kiln::compile] OpenSSL could not start a SHA-256 digest.");
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_); }

void Sha256::update(std::string_view bytes) { EVP_DigestUpdate(ctx_, bytes.data(), bytes.size()); }

void Sha256::field(std::string_view name, std::string_view value) {
  update(name);
  update(std::string_view("\0", 1));
  update(std::to_string(value.size()));
  update(std::string_view("\0", 1));
  update(value);
}

std::string Sha256::hex() {
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

// The cache root with its parents' links resolved, checked from / down.
std::string resolve_root() {
  fs::path root = configured_root();
  fs::path parent = root.parent_path();
  create_missing(parent);
  char real[PATH_MAX];
  KILN_CHECK(::realpath(parent.c_str(), real) != nullptr, CompileError,
             "[kiln::compile] cannot resolve " + parent.string() + ", the parent of the kernel " +
                 "cache directory: " + errno_text(errno) + ". " + kPrivateDirFix);
  std::string dir = (fs::path(real) / root.filename()).string();
  check_ancestors(real, dir);
  ensure_private_dir(dir);
  return dir;
}

// <root>/<kind>-v<version>, checked.
std::string version_dir(const std::string& root, const std::string& kind) {
  std::string dir = root + "/" + kind + "-v" KILN_VERSION;
  ensure_private_dir(dir);
  return dir;
}

int open_private_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? -1 : -2;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      (st.st_mode & (S_IWGRP | S_IWOTH))) {
    ::close(fd);
    return -2;
  }
  return fd;
}

// Reads a small file of ours (at most `limit` bytes); nullopt when absent, foreign or unreadable.
std::optional<std::string> read_private_file(const std::string& path, size_t limit) {
  Fd fd(open_private_file(path));
  if (fd.fd < 0) return std::nullopt;
  std::string text;
  std::vector<char> buf(1 << 16);
  for (;;) {
    ssize_t n = ::read(fd.fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    if (n == 0) break;
    text.append(buf.data(), static_cast<size_t>(n));
    if (text.size() > limit) return std::nullopt;
  }
  return text;
}

void write_all(int fd, std::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == ENOSPC) {
      throw codegen::DiskFullError("[kiln::compile] cannot write " + path +
                                   ": the disk is full. Free some space, or set KILN_CACHE_DIR "
                                   "to a disk with room.");
    }
    KILN_CHECK(n > 0, CompileError,
               "[kiln::compile] cannot write " + path + ": " + errno_text(errno) +
                   ". Check the free space of the kernel cache directory.");
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

// Writes `bytes` to <dir>/<name> atomically (temp file, fsync, rename), mode 0600.
std::string write_temp_file(const std::string& dir, const std::string& name, std::string_view bytes) {
  std::string tmp = dir + "/." + name + ".XXXXXX";
  Fd out(::mkostemp(tmp.data(), O_CLOEXEC));  // 0600
  KILN_CHECK(out.fd >= 0, CompileError,
             "[kiln::compile] cannot create a file in " + dir + ": " + errno_text(errno) + ".");
  try {
    write_all(out.fd, bytes, tmp);
    KILN_CHECK(::fsync(out.fd) == 0, CompileError,
               "[kiln::compile] cannot write " + tmp + ": " + errno_text(errno) + ".");
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  return tmp;
}

void write_file_atomically(const std::string& dir, const std::string& name, std::string_view bytes) {
  const std::string tmp = write_temp_file(dir, name, bytes);
  if (::rename(tmp.c_str(), (dir + "/" + name).c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    detail::throw_error<CompileError>("[kiln::compile] cannot move " + tmp + " into place: " + errno_text(err) + ".");
  }
}

// ---- entries ----

VerifiedEntry verify_entry(const std::string& path, const std::string& sum_path, bool keep_bytes) {
  VerifiedEntry out;
  Fd file(open_private_file(path));
  Fd sum(open_private_file(sum_path));
  if (file.fd == -1 && sum.fd == -1) return out;
  out.state = VerifiedEntry::State::bad;
  if (file.fd < 0 || sum.fd < 0) return out;
  char text[130];
  ssize_t n = ::read(sum.fd, text, sizeof text);
  if (n < 64) return out;
  std::string expected(text, static_cast<size_t>(n));
  if (expected.back() == '\n') expected.pop_back();
  if (expected.size() != 64 ||
      expected.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return out;
  }
  auto actual = sha256_of_fd(file.fd, keep_bytes ? &out.bytes : nullptr);
  if (!actual || *actual != expected) {
    out.bytes.clear();
    return out;
  }
  out.state = VerifiedEntry::State::valid;
  out.fd = std::move(file);
  return out;
}

void remove_entry(const std::string& path, const std::string& sum_path) {
  for (const auto& p : {path, sum_path}) {
    std::error_code ec;
    fs::remove_all(p, ec);  // never follows links; a directory in the way goes too
    KILN_CHECK(!ec, CompileError,
               "[kiln::compile] cannot remove the bad kernel cache entry " + p + ": " +
                   ec.message() + ". Remove it by hand.");
  }
}

EntryLock::EntryLock(const std::string& path, const std::string& label) {
  fd_ = Fd(::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600));
  if (fd_.fd < 0 && (errno == EROFS || errno == EACCES || errno == EPERM)) {
    read_only_reason_ = errno_text(errno);
    return;
  }
  KILN_CHECK(fd_.fd >= 0, CompileError,
             "[kiln::compile] cannot open the kernel cache lock " + path + ": " + errno_text(errno) +
                 ". Remove it, or set KILN_CACHE_DIR to a private directory.");
  struct stat st;
  KILN_CHECK(::fstat(fd_.fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid(), CompileError,
             "[kiln::compile] the kernel cache lock " + path + " is not a regular file of this user's. Remove it.");
  if (::flock(fd_.fd, LOCK_EX | LOCK_NB) != 0) wait(path, label);
  std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_.fd, 0) == 0) (void)!::pwrite(fd_.fd, pid.data(), pid.size(), 0);
}  // the lock goes with the descriptor

void EntryLock::wait(const std::string& path, const std::string& label) {
  using clock = std::chrono::steady_clock;
  const double timeout = lock_timeout_seconds();
  const auto start = clock::now();
  bool announced = false;
  auto delay = std::chrono::milliseconds(1);
  for (;;) {
    if (::flock(fd_.fd, LOCK_EX | LOCK_NB) == 0) return;
    KILN_CHECK(errno == EWOULDBLOCK || errno == EINTR, CompileError,
               "[kiln::compile] cannot lock " + path + ": " + errno_text(errno) + ".");
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    const std::string holder = holder_pid();
    const std::string whom = holder.empty() ? "another process" : "process " + holder;
    if (waited >= timeout) {
      detail::throw_error<CompileError>(
          "[kiln::compile] gave up building " + label + " after waiting " +
          std::to_string(static_cast<long long>(waited)) + " s for " + whom +
          ", which is building the same kernels and holds the lock " + path +
          ". Wait for it to finish or stop it, or raise KILN_CACHE_LOCK_TIMEOUT (seconds).");
    }
    // Threads of this process wait for each other's builds silently.
    if (!announced && holder != std::to_string(::getpid()) && waited >= 2.0) {
      std::fprintf(stderr,
                   "[kiln::compile] waiting for %s to finish building %s (lock %s; giving up after "
                   "%g s, KILN_CACHE_LOCK_TIMEOUT)\n",
                   whom.c_str(), label.c_str(), path.c_str(), timeout);
      announced = true;
    }
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(100));
  }
}

std::string EntryLock::holder_pid() const {
  char text[32] = {};
  ssize_t n = ::pread(fd_.fd, text, sizeof text - 1, 0);
  std::string pid = n > 0 ? std::string(text, static_cast<size_t>(n)) : std::string();
  while (!pid.empty() && !std::isdigit(static_cast<unsigned char>(pid.back()))) pid.pop_back();
  return pid.find_first_not_of("0123456789") == std::string::npos ? pid : std::string();
}

[[noreturn]] void throw_read_only(const std::string& vdir, const std::string& reason,
                                  const std::string& label) {
  detail::throw_error<CompileError>(
      "[kiln::compile] the kernel cache " + vdir + " cannot be written (" + reason +
      ") and holds no valid entry for " + label +
      ". Make it writable, or set KILN_CACHE_DIR to a writable private directory.");
}

// Moves the freshly built file into place, then its checksum: each durable (fsync) before an
// atomic rename, so a reader sees either no entry or a whole one. A crash between the two
// renames leaves a file without a checksum, which the next load rejects and rebuilds.
void install_entry(const std::string& built, const std::string& vdir, const std::string& key,
                   const char* suffix) {
  std::string hex;
  {
    Fd file(::open(built.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    KILN_CHECK(file.fd >= 0, CompileError,
               "[kiln::compile] the build produced no file at " + built + ": " +
                   errno_text(errno) + ".");
    ::fchmod(file.fd, 0600);  // the linker's mode follows the umask; entries must be private
    auto sum = sha256_of_fd(file.fd);
    KILN_CHECK(sum && ::fsync(file.fd) == 0, CompileError,
               "[kiln::compile] cannot read back " + built + ": " + errno_text(errno) + ".");
    hex = *sum;
  }
  KILN_CHECK(::rename(built.c_str(), (vdir + "/" + key + suffix).c_str()) == 0, CompileError,
             "[kiln::compile] cannot move " + built + " into the cache: " + errno_text(errno) + ".");
  write_file_atomically(vdir, key + ".sha256", hex + "\n");
  fsync_dir(vdir);
}

BuildDir::BuildDir(const std::string& vdir, const std::string& label) {
  // Made under a name the sweeper ignores, locked, then renamed: never unlocked as tmp-*.
  std::string fresh = vdir + "/.new-" + dir_safe(label) + "-XXXXXX";
  if (::mkdtemp(fresh.data()) == nullptr) {
    int err = errno;
    if (err == EROFS || err == EACCES || err == EPERM) throw_read_only(vdir, errno_text(err), label);
    if (err == ENOSPC) {
      throw codegen::DiskFullError("[kiln::compile] cannot create a build directory in " + vdir +
                                   ": the disk is full. Free some space, or set KILN_CACHE_DIR to a "
                                   "disk with room.");
    }
    detail::throw_error<CompileError>("[kiln::compile] cannot create a build directory in " + vdir + ": " +
                                      errno_text(err) + ".");
  }
  lock_ = Fd(::open(fresh.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  path_ = vdir + "/tmp" + fresh.substr(vdir.size() + 5);
  if (lock_.fd < 0 || ::flock(lock_.fd, LOCK_EX | LOCK_NB) != 0 || ::rename(fresh.c_str(), path_.c_str()) != 0) {
    int err = errno;
    std::error_code ec;
    fs::remove_all(fresh, ec);
    detail::throw_error<CompileError>("[kiln::compile] cannot set up the build directory " + fresh + ": " +
                                      errno_text(err) + ".");
  }
}

BuildDir::~BuildDir() {
  std::error_code ec;
  if (keep_) {
    Fd marker(::open((path_ + "/" + kKeptMarker).c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
  } else {
    fs::remove_all(path_, ec);
  }
}

// Removes the build directories of builds that died (a process killed mid-build leaves its
// tmp-* directory unlocked and unmarked), and kept ones older than kKeptBuildLifetime.
void sweep_abandoned_builds(const std::string& vdir) {
  std::error_code ec;
  for (fs::directory_iterator it(vdir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("tmp-", 0) != 0) continue;
    const std::string path = it->path().string();
    Fd dir(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (dir.fd < 0 || ::flock(dir.fd, LOCK_EX | LOCK_NB) != 0) continue;  // a live build
    struct stat marker;
    if (::fstatat(dir.fd, kKeptMarker, &marker, AT_SYMLINK_NOFOLLOW) == 0) {
      auto age = std::chrono::system_clock::now() -
                 std::chrono::system_clock::from_time_t(marker.st_mtim.tv_sec);
      if (age < kKeptBuildLifetime) continue;
    }
    std::error_code remove_ec;
    fs::remove_all(path, remove_ec);
  }
}

void write_new_file(const std::string& path, std::string_view bytes) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  KILN_CHECK(fd.fd >= 0, CompileError,
             "[kiln::compile] cannot create " + path + ": " + errno_text(errno) + ".");
  write_all(fd.fd, bytes, path);
}

}  // namespace kiln::compiler::runtime::files
