// DLPack export and import. Both directions share memory: an exported DLManagedTensor holds a
// reference to Kiln's storage; an imported one becomes the free context of a from_blob storage,
// so the producer's deleter runs exactly once, when the last Kiln view of the memory dies.
#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "core/shape.h"
#include "kiln/io.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

DLDataType to_dl_dtype(DType t) {
  const uint8_t bits = static_cast<uint8_t>(itemsize(t) * 8);
  switch (t) {
    case DType::bool_:
      return {kDLBool, 8, 1};
    case DType::uint8:
      return {kDLUInt, bits, 1};
    case DType::int8:
    case DType::int32:
    case DType::int64:
      return {kDLInt, bits, 1};
    case DType::float16:
    case DType::float32:
    case DType::float64:
      return {kDLFloat, bits, 1};
    case DType::bfloat16:
      return {kDLBfloat, 16, 1};
  }
  return {kDLOpaqueHandle, 0, 1};
}

std::string describe(DLDataType d) {
  static constexpr const char* kCodes[] = {"int",    "uint",    "float", "opaque handle",
                                           "bfloat", "complex", "bool"};
  std::string code = d.code < std::size(kCodes) ? kCodes[d.code] : "code ";
  if (d.code >= std::size(kCodes)) code += std::to_string(d.code);
  std::string s = code + std::to_string(d.bits);
  if (d.lanes != 1) {  // two appends: GCC 12's -Wrestrict misfires on "x" + to_string(...)
    s += 'x';
    s += std::to_string(d.lanes);
  }
  return s;
}

DType from_dl_dtype(DLDataType d, const std::string& op) {
  KILN_CHECK(d.lanes == 1, DTypeError,
             op + "vector element types are not supported (got " + describe(d) + ", lanes " +
                 std::to_string(d.lanes) + "). Export a tensor with lanes = 1.");
  switch (d.code) {
    case kDLBool:
      if (d.bits == 8) return kBool;
      break;
    case kDLUInt:
      if (d.bits == 8) return kUInt8;
      break;
    case kDLInt:
      if (d.bits == 8) return kInt8;
      if (d.bits == 32) return kInt32;
      if (d.bits == 64) return kInt64;
      break;
    case kDLFloat:
      if (d.bits == 16) return kFloat16;
      if (d.bits == 32) return kFloat32;
      if (d.bits == 64) return kFloat64;
      break;
    case kDLBfloat:
      if (d.bits == 16) return kBFloat16;
      break;
    default:
      break;
  }
  throw DTypeError(
      op + "Kiln has no dtype for DLPack " + describe(d) +
      ". Supported: bool8, uint8, int8, int32, int64, float16, bfloat16, float32, float64; "
      "convert the tensor before exporting it.");
}

DLDevice to_dl_device(Device d) {
  if (d.is_cuda()) return {kDLCUDA, static_cast<int32_t>(d.index)};
  return {kDLCPU, 0};
}

Device from_dl_device(DLDevice d, const std::string& op) {
  if (d.device_type == kDLCPU) return kCPU;
  if (d.device_type == kDLCUDA) {
    KILN_CHECK(d.device_id >= 0 && d.device_id < cuda::device_count(), DeviceError,
               op + "the tensor is on CUDA device " + std::to_string(d.device_id) + ", but " +
                   std::to_string(cuda::device_count()) +
                   " CUDA devices are available to Kiln. Copy it to the CPU before exporting it.");
    return cuda_device(d.device_id);
  }
  throw DeviceError(
      op + "DLPack device type " + std::to_string(static_cast<int>(d.device_type)) +
      " is not supported; Kiln reads kDLCPU (1) and kDLCUDA (2). Copy the tensor to the "
      "CPU before exporting it.");
}

// What an exported tensor points at: a reference to the storage and the shape/stride arrays.
template <class Managed>
struct ExportContext {
  std::shared_ptr<detail::Storage> storage;
  std::vector<int64_t> shape, strides;
  Managed managed{};
};

template <class Managed>
void delete_export(Managed* self) {
  delete static_cast<ExportContext<Managed>*>(self->manager_ctx);
}

template <class Managed>
std::unique_ptr<ExportContext<Managed>> export_tensor(const Tensor& t, const std::string& op) {
  KILN_CHECK(t.defined(), ValueError, op + "the tensor is undefined. Pass a defined tensor.");
  KILN_CHECK(!t.requires_grad(), ValueError,
             op + "Can't export tensors that require gradient, use tensor.detach().");
  auto ctx = std::make_unique<ExportContext<Managed>>();
  ctx->storage = t.impl().storage;
  ctx->shape = t.sizes().vec();
  ctx->strides = t.strides().vec();
  DLTensor& dl = ctx->managed.dl_tensor;
  dl.data = t.is_cpu() ? t.raw_data_ptr() : t.impl().data();  // the address of element 0
  dl.device = to_dl_device(t.device());
  dl.ndim = static_cast<int32_t>(t.dim());
  dl.dtype = to_dl_dtype(t.dtype());
  dl.shape = ctx->shape.data();
  dl.strides = ctx->strides.data();
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &delete_export<Managed>;
  return ctx;
}

// The storage free function of an imported tensor: hands the memory back to its producer.
template <class Managed>
void release_import(void* /*data*/, void* context) {
  auto* managed = static_cast<Managed*>(context);
  if (managed->deleter) managed->deleter(managed);
}

// Validates `dl` completely, then wraps it; `managed` is consumed only when this returns.
template <class Managed>
Tensor import_tensor(Managed* managed, const DLTensor& dl, const std::string& op) {
  KILN_CHECK(dl.ndim >= 0, ValueError, op + "ndim is negative (" + std::to_string(dl.ndim) + ").");
  KILN_CHECK(dl.ndim <= kMaxDims, ShapeError,
             op + "the tensor has " + std::to_string(dl.ndim) + " dimensions; Kiln supports at most " +
                 std::to_string(kMaxDims) + " (kiln::kMaxDims).");
  KILN_CHECK(dl.ndim == 0 || dl.shape != nullptr, ValueError,
             op + "shape is null for a tensor of " + std::to_string(dl.ndim) + " dims.");
  const DType dtype = from_dl_dtype(dl.dtype, op);
  const Device device = from_dl_device(dl.device, op);

  std::vector<int64_t> sizes(dl.shape, dl.shape + dl.ndim);
  int64_t numel = 1;
  bool overflow = false;
  for (int64_t s : sizes) {
    KILN_CHECK(s >= 0, ValueError, op + "the shape " + shape_str(sizes) + " has a negative size.");
    overflow |= __builtin_mul_overflow(numel, s, &numel);
  }
  KILN_CHECK(!overflow, ValueError,
             op + "the shape " + shape_str(sizes) + " has more elements than fit in int64.");

  std::vector<int64_t> strides;
  if (dl.strides != nullptr) {
    strides.assign(dl.strides, dl.strides + dl.ndim);
    for (int64_t st : strides)
      KILN_CHECK(
          st >= 0, ValueError,
          op + "the strides " + shape_str(strides) +
              " are negative somewhere; Kiln has no negative strides. Export a contiguous copy.");
  }
  if (numel > 0) {
    // The byte span of the view must be representable, so no address computation wraps.
    const int64_t span = strides.empty() ? numel : detail::checked_storage_span(sizes, strides, "from_dlpack");
    int64_t span_bytes = 0;
    KILN_CHECK(!__builtin_mul_overflow(span, itemsize(dtype), &span_bytes), ValueError,
               op + "the strides " + shape_str(strides) + " span more bytes than fit in int64.");
    KILN_CHECK(dl.data != nullptr, ValueError,
               op + "data is null for a tensor of " + std::to_string(numel) + " elements.");
  }

  const auto base = reinterpret_cast<uintptr_t>(dl.data);
  KILN_CHECK(
      dl.byte_offset <= UINTPTR_MAX - base, ValueError,
      op + "byte_offset " + std::to_string(dl.byte_offset) + " overflows the address space.");
  void* data = reinterpret_cast<void*>(base + static_cast<uintptr_t>(dl.byte_offset));
  KILN_CHECK(numel == 0 ||
                 reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(itemsize(dtype)) == 0,
             ValueError,
             op + "data + byte_offset is not aligned to the " + std::to_string(itemsize(dtype)) +
                 "-byte element size. Export an aligned (e.g. contiguous) copy.");
  // from_blob cannot fail after the checks above; from here on Kiln owns `managed`.
  return from_blob(data, sizes, strides, dtype, device, &release_import<Managed>, managed);
}

}  // namespace

DLManagedTensor* to_dlpack(const Tensor& t) {
  return &export_tensor<DLManagedTensor>(t, "[kiln::to_dlpack] ").release()->managed;
}

DLManagedTensorVersioned* to_dlpack_versioned(const Tensor& t) {
  auto ctx = export_tensor<DLManagedTensorVersioned>(t, "[kiln::to_dlpack_versioned] ");
  ctx->managed.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  ctx->managed.flags = 0;
  return &ctx.release()->managed;
}

Tensor from_dlpack(DLManagedTensor* src) {
  const std::string op = "[kiln::from_dlpack] ";
  KILN_CHECK(src != nullptr, ValueError, op + "the DLManagedTensor pointer is null.");
  return import_tensor(src, src->dl_tensor, op);
}

Tensor from_dlpack(DLManagedTensorVersioned* src) {
  const std::string op = "[kiln::from_dlpack] ";
  KILN_CHECK(src != nullptr, ValueError, op + "the DLManagedTensorVersioned pointer is null.");
  KILN_CHECK(src->version.major == DLPACK_MAJOR_VERSION, ValueError,
             op + "DLPack version " + std::to_string(src->version.major) + "." +
                 std::to_string(src->version.minor) +
                 " is not supported; Kiln reads major version " +
                 std::to_string(DLPACK_MAJOR_VERSION) + ".");
  KILN_CHECK(
      (src->flags & DLPACK_FLAG_BITMASK_READ_ONLY) == 0, ValueError,
      op + "the tensor is read-only (DLPACK_FLAG_BITMASK_READ_ONLY) and Kiln tensors are always "
           "writable. Export a writable copy.");
  return import_tensor(src, src->dl_tensor, op);
}

}  // namespace kiln
