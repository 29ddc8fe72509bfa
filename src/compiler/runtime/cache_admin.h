// Looking after the kernel cache (kernel_cache.h): what it holds, a re-check of every entry, and
// removal by age. `kiln cache info|verify|clear` (tools/kiln) prints these reports.
//
// The cache root is resolve_root()'s (checked from / down before anything is read); it holds one
// directory per kind and Kiln version, <kind>-v<version> (cpp: kernel libraries, .so; cuda: CUDA
// binaries, .bin), each with entries <key><suffix> beside <key>.sha256, <key>.lock files,
// compiler-*.json probe records and tmp-* build directories. Nothing here follows a link, and
// nothing that is not a regular file of this user's is read or removed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kiln::compiler::runtime {

// One <kind>-v<version> directory.
struct CacheKindInfo {
  std::string kind, version;
  bool current = false;       // this Kiln's version (others are left by other versions)
  int64_t entries = 0;        // entries (an entry file with or without its checksum)
  int64_t bytes = 0;          // all files in the directory
  double oldest_days = 0, newest_days = 0;  // entries' ages by modification time
  int64_t locks = 0, records = 0, build_dirs = 0, other = 0;
};

struct CacheInfo {
  std::string root;
  std::string version;  // this Kiln's
  std::vector<CacheKindInfo> kinds;
  int64_t bytes = 0;
};

// What the cache holds; creates nothing but the root (resolve_root() creates it when missing).
CacheInfo cache_info();

struct CacheVerifyReport {
  int64_t checked = 0, valid = 0;
  std::vector<std::string> removed;  // "<path>: why"
};

// Re-checks every entry of every kind and version under its lock: the entry and its checksum must
// be regular files of this user's that nobody else can write, and the bytes must match; a bad one
// (or a checksum without its entry) is removed, as a load would remove it.
CacheVerifyReport verify_cache();

struct CacheClearReport {
  int64_t removed_entries = 0, removed_bytes = 0, kept_entries = 0;
};

// Removes entries (with their checksum and lock files) whose entry file was last modified more than
// `older_than_days` ago, each under its lock; without an age, every entry, every compiler record
// and every abandoned build directory, and then the directories left empty. A build under way keeps
// its directory.
CacheClearReport clear_cache(std::optional<double> older_than_days);

}  // namespace kiln::compiler::runtime
