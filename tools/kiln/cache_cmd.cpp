// `kiln cache info|verify|clear` over compiler/runtime/cache_admin.h.
#include "cache_cmd.h"

#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "compiler/runtime/cache_admin.h"
#include "kiln/error.h"

namespace kiln::cli {

namespace {

namespace rt = kiln::compiler::runtime;

constexpr const char* kCacheUsage =
    "usage: kiln cache info [--json]      what the kernel cache holds, by kind and Kiln version\n"
    "       kiln cache verify             re-check every entry's checksum and ownership; remove bad ones\n"
    "                                     (exit status 1 when any was bad)\n"
    "       kiln cache clear [--older-than DAYS]\n"
    "                                     remove entries (older than DAYS), records and dead builds\n";

std::string size_text(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.1f} GiB", double(bytes) / double(int64_t{1} << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", double(bytes) / double(int64_t{1} << 20));
  if (bytes >= 1024) return fmt::format("{:.1f} KiB", double(bytes) / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string age_text(double days) {
  if (days >= 1) return fmt::format("{:.1f} d", days);
  if (days * 24 >= 1) return fmt::format("{:.1f} h", days * 24);
  return fmt::format("{:.0f} min", days * 24 * 60);
}

int info(bool json) {
  const rt::CacheInfo c = rt::cache_info();
  if (json) {
    nlohmann::ordered_json j = {{"root", c.root}, {"version", c.version}, {"bytes", c.bytes}, {"kinds", nlohmann::json::array()}};
    for (const rt::CacheKindInfo& k : c.kinds)
      j["kinds"].push_back({{"kind", k.kind},
                            {"version", k.version},
                            {"current", k.current},
                            {"entries", k.entries},
                            {"bytes", k.bytes},
                            {"oldest_days", k.oldest_days},
                            {"newest_days", k.newest_days},
                            {"locks", k.locks},
                            {"compiler_records", k.records},
                            {"build_dirs", k.build_dirs},
                            {"other", k.other}});
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("kernel cache at {} (this Kiln: {})\n", c.root, c.version);
  if (c.kinds.empty()) {
    std::cout << "empty\n";
    return 0;
  }
  std::cout << fmt::format("{:<6} {:<12} {:>8} {:>11} {:>9} {:>9} {:>6} {:>8} {:>7}\n", "kind", "version", "entries", "size",
                           "oldest", "newest", "locks", "records", "builds");
  for (const rt::CacheKindInfo& k : c.kinds)
    std::cout << fmt::format("{:<6} {:<12} {:>8} {:>11} {:>9} {:>9} {:>6} {:>8} {:>7}\n", k.kind,
                             k.version + (k.current ? "" : " (old)"), k.entries, size_text(k.bytes),
                             k.entries ? age_text(k.oldest_days) : "-", k.entries ? age_text(k.newest_days) : "-",
                             k.locks, k.records, k.build_dirs);
  std::cout << fmt::format("total {}\n", size_text(c.bytes));
  return 0;
}

int verify() {
  const rt::CacheVerifyReport r = rt::verify_cache();
  for (const std::string& line : r.removed) std::cout << "bad: " << line << "\n";
  std::cout << fmt::format("checked {} entries: {} valid, {} bad\n", r.checked, r.valid, r.removed.size());
  return r.removed.empty() ? 0 : 1;
}

int clear(const std::vector<std::string>& args) {
  std::optional<double> days;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--older-than" && i + 1 < args.size()) {
      size_t used = 0;
      double v = -1;
      try {
        v = std::stod(args[i + 1], &used);
      } catch (const std::exception&) {
        used = 0;
      }
      KILN_CHECK(used == args[i + 1].size() && v >= 0, ValueError,
                 "[kiln cache] --older-than needs a number of days >= 0, got '" + args[i + 1] + "'.");
      days = v;
      ++i;
    } else {
      throw ValueError("[kiln cache] unknown option '" + args[i] + "' for clear.\n" + kCacheUsage);
    }
  }
  const rt::CacheClearReport r = rt::clear_cache(days);
  std::cout << fmt::format("removed {} entries ({}), kept {}\n", r.removed_entries, size_text(r.removed_bytes),
                           r.kept_entries);
  return 0;
}

}  // namespace

int run_cache(const std::vector<std::string>& args) {
  if (args.empty()) {
    std::cerr << kCacheUsage;
    return 2;
  }
  const std::string& what = args[0];
  if (what == "info" && (args.size() == 1 || (args.size() == 2 && args[1] == "--json"))) return info(args.size() == 2);
  if (what == "verify" && args.size() == 1) return verify();
  if (what == "clear") return clear(args);
  std::cerr << "kiln cache: unknown arguments.\n" << kCacheUsage;
  return 2;
}

}  // namespace kiln::cli
