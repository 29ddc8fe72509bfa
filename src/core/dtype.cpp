#include "kiln/dtype.h"

#include <atomic>
#include <string>

#include "kiln/error.h"

namespace kiln {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::bool_: return "bool";
    case DType::uint8: return "uint8";
    case DType::int8: return "int8";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float32: return "float32";
    case DType::float64: return "float64";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (dtype_name(static_cast<DType>(i)) == name) return static_cast<DType>(i);
  if (name == "float") return DType::float32;
  if (name == "double") return DType::float64;
  if (name == "half") return DType::float16;
  if (name == "long") return DType::int64;
  if (name == "int") return DType::int32;
  throw ValueError("[kiln::dtype] unknown dtype '" + std::string(name) +
                   "'. Valid names: bool, uint8, int8, int32, int64, float16, bfloat16, float32, float64.");
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::bool_) return b;
  if (b == DType::bool_) return a;
  bool fa = is_floating_point(a), fb = is_floating_point(b);
  if (fa != fb) return fa ? a : b;  // floating wins over integral
  if (fa) {  // both floating
    if ((a == DType::float16 && b == DType::bfloat16) || (a == DType::bfloat16 && b == DType::float16))
      return DType::float32;
    return itemsize(a) >= itemsize(b) ? a : b;
  }
  // both integral
  if ((a == DType::uint8 && b == DType::int8) || (a == DType::int8 && b == DType::uint8))
    return DType::int32;  // PyTorch gives int16, which Kiln does not have
  if (a == DType::uint8) return b;  // b is a wider signed type
  if (b == DType::uint8) return a;
  return itemsize(a) >= itemsize(b) ? a : b;
}

bool can_cast(DType from, DType to) {
  if (is_floating_point(from) && is_integral(to, /*include_bool=*/true)) return false;
  if (from != DType::bool_ && to == DType::bool_) return false;
  return true;
}

namespace {
std::atomic<DType> g_default_dtype{DType::float32};
}

DType default_dtype() { return g_default_dtype.load(std::memory_order_relaxed); }

void set_default_dtype(DType t) {
  KILN_CHECK(t == DType::float32 || t == DType::float64, ValueError,
             "[kiln::set_default_dtype] the default dtype must be float32 or float64, got " +
                 std::string(dtype_name(t)) + ".");
  g_default_dtype.store(t, std::memory_order_relaxed);
}

}  // namespace kiln
