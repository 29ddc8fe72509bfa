// A second process for tests/test_kernel_cache.cpp: loads (or builds) the kernel library of one
// source file through the cache in $KILN_CACHE_DIR, calls its kiln_answer() and prints
//   answer=<n> hits=<n> builds=<n> rejected=<n>
// Usage: kiln_kernel_cache_worker SOURCE_FILE [GO_FILE]
// With GO_FILE it first waits until that file exists, so that two workers start at once.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "compiler/runtime/kernel_cache.h"

int main(int argc, char** argv) {
  namespace rt = kiln::compiler::runtime;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s SOURCE_FILE [GO_FILE]\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  std::stringstream source;
  source << in.rdbuf();
  if (argc > 2) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!std::filesystem::exists(argv[2])) {
      if (std::chrono::steady_clock::now() > deadline) return 3;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  try {
    auto object = rt::load_or_build({.sources = {source.str()}, .label = "worker"});
    int answer = object->function<int()>("kiln_answer")();
    auto stats = rt::cache_stats();
    std::printf("answer=%d hits=%lld builds=%lld rejected=%lld\n", answer,
                static_cast<long long>(stats.hits), static_cast<long long>(stats.builds),
                static_cast<long long>(stats.rejected));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
