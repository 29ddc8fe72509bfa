// A second process for tests/test_kernel_cache.cpp: loads (or builds) the kernel library of one
// source file through the cache in $KILN_CACHE_DIR, calls its kiln_answer() and prints
//   answer=<n> hits=<n> builds=<n> rejected=<n>
// Usage: kiln_kernel_cache_worker [--no-file-override] SOURCE_FILE [GO_FILE]
// With GO_FILE it first waits until that file exists, so that two workers start at once. With
// --no-file-override it first gives up the capabilities that let root ignore file permissions,
// so that a test running as root can show what a read-only cache does.
#include <linux/capability.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "compiler/runtime/kernel_cache.h"

namespace {

// Clears CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from this process's capabilities.
bool drop_file_override() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  for (int cap : {CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER}) {
    data[0].effective &= ~(1u << cap);
    data[0].permitted &= ~(1u << cap);
  }
  return syscall(SYS_capset, &header, data) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  namespace rt = kiln::compiler::runtime;
  if (argc > 1 && std::string(argv[1]) == "--no-file-override") {
    if (!drop_file_override()) {
      std::perror("capset");
      return 4;
    }
    --argc;
    ++argv;
  }
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
