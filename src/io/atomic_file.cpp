#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <random>
#include <system_error>

#include "kiln/error.h"

namespace kiln::io {

namespace {

constexpr uint64_t kMaxChunk = uint64_t{1} << 30;  // per write(2)

}  // namespace

AtomicOutputFile::AtomicOutputFile(std::string path, std::string who, mode_t mode)
    : path_(std::move(path)), who_(std::move(who)) {
  namespace fs = std::filesystem;
  const fs::path target(path_);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  for (int attempt = 0; attempt < 16 && fd_ < 0; ++attempt) {
    tmp_ = (dir / std::string(".").append(target.filename().string()))
               .string()
               .append(".tmp-")
               .append(std::to_string(::getpid()))
               .append("-")
               .append(std::to_string(counter++))
               .append("-")
               .append(std::to_string(rd()));
    do fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  if (fd_ < 0)
    fail("cannot create a temporary file in " + dir.string(), errno,
         " Check that the directory exists and is writable.");
}

AtomicOutputFile::~AtomicOutputFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicOutputFile::write(const void* data, uint64_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::write(fd_, p, static_cast<size_t>(std::min(n, kMaxChunk)));
    if (put < 0) {
      if (errno == EINTR) continue;
      fail("writing " + tmp_ + " failed", errno);
    }
    p += put;
    n -= static_cast<uint64_t>(put);
  }
}

void AtomicOutputFile::commit() {
  if (::fsync(fd_) != 0) fail("fsync of " + tmp_ + " failed", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("closing " + tmp_ + " failed", errno);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename " + tmp_ + " to the target", errno);
  committed_ = true;
  const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void AtomicOutputFile::fail(const std::string& what, int err, const char* hint) const {
  throw Error(who_ + " " + path_ + ": " + what + ": " + std::generic_category().message(err) + "." + hint);
}

}  // namespace kiln::io
