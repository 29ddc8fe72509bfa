// safetensors load and save. The header is validated completely (lengths, JSON, fields, dtypes,
// byte counts with overflow checks, exact coverage of the data buffer) before any tensor is
// read, so a malformed file can never cause an out-of-bounds read or a huge allocation: every
// allocation is at most the size of the file. Tensors are read with pread into fresh CPU
// tensors (no mmap: the result does not depend on the file staying unchanged). Saving writes a
// temporary sibling file, fsyncs it and renames it over the target.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "core/tensor_factory.h"
#include "io/atomic_file.h"
#include "kiln/io.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping here");

using json = nlohmann::json;

// The reference implementation's limit; larger headers are refused before being read.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// JSON nesting deeper than this is refused while parsing (a valid header needs 3 levels).
constexpr int kMaxJsonDepth = 64;
// Largest single read/write: Linux transfers at most 0x7ffff000 bytes per call.
constexpr size_t kMaxChunk = size_t{1} << 30;

struct DTypeName {
  std::string_view name;
  DType dtype;
};
// In the order of the reference implementation's Dtype enum ("increasing alignment"); the
// writer lays data out by this rank descending.
constexpr std::array<DTypeName, 9> kDTypeNames = {{{"BOOL", kBool},
                                                   {"U8", kUInt8},
                                                   {"I8", kInt8},
                                                   {"F16", kFloat16},
                                                   {"BF16", kBFloat16},
                                                   {"I32", kInt32},
                                                   {"F32", kFloat32},
                                                   {"F64", kFloat64},
                                                   {"I64", kInt64}}};
// Valid safetensors dtypes that Kiln has no dtype for.
constexpr std::array<std::string_view, 11> kForeignDTypes = {
    "I16", "U16", "U32", "U64", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"};

std::string_view safetensors_name(DType t) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == t) return d.name;
  return "?";
}
int layout_rank(DType t) {
  for (size_t i = 0; i < kDTypeNames.size(); ++i)
    if (kDTypeNames[i].dtype == t) return static_cast<int>(i);
  return 0;
}

std::string os_error(int err) {
  return std::generic_category().message(err);
}

// A name as it appears in messages: JSON-quoted, so control characters stay visible.
std::string quoted(const std::string& s) {
  return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string shape_list(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Errors raised while reading name the operation and the file.
class Context {
 public:
  Context(std::string op, const std::string& path)
      : prefix_("[kiln::" + std::move(op) + "] " + path + ": ") {}
  template <class E = ValueError>
  [[noreturn]] void fail(const std::string& what) const {
    throw E(prefix_ + what);
  }
  [[noreturn]] void malformed(const std::string& what) const {
    fail(what +
         ". The file is not a valid safetensors file (corrupt, truncated or written by a buggy "
         "tool).");
  }

 private:
  std::string prefix_;
};

// Where a safetensors image is read from: a file or bytes in memory.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly n bytes at `offset`.
  virtual void read_at(void* dst, uint64_t n, uint64_t offset) const = 0;
};

// Bytes in memory (an exported program's weights section).
class MemorySource : public ByteSource {
 public:
  MemorySource(std::string_view bytes, const Context& ctx) : bytes_(bytes), ctx_(ctx) {}
  uint64_t size() const override { return bytes_.size(); }
  void read_at(void* dst, uint64_t n, uint64_t offset) const override {
    if (offset > bytes_.size() || n > bytes_.size() - offset) ctx_.malformed("a read runs past the end of the bytes");
    if (n > 0) std::memcpy(dst, bytes_.data() + offset, static_cast<size_t>(n));
  }

 private:
  std::string_view bytes_;
  const Context& ctx_;
};

// A read-only file descriptor.
class InputFile : public ByteSource {
 public:
  InputFile(const std::string& path, const Context& ctx) : ctx_(ctx) {
    // O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; the type is checked
    // below, and for a regular file the flag changes nothing.
    do fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) {
      int err = errno;
      ctx.fail<Error>("cannot open the file: " + os_error(err) + ".");
    }
    struct stat st {};
    int err = ::fstat(fd_, &st) != 0 ? errno : 0;
    if (err != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);  // the destructor does not run when the constructor throws
      if (err != 0) ctx.fail<Error>("cannot stat the file: " + os_error(err) + ".");
      ctx.fail<Error>("not a regular file. Pass the path of a .safetensors file.");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  uint64_t size() const override { return size_; }

  // Reads exactly n bytes at `offset`; a file that shrank since it was opened is an error.
  void read_at(void* dst, uint64_t n, uint64_t offset) const override {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, kMaxChunk));
      ssize_t got = ::pread(fd_, p, chunk, static_cast<off_t>(offset));
      if (got < 0) {
        int err = errno;
        if (err == EINTR) continue;
        ctx_.fail<Error>("read failed: " + os_error(err) + ".");
      }
      if (got == 0)
        ctx_.fail("the file ended early; it was truncated while being read. Read it again");
      p += got;
      n -= static_cast<uint64_t>(got);
      offset += static_cast<uint64_t>(got);
    }
  }

 private:
  const Context& ctx_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the start of the data buffer
};

struct Header {
  uint64_t data_start = 0;     // 8 + header length
  std::vector<Entry> entries;  // sorted by data offset
  std::map<std::string, std::string> metadata;
};

// Parses the JSON text, refusing duplicate keys (a parser differential: other readers keep the
// first or the last) and absurd nesting.
json parse_json(const std::string& text, const Context& ctx) {
  std::vector<std::set<std::string>> keys;  // the keys seen in each open object
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxJsonDepth)
      ctx.malformed("the JSON header nests deeper than " + std::to_string(kMaxJsonDepth) +
                    " levels");
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
          ctx.malformed("the JSON header repeats the key " + quoted(parsed.get<std::string>()));
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, on_event);
  } catch (const json::exception& e) {
    ctx.malformed(std::string("the header is not valid JSON (") + e.what() + ")");
  }
}

// A non-negative JSON integer that fits in int64, or nullopt.
std::optional<uint64_t> as_size(const json& v) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return u;
    return std::nullopt;
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i >= 0) return static_cast<uint64_t>(i);
  }
  return std::nullopt;
}

DType parse_dtype(const json& v, const std::string& tensor, const Context& ctx) {
  if (!v.is_string()) ctx.malformed("tensor " + tensor + " has a 'dtype' that is not a string");
  const auto& s = v.get_ref<const std::string&>();
  for (const auto& d : kDTypeNames)
    if (d.name == s) return d.dtype;
  std::string valid;
  for (const auto& d : kDTypeNames) valid += (valid.empty() ? "" : ", ") + std::string(d.name);
  if (std::find(kForeignDTypes.begin(), kForeignDTypes.end(), s) != kForeignDTypes.end())
    ctx.fail<DTypeError>("tensor " + tensor + " has dtype " + s +
                         ", which Kiln does not support. Convert it to one of " + valid +
                         " before saving.");
  ctx.fail<DTypeError>("tensor " + tensor + " has unknown dtype " + quoted(s) +
                       ". Valid dtypes: " + valid + ".");
}

Entry parse_entry(const std::string& name, const json& info, const Context& ctx) {
  const std::string tensor = quoted(name);
  if (!info.is_object())
    ctx.malformed("the header entry of tensor " + tensor + " is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!info.contains(field)) ctx.malformed("tensor " + tensor + " has no '" + field + "'");
  Entry e;
  e.name = name;
  e.dtype = parse_dtype(info.at("dtype"), tensor, ctx);

  const json& shape = info.at("shape");
  if (!shape.is_array()) ctx.malformed("tensor " + tensor + " has a 'shape' that is not an array");
  if (shape.size() > static_cast<size_t>(kMaxDims))
    ctx.fail<ShapeError>("tensor " + tensor + " has " + std::to_string(shape.size()) +
                         " dimensions; Kiln supports at most " + std::to_string(kMaxDims) +
                         " (kiln::kMaxDims).");
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& s : shape) {
    auto n = as_size(s);
    if (!n)
      ctx.malformed("tensor " + tensor + " has a shape entry " + s.dump() +
                    " that is not a non-negative integer");
    e.shape.push_back(static_cast<int64_t>(*n));
    overflow |= __builtin_mul_overflow(numel, *n, &numel);
  }
  uint64_t nbytes = 0;
  overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(itemsize(e.dtype)), &nbytes);
  // numel can be 0 after an overflowing prefix (e.g. [2^40, 2^40, 0]); only a product that is
  // representable in int64 throughout is accepted.
  if (overflow || numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    ctx.malformed("tensor " + tensor + " has shape " + shape_list(e.shape) +
                  ", whose size overflows 64 bits");

  const json& offsets = info.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2)
    ctx.malformed("tensor " + tensor + " has 'data_offsets' that are not a [begin, end] pair");
  auto begin = as_size(offsets[0]), end = as_size(offsets[1]);
  if (!begin || !end)
    ctx.malformed("tensor " + tensor + " has data_offsets " + offsets.dump() +
                  " that are not non-negative integers");
  e.begin = *begin;
  e.end = *end;
  if (e.begin > e.end)
    ctx.malformed("tensor " + tensor + " has data_offsets " + offsets.dump() +
                  " that end before they begin");
  if (e.end - e.begin != nbytes)
    ctx.malformed("tensor " + tensor + " of dtype " + std::string(safetensors_name(e.dtype)) +
                  " and shape " + shape_list(e.shape) + " needs " + std::to_string(nbytes) +
                  " bytes, but its data_offsets " + offsets.dump() + " span " +
                  std::to_string(e.end - e.begin));
  return e;
}

// Reads and validates the length prefix and the JSON header, and checks that the tensors'
// byte ranges tile the data buffer exactly (what the reference implementation requires).
Header read_header(const ByteSource& file, const Context& ctx) {
  const uint64_t file_size = file.size();
  if (file_size < 8)
    ctx.malformed("the file has " + std::to_string(file_size) +
                  " bytes, fewer than the 8-byte header length");
  unsigned char prefix[8];
  file.read_at(prefix, 8, 0);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes)
    ctx.malformed("the header length " + std::to_string(n) + " exceeds the limit of " +
                  std::to_string(kMaxHeaderBytes) + " bytes");
  if (n > file_size - 8)
    ctx.malformed("the header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(file_size) + " bytes)");
  std::string text(static_cast<size_t>(n), '\0');
  file.read_at(text.data(), n, 8);
  if (text.empty() || text[0] != '{') ctx.malformed("the header does not start with '{'");
  json root = parse_json(text, ctx);
  if (!root.is_object()) ctx.malformed("the header is not a JSON object");

  Header h;
  h.data_start = 8 + n;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) ctx.malformed("'__metadata__' is not a JSON object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          ctx.malformed("'__metadata__' maps " + quoted(mk) + " to " + mv.dump() +
                        "; values must be strings");
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.entries.push_back(parse_entry(key, value, ctx));
  }

  std::sort(h.entries.begin(), h.entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const uint64_t data_size = file_size - h.data_start;
  uint64_t covered = 0;  // the data buffer [0, covered) belongs to the tensors checked so far
  const Entry* previous = nullptr;
  for (const Entry& e : h.entries) {
    std::string range = "[";
    range += std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
    if (e.end > data_size)
      ctx.malformed("tensor " + quoted(e.name) + " has data_offsets " + range +
                    " past the end of the data buffer (" + std::to_string(data_size) +
                    " bytes; the file may be truncated)");
    if (e.begin < covered)
      ctx.malformed("tensor " + quoted(e.name) + " has data_offsets " + range +
                    " overlapping tensor " + quoted(previous->name));
    if (e.begin > covered)
      ctx.malformed("bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) +
                    ") of the data buffer belong to no tensor (a gap before tensor " +
                    quoted(e.name) + ")");
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size)
    ctx.malformed("the tensors cover " + std::to_string(covered) +
                  " bytes of data but the file holds " + std::to_string(data_size) +
                  " bytes after the header (trailing bytes belong to no tensor)");
  return h;
}

// ---------------- writing ----------------


}  // namespace

namespace {

NamedTensors read_tensors(const ByteSource& file, const Context& ctx) {
  Header h = read_header(file, ctx);
  NamedTensors out;
  out.reserve(h.entries.size());
  for (const Entry& e : h.entries) {
    Tensor t = detail::make_empty(e.shape, e.dtype, kCPU);
    const uint64_t nbytes = e.end - e.begin;
    if (nbytes > 0) {
      file.read_at(t.raw_data_ptr(), nbytes, h.data_start + e.begin);
      // A bool byte other than 0 or 1 is undefined behaviour in C++: normalize like NumPy.
      if (e.dtype == kBool) {
        auto* p = static_cast<uint8_t*>(t.raw_data_ptr());
        for (uint64_t i = 0; i < nbytes; ++i) p[i] = p[i] != 0;
      }
    }
    out.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace

NamedTensors load_safetensors(const std::string& path) {
  Context ctx("load_safetensors", path);
  InputFile file(path, ctx);
  return read_tensors(file, ctx);
}

NamedTensors load_safetensors_bytes(std::string_view bytes, const std::string& what) {
  Context ctx("load_safetensors_bytes", what);
  MemorySource source(bytes, ctx);
  return read_tensors(source, ctx);
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  Context ctx("load_safetensors_metadata", path);
  InputFile file(path, ctx);
  return read_header(file, ctx).metadata;
}

namespace {

// Writes the safetensors image of `tensors` through `write(data, n)`.
template <class Write>
void write_safetensors(const std::string& op, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata, Write&& write) {
  std::set<std::string_view> names;
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(t.defined(), ValueError,
               op + "tensor " + quoted(name) + " is undefined. Pass defined tensors only.");
    KILN_CHECK(name != "__metadata__", ValueError,
               op + "\"__metadata__\" is reserved for the metadata map and cannot name a tensor. "
                    "Rename it.");
    KILN_CHECK(names.insert(name).second, ValueError,
               op + "the name " + quoted(name) + " appears twice. Tensor names must be unique.");
  }

  // The reference layout: element size (dtype rank) descending, then name, so each tensor
  // starts at a multiple of its element size.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    int ra = layout_rank(tensors[a].second.dtype()), rb = layout_rank(tensors[b].second.dtype());
    if (ra != rb) return ra > rb;
    return tensors[a].first < tensors[b].first;
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    uint64_t nbytes = static_cast<uint64_t>(t.nbytes());
    header[tensors[i].first] = {{"dtype", std::string(safetensors_name(t.dtype()))},
                                {"shape", t.sizes().vec()},
                                {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception&) {
    throw ValueError(
        op + "a tensor name or metadata string is not valid UTF-8. JSON headers need UTF-8 text.");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  KILN_CHECK(text.size() <= kMaxHeaderBytes, ValueError,
             op + "the header would be " + std::to_string(text.size()) + " bytes, over the " +
                 std::to_string(kMaxHeaderBytes) +
                 "-byte limit readers accept. Save fewer tensors per file.");

  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i)
    prefix[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));
  write(prefix, 8);
  write(text.data(), text.size());
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    Tensor host = t.to(kCPU).contiguous();  // one tensor at a time: peak extra memory is one tensor
    write(host.raw_data_ptr(), static_cast<uint64_t>(host.nbytes()));
  }
}

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string op = "[kiln::save_safetensors] " + path + ": ";
  std::optional<io::AtomicOutputFile> file;
  write_safetensors(op, tensors, metadata, [&](const void* data, uint64_t n) {
    if (!file) file.emplace(path, "[kiln::save_safetensors]");  // created once the tensors and names are checked
    file->write(data, n);
  });
  file->commit();
}

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::string out;
  write_safetensors("[kiln::safetensors_bytes] ", tensors, metadata, [&](const void* data, uint64_t n) {
    out.append(static_cast<const char*>(data), static_cast<size_t>(n));
  });
  return out;
}

}  // namespace kiln
