// Shared pieces of the CUDA kernels for indexing, losses, random numbers, range factories and
// cat (index_kernels.cpp, loss_kernels.cpp, random_kernels.cpp, shape_kernels.cpp): the
// parameter block, launch sizing, the kernel-source preamble, the device-side index check, and
// the generated sources for the NVRTC compile tests.
#pragma once

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::cuda::detail {

constexpr int kMiscBlock = 256;

// A kernel's single by-value struct parameter, laid out as the generated source declares it
// (every field here is 8 bytes wide, so the layout has no padding).
class MiscParams {
 public:
  template <class T>
  void add(T v) {
    static_assert(sizeof(T) == 8, "parameter fields are 8 bytes wide");
    size_t at = bytes_.size();
    bytes_.resize(at + 8);
    std::memcpy(bytes_.data() + at, &v, 8);
  }
  void* data() { return bytes_.data(); }

 private:
  std::vector<unsigned char> bytes_;
};

// The raw 8 bytes of a value (scalar parameters travel as unsigned long long).
template <class T>
unsigned long long misc_bits(T v) {
  static_assert(sizeof(T) <= 8);
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

// Blocks for a grid-stride loop over `items` work items on `device`.
unsigned misc_grid(int64_t items, int device);

// Launches `f` (a kiln_* kernel taking one struct parameter) over `items` work items on the
// current stream of `device`, and checks the launch.
void launch_misc(void* f, int64_t items, int device, MiscParams& params, const char* op);

// Includes and helpers for the generated sources: conversions as the CPU kernels do them, atomic
// adds for every dtype the accumulating kernels use, and rounding to 16-bit floats.
const std::string& misc_preamble();

// The first position (row-major) of a contiguous int32/int64 device tensor `index` whose value v
// fails lo <= v < hi (values equal to *ignore pass), or -1. With `wrapped`, also writes the
// values as int64, negatives plus hi (the caller's wrap), into that contiguous int64 tensor of
// the same numel. Reads one word back to the host (a stream synchronization) when index is not
// empty: the ops throw IndexError before writing anything, as on the CPU.
int64_t first_bad_index(const Tensor& index, int64_t lo, int64_t hi, const int64_t* ignore, Tensor* wrapped,
                        const char* op);
// Element `position` (row-major) of a device tensor, read to the host as a 0-dim CPU tensor.
Tensor host_element(const Tensor& t, int64_t position);

// Generated sources (label, CUDA C++) of each file's kernels for representative dtypes and
// layouts, for tests that compile them with NVRTC on machines without a GPU.
std::vector<std::pair<std::string, std::string>> index_sources_for_test();
std::vector<std::pair<std::string, std::string>> loss_sources_for_test();
std::vector<std::pair<std::string, std::string>> random_sources_for_test();
std::vector<std::pair<std::string, std::string>> shape_sources_for_test();

}  // namespace kiln::cuda::detail
