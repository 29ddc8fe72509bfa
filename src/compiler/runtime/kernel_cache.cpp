#include "compiler/runtime/kernel_cache.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <atomic>
#include <climits>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <string_view>
#include <chrono>
#include <unordered_map>
#include <vector>

#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "compiler/codegen/cpp/cxx_driver.h"
#include "compiler/runtime/cache_files.h"
#include "core/embedded_headers.h"
#include "core/layer_hooks.h"
#include "kiln/error.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::compiler::runtime {
namespace {

namespace fs = std::filesystem;
using namespace files;  // the cache's file-system layer (cache_files.h)

// Bump when the entry layout or the key's contents change.
constexpr std::string_view kKeyFormat = "kiln-cpp-kernel-cache-2";
constexpr std::string_view kCompilerRecordFormat = "kiln-compiler-record-1";

std::atomic<int64_t> g_hits{0}, g_builds{0}, g_rejected{0};

std::mutex g_hook_mutex;
std::function<void(const std::string&)> g_verified_hook;

// ---- the compiler, probed once per binary and CPU ----

// What -march=native resolves to depends on the CPU: its vendor, model and feature bits (CPUID,
// with the per-core APIC id left out) and the register state the OS enables (XCR0).
std::string cpu_fingerprint() {
  std::string out;
#if defined(__x86_64__) || defined(__i386__)
  auto leaf = [&](unsigned id, unsigned sub, bool with_ebx) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(id, sub, &a, &b, &c, &d)) return;
    out += std::to_string(id) + "." + std::to_string(sub) + ":" + std::to_string(a) + "," +
           (with_ebx ? std::to_string(b) : std::string("-")) + "," + std::to_string(c) + "," +
           std::to_string(d) + ";";
  };
  leaf(0, 0, true);
  leaf(1, 0, false);  // ebx holds the APIC id of the core this runs on
  leaf(7, 0, true);
  leaf(7, 1, true);
  leaf(0xd, 1, false);
  for (unsigned id = 0x80000001; id <= 0x80000004; ++id) leaf(id, 0, true);
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27))) {  // OSXSAVE: xgetbv is available
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    out += "xcr0:" + std::to_string(lo) + "," + std::to_string(hi);
  }
#else
  out = "unknown-cpu";
#endif
  return out;
}

// The identity of the compiler binary a probe result belongs to; empty when it is not installed.
std::string binary_identity(const std::string& executable) {
  struct stat st;
  if (executable.empty() || ::stat(executable.c_str(), &st) != 0) return {};
  char real[PATH_MAX];
  std::string resolved = ::realpath(executable.c_str(), real) ? real : executable;
  return resolved + "|" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + "|" +
         std::to_string(st.st_size) + "|" + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec) + "|" + std::to_string(st.st_ctim.tv_sec) + "." +
         std::to_string(st.st_ctim.tv_nsec);
}

// The compiler to build with, as probed. A probe runs the compiler twice; its result is kept in
// <vdir>/compiler-<hash of path, -march and CPU>.json with the identity of the binary it came
// from, and reused while that binary is unchanged (or absent: its kernels are all cached then).
const codegen::CxxCompiler& compiler_for(const std::string& vdir) {
  static std::mutex mutex;
  // Compilers live as long as the process; the map never erases, so references stay valid.
  static std::map<std::string, std::unique_ptr<codegen::CxxCompiler>> known;
  const std::string path = codegen::configured_compiler();
  const std::string identity = binary_identity(codegen::find_executable(path));
  const std::string arch = codegen::target_arch();
  Sha256 record_key;
  record_key.field("path", path);
  record_key.field("arch", arch);
  static const std::string cpu = cpu_fingerprint();  // CPUID traps to the hypervisor in a VM: once
  record_key.field("cpu", arch == "native" ? cpu : std::string());
  const std::string record_name = "compiler-" + record_key.hex().substr(0, 32) + ".json";

  std::lock_guard<std::mutex> lock(mutex);
  const std::string memo = record_name + '\0' + identity;
  if (auto it = known.find(memo); it != known.end()) return *it->second;

  auto cxx = std::make_unique<codegen::CxxCompiler>();
  bool from_record = false;
  if (auto text = read_private_file(vdir + "/" + record_name, 1 << 20)) {
    try {
      auto record = nlohmann::json::parse(*text);
      if (record.at("format") == kCompilerRecordFormat && record.at("path") == path &&
          (identity.empty() || record.at("identity") == identity)) {
        cxx->path = path;
        cxx->version = record.at("version").get<std::string>();
        cxx->target_macros = record.at("macros").get<std::string>();
        cxx->default_flags = codegen::default_flags_for(cxx->target_macros);
        from_record = true;
      }
    } catch (const nlohmann::json::exception&) {
      // A damaged record is probed again and rewritten.
    }
  }
  if (!from_record) {
    *cxx = codegen::probe_compiler(path);  // throws "cannot run the C++ compiler" when absent
    nlohmann::json record = {{"format", kCompilerRecordFormat}, {"path", path},
                             {"identity", identity},         {"version", cxx->version},
                             {"macros", cxx->target_macros}};
    try {
      write_file_atomically(vdir, record_name, record.dump());
    } catch (const CompileError&) {
      // A read-only cache: probe again next time.
    }
  }
  return *known.emplace(memo, std::move(cxx)).first->second;
}

// ---- the key ----

// A digest of the headers generated code includes (embedded in the library).
const std::string& headers_digest() {
  static const std::string digest = [] {
    Sha256 sha;
    for (const auto& header : kiln::detail::embedded_headers()) sha.field(header.name, header.text);
    return sha.hex();
  }();
  return digest;
}

std::string cache_key(const codegen::CxxCompiler& cxx, const std::vector<std::string>& flags,
                      const std::vector<std::string>& sources) {
  Sha256 sha;
  sha.field("format", kKeyFormat);
  sha.field("kiln", KILN_VERSION);
  sha.field("compiler", cxx.path);
  sha.field("compiler-version", cxx.version);
  sha.field("target", cxx.target_macros);  // the ISA -march resolves to, on this machine
  sha.field("headers", headers_digest());
  for (const auto& flag : flags) sha.field("flag", flag);
  for (const auto& source : sources) sha.field("source", source);
  return sha.hex();
}

// Builds the entry for `key` in a private build directory inside the cache and installs it.
void build_entry(const BuildRequest& req, const codegen::CxxCompiler& cxx,
                 const std::vector<std::string>& flags, const std::string& vdir,
                 const std::string& key, const std::string& label) {
  sweep_abandoned_builds(vdir);
  BuildDir dir(vdir, label);
  dir.keep(false);

  codegen::CxxBuild build;
  build.flags = flags;
  build.work_dir = dir.path();
  build.output_path = dir.path() + "/kernels.so";
  build.label = label;
  try {
    // Kiln's headers, from the library itself: nothing outside this private directory is included
    // but the system's own headers.
    for (const auto& header : kiln::detail::embedded_headers()) {
      fs::path target = fs::path(dir.path()) / "include" / std::string(header.name);
      fs::create_directories(target.parent_path());  // inside the private (0700) build directory
      write_new_file(target.string(), header.text);
    }
    build.flags.push_back("-I" + dir.path() + "/include");
    for (size_t i = 0; i < req.sources.size(); ++i) {
      std::string path = dir.path() + "/kernel_" + std::to_string(i) + ".cpp";
      write_new_file(path, req.sources[i]);
      build.source_paths.push_back(path);
    }
    dir.keep(true);
    codegen::build_shared_object(cxx, build);
    dir.keep(false);
  } catch (const codegen::DiskFullError&) {
    dir.keep(false);  // nothing to inspect, and the space is needed
    throw;
  }
  install_entry(build.output_path, vdir, key, ".so");
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

void run_verified_hook(const std::string& path) {
  std::function<void(const std::string&)> hook;
  {
    std::lock_guard<std::mutex> lock(g_hook_mutex);
    hook = g_verified_hook;
  }
  if (hook) hook(path);
}

std::shared_ptr<SharedObject> load(VerifiedEntry entry, const std::string& so_path,
                                   const std::string& label) {
  run_verified_hook(so_path);
  auto object = std::make_shared<SharedObject>(entry.fd.release(), so_path, label);
  std::lock_guard<std::mutex> lock(g_loaded_mutex);
  std::erase_if(g_loaded, [](const auto& loaded) { return loaded.second.expired(); });
  g_loaded[so_path] = object;
  return object;
}

std::string fd_path(int fd) {
  return "/proc/self/fd/" + std::to_string(fd);
}

}  // namespace

// ---- SharedObject ----

SharedObject::SharedObject(int fd, std::string path, std::string label)
    : fd_(fd), path_(std::move(path)), label_(std::move(label)) {
  // The loader opens the descriptor's own file: the bytes that were verified, whatever the path
  // in the cache names by now.
  handle_ = ::dlopen(fd_path(fd_).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) {
    const char* error = ::dlerror();
    std::string why = error ? error : "unknown error";
    if (::access("/proc/self/fd", F_OK) != 0) why += " (/proc is not mounted; Kiln needs it)";
    ::close(fd_);
    kiln::detail::throw_error<CompileError>(
        "[kiln::compile] cannot load the kernel library " + path_ + " built for " + label_ + ": " +
        why + ". Delete the file to rebuild it; if that does not help, please report it.");
  }
}

SharedObject::~SharedObject() {
  ::dlclose(handle_);
  // The loader knows the library by its name, /proc/self/fd/N. While it stays loaded (a library
  // with unique symbols cannot be unloaded), N must not name another file, or a later dlopen of
  // /proc/self/fd/N would be handed this library: then the descriptor is kept open for good.
  if (void* still = ::dlopen(fd_path(fd_).c_str(), RTLD_NOW | RTLD_NOLOAD)) {
    ::dlclose(still);
    return;
  }
  ::close(fd_);
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
  return resolve_root();
}

CacheStats cache_stats() {
  return CacheStats{g_hits.load(), g_builds.load(), g_rejected.load()};
}

void set_entry_verified_hook_for_testing(std::function<void(const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  g_verified_hook = std::move(hook);
}

namespace {

// The compile trace's "kernel" event: where a kernel binary came from ("loaded": already in this
// process; "hit": the disk cache; "bundled": an exported program; "build": built now, `seconds`).
void trace_kernel(const std::string& kind, const std::string& key, const std::string& label, const char* result,
                  double seconds = -1) {
  if (!compiler::detail::compile_trace_on()) return;
  nlohmann::json event = {{"kind", kind}, {"key", key}, {"label", label}, {"result", result}};
  if (seconds >= 0) event["seconds"] = seconds;
  compiler::detail::trace_event("kernel", std::move(event));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where an entry of the disk cache came from, for the bundle recorder.
struct CacheEntryInfo {
  std::string so_path, sum_path, target_macros, compiler;
};

std::shared_ptr<SharedObject> load_or_build_cached(const BuildRequest& req, const std::string& label,
                                                   CacheEntryInfo& info) {
  const std::string vdir = version_dir(resolve_root(), "cpp");
  const codegen::CxxCompiler& cxx = compiler_for(vdir);
  std::vector<std::string> flags = cxx.default_flags;
  flags.insert(flags.end(), req.extra_flags.begin(), req.extra_flags.end());
  const std::string key = cache_key(cxx, flags, req.sources);
  const std::string so_path = vdir + "/" + key + ".so";
  const std::string sum_path = vdir + "/" + key + ".sha256";
  info = {so_path, sum_path, cxx.target_macros, cxx.version.substr(0, cxx.version.find('\n'))};

  if (auto object = find_loaded(so_path)) {
    ++g_hits;
    trace_kernel("cpp", key, label, "loaded");
    return object;
  }
  // Entries are only read, deleted or written under the lock, so no process ever sees another's
  // half-installed entry (a .so whose checksum is not there yet) and deletes it as bad.
  EntryLock lock(vdir + "/" + key + ".lock", label);
  if (auto object = find_loaded(so_path)) {  // another thread loaded it while we waited
    ++g_hits;
    trace_kernel("cpp", key, label, "loaded");
    return object;
  }
  VerifiedEntry entry = verify_entry(so_path, sum_path, false);
  if (entry.state == VerifiedEntry::State::valid) {
    ++g_hits;
    trace_kernel("cpp", key, label, "hit");
    return load(std::move(entry), so_path, label);
  }
  if (!lock.read_only_reason().empty()) throw_read_only(vdir, lock.read_only_reason(), label);
  if (entry.state == VerifiedEntry::State::bad) {
    ++g_rejected;
    remove_entry(so_path, sum_path);
  }
  const auto t0 = std::chrono::steady_clock::now();
  build_entry(req, cxx, flags, vdir, key, label);
  trace_kernel("cpp", key, label, "build", seconds_since(t0));
  ++g_builds;
  compiler::detail::counter_set().kernel_builds.fetch_add(1, std::memory_order_relaxed);
  VerifiedEntry built = verify_entry(so_path, sum_path, false);
  KILN_CHECK(built.state == VerifiedEntry::State::valid, CompileError,
             "[kiln::compile] the kernel library " + so_path + " built for " + label +
                 " changed before it could be loaded. Is another program writing to the kernel "
                 "cache directory?");
  return load(std::move(built), so_path, label);
}

// ---- bundled kernels ----

std::mutex g_bundle_mutex;
std::unordered_map<std::string, std::weak_ptr<const BundledLibrary>> g_bundled_libraries;
std::unordered_map<std::string, std::weak_ptr<SharedObject>> g_bundled_loaded;
std::map<std::pair<std::string, std::string>, std::weak_ptr<const BundledBlob>> g_bundled_blobs;
thread_local BundleRecorder* t_recorder = nullptr;

// The registered library for `key` loaded (once per process while in use), or nullptr.
std::shared_ptr<SharedObject> load_bundled(const std::string& key, const std::string& label,
                                           std::shared_ptr<const BundledLibrary>& library) {
  std::lock_guard<std::mutex> lock(g_bundle_mutex);
  auto it = g_bundled_libraries.find(key);
  if (it == g_bundled_libraries.end()) return nullptr;
  library = it->second.lock();
  if (!library) {
    g_bundled_libraries.erase(it);
    return nullptr;
  }
  if (auto loaded = g_bundled_loaded[key].lock()) return loaded;
  // The verified bytes go into a sealed anonymous file of this process: no path another user could
  // write, and nothing can change them between here and the loader.
  Fd fd(::memfd_create("kiln-bundled-kernels", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  KILN_CHECK(fd.fd >= 0, CompileError,
             "[kiln::compile] cannot create an in-memory file for a bundled kernel library: " +
                 errno_text(errno) + ".");
  write_all(fd.fd, library->bytes, "a bundled kernel library");
  ::fcntl(fd.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  auto object = std::make_shared<SharedObject>(fd.release(), "bundled kernels " + key.substr(0, 16), label);
  g_bundled_loaded[key] = object;
  return object;
}

}  // namespace

namespace {

// The ISA features generated code may use: the compiler's macro for each, its name, and whether
// isa_features() reports it (the AVX families; the SSE-era ones every x86-64-v2 CPU has are left
// out of that summary). In isa_features()'s order.
struct IsaFeature {
  const char* macro;
  const char* name;
  bool reported;
};
constexpr IsaFeature kIsaFeatures[] = {
    {"__AVX__", "avx", true},
    {"__AVX2__", "avx2", true},
    {"__FMA__", "fma", true},
    {"__F16C__", "f16c", true},
    {"__AVX512F__", "avx512f", true},
    {"__AVX512BW__", "avx512bw", true},
    {"__AVX512VL__", "avx512vl", true},
    {"__AVX512DQ__", "avx512dq", true},
    {"__AVX512VNNI__", "avx512vnni", true},
    {"__AVX512BF16__", "avx512bf16", true},
    {"__AVX512FP16__", "avx512fp16", true},
    {"__SSE3__", "sse3", false},
    {"__SSSE3__", "ssse3", false},
    {"__SSE4_1__", "sse4.1", false},
    {"__SSE4_2__", "sse4.2", false},
    {"__POPCNT__", "popcnt", false},
    {"__BMI__", "bmi", false},
    {"__BMI2__", "bmi2", false},
    {"__AVX512IFMA__", "avx512ifma", false},
    {"__AVX512CD__", "avx512cd", false},
    {"__AVX512VBMI__", "avx512vbmi", false},
    {"__AVX512VBMI2__", "avx512vbmi2", false},
    {"__AVX512BITALG__", "avx512bitalg", false},
    {"__AVX512VPOPCNTDQ__", "avx512vpopcntdq", false},
    {"__AVXVNNI__", "avxvnni", false},
};

bool uses(const std::string& target_macros, const IsaFeature& f) {
  return target_macros.find(std::string("#define ") + f.macro + " ") != std::string::npos;
}

// The names of kIsaFeatures this CPU and its OS support (CPUID and XCR0), probed once: CPUID traps
// to the hypervisor in a VM.
const std::set<std::string>& cpu_features() {
  static const std::set<std::string> present = [] {
    std::set<std::string> out;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c1 = 0, d1 = 0, b7 = 0, c7 = 0, d7 = 0, a71 = 0;
    __get_cpuid(1, &a, &b, &c1, &d1);
    __get_cpuid_count(7, 0, &a, &b7, &c7, &d7);
    __get_cpuid_count(7, 1, &a71, &b, &a, &a);
    uint64_t xcr0 = 0;
    if (c1 & (1u << 27)) {  // OSXSAVE
      unsigned lo = 0, hi = 0;
      __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
    }
    const bool os_avx = (xcr0 & 0x6) == 0x6;                 // XMM and YMM state
    const bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM0-15 and ZMM16-31 state
    const std::pair<const char*, bool> bits[] = {
        {"sse3", (c1 & 1u) != 0},
        {"ssse3", (c1 >> 9 & 1u) != 0},
        {"sse4.1", (c1 >> 19 & 1u) != 0},
        {"sse4.2", (c1 >> 20 & 1u) != 0},
        {"popcnt", (c1 >> 23 & 1u) != 0},
        {"avx", (c1 >> 28 & 1u) && os_avx},
        {"f16c", (c1 >> 29 & 1u) && os_avx},
        {"fma", (c1 >> 12 & 1u) && os_avx},
        {"bmi", (b7 >> 3 & 1u) != 0},
        {"avx2", (b7 >> 5 & 1u) && os_avx},
        {"bmi2", (b7 >> 8 & 1u) != 0},
        {"avx512f", (b7 >> 16 & 1u) && os_avx512},
        {"avx512dq", (b7 >> 17 & 1u) && os_avx512},
        {"avx512ifma", (b7 >> 21 & 1u) && os_avx512},
        {"avx512cd", (b7 >> 28 & 1u) && os_avx512},
        {"avx512bw", (b7 >> 30 & 1u) && os_avx512},
        {"avx512vl", (b7 >> 31 & 1u) && os_avx512},
        {"avx512vbmi", (c7 >> 1 & 1u) && os_avx512},
        {"avx512vbmi2", (c7 >> 6 & 1u) && os_avx512},
        {"avx512vnni", (c7 >> 11 & 1u) && os_avx512},
        {"avx512bitalg", (c7 >> 12 & 1u) && os_avx512},
        {"avx512vpopcntdq", (c7 >> 14 & 1u) && os_avx512},
        {"avx512fp16", (d7 >> 23 & 1u) && os_avx512},
        {"avx512bf16", (a71 >> 5 & 1u) && os_avx512},
        {"avxvnni", (a71 >> 4 & 1u) && os_avx},
    };
    for (const auto& [name, present_here] : bits)
      if (present_here) out.insert(name);
#else
    for (const IsaFeature& f : kIsaFeatures) out.insert(f.name);  // no x86 feature macros apply
#endif
    return out;
  }();
  return present;
}

}  // namespace

std::vector<std::string> cpu_lacks(const std::string& target_macros) {
  std::vector<std::string> lacking;
  for (const IsaFeature& f : kIsaFeatures)
    if (uses(target_macros, f) && !cpu_features().count(f.name)) lacking.push_back(f.name);
  return lacking;
}

std::string isa_features(const std::string& target_macros) {
  std::string out;
  for (const IsaFeature& f : kIsaFeatures)
    if (f.reported && uses(target_macros, f)) {
      if (!out.empty()) out += ' ';
      out += f.name;
    }
  return out.empty() ? "baseline x86-64" : out;
}

std::string bundle_key(const BuildRequest& req) {
  Sha256 sha;
  sha.field("format", "kiln-bundled-kernels-1");
  sha.field("kiln", KILN_VERSION);
  sha.field("headers", headers_digest());
  for (const auto& flag : req.extra_flags) sha.field("flag", flag);
  for (const auto& source : req.sources) sha.field("source", source);
  return sha.hex();
}

void register_bundled(std::shared_ptr<const BundledLibrary> library) {
  std::lock_guard<std::mutex> lock(g_bundle_mutex);
  g_bundled_libraries[library->key] = library;
}

void register_bundled(std::shared_ptr<const BundledBlob> blob) {
  std::lock_guard<std::mutex> lock(g_bundle_mutex);
  g_bundled_blobs[{blob->kind, blob->key}] = blob;
}

BundleRecorder::BundleRecorder() : saved_(std::exchange(t_recorder, this)) {}
BundleRecorder::~BundleRecorder() { t_recorder = saved_; }
BundleRecorder* BundleRecorder::current() { return t_recorder; }
BundleRecorder::Scope::Scope(BundleRecorder* recorder) : saved_(std::exchange(t_recorder, recorder)) {}
BundleRecorder::Scope::~Scope() { t_recorder = saved_; }

std::vector<BundledLibrary> BundleRecorder::libraries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return libraries_;
}
std::vector<BundledBlob> BundleRecorder::blobs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return blobs_;
}
void BundleRecorder::add(BundledLibrary library) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& l : libraries_)
    if (l.key == library.key) return;
  libraries_.push_back(std::move(library));
}
void BundleRecorder::add(BundledBlob blob) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& b : blobs_)
    if (b.kind == blob.kind && b.key == blob.key) return;
  blobs_.push_back(std::move(blob));
}

std::shared_ptr<SharedObject> load_or_build(const BuildRequest& req) {
  std::string label = req.label.empty() ? "a kernel library" : req.label;
  KILN_CHECK(!req.sources.empty(), ValueError,
             "[kiln::compile] nothing to build for " + label + ": the request has no sources.");
  const std::string bkey = bundle_key(req);
  std::shared_ptr<const BundledLibrary> bundled;
  if (auto object = load_bundled(bkey, label, bundled)) {
    ++g_hits;
    trace_kernel("cpp", bkey, label, "bundled");
    if (BundleRecorder* r = t_recorder) r->add(*bundled);
    return object;
  }
  CacheEntryInfo info;
  std::shared_ptr<SharedObject> object = load_or_build_cached(req, label, info);
  if (BundleRecorder* r = t_recorder) {
    VerifiedEntry entry = verify_entry(info.so_path, info.sum_path, true);
    KILN_CHECK(entry.state == VerifiedEntry::State::valid, CompileError,
               "[kiln::export_program] the kernel library " + info.so_path + " built for " + label +
                   " changed in the cache before it could be bundled. Is another program writing to "
                   "the kernel cache directory?");
    r->add(BundledLibrary{bkey, req.sources, req.extra_flags, info.target_macros, info.compiler,
                          std::move(entry.bytes)});
  }
  return object;
}

std::string load_or_build_blob(const BlobRequest& req, const std::function<std::string()>& build) {
  Sha256 sha;
  sha.field("format", "kiln-blob-cache-1");
  sha.field("kiln", KILN_VERSION);
  for (const auto& [name, value] : req.key_fields) sha.field(name, value);
  const std::string key = sha.hex();
  const std::string label = req.label.empty() ? "a " + req.kind + " binary" : req.label;
  BundleRecorder* recorder = t_recorder;
  {
    std::shared_ptr<const BundledBlob> bundled;
    {
      std::lock_guard<std::mutex> lock(g_bundle_mutex);
      if (auto it = g_bundled_blobs.find({req.kind, key}); it != g_bundled_blobs.end()) bundled = it->second.lock();
    }
    if (bundled) {
      ++g_hits;
      trace_kernel(req.kind, key, label, "bundled");
      if (recorder) recorder->add(*bundled);
      return bundled->bytes;
    }
  }
  auto record = [&](const std::string& bytes) {
    if (recorder) recorder->add(BundledBlob{req.kind, key, label, bytes});
  };
  const std::string vdir = version_dir(resolve_root(), req.kind);
  const std::string bin_path = vdir + "/" + key + ".bin";
  const std::string sum_path = vdir + "/" + key + ".sha256";
  EntryLock lock(vdir + "/" + key + ".lock", label);
  VerifiedEntry entry = verify_entry(bin_path, sum_path, true);
  if (entry.state == VerifiedEntry::State::valid) {
    ++g_hits;
    trace_kernel(req.kind, key, label, "hit");
    run_verified_hook(bin_path);
    record(entry.bytes);
    return std::move(entry.bytes);  // the bytes that were hashed, not the file read again
  }
  if (!lock.read_only_reason().empty()) throw_read_only(vdir, lock.read_only_reason(), label);
  if (entry.state == VerifiedEntry::State::bad) {
    ++g_rejected;
    remove_entry(bin_path, sum_path);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string bytes = build();
  trace_kernel(req.kind, key, label, "build", seconds_since(t0));
  ++g_builds;
  compiler::detail::counter_set().kernel_builds.fetch_add(1, std::memory_order_relaxed);
  const std::string tmp = write_temp_file(vdir, key + ".bin", bytes);
  install_entry(tmp, vdir, key, ".bin");
  record(bytes);
  return bytes;
}

namespace {

// The eager CUDA kernels' share of the cache (core/layer_hooks.h), installed when the library loads.
[[maybe_unused]] const bool g_kernel_cache_hooks_installed = [] {
  kiln::detail::kernel_cache_hooks.load_or_build_blob =
      [](const std::string& kind, const std::vector<std::pair<std::string, std::string>>& key_fields,
         const std::string& label, const std::function<std::string()>& build) {
        return load_or_build_blob(BlobRequest{kind, key_fields, label}, build);
      };
  kiln::detail::kernel_cache_hooks.recording = [] { return t_recorder != nullptr; };
  return true;
}();

}  // namespace

}  // namespace kiln::compiler::runtime
