// Weights I/O: safetensors files and DLPack exchange with other tensor libraries.
// Semantics, ownership rules and examples: docs/io.md.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/dlpack.h"
#include "kiln/tensor.h"

namespace kiln {

// Named tensors in a chosen order (a state dict). Lookups are by name; the order is only the
// order of iteration.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// ======================= safetensors =======================
// The format: an 8-byte little-endian header length N, N bytes of JSON header
// ({"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}), then the tensors' bytes, row-major and little-endian.
// Dtypes: BOOL U8 I8 I32 I64 F16 BF16 F32 F64 (Kiln's dtypes; I16, U16, U32, U64, F8_* and
// C64 files are rejected with DTypeError).

// Reads every tensor of a safetensors file into fresh CPU tensors (the file is copied, not
// mapped, so it may be changed or deleted afterwards). Entries come back ordered by their data
// offset in the file, i.e. in the order the writer laid them out.
// The whole file is validated before anything is read into a tensor; a malformed file throws
// ValueError naming the file and the tensor (header length, JSON, missing or mistyped fields,
// shape not matching the byte range, ranges out of bounds, overlapping, leaving gaps or not
// covering the data to its end, duplicate names); an unknown dtype throws DTypeError; a file
// that cannot be opened or read throws kiln::Error.
NamedTensors load_safetensors(const std::string& path);

// The header's "__metadata__" string map (empty when absent). Reads and validates the header
// only, not the tensor data.
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

// Writes `tensors` (and `metadata` as "__metadata__", keys sorted, when not empty) in the
// standard format the way the reference implementation (safetensors.torch.save_file) does —
// without metadata the bytes are identical: a compact JSON header padded with spaces to a
// multiple of 8 bytes, data laid out by dtype (widest first) then by name, so every tensor is
// aligned to its element size in the file. The order of `tensors` does not matter.
// Non-contiguous tensors are written row-major; non-CPU tensors are copied to the CPU one at a
// time. The file is written to a temporary sibling and renamed over `path`, so a crash never
// leaves a partial file at `path`. Throws ValueError for duplicate names, the reserved name
// "__metadata__", undefined tensors or names/metadata that are not valid UTF-8; kiln::Error
// when the file cannot be written.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The same, over a safetensors image in memory; `what` names it in errors (e.g. the package and
// section it came from).
NamedTensors load_safetensors_bytes(std::string_view bytes, const std::string& what);
// The bytes save_safetensors writes, in memory (for containers that hold a safetensors image,
// such as exported programs).
std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

// ======================= DLPack =======================
// Zero-copy exchange with any DLPack producer or consumer (PyTorch, JAX, CuPy, NumPy, TVM).

// Exports `t` as a DLManagedTensor sharing its memory (no copy): shape, strides (always set,
// in elements), dtype, device, byte_offset 0. The DLManagedTensor keeps Kiln's storage alive
// until the consumer calls its deleter, exactly once. Throws ValueError for a tensor that
// requires grad (detach() it first, as PyTorch asks) or an undefined tensor.
DLManagedTensor* to_dlpack(const Tensor& t);
// The DLPack 1.0 form (version {1, 0}, flags 0: writable, not a copy).
DLManagedTensorVersioned* to_dlpack_versioned(const Tensor& t);

// Wraps a producer's memory without copying. On success Kiln owns `src`: its deleter runs once,
// when the last Kiln tensor viewing the memory dies. On failure nothing is consumed and the
// caller still owns `src`. Honours byte_offset and strides (NULL means row-major). Rejects, with
// DTypeError, vector types (lanes != 1) and element types Kiln lacks; with DeviceError, devices
// other than kDLCPU and kDLCUDA (and CUDA when no GPU is available); with ValueError, a null
// pointer, negative ndim/sizes/strides, or a data address not aligned to the element size.
Tensor from_dlpack(DLManagedTensor* src);
// Also rejects (ValueError) a major version other than 1 and read-only tensors
// (DLPACK_FLAG_BITMASK_READ_ONLY): Kiln tensors are always writable.
Tensor from_dlpack(DLManagedTensorVersioned* src);

}  // namespace kiln
