// NVRTC + driver API (see jit.h).
#include "kernels/cuda/jit.h"

#include <cuda.h>
#include <nvrtc.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_runtime.h"
#include "core/layer_hooks.h"
#include "core/embedded_headers.h"
#include "kiln/error.h"

namespace kiln::cuda::detail {

namespace {

std::atomic<long> g_compiles{0}, g_loads{0};

// The few standard-library pieces Kiln's math headers use, for NVRTC, which ships no standard
// library. Device math functions are NVRTC built-ins in the global namespace.
constexpr std::string_view kCmath = R"(#pragma once
#define INFINITY __builtin_bit_cast(float, 0x7f800000u)
#define NAN __builtin_bit_cast(float, 0x7fc00000u)
namespace std {
using ::abs; using ::fabs; using ::exp; using ::log; using ::log1p; using ::expm1; using ::sin; using ::cos;
using ::tan; using ::tanh; using ::erf; using ::sqrt; using ::pow; using ::atan2; using ::hypot; using ::fmod; using ::floor;
using ::ceil; using ::nearbyint; using ::copysign; using ::fma; using ::isnan; using ::isinf; using ::isfinite;
using ::fmin; using ::fmax; using ::trunc; using ::round; using ::exp2; using ::log2; using ::lgamma;
}
)";
constexpr std::string_view kCstdint = R"(#pragma once
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t; typedef unsigned long long uintptr_t;
namespace std { using ::int8_t; using ::int16_t; using ::int32_t; using ::int64_t; using ::uint8_t;
using ::uint16_t; using ::uint32_t; using ::uint64_t; using ::uintptr_t; }
)";
constexpr std::string_view kCstring = R"(#pragma once
namespace std { using ::memcpy; using ::memset; }
)";
constexpr std::string_view kTypeTraits = R"(#pragma once
namespace std {
template <class T, T v> struct integral_constant { static constexpr T value = v; };
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;
template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> inline constexpr bool is_same_v = is_same<A, B>::value;
template <class T> struct remove_cv { using type = T; };
template <class T> struct remove_cv<const T> { using type = T; };
template <class T> struct remove_cv<volatile T> { using type = T; };
template <class T> struct remove_cv<const volatile T> { using type = T; };
template <class T> using remove_cv_t = typename remove_cv<T>::type;
template <class T> struct is_fp_ : false_type {};
template <> struct is_fp_<float> : true_type {};
template <> struct is_fp_<double> : true_type {};
template <class T> inline constexpr bool is_floating_point_v = is_fp_<remove_cv_t<T>>::value;
template <class T> struct is_int_ : false_type {};
template <> struct is_int_<bool> : true_type {};
template <> struct is_int_<char> : true_type {};
template <> struct is_int_<signed char> : true_type {};
template <> struct is_int_<unsigned char> : true_type {};
template <> struct is_int_<short> : true_type {};
template <> struct is_int_<unsigned short> : true_type {};
template <> struct is_int_<int> : true_type {};
template <> struct is_int_<unsigned> : true_type {};
template <> struct is_int_<long> : true_type {};
template <> struct is_int_<unsigned long> : true_type {};
template <> struct is_int_<long long> : true_type {};
template <> struct is_int_<unsigned long long> : true_type {};
template <class T> inline constexpr bool is_integral_v = is_int_<remove_cv_t<T>>::value;
template <class T> inline constexpr bool is_arithmetic_v = is_integral_v<T> || is_floating_point_v<T>;
template <class T> inline constexpr bool is_signed_v = is_arithmetic_v<T> && T(-1) < T(0);
template <class T> inline constexpr bool is_unsigned_v = is_arithmetic_v<T> && T(0) < T(-1);
template <class T> struct make_unsigned;
template <> struct make_unsigned<signed char> { using type = unsigned char; };
template <> struct make_unsigned<char> { using type = unsigned char; };
template <> struct make_unsigned<unsigned char> { using type = unsigned char; };
template <> struct make_unsigned<short> { using type = unsigned short; };
template <> struct make_unsigned<unsigned short> { using type = unsigned short; };
template <> struct make_unsigned<int> { using type = unsigned; };
template <> struct make_unsigned<unsigned> { using type = unsigned; };
template <> struct make_unsigned<long> { using type = unsigned long; };
template <> struct make_unsigned<unsigned long> { using type = unsigned long; };
template <> struct make_unsigned<long long> { using type = unsigned long long; };
template <> struct make_unsigned<unsigned long long> { using type = unsigned long long; };
template <class T> using make_unsigned_t = typename make_unsigned<T>::type;
template <bool B, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
}
)";
constexpr std::string_view kEmpty = "#pragma once\n";

// The driver API, reached through the runtime's entry points (no link against libcuda).
struct Driver {
  decltype(&cuModuleLoadData) module_load_data = nullptr;
  decltype(&cuModuleGetFunction) module_get_function = nullptr;
  decltype(&cuLaunchKernel) launch_kernel = nullptr;
  decltype(&cuFuncSetAttribute) func_set_attribute = nullptr;
  decltype(&cuGetErrorString) get_error_string = nullptr;
};

template <class F>
void entry_point(const char* symbol, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  check(cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status), "cuda::jit");
  KILN_CHECK(status == cudaDriverEntryPointSuccess && p, DeviceError,
             std::string("[kiln::cuda::jit] the CUDA driver has no ") + symbol + ". Update the GPU driver.");
  fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    entry_point("cuModuleLoadData", r.module_load_data);
    entry_point("cuModuleGetFunction", r.module_get_function);
    entry_point("cuLaunchKernel", r.launch_kernel);
    entry_point("cuFuncSetAttribute", r.func_set_attribute);
    entry_point("cuGetErrorString", r.get_error_string);
    return r;
  }();
  return d;
}

void check_driver(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  driver().get_error_string(r, &text);
  throw DeviceError(std::string("[kiln::cuda::") + what + "] CUDA driver error " + std::to_string(static_cast<int>(r)) +
                    " (" + (text ? text : "unknown") + ").");
}

void check_nvrtc(nvrtcResult r, const char* what) {
  KILN_CHECK(r == NVRTC_SUCCESS, CompileError,
             std::string("[kiln::cuda::jit] NVRTC failed in ") + what + ": " + nvrtcGetErrorString(r) + ".");
}

std::string nvrtc_version() {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  return std::to_string(major) + "." + std::to_string(minor);
}

// The options every kernel is built with. --fmad=true: a * b + c contracts into an fma, as the
// CPU build (GCC, -ffp-contract=fast with FMA in -march) contracts it, so that eager CUDA results
// agree with the CPU's bit for bit wherever both compilers contract the same expressions (ranges,
// random streams, the functors' polynomials).
std::vector<std::string> options(const std::string& target) {
  return {"--gpu-architecture=" + target, "-std=c++17", "-default-device", "--fmad=true", "-DKILN_JIT=1",
          "--device-int128"};
}

struct Built {
  std::string binary;
  bool is_cubin = true;
};

Built compile(const std::string& source, const std::string& target, const std::string& label) {
  std::vector<const char*> names, texts;
  std::vector<std::pair<std::string_view, std::string_view>> shims = {
      {"cmath", kCmath}, {"cstdint", kCstdint}, {"cstring", kCstring}, {"type_traits", kTypeTraits},
      {"bit", kEmpty},   {"limits", kEmpty}};
  // NVRTC wants NUL-terminated strings; the embedded views are literals, hence terminated.
  for (const auto& [n, t] : shims) {
    names.push_back(n.data());
    texts.push_back(t.data());
  }
  for (const auto& header : kiln::detail::embedded_headers()) {
    names.push_back(header.name.data());
    texts.push_back(header.text.data());
  }
  nvrtcProgram prog = nullptr;
  check_nvrtc(nvrtcCreateProgram(&prog, source.c_str(), (label + ".cu").c_str(), static_cast<int>(names.size()),
                                 texts.data(), names.data()),
              "nvrtcCreateProgram");
  std::unique_ptr<_nvrtcProgram, void (*)(_nvrtcProgram*)> guard(prog, [](_nvrtcProgram* p) { nvrtcDestroyProgram(&p); });
  std::vector<std::string> opts = options(target);
  std::vector<const char*> argv;
  for (const auto& o : opts) argv.push_back(o.c_str());
  nvrtcResult r = nvrtcCompileProgram(prog, static_cast<int>(argv.size()), argv.data());
  ++g_compiles;
  if (r != NVRTC_SUCCESS) {
    size_t n = 0;
    nvrtcGetProgramLogSize(prog, &n);
    std::string log(n, '\0');
    nvrtcGetProgramLog(prog, log.data());
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();  // NVRTC counts the NUL
    throw CompileError("[kiln::cuda::jit] NVRTC could not compile " + label + " for " + target + ":\n" + log +
                       "\n--- source ---\n" + source);
  }
  Built out;
  size_t size = 0;
  if (target.rfind("sm_", 0) == 0) {
    check_nvrtc(nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize");
    out.binary.resize(size);
    check_nvrtc(nvrtcGetCUBIN(prog, out.binary.data()), "nvrtcGetCUBIN");
  } else {
    check_nvrtc(nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize");
    out.binary.resize(size);
    check_nvrtc(nvrtcGetPTX(prog, out.binary.data()), "nvrtcGetPTX");
    out.is_cubin = false;
  }
  return out;
}

// sm_XY when this NVRTC can build machine code for the device; else PTX for the newest
// architecture it knows, which the driver compiles (a GPU newer than the toolkit).
std::string target_for(int device) {
  const cudaDeviceProp& p = properties(device);
  int arch = p.major * 10 + p.minor;
  int count = 0;
  nvrtcGetNumSupportedArchs(&count);
  std::vector<int> archs(count);
  if (count > 0) nvrtcGetSupportedArchs(archs.data());
  int best = 0;
  for (int a : archs) {
    if (a == arch) return "sm_" + std::to_string(arch);
    if (a < arch) best = std::max(best, a);
  }
  KILN_CHECK(best > 0, DeviceError,
             "[kiln::cuda::jit] this NVRTC (" + nvrtc_version() + ") cannot build code for compute capability " +
                 std::to_string(p.major) + "." + std::to_string(p.minor) + ".");
  return "compute_" + std::to_string(best);
}

struct Entry {
  std::once_flag once;
  std::vector<JitFunction> functions;
  std::exception_ptr error;
  std::string source, target;  // what the binary was built from (for export's recorder)
};

// What the binary of `source` for `target` is keyed by in the kernel cache.
std::vector<std::pair<std::string, std::string>> blob_key(const std::string& source, const std::string& target) {
  std::vector<std::pair<std::string, std::string>> key = {{"nvrtc", nvrtc_version()}, {"target", target}, {"source", source}};
  for (const auto& o : options(target)) key.emplace_back("option", o);
  for (const auto& header : kiln::detail::embedded_headers())
    key.emplace_back(std::string(header.name), std::string(header.text));
  return key;
}

}  // namespace

JitFunction jit_function(int device, const std::string& key, const char* name,
                         const std::function<std::string()>& source) {
  return jit_functions(device, key, {name}, source)[0];
}

std::vector<JitFunction> jit_functions(int device, const std::string& key, const std::vector<std::string>& names,
                                       const std::function<std::string()>& source) {
  static std::mutex mutex;
  static auto* entries = new std::unordered_map<std::string, std::shared_ptr<Entry>>();  // modules live forever
  KILN_CHECK(!names.empty(), Error, "[kiln::cuda::jit] a module needs at least one function. This is a Kiln bug.");
  std::string full_key = std::to_string(device);
  for (const std::string& n : names) full_key += '\0' + n;
  full_key += '\0' + key;
  const std::string label = names.size() == 1 ? names[0] : names[0] + "+" + std::to_string(names.size() - 1);
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard lock(mutex);
    auto& e = (*entries)[full_key];
    if (!e) e = std::make_shared<Entry>();
    entry = e;
  }
  bool loaded_now = false;  // this call built or loaded the module (and offered it to the cache)
  std::call_once(entry->once, [&] {
    loaded_now = true;
    try {
      DeviceGuard guard(device);
      cudaFree(nullptr);  // makes the device's primary context current on this thread
      std::string target = target_for(device);
      std::string text = source();
      const std::vector<std::pair<std::string, std::string>> key = blob_key(text, target);
      entry->source = text;
      entry->target = target;
      auto build = [&] { return compile(text, target, label).binary; };
      const auto& cache = kiln::detail::kernel_cache_hooks;
      std::string binary = cache.load_or_build_blob ? cache.load_or_build_blob("cuda", key, label, build) : build();
      CUmodule module = nullptr;
      check_driver(driver().module_load_data(&module, binary.data()), "jit (cuModuleLoadData)");
      ++g_loads;
      for (const std::string& n : names) {
        CUfunction f = nullptr;
        check_driver(driver().module_get_function(&f, module, n.c_str()), "jit (cuModuleGetFunction)");
        entry->functions.push_back(f);
      }
    } catch (...) {
      entry->error = std::current_exception();
    }
  });
  if (entry->error) std::rethrow_exception(entry->error);
  const auto& cache = kiln::detail::kernel_cache_hooks;
  if (!loaded_now && cache.recording && cache.recording() && cache.load_or_build_blob) {
    // A module this process loaded earlier: hand its binary to the cache again (a disk hit, or a
    // rebuild where the cache cannot keep it), so that export_program's recorder sees it.
    const std::string& text = entry->source;
    const std::string& target = entry->target;
    cache.load_or_build_blob("cuda", blob_key(text, target), label, [&] { return compile(text, target, label).binary; });
  }
  return entry->functions;
}

void launch_grid(JitFunction f, unsigned grid_x, unsigned grid_y, unsigned block, unsigned shared_bytes,
                 cudaStream_t stream, void** args) {
  check_driver(driver().launch_kernel(static_cast<CUfunction>(f), grid_x, grid_y, 1, block, 1, 1, shared_bytes,
                                      static_cast<CUstream>(stream), args, nullptr),
               "launch");
}

void launch(JitFunction f, unsigned grid, unsigned block, unsigned shared_bytes, cudaStream_t stream, void** args) {
  launch_grid(f, grid, 1, block, shared_bytes, stream, args);
}

void set_max_dynamic_shared(JitFunction f, int bytes) {
  check_driver(driver().func_set_attribute(static_cast<CUfunction>(f), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
               "set_max_dynamic_shared");
}

std::string compile_cubin(const std::string& source, int arch, const std::string& label) {
  return compile(source, "sm_" + std::to_string(arch), label).binary;
}

JitStats jit_stats() { return JitStats{g_compiles.load(), g_loads.load()}; }

}  // namespace kiln::cuda::detail
