// The on-disk cache of compiled CPU kernel libraries and CUDA binaries (DESIGN §2.5).
//
// Entries live in <cache_dir()>/cpp-v<Kiln version>/ as <key>.so plus <key>.sha256 (hex SHA-256 of
// the .so). The key is a SHA-256 over everything that affects the binary: the sources, the compiler
// path, its --version and predefined macros (the target ISA), all flags, Kiln's version and the
// headers embedded in the library. What Kiln loads is exactly what it verified:
//   - the cache directory and every directory above it may be written only by this user or root
//     (a sticky directory such as /tmp is fine), so nobody else can swap a path under Kiln;
//   - an entry is opened without following links, must be a regular file of ours that nobody else
//     can write, and its bytes must match the checksum; a bad one (mismatch, truncated, missing,
//     foreign, a symlink, a FIFO) is deleted and rebuilt, never loaded;
//   - the library is then dlopen'ed through the very descriptor that was hashed
//     (/proc/self/fd/N), and CUDA binaries are loaded from the bytes that were hashed.
// Generated kernels are built against copies of Kiln's embedded headers written into the build's
// private directory, never against the source tree or the install prefix. Writes are temp file +
// fsync + atomic rename, and an flock on <key>.lock makes concurrent processes (and threads)
// build a key once and never see a half-written entry; a waiter says what it waits for and gives
// up after KILN_CACHE_LOCK_TIMEOUT seconds (default 600). A read-only cache serves its valid
// entries. The compiler is probed (two runs) once per compiler binary and CPU, and the result is
// remembered in the cache, so a process whose kernels are all cached starts no compiler and needs
// none installed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kiln::compiler::runtime {

// A shared object loaded with dlopen(RTLD_NOW | RTLD_LOCAL) from a verified descriptor; dlclose on
// destruction. Function pointers taken from it are valid while it lives: keep the shared_ptr next
// to them.
class SharedObject {
 public:
  // Loads the file open on `fd` (taken over: closed with the object), whose path in the cache is
  // `path` (for messages). Throws CompileError with dlerror() when it cannot be loaded.
  SharedObject(int fd, std::string path, std::string label);
  ~SharedObject();
  SharedObject(const SharedObject&) = delete;
  SharedObject& operator=(const SharedObject&) = delete;

  // The address of `name`; throws CompileError naming the symbol and the library if missing.
  void* symbol(const char* name) const;
  // symbol() cast to a function pointer type, e.g. function<int()>("kiln_answer").
  template <class Signature>
  Signature* function(const char* name) const {
    return reinterpret_cast<Signature*>(symbol(name));
  }
  const std::string& path() const { return path_; }
  const std::string& label() const { return label_; }

 private:
  void* handle_ = nullptr;
  int fd_ = -1;
  std::string path_;
  std::string label_;
};

struct BuildRequest {
  std::vector<std::string> sources;  // translation units; compiled in parallel, linked into one .so
  std::vector<std::string> extra_flags;  // appended to the default flags
  std::string label;                     // for messages and debug dirs, e.g. "graph 0/3"
};

// Loads the shared object for `req` from the cache, or builds it with the system compiler, stores
// it and loads it. Objects already loaded by this process are shared, not loaded again. Thread
// safe. Throws CompileError with the compiler's output and the source path on failure (the
// sources are kept in a tmp-* directory of the cache for inspection, for 7 days).
std::shared_ptr<SharedObject> load_or_build(const BuildRequest& req);

// A binary built from a source without the system compiler (a CUDA cubin from NVRTC), cached in
// <cache_dir()>/<kind>-v<Kiln version>/<key>.bin plus <key>.sha256 under the same rules as the
// shared objects: verified before use, rebuilt when bad, installed atomically under a lock.
struct BlobRequest {
  std::string kind;  // the subdirectory's name: "cuda"
  // Everything that affects the bytes (source, compiler version, options, target): hashed, in
  // order, with the field names, into the key.
  std::vector<std::pair<std::string, std::string>> key_fields;
  std::string label;  // for messages
};
// The bytes for `req`: read from the disk cache (exactly the bytes whose checksum matched), or
// produced by `build` (which throws CompileError on failure) and stored. Thread- and
// process-safe.
std::string load_or_build_blob(const BlobRequest& req, const std::function<std::string()>& build);

// ---- kernels bundled with exported programs (compiler/export, docs/export.md) ----
//
// An exported program carries the kernel libraries and CUDA binaries its graph was built into on
// the exporting machine. Loading it registers them here; load_or_build and load_or_build_blob then
// serve a request whose bundle key matches from those verified bytes, before they look at the
// compiler or the disk cache, so a loaded program runs on a machine with no compiler installed.

// A kernel library as a package bundles it.
struct BundledLibrary {
  std::string key;                       // bundle_key() of the request that built it
  std::vector<std::string> sources;      // the request's sources and extra flags
  std::vector<std::string> extra_flags;
  std::string target_macros;             // the exporting compiler's predefined macros (its ISA)
  std::string compiler;                  // the first line of its --version, for messages
  std::string bytes;                     // the shared object
};
// A CUDA binary (cubin) as a package bundles it, keyed like the blob cache (source, NVRTC
// version, options and the GPU architecture are all in the key).
struct BundledBlob {
  std::string kind;   // "cuda"
  std::string key;
  std::string label;
  std::string bytes;
};

// The key a bundled library is found by: a SHA-256 over the bundle format, Kiln's version, the
// embedded headers, the request's extra flags and its sources. Unlike the cache key it holds no
// compiler identity (the loading machine may have no compiler); the target ISA is checked
// separately (cpu_lacks()).
std::string bundle_key(const BuildRequest& req);

// The ISA features a compiler's predefined macros say its code uses (__AVX2__, __AVX512F__, ...)
// that this CPU or its OS lacks, by name ("avx512bw"); empty when the code can run here.
std::vector<std::string> cpu_lacks(const std::string& target_macros);
// The AVX-family features those macros say the code uses, for messages and summaries:
// "avx avx2 fma f16c avx512f ...", or "baseline x86-64".
std::string isa_features(const std::string& target_macros);

// Makes `library` (and `blob`) available to load_or_build (load_or_build_blob) for as long as the
// caller keeps the shared_ptr. The caller has verified the bytes and checked cpu_lacks().
void register_bundled(std::shared_ptr<const BundledLibrary> library);
void register_bundled(std::shared_ptr<const BundledBlob> blob);

// While alive, records on this thread every library and blob that load_or_build and
// load_or_build_blob return (from any source), with its bytes, for export_program. Nests; the
// innermost recorder receives. current() is the active one (pass it to worker threads with a
// BundleRecorder::Scope).
class BundleRecorder {
 public:
  BundleRecorder();
  ~BundleRecorder();
  BundleRecorder(const BundleRecorder&) = delete;
  BundleRecorder& operator=(const BundleRecorder&) = delete;

  std::vector<BundledLibrary> libraries() const;
  std::vector<BundledBlob> blobs() const;
  void add(BundledLibrary library);
  void add(BundledBlob blob);
  static BundleRecorder* current();

  // Makes `recorder` current on this thread while alive (worker threads of a build).
  class Scope {
   public:
    explicit Scope(BundleRecorder* recorder);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    BundleRecorder* saved_;
  };

 private:
  mutable std::mutex mutex_;
  std::vector<BundledLibrary> libraries_;
  std::vector<BundledBlob> blobs_;
  BundleRecorder* saved_;
};

// The cache directory: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln; read
// on every call, and returned with the symbolic links of its parents resolved. Created 0700 if
// missing (missing parents too); throws CompileError if it is a symlink, not a directory, not
// owned by this user, or group/world-writable, or if a directory above it could be written by
// another user (not owned by this user or root, or group/world-writable without the sticky bit).
std::string cache_dir();

// Counters for tests and benches, since process start: loads served by the cache (memory or
// disk), builds, and bad entries rejected.
struct CacheStats {
  int64_t hits = 0, builds = 0, rejected = 0;
};
CacheStats cache_stats();

// For tests: called with an entry's path after it was verified and before it is loaded, to prove
// that what is loaded is what was verified even if the path changes in between. Empty: no hook.
void set_entry_verified_hook_for_testing(std::function<void(const std::string& path)> hook);

}  // namespace kiln::compiler::runtime
