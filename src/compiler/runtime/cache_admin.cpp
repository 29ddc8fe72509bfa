// Looking after the kernel cache (cache_admin.h).
#include "compiler/runtime/cache_admin.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <map>
#include <string_view>

#include "compiler/runtime/cache_files.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::compiler::runtime {

namespace {

using files::EntryLock;

struct KindDir {
  std::string path, kind, version;
};

bool is_key(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

bool lstat_of(const std::string& path, struct stat& st) { return ::lstat(path.c_str(), &st) == 0; }
bool own_regular(const struct stat& st) { return S_ISREG(st.st_mode) && st.st_uid == ::getuid(); }
bool own_directory(const struct stat& st) { return S_ISDIR(st.st_mode) && st.st_uid == ::getuid(); }

double age_days(const struct stat& st) {
  const auto modified = std::chrono::system_clock::from_time_t(st.st_mtim.tv_sec);
  return std::chrono::duration<double>(std::chrono::system_clock::now() - modified).count() / 86400.0;
}

// The names in `dir`, sorted (no links followed: the caller lstat's each).
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(std::move(n));
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The root's <kind>-v<version> directories that are real directories of this user's.
std::vector<KindDir> kind_dirs(const std::string& root) {
  std::vector<KindDir> dirs;
  for (const std::string& name : names_in(root)) {
    const size_t v = name.rfind("-v");
    struct stat st;
    if (v == std::string::npos || v == 0 || v + 2 >= name.size() || !lstat_of(root + "/" + name, st) || !own_directory(st))
      continue;
    dirs.push_back({root + "/" + name, name.substr(0, v), name.substr(v + 2)});
  }
  return dirs;
}

// The entries of a kind directory: key -> the entry file's suffix (".so", ".bin"; empty for a
// checksum whose entry file is gone).
std::map<std::string, std::string> entries_of(const std::string& dir) {
  std::map<std::string, std::string> entries;
  for (const std::string& name : names_in(dir)) {
    if (name.size() <= 64 || !is_key(std::string_view(name).substr(0, 64))) continue;
    const std::string key = name.substr(0, 64), suffix = name.substr(64);
    if (suffix == ".lock") continue;
    if (suffix == ".sha256") entries.emplace(key, "");
    else entries[key] = suffix;
  }
  return entries;
}

// The files of one entry of a kind directory; `found_suffix` as entries_of gives it.
struct EntryPaths {
  std::string entry, sum, lock;
};
EntryPaths paths_of(const KindDir& d, const std::string& key, const std::string& found_suffix) {
  const std::string suffix = !found_suffix.empty() ? found_suffix : d.kind == "cpp" ? ".so" : ".bin";
  const std::string base = d.path + "/" + key;
  return {base + suffix, base + ".sha256", base + ".lock"};
}

// Why an entry that failed verification is bad, for the report.
std::string why_bad(const std::string& entry, const std::string& sum) {
  struct stat e, s;
  const bool has_entry = lstat_of(entry, e), has_sum = lstat_of(sum, s);
  if (!has_entry) return "its checksum has no entry file";
  if (!has_sum) return "no checksum";
  for (const auto& [st, what] : {std::pair{&e, "the entry"}, std::pair{&s, "its checksum"}}) {
    if (!S_ISREG(st->st_mode)) return std::string(what) + " is not a regular file";
    if (st->st_uid != ::getuid()) return std::string(what) + " belongs to another user";
    if (st->st_mode & (S_IWGRP | S_IWOTH)) return std::string(what) + " is writable by others";
  }
  return "its bytes do not match the checksum";
}

}  // namespace

CacheInfo cache_info() {
  CacheInfo info;
  info.root = files::resolve_root();
  info.version = KILN_VERSION;
  for (const KindDir& d : kind_dirs(info.root)) {
    CacheKindInfo k;
    k.kind = d.kind;
    k.version = d.version;
    k.current = d.version == KILN_VERSION;
    bool first = true;
    for (const std::string& name : names_in(d.path)) {
      struct stat st;
      if (!lstat_of(d.path + "/" + name, st)) continue;
      if (S_ISDIR(st.st_mode)) {
        if (name.rfind("tmp-", 0) == 0) ++k.build_dirs;
        else ++k.other;
        continue;
      }
      if (S_ISREG(st.st_mode)) k.bytes += st.st_size;
      const bool keyed = name.size() > 64 && is_key(std::string_view(name).substr(0, 64));
      const std::string suffix = keyed ? name.substr(64) : "";
      if (keyed && suffix == ".lock") {
        ++k.locks;
      } else if (keyed && suffix == ".sha256") {
        // counted with its entry
      } else if (keyed) {
        ++k.entries;
        const double age = age_days(st);
        k.oldest_days = first ? age : std::max(k.oldest_days, age);
        k.newest_days = first ? age : std::min(k.newest_days, age);
        first = false;
      } else if (name.rfind("compiler-", 0) == 0) {
        ++k.records;
      } else {
        ++k.other;
      }
    }
    info.bytes += k.bytes;
    info.kinds.push_back(std::move(k));
  }
  return info;
}

CacheVerifyReport verify_cache() {
  CacheVerifyReport report;
  for (const KindDir& d : kind_dirs(files::resolve_root())) {
    for (const auto& [key, found_suffix] : entries_of(d.path)) {
      const auto [entry, sum, lock_path] = paths_of(d, key, found_suffix);
      EntryLock lock(lock_path, "kiln cache verify");
      ++report.checked;
      files::VerifiedEntry v = files::verify_entry(entry, sum, /*keep_bytes=*/false);
      if (v.state == files::VerifiedEntry::State::valid) {
        ++report.valid;
        continue;
      }
      if (v.state == files::VerifiedEntry::State::missing) continue;  // removed meanwhile
      const std::string why = why_bad(entry, sum);
      if (!lock.read_only_reason().empty()) {
        report.removed.push_back(entry + ": " + why + " (not removed: " + lock.read_only_reason() + ")");
        continue;
      }
      files::remove_entry(entry, sum);
      report.removed.push_back(entry + ": " + why);
    }
  }
  return report;
}

CacheClearReport clear_cache(std::optional<double> older_than_days) {
  CacheClearReport report;
  for (const KindDir& d : kind_dirs(files::resolve_root())) {
    for (const auto& [key, found_suffix] : entries_of(d.path)) {
      const auto [entry, sum, lock_path] = paths_of(d, key, found_suffix);
      struct stat st{};
      const bool has_entry = lstat_of(entry, st);
      if (older_than_days && has_entry && age_days(st) < *older_than_days) {
        ++report.kept_entries;
        continue;
      }
      EntryLock lock(lock_path, "kiln cache clear");
      if (!lock.read_only_reason().empty()) {
        ++report.kept_entries;
        continue;
      }
      if (has_entry && own_regular(st)) {
        ++report.removed_entries;
        report.removed_bytes += st.st_size;
      }
      files::remove_entry(entry, sum);
      // A process waiting on this lock file holds an inode nobody will lock again: at worst it
      // builds the entry a second time, and installing is atomic.
      struct stat ls;
      if (lstat_of(lock_path, ls) && own_regular(ls)) ::unlink(lock_path.c_str());
    }
    if (older_than_days) continue;
    for (const std::string& name : names_in(d.path)) {
      const std::string path = d.path + "/" + name;
      struct stat st;
      const bool keyed_lock = name.size() == 69 && is_key(std::string_view(name).substr(0, 64)) && name.substr(64) == ".lock";
      if ((name.rfind("compiler-", 0) == 0 || keyed_lock) && lstat_of(path, st) && own_regular(st)) ::unlink(path.c_str());
    }
    files::sweep_abandoned_builds(d.path);
    ::rmdir(d.path.c_str());  // only when empty
  }
  return report;
}

}  // namespace kiln::compiler::runtime
