// A kernel cache of the test binary's own: KILN_CACHE_DIR points at a fresh temp directory for
// the whole run (never the user's ~/.cache/kiln) and the directory goes at exit. A death test's
// child process inherits the parent's directory instead of making (and removing) its own.
//
// Use once per test binary, at namespace scope:
//   KILN_TEST_KERNEL_CACHE_DIR("kiln_test_kiln_backend");
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace kiln::testing {

class KernelCacheDir : public ::testing::Environment {
 public:
  explicit KernelCacheDir(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    namespace fs = std::filesystem;
    if (const char* inherited = std::getenv(kOwnerVariable)) {
      dir_ = inherited;
      owner_ = false;
    } else {
      std::string pattern = (fs::temp_directory_path() / (prefix_ + "_XXXXXX")).string();
      ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << "mkdtemp failed";
      dir_ = pattern;
      owner_ = true;
      ::setenv(kOwnerVariable, dir_.c_str(), 1);
    }
    ::setenv("KILN_CACHE_DIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    if (!owner_) return;
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    ::unsetenv(kOwnerVariable);
  }

 private:
  static constexpr const char* kOwnerVariable = "KILN_TEST_CACHE_OWNER_DIR";
  std::string prefix_;
  std::string dir_;
  bool owner_ = false;
};

}  // namespace kiln::testing

#define KILN_TEST_KERNEL_CACHE_DIR(prefix)                                        \
  [[maybe_unused]] static ::testing::Environment* const kiln_test_cache_environment = \
      ::testing::AddGlobalTestEnvironment(new ::kiln::testing::KernelCacheDir(prefix))
