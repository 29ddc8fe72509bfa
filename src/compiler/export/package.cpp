// The package container (package.h).
#include "compiler/export/package.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>
#include <set>

#include "compiler/runtime/cache_files.h"
#include "io/atomic_file.h"
#include "kiln/error.h"
#include "kiln/export.h"

namespace kiln::compiler::exporting {

namespace {

constexpr char kMagic[9] = "KILNPKG\n";
constexpr size_t kHeaderBytes = 8 + 8 + 64;
constexpr uint64_t kMaxManifestBytes = 16u << 20;
constexpr uint64_t kMaxPackageBytes = uint64_t{64} << 30;

using runtime::files::errno_text;
using runtime::files::Sha256;

std::string sha256_hex(std::string_view bytes) {
  Sha256 sha;
  sha.update(bytes);
  return sha.hex();
}

bool valid_section_name(const std::string& name) {
  if (name.empty() || name.size() > 200 || name.front() == '/' || name.find("..") != std::string::npos) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == '/')) return false;
  return true;
}

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw PackageError("[kiln::load_program] " + path + ": " + what);
}

}  // namespace

void write_package(const std::string& path, const std::vector<Section>& sections) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Section& s : sections) {
    KILN_CHECK(valid_section_name(s.name) && names.insert(s.name).second, ValueError,
               "[kiln::ExportedProgram::save] bad or duplicate section name '" + s.name + "'. This is a bug in Kiln.");
    list.push_back({{"name", s.name}, {"offset", offset}, {"size", s.bytes.size()}, {"sha256", sha256_hex(s.bytes)}});
    offset += s.bytes.size();
  }
  const std::string manifest =
      nlohmann::ordered_json{{"format", "kiln-package"}, {"version", kPackageVersion}, {"sections", list}}.dump();
  std::string header(kMagic, 8);
  for (int i = 0; i < 8; ++i) header.push_back(static_cast<char>(static_cast<uint64_t>(manifest.size()) >> (8 * i)));
  header += sha256_hex(manifest);

  io::AtomicOutputFile file(path, "[kiln::ExportedProgram::save]", 0644);
  file.write(header.data(), header.size());
  file.write(manifest.data(), manifest.size());
  for (const Section& s : sections) file.write(s.bytes.data(), s.bytes.size());
  file.commit();
}

std::map<std::string, std::string> read_package(const std::string& path) {
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) refuse(path, "cannot open the file: " + errno_text(errno) + ".");
  runtime::files::Fd owner(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) refuse(path, "not a regular file. Pass the path of a .kpkg file.");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > kMaxPackageBytes) refuse(path, "the file has " + std::to_string(size) + " bytes, over the 64 GiB limit.");
  std::string bytes(static_cast<size_t>(size), '\0');
  for (uint64_t done = 0; done < size;) {
    ssize_t got = ::pread(fd, bytes.data() + done, std::min<uint64_t>(size - done, uint64_t{1} << 30), static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) refuse(path, "read failed: " + errno_text(errno) + ".");
    if (got == 0) refuse(path, "the file shrank while it was read.");
    done += static_cast<uint64_t>(got);
  }

  if (size < kHeaderBytes || bytes.compare(0, 8, kMagic, 8) != 0)
    refuse(path, "not a Kiln package (it does not start with the package magic). Packages are written by "
                 "kiln::ExportedProgram::save.");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[8 + i]);
  if (n > kMaxManifestBytes || n > size - kHeaderBytes)
    refuse(path, "the manifest length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) +
                     " bytes): the file is truncated or damaged.");
  const std::string_view manifest(bytes.data() + kHeaderBytes, static_cast<size_t>(n));
  if (sha256_hex(manifest) != std::string_view(bytes.data() + 16, 64))
    refuse(path, "the manifest's SHA-256 does not match: the file is damaged. Nothing was loaded.");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(manifest);
  } catch (const nlohmann::json::exception& e) {
    refuse(path, std::string("the manifest is not valid JSON: ") + e.what());
  }
  try {
    if (m.at("format") != "kiln-package") refuse(path, "the manifest's format is not \"kiln-package\".");
    const int version = m.at("version").get<int>();
    if (version > kPackageVersion)
      refuse(path, "the package format version is " + std::to_string(version) + "; this Kiln reads versions up to " +
                       std::to_string(kPackageVersion) + ". Load it with a newer Kiln, or export it again with this one.");
    if (version < 1) refuse(path, "the package format version " + std::to_string(version) + " is not valid.");
    const uint64_t data_start = kHeaderBytes + n;
    const uint64_t data_size = size - data_start;
    std::map<std::string, std::string> sections;
    uint64_t covered = 0;
    for (const auto& s : m.at("sections")) {
      const std::string name = s.at("name").get<std::string>();
      const uint64_t offset = s.at("offset").get<uint64_t>();
      const uint64_t length = s.at("size").get<uint64_t>();
      const std::string sha = s.at("sha256").get<std::string>();
      if (!valid_section_name(name)) refuse(path, "the manifest names a section '" + name + "', which is not a valid name.");
      if (sections.count(name)) refuse(path, "the manifest lists section '" + name + "' twice.");
      if (offset != covered || length > data_size - covered)
        refuse(path, "section '" + name + "' (offset " + std::to_string(offset) + ", " + std::to_string(length) +
                         " bytes) does not follow the previous one inside the file's " + std::to_string(data_size) +
                         " bytes of data: the file is truncated or damaged.");
      const std::string_view content(bytes.data() + data_start + offset, static_cast<size_t>(length));
      if (sha256_hex(content) != sha)
        refuse(path, "section '" + name + "' does not match its SHA-256: the file is damaged or was modified. Nothing was loaded.");
      sections.emplace(name, std::string(content));
      covered += length;
    }
    if (covered != data_size)
      refuse(path, std::to_string(data_size - covered) + " bytes after the last section belong to no section.");
    return sections;
  } catch (const nlohmann::json::exception& e) {
    refuse(path, std::string("the manifest is malformed: ") + e.what());
  }
}

}  // namespace kiln::compiler::exporting
