#include "core/generator.h"

#include "kiln/ops.h"

namespace kiln {

namespace detail {

void Generator::manual_seed(uint64_t seed) {
  std::lock_guard lock(mutex_);
  seed_ = seed;
  offset_ = 0;
}

uint64_t Generator::seed() const {
  std::lock_guard lock(mutex_);
  return seed_;
}

uint64_t Generator::offset() const {
  std::lock_guard lock(mutex_);
  return offset_;
}

PhiloxSeedOffset Generator::reserve(uint64_t counters) {
  std::lock_guard lock(mutex_);
  PhiloxSeedOffset at{seed_, offset_};
  offset_ += counters;
  return at;
}

Generator& default_generator() {
  static Generator generator;
  return generator;
}

}  // namespace detail

void manual_seed(uint64_t seed) { detail::default_generator().manual_seed(seed); }

}  // namespace kiln
