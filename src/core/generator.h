// The process-wide random generator: a Philox stream position (seed, offset).
//
// Each random op call reserves the counters it will use (reserve(n) returns the current
// (seed, offset) and advances offset by n) and hands both to its kernel as attrs, so a kernel is
// a pure function of (seed, offset, shape). Thread-safe: a mutex guards seed and offset.
#pragma once

#include <cstdint>
#include <mutex>

namespace kiln::detail {

// Where one op call reads the stream: counters [offset, offset + n) of the stream keyed by seed.
struct PhiloxSeedOffset {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

class Generator {
 public:
  // PyTorch's default seed, so a fresh process draws the same stream every run.
  static constexpr uint64_t kDefaultSeed = 67280421310721ull;

  explicit Generator(uint64_t seed = kDefaultSeed) : seed_(seed) {}

  // Restarts the stream: sets the seed and rewinds the offset to 0.
  void manual_seed(uint64_t seed);
  uint64_t seed() const;
  uint64_t offset() const;
  // Returns the current position and advances the offset past `counters` counters.
  PhiloxSeedOffset reserve(uint64_t counters);

 private:
  mutable std::mutex mutex_;
  uint64_t seed_;
  uint64_t offset_ = 0;
};

// The generator behind manual_seed, rand, randn, randint, bernoulli, dropout, uniform_, normal_.
Generator& default_generator();

}  // namespace kiln::detail
