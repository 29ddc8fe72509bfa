// A file written whole or not at all, for what Kiln saves at a path its caller names (safetensors
// files, exported program packages): the bytes go to a new temporary file beside the target
// (created exclusively, never through a link), which is made durable and renamed over the target,
// and then the rename itself is made durable (best effort: not every file system can). Destroyed
// before commit(), the writer removes its temporary file, so a failed or interrupted save leaves
// the target as it was. (The kernel cache keeps its own private-file writer: cache_files.h.)
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace kiln::io {

class AtomicOutputFile {
 public:
  // Creates the temporary file, with permissions `mode` (less the umask). Errors throw kiln::Error
  // prefixed by `who` ("[kiln::save_safetensors]") and the target's path.
  AtomicOutputFile(std::string path, std::string who, mode_t mode = 0666);
  ~AtomicOutputFile();
  AtomicOutputFile(const AtomicOutputFile&) = delete;
  AtomicOutputFile& operator=(const AtomicOutputFile&) = delete;

  void write(const void* data, uint64_t n);
  // Makes the data durable, then replaces the target atomically.
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what, int err, const char* hint = "") const;
  std::string path_, who_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace kiln::io
