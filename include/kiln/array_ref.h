// IntArrayRef: a non-owning view of int64 values that binds to {1, 2}, std::vector and spans.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace kiln {

class IntArrayRef {
 public:
  constexpr IntArrayRef() = default;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
  // Like std::span over a braced list: valid for the full-expression of the call it is passed to.
  constexpr IntArrayRef(std::initializer_list<int64_t> v) : data_(v.begin()), size_(v.size()) {}  // NOLINT
#pragma GCC diagnostic pop
  IntArrayRef(const std::vector<int64_t>& v) : data_(v.data()), size_(v.size()) {}  // NOLINT
  constexpr IntArrayRef(std::span<const int64_t> v) : data_(v.data()), size_(v.size()) {}  // NOLINT
  constexpr IntArrayRef(const int64_t* d, size_t n) : data_(d), size_(n) {}
  constexpr IntArrayRef(const int64_t& single) : data_(&single), size_(1) {}  // NOLINT

  constexpr const int64_t* begin() const { return data_; }
  constexpr const int64_t* end() const { return data_ + size_; }
  constexpr const int64_t* data() const { return data_; }
  constexpr size_t size() const { return size_; }
  constexpr bool empty() const { return size_ == 0; }
  constexpr int64_t operator[](size_t i) const { return data_[i]; }
  constexpr int64_t back() const { return data_[size_ - 1]; }
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  friend bool operator==(IntArrayRef a, IntArrayRef b) {
    if (a.size_ != b.size_) return false;
    for (size_t i = 0; i < a.size_; ++i)
      if (a.data_[i] != b.data_[i]) return false;
    return true;
  }

 private:
  const int64_t* data_ = nullptr;
  size_t size_ = 0;
};

// "(2, 3)" — the shape notation used in error messages. "()" for a scalar.
std::string shape_str(IntArrayRef sizes);

}  // namespace kiln
