// The package file of an exported program (docs/export.md, "Package format"): named sections,
// each with its SHA-256, in one file.
//
//   bytes 0-7     "KILNPKG\n"
//   bytes 8-15    N, the manifest's length (little-endian)
//   bytes 16-79   the manifest's SHA-256, as 64 lowercase hex digits
//   N bytes       the manifest: {"format": "kiln-package", "version": 1,
//                 "sections": [{"name", "offset", "size", "sha256"}, ...]}
//   the sections' bytes, back to back in manifest order (offsets count from the end of the
//   manifest and tile the rest of the file exactly)
//
// Reading checks the magic, the manifest's hash, every range and every section's hash before
// any section is returned: a reader never sees a byte that was not verified.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace kiln::compiler::exporting {

struct Section {
  std::string name;   // letters, digits and . _ - /; at most 200 characters
  std::string bytes;
};

inline constexpr int kPackageVersion = 1;

// Writes the package to `path` through a temporary file in the same directory, fsync'ed and
// renamed over it. Throws kiln::Error when it cannot.
void write_package(const std::string& path, const std::vector<Section>& sections);

// The verified sections of the package at `path`, by name. Throws PackageError naming the file
// and the problem (not a package, a newer version, a bad hash, truncated, malformed manifest).
std::map<std::string, std::string> read_package(const std::string& path);

}  // namespace kiln::compiler::exporting
