/* The DLPack C ABI (https://dmlc.github.io/dlpack/latest/c_api.html), version 1.0: the structs
 * that tensor libraries exchange to share memory without copying. Written from the
 * specification; the layout and the names are the standard ones, so a DLManagedTensor* from
 * PyTorch, JAX, CuPy, NumPy or TVM passes straight to kiln::from_dlpack.
 *
 * This header uses the include guard of the official dlpack/dlpack.h. When the official header
 * (1.0 or newer) was included first, its definitions are used and this one adds nothing; when
 * this one comes first, a later official include is skipped. Include the official header first
 * if you need enumerators this copy leaves out (the float8/float6/float4 codes of DLPack 1.1+).
 */
#ifndef DLPACK_DLPACK_H_
#define DLPACK_DLPACK_H_

#include <stdint.h>

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the ABI a DLManagedTensorVersioned follows. A consumer must not read any
 * field but `deleter` of a tensor whose major version it does not know. */
typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

/* Where the memory lives. */
typedef enum {
  kDLCPU = 1,          /* host memory */
  kDLCUDA = 2,         /* CUDA device memory */
  kDLCUDAHost = 3,     /* pinned host memory allocated by cudaMallocHost */
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13, /* CUDA unified memory (cudaMallocManaged) */
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id; /* the ordinal; 0 for the CPU */
} DLDevice;

/* The kind of an element; DLDataType.code holds one of these. */
typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U
} DLDataTypeCode;

/* An element type: float32 is {kDLFloat, 32, 1}, bool is {kDLBool, 8, 1}. lanes > 1 is a
 * vector type (e.g. float4). */
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

/* A strided view of memory. Not owning.
 * - data + byte_offset is the address of element 0 (for CUDA, `data` may be an opaque handle);
 * - shape has ndim entries; strides has ndim entries counted in ELEMENTS, or is NULL meaning
 *   compact row-major (producers of DLPack >= 1.2 always set it). */
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;

/* A DLTensor plus its owner. The consumer calls deleter(self) exactly once when it no longer
 * needs the memory; `deleter` may be NULL when there is nothing to free. */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

/* Bits of DLManagedTensorVersioned.flags. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)              /* consumer must not write */
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)              /* producer made a copy */
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (UINT64_C(1) << 2) /* sub-byte types padded */

/* The DLPack 1.0 form: adds the ABI version and flags. Same ownership rule as above. */
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* DLPACK_DLPACK_H_ */

/* An official dlpack.h older than 1.0 lacks DLManagedTensorVersioned. */
#if !defined(DLPACK_MAJOR_VERSION) || DLPACK_MAJOR_VERSION < 1
#error "Kiln needs DLPack 1.0 or newer: include <kiln/dlpack.h> before an older dlpack/dlpack.h."
#endif
