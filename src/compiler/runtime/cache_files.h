// The file-system layer of the kernel cache (kernel_cache.h): where the cache lives and the checks
// that make it private, checksummed entries, locks, and build directories. Everything here
// assumes that another local user may try to plant or swap files: paths are checked from / down,
// files are opened without following links and without blocking, and what is verified is the
// open descriptor, never the path again.
#pragma once

#include <openssl/evp.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace kiln::compiler::runtime::files {

// An owned file descriptor (-1: none).
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& other) noexcept : fd(std::exchange(other.fd, -1)) {}
  Fd& operator=(Fd&& other) noexcept;
  ~Fd() { reset(); }
  void reset();
  int release() { return std::exchange(fd, -1); }
};

// SHA-256 through OpenSSL.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(std::string_view bytes);
  // A named, length-prefixed field, so that no two different key inputs hash the same bytes.
  void field(std::string_view name, std::string_view value);
  std::string hex();

 private:
  EVP_MD_CTX* ctx_;
};

std::string errno_text(int err);

// ---- the directory ----

// The cache root ($KILN_CACHE_DIR, $XDG_CACHE_HOME/kiln or ~/.cache/kiln) with its parents' links
// resolved. Missing directories are created 0700. Every directory from / down must be writable
// only by this user or root (or be sticky, like /tmp), and the root itself must be a real
// directory of this user's that nobody else can write; otherwise CompileError says which and why.
std::string resolve_root();
// <root>/<kind>-v<Kiln version>, created 0700 when missing and checked like the root.
std::string version_dir(const std::string& root, const std::string& kind);

// ---- private files ----

// Opens a file of the cache for reading without following links or blocking (a FIFO planted at
// the path must not hang us): the descriptor, -1 with errno ENOENT when absent, or -2 when it is
// not a regular file of this user's that only this user can write.
int open_private_file(const std::string& path);
// A small private file's bytes (at most `limit`); nullopt when absent, foreign or unreadable.
std::optional<std::string> read_private_file(const std::string& path, size_t limit);
// Writes all of `bytes`; CompileError on failure (DiskFullError when the disk is full).
void write_all(int fd, std::string_view bytes, const std::string& path);
// Writes `bytes` to a new private temp file <dir>/.<name>.XXXXXX and fsyncs it; returns its path.
std::string write_temp_file(const std::string& dir, const std::string& name, std::string_view bytes);
// Writes <dir>/<name> atomically: a private temp file, fsync, rename.
void write_file_atomically(const std::string& dir, const std::string& name, std::string_view bytes);
// Creates a new file (never an existing one, never through a link), mode 0600, holding `bytes`.
void write_new_file(const std::string& path, std::string_view bytes);

// ---- checksummed entries: <key><suffix> beside <key>.sha256 ----

// An entry's file, open and verified against its checksum.
struct VerifiedEntry {
  enum class State { missing, valid, bad } state = State::missing;
  Fd fd;              // valid only: the entry's file
  std::string bytes;  // what was hashed, when asked for
};
// Opens both files (open_private_file) and hashes the entry through its descriptor: missing
// when neither exists, valid when the hash matches, bad for anything else.
VerifiedEntry verify_entry(const std::string& path, const std::string& sum_path, bool keep_bytes);
// Moves a freshly built file to <vdir>/<key><suffix>, then writes its checksum, each durable
// before an atomic rename: a reader sees no entry or a whole one (a crash between the two leaves a
// file without a checksum, which the next load rejects and rebuilds).
void install_entry(const std::string& built, const std::string& vdir, const std::string& key,
                   const char* suffix);
// Deletes both files of a bad entry (a directory in the way too), never following links.
void remove_entry(const std::string& path, const std::string& sum_path);

// ---- locks ----

// An exclusive flock on a <key>.lock file for its lifetime. Each open() is its own lock, so it
// also serializes threads of this process. The holder writes its pid into the file, so that a
// waiter can say whom it waits for; a waiter says so on stderr after 2 s and gives up with
// CompileError after KILN_CACHE_LOCK_TIMEOUT seconds (default 600). In a cache this user cannot
// write (read-only file system or directory) there is no lock: entries can only be read then,
// and nobody can be writing them.
class EntryLock {
 public:
  EntryLock(const std::string& path, const std::string& label);
  EntryLock(const EntryLock&) = delete;
  EntryLock& operator=(const EntryLock&) = delete;

  // Why the cache cannot be written; empty when the lock is held.
  const std::string& read_only_reason() const { return read_only_reason_; }

 private:
  void wait(const std::string& path, const std::string& label);
  std::string holder_pid() const;

  Fd fd_;
  std::string read_only_reason_;
};

// CompileError: the cache at `vdir` cannot be written (`reason`) and has no entry for `label`.
[[noreturn]] void throw_read_only(const std::string& vdir, const std::string& reason,
                                  const std::string& label);

// ---- build directories ----

// A private build directory <vdir>/tmp-<label>-XXXXXX, flock'ed while its build runs so that a
// later build can tell an abandoned one (its process was killed) from a live one. Removed on
// destruction unless kept (a failed build's sources, marked KEPT, stay for a week).
class BuildDir {
 public:
  BuildDir(const std::string& vdir, const std::string& label);
  ~BuildDir();
  BuildDir(const BuildDir&) = delete;
  BuildDir& operator=(const BuildDir&) = delete;

  const std::string& path() const { return path_; }
  void keep(bool keep) { keep_ = keep; }

 private:
  std::string path_;
  Fd lock_;
  bool keep_ = false;
};

// Removes the build directories of builds whose process died (unlocked and not kept), and kept
// ones older than a week.
void sweep_abandoned_builds(const std::string& vdir);

}  // namespace kiln::compiler::runtime::files
