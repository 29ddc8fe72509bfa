// Weights I/O: safetensors round trips, the exact file format, rejection of every kind of
// malformed file, and zero-copy DLPack exchange with its ownership rules.
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <random>
#include <typeinfo>

#include "reference.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() /
           ("kiln_test_io_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}
template <class T>
std::string bytes_of(std::initializer_list<T> values) {
  std::string s;
  for (T v : values) s.append(reinterpret_cast<const char*>(&v), sizeof(T));
  return s;
}
// A safetensors file: length prefix (the header's own length unless given), header, data.
std::string file_bytes(const std::string& header, const std::string& data,
                       std::optional<uint64_t> length = {}) {
  return le64(length.value_or(header.size())) + header + data;
}

// The tensor's elements, row-major, as raw bytes (bit-exact comparisons, NaN included).
std::string raw(const Tensor& t) {
  Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.raw_data_ptr()), static_cast<size_t>(c.nbytes()));
}

std::vector<std::string> names_of(const NamedTensors& ts) {
  std::vector<std::string> out;
  for (const auto& [name, t] : ts) out.push_back(name);
  return out;
}

const Tensor& find(const NamedTensors& ts, const std::string& name) {
  for (const auto& [n, t] : ts)
    if (n == name) return t;
  throw std::runtime_error("no tensor named " + name);
}

// Expects loading `bytes` to throw exactly E with a message naming the file and `needle`.
template <class E>
::testing::AssertionResult load_fails(const std::string& path, const std::string& bytes,
                                      const std::string& needle) {
  write_file(path, bytes);
  try {
    load_safetensors(path);
  } catch (const E& e) {
    std::string msg = e.what();
    if (typeid(e) != typeid(E)) return ::testing::AssertionFailure() << "wrong subclass: " << msg;
    if (msg.find(path) == std::string::npos)
      return ::testing::AssertionFailure() << "no path in: " << msg;
    if (msg.find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "'" << needle << "' not in: " << msg;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "loaded without an error";
}

NamedTensors every_dtype() {
  const float inf = std::numeric_limits<float>::infinity(),
              nan = std::numeric_limits<float>::quiet_NaN();
  return {
      {"bool", tensor<bool>(std::vector<bool>{true, false, true, true}, {2, 2})},
      {"u8", tensor<uint8_t>({0, 255, 7})},
      {"i8", tensor<int8_t>({-128, 127, 0, -1})},
      {"i32", tensor<int32_t>(
                  {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), 5})},
      {"i64", tensor<int64_t>(std::vector<int64_t>{std::numeric_limits<int64_t>::min(), -3, 7,
                                                   std::numeric_limits<int64_t>::max()},
                              {2, 2})},
      {"f16",
       tensor<Half>({Half(1.5f), Half(-0.0f), Half(65504.f), Half(inf), Half(nan), Half(6e-8f)})},
      {"bf16", tensor<BFloat16>({BFloat16(3.140625f), BFloat16(-1e30f), BFloat16(-inf)})},
      {"f32", tensor<float>(std::vector<float>{3.14159265f, -1e-40f, nan, inf, 0.f, -0.f}, {3, 2})},
      {"f64", tensor<double>({std::numbers::pi, -1e-310, 1e300})},
  };
}

}  // namespace

// ======================= round trips =======================

TEST_F(IoTest, EveryDtypeRoundTripsBitExactly) {
  NamedTensors src = every_dtype();
  save_safetensors(path("all.safetensors"), src);
  NamedTensors back = load_safetensors(path("all.safetensors"));
  ASSERT_EQ(back.size(), src.size());
  for (const auto& [name, t] : src) {
    const Tensor& u = find(back, name);
    EXPECT_EQ(u.dtype(), t.dtype()) << name;
    EXPECT_EQ(u.sizes().vec(), t.sizes().vec()) << name;
    EXPECT_TRUE(u.is_cpu() && u.is_contiguous()) << name;
    EXPECT_EQ(raw(u), raw(t)) << name;
  }
}

TEST_F(IoTest, ZeroDimAndEmptyTensorsRoundTrip) {
  NamedTensors src = {{"scalar", scalar_tensor(2.5, kFloat64)},
                      {"empty", zeros({0}, kFloat32)},
                      {"empty3d", zeros({2, 0, 3}, kInt64)},
                      {"one", full({1}, 7, kInt32)}};
  save_safetensors(path("z.safetensors"), src);
  NamedTensors back = load_safetensors(path("z.safetensors"));
  ASSERT_EQ(back.size(), 4u);
  EXPECT_EQ(find(back, "scalar").dim(), 0);
  EXPECT_EQ(find(back, "scalar").item<double>(), 2.5);
  EXPECT_EQ(find(back, "empty").sizes().vec(), (std::vector<int64_t>{0}));
  EXPECT_EQ(find(back, "empty3d").sizes().vec(), (std::vector<int64_t>{2, 0, 3}));
  EXPECT_EQ(find(back, "empty3d").dtype(), kInt64);
  EXPECT_EQ(find(back, "one").item<int32_t>(), 7);
}

TEST_F(IoTest, EmptyDictionaryRoundTrips) {
  save_safetensors(path("none.safetensors"), {});
  EXPECT_TRUE(load_safetensors(path("none.safetensors")).empty());
  EXPECT_TRUE(load_safetensors_metadata(path("none.safetensors")).empty());
}

TEST_F(IoTest, NonContiguousSourcesAreWrittenRowMajor) {
  Tensor base = tensor<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}).view({3, 4});
  NamedTensors src = {{"transposed", base.t()},
                      {"stepped", base.slice(1, 0, 4, 2)},
                      {"expanded", tensor<int32_t>({1, 2}).expand({3, 2})},
                      {"f16_transposed", base.to(kFloat16).t()}};
  save_safetensors(path("nc.safetensors"), src);
  NamedTensors back = load_safetensors(path("nc.safetensors"));
  using kiln::testing::matches;
  EXPECT_TRUE(matches(find(back, "transposed"), {4, 3}, {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_TRUE(matches(find(back, "stepped"), {3, 2}, {0, 2, 4, 6, 8, 10}));
  EXPECT_TRUE(matches(find(back, "expanded"), {3, 2}, {1, 2, 1, 2, 1, 2}));
  EXPECT_TRUE(
      matches(find(back, "f16_transposed"), {4, 3}, {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  // The source views are untouched.
  EXPECT_FALSE(src[0].second.is_contiguous());
}

TEST_F(IoTest, MetadataRoundTrips) {
  std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"note", "ünïcode \"quoted\"\n\ttabs"}, {"", "empty key"}};
  save_safetensors(path("m.safetensors"), {{"w", ones({2})}}, meta);
  EXPECT_EQ(load_safetensors_metadata(path("m.safetensors")), meta);
  EXPECT_EQ(names_of(load_safetensors(path("m.safetensors"))), (std::vector<std::string>{"w"}));
  save_safetensors(path("n.safetensors"), {{"w", ones({2})}});
  EXPECT_TRUE(load_safetensors_metadata(path("n.safetensors")).empty());
}

TEST_F(IoTest, LoadOrderIsDataOffsetOrderAndSaveUsesReferenceLayout) {
  // The writer lays data out by dtype (I64, F64, F32, I32, BF16, F16, I8, U8, BOOL), then name.
  NamedTensors src = {{"b", ones({3})},           {"flag", ones({3}, kBool)},
                      {"a", ones({1})},           {"h", ones({1}, kFloat16)},
                      {"idx", ones({2}, kInt64)}, {"d", ones({1}, kFloat64)}};
  save_safetensors(path("o.safetensors"), src);
  EXPECT_EQ(names_of(load_safetensors(path("o.safetensors"))),
            (std::vector<std::string>{"idx", "d", "a", "b", "h", "flag"}));
}

TEST_F(IoTest, ReadsFilesFromOtherWritersInOffsetOrder) {
  // Header order differs from data order, extra whitespace, an unknown field (ignored, as the
  // reference implementation does) and a bool byte of 2 (normalized to true).
  std::string header =
      R"( {"z": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6], "extra": {"x": 1}},
                            "a": {"shape": [], "data_offsets": [0, 4], "dtype": "I32"},
                            "m": {"dtype": "BOOL", "shape": [2], "data_offsets": [6, 8]} }   )";
  header.erase(0, 1);  // the header must start with '{'
  std::string data = bytes_of<int32_t>({-5}) + std::string("\x09\x0a\x02\x00", 4);
  write_file(path("other.safetensors"), file_bytes(header, data));
  NamedTensors back = load_safetensors(path("other.safetensors"));
  EXPECT_EQ(names_of(back), (std::vector<std::string>{"a", "z", "m"}));
  EXPECT_EQ(find(back, "a").item<int64_t>(), -5);
  EXPECT_EQ(find(back, "z").to_vector<uint8_t>(), (std::vector<uint8_t>{9, 10}));
  EXPECT_EQ(raw(find(back, "m")), std::string("\x01\x00", 2));
}

TEST_F(IoTest, LoadedTensorsDoNotDependOnTheFile) {
  save_safetensors(path("x.safetensors"), {{"w", full({4}, 3.0)}});
  NamedTensors back = load_safetensors(path("x.safetensors"));
  fs::remove(path("x.safetensors"));
  EXPECT_TRUE(kiln::testing::matches(back[0].second, {4}, {3, 3, 3, 3}));
}

// ======================= the exact format =======================

TEST_F(IoTest, SmallFileIsByteExact) {
  // One F32 tensor: the JSON header (65 bytes) is padded with 7 spaces to 72.
  save_safetensors(path("a.safetensors"),
                   {{"attn0", tensor<float>({0, 1, 2, 3, 4, 5}).view({1, 1, 2, 3})}});
  const std::string json = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  ASSERT_EQ(json.size(), 65u);
  std::string expected = std::string("\x48\0\0\0\0\0\0\0", 8) + json + std::string(7, ' ') +
                         std::string(
                             "\x00\x00\x00\x00\x00\x00\x80\x3f\x00\x00\x00\x40"
                             "\x00\x00\x40\x40\x00\x00\x80\x40\x00\x00\xa0\x40",
                             24);
  EXPECT_EQ(read_file(path("a.safetensors")), expected);
}

TEST_F(IoTest, MixedDtypesAndMetadataFileIsByteExact) {
  save_safetensors(path("b.safetensors"),
                   {{"x", tensor<int8_t>({1, -1})}, {"y", scalar_tensor(2.0, kFloat64)}},
                   {{"k", "v"}});
  const std::string json =
      R"({"__metadata__":{"k":"v"},"y":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
      R"("x":{"dtype":"I8","shape":[2],"data_offsets":[8,10]}})";
  ASSERT_EQ(json.size(), 131u);  // padded with 5 spaces to 136 = 0x88
  std::string expected = std::string("\x88\0\0\0\0\0\0\0", 8) + json + "     " +
                         std::string("\0\0\0\0\0\0\0\x40", 8) + std::string("\x01\xff", 2);
  EXPECT_EQ(read_file(path("b.safetensors")), expected);
}

TEST_F(IoTest, EmptyFileIsByteExact) {
  save_safetensors(path("e.safetensors"), {});
  EXPECT_EQ(read_file(path("e.safetensors")), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
}

// ======================= saving: atomicity and bad input =======================

TEST_F(IoTest, SaveReplacesAnExistingFileAndLeavesNoTemporaries) {
  save_safetensors(path("w.safetensors"), {{"a", ones({100})}});
  save_safetensors(path("w.safetensors"), {{"b", zeros({2})}});
  EXPECT_EQ(names_of(load_safetensors(path("w.safetensors"))), (std::vector<std::string>{"b"}));
  int files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 1);
}

TEST_F(IoTest, SaveRejectsBadInputWithoutTouchingTheTarget) {
  const std::string p = path("bad.safetensors");
  EXPECT_THROW(save_safetensors(p, {{"a", ones({1})}, {"a", ones({2})}}), ValueError);
  EXPECT_THROW(save_safetensors(p, {{"__metadata__", ones({1})}}), ValueError);
  EXPECT_THROW(save_safetensors(p, {{"a", Tensor()}}), ValueError);
  EXPECT_THROW(save_safetensors(p, {{std::string("\xff\xfe", 2), ones({1})}}), ValueError);
  EXPECT_THROW(save_safetensors(p, {{"a", ones({1})}}, {{"k", std::string("\xc3", 1)}}),
               ValueError);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(IoTest, SaveIntoAMissingDirectoryThrowsError) {
  try {
    save_safetensors(path("no/such/dir/x.safetensors"), {{"a", ones({1})}});
    FAIL() << "no error";
  } catch (const ValueError&) {
    FAIL() << "an I/O failure is not a ValueError";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.safetensors"), std::string::npos);
  }
}

// ======================= loading: one test per malformed file =======================

TEST_F(IoTest, MissingFileOrDirectoryThrowsError) {
  EXPECT_THROW(load_safetensors(path("absent.safetensors")), Error);
  EXPECT_THROW(load_safetensors(dir_.string()), Error);
}

TEST_F(IoTest, RejectsFileShorterThanTheLengthPrefix) {
  EXPECT_TRUE(load_fails<ValueError>(path("f"), "", "fewer than the 8-byte header length"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"), "\x02\0\0", "fewer than the 8-byte header length"));
}

TEST_F(IoTest, RejectsHeaderLengthPastTheEndOfTheFile) {
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes("{}", "", 100),
                                     "runs past the end of the file"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"), le64(1), "runs past the end of the file"));
}

TEST_F(IoTest, RejectsAbsurdHeaderLength) {
  EXPECT_TRUE(
      load_fails<ValueError>(path("f"), file_bytes("{}", "", 100'000'001), "exceeds the limit"));
  EXPECT_TRUE(
      load_fails<ValueError>(path("f"), file_bytes("{}", "", UINT64_MAX), "exceeds the limit"));
}

TEST_F(IoTest, RejectsInvalidJson) {
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(R"({"a": )", ""), "not valid JSON"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(R"({"a": 1} x)", ""), "not valid JSON"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes("{\"\xff\": 1}", ""), "not valid JSON"));
  EXPECT_TRUE(
      load_fails<ValueError>(path("f"), file_bytes(R"([1, 2])", ""), "does not start with '{'"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes("", ""), "does not start with '{'"));
}

TEST_F(IoTest, RejectsDeeplyNestedJsonWithoutCrashing) {
  std::string deep = R"({"a":)" + std::string(200000, '[') + std::string(200000, ']') + "}";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(deep, ""), "nests deeper"));
}

TEST_F(IoTest, RejectsDuplicateKeys) {
  std::string h =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(h, "xy"), "repeats the key \"a\""));
  h = R"({"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(h, "x"), "repeats the key \"dtype\""));
}

TEST_F(IoTest, RejectsEntriesMissingFields) {
  EXPECT_TRUE(load_fails<ValueError>(path("f"),
                                     file_bytes(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "x"),
                                     "tensor \"w\" has no 'dtype'"));
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", "x"),
      "tensor \"w\" has no 'shape'"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"),
                                     file_bytes(R"({"w":{"dtype":"U8","shape":[1]}})", "x"),
                                     "tensor \"w\" has no 'data_offsets'"));
  EXPECT_TRUE(
      load_fails<ValueError>(path("f"), file_bytes(R"({"w":[1]})", "x"), "is not a JSON object"));
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "x"),
      "[begin, end] pair"));
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":5,"shape":[1],"data_offsets":[0,1]}})", "x"),
      "not a string"));
}

TEST_F(IoTest, RejectsUnknownDtype) {
  EXPECT_TRUE(load_fails<DTypeError>(
      path("f"),
      file_bytes(R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})",
                 std::string(16, 'x')),
      "tensor \"w\" has unknown dtype \"F128\""));
  EXPECT_TRUE(load_fails<DTypeError>(
      path("f"), file_bytes(R"({"w":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}})", "xy"),
      "dtype I16, which Kiln does not support"));
}

TEST_F(IoTest, RejectsNegativeOrNonIntegerShapeEntries) {
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", ""),
      "shape entry -1"));
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", "xy"),
      "shape entry 2.0"));
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":"2","data_offsets":[0,2]}})", "xy"),
      "not an array"));
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[-1,1]}})", "xy"),
      "not non-negative integers"));
}

// Issue 18.7: a shape with more than kMaxDims dimensions is refused before any tensor is made.
TEST_F(IoTest, RejectsShapesWithTooManyDimensions) {
  std::string shape = "[1";
  for (int i = 1; i < 100000; ++i) shape += ",1";
  shape += "]";
  EXPECT_TRUE(load_fails<ShapeError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,1]}})", "x"),
      "has 100000 dimensions; Kiln supports at most 64"));
}

// Issue 18.6: a FIFO (or any non-regular file) is refused at once; opening it must not wait for
// a writer.
TEST_F(IoTest, RejectsAFifoWithoutBlocking) {
  const std::string fifo = path("fifo.safetensors");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto loaded = std::async(std::launch::async, [&]() -> std::string {
    try {
      load_safetensors(fifo);
    } catch (const Error& e) {
      return e.what();
    }
    return "loaded";
  });
  if (loaded.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "load_safetensors blocked on a FIFO\n");
    std::_Exit(1);
  }
  const std::string message = loaded.get();
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

TEST_F(IoTest, RejectsShapeWhoseByteCountDoesNotMatchTheOffsets) {
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"),
      "needs 8 bytes"));
  // The element count overflows 64 bits: 2^32 * 2^32 * 16.
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"),
      file_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})",
                 ""),
      "overflows 64 bits"));
  // The byte count overflows even though the element count does not: 2^62 * 8.
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"),
      file_bytes(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", ""),
      "overflows 64 bits"));
}

TEST_F(IoTest, RejectsOffsetsThatEndBeforeTheyBegin) {
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", "abcd"),
      "end before they begin"));
}

TEST_F(IoTest, RejectsOffsetsPastTheDataBuffer) {
  EXPECT_TRUE(load_fails<ValueError>(
      path("f"), file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "abcd"),
      "past the end of the data buffer"));
}

TEST_F(IoTest, RejectsTruncatedFile) {
  save_safetensors(path("t.safetensors"), {{"w", ones({16})}});
  std::string bytes = read_file(path("t.safetensors"));
  EXPECT_TRUE(load_fails<ValueError>(path("t.safetensors"), bytes.substr(0, bytes.size() - 1),
                                     "tensor \"w\" has data_offsets [0, 64] past the end"));
}

TEST_F(IoTest, RejectsOverlappingRanges) {
  std::string h =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(h, std::string(12, 'x')),
                                     "overlapping tensor \"a\""));
  h = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(h, "abcd"), "overlapping"));
}

TEST_F(IoTest, RejectsIncompleteCoverageOfTheDataBuffer) {
  std::string gap =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(gap, std::string(12, 'x')),
                                     "belong to no tensor (a gap"));
  std::string trailing = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(trailing, std::string(8, 'x')),
                                     "trailing bytes"));
  std::string leading = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_TRUE(
      load_fails<ValueError>(path("f"), file_bytes(leading, std::string(8, 'x')), "bytes [0, 4)"));
}

TEST_F(IoTest, RejectsMetadataThatIsNotAStringMap) {
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(R"({"__metadata__":{"k":1}})", ""),
                                     "values must be strings"));
  EXPECT_TRUE(load_fails<ValueError>(path("f"), file_bytes(R"({"__metadata__":"x"})", ""),
                                     "not a JSON object"));
  write_file(path("g"), file_bytes(R"({"__metadata__":{"k":1}})", ""));
  EXPECT_THROW(load_safetensors_metadata(path("g")), ValueError);
}

TEST_F(IoTest, CorruptedAndTruncatedFilesNeverCrash) {
  save_safetensors(
      path("good"),
      {{"weight", ones({2, 3})}, {"bias", zeros({3}, kFloat16)}, {"flag", ones({1}, kBool)}},
      {{"k", "v"}});
  const std::string good = read_file(path("good"));
  int rejected = 0;
  for (size_t len = 0; len < good.size(); ++len) {  // every strict prefix is invalid
    write_file(path("cut"), good.substr(0, len));
    EXPECT_THROW(load_safetensors(path("cut")), Error) << len;
    ++rejected;
  }
  // Any single corrupted header byte either still loads or throws a kiln::Error.
  size_t header_end = 8;
  for (int i = 7; i >= 0; --i)
    header_end += static_cast<size_t>(static_cast<unsigned char>(good[i])) << (8 * i);
  for (size_t i = 0; i < header_end; ++i) {
    for (char c : {'9', '}', '\xff'}) {
      std::string bad = good;
      bad[i] = c;
      write_file(path("bad"), bad);
      try {
        load_safetensors(path("bad"));
      } catch (const Error&) {
        ++rejected;
      }
    }
  }
  EXPECT_GT(rejected, static_cast<int>(good.size()));
}

// ======================= DLPack =======================

namespace {
int g_deleted = 0;
void count_deletion(DLManagedTensor*) {
  ++g_deleted;
}
void count_deletion_versioned(DLManagedTensorVersioned*) {
  ++g_deleted;
}

// A DLManagedTensor describing `buffer` (owned by the test) whose deleter counts calls.
struct Producer {
  std::vector<float> buffer = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int64_t> shape = {2, 3};
  std::vector<int64_t> strides = {3, 1};
  DLManagedTensor managed{};
  Producer() {
    g_deleted = 0;
    managed.dl_tensor = {buffer.data(), {kDLCPU, 0},    2, {kDLFloat, 32, 1},
                         shape.data(),  strides.data(), 0};
    managed.deleter = &count_deletion;
  }
};
}  // namespace

TEST(DLPack, ExportDescribesTheTensorAndItsStrides) {
  Tensor base = tensor<float>({0, 1, 2, 3, 4, 5}).view({2, 3});
  Tensor tr = base.t();
  DLManagedTensor* m = to_dlpack(tr);
  const DLTensor& dl = m->dl_tensor;
  EXPECT_EQ(dl.ndim, 2);
  EXPECT_EQ(std::vector<int64_t>(dl.shape, dl.shape + 2), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(std::vector<int64_t>(dl.strides, dl.strides + 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(dl.device.device_type, kDLCPU);
  EXPECT_EQ(dl.device.device_id, 0);
  EXPECT_EQ(dl.dtype.code, kDLFloat);
  EXPECT_EQ(dl.dtype.bits, 32);
  EXPECT_EQ(dl.dtype.lanes, 1);
  EXPECT_EQ(dl.byte_offset, 0u);
  EXPECT_EQ(dl.data, base.raw_data_ptr());
  m->deleter(m);

  Tensor sliced = base.select(0, 1);  // storage offset 3: data points at element 0 of the view
  m = to_dlpack(sliced);
  EXPECT_EQ(static_cast<float*>(m->dl_tensor.data)[0], 3.f);
  m->deleter(m);
}

TEST(DLPack, ExportMapsEveryDtype) {
  const std::vector<std::tuple<DType, int, int>> cases = {
      {kBool, kDLBool, 8},        {kUInt8, kDLUInt, 8},     {kInt8, kDLInt, 8},
      {kInt32, kDLInt, 32},       {kInt64, kDLInt, 64},     {kFloat16, kDLFloat, 16},
      {kBFloat16, kDLBfloat, 16}, {kFloat32, kDLFloat, 32}, {kFloat64, kDLFloat, 64}};
  for (auto [dtype, code, bits] : cases) {
    Tensor t = ones({2}, dtype);
    DLManagedTensor* m = to_dlpack(t);
    EXPECT_EQ(m->dl_tensor.dtype.code, code) << dtype_name(dtype);
    EXPECT_EQ(m->dl_tensor.dtype.bits, bits) << dtype_name(dtype);
    Tensor back = from_dlpack(m);  // and every dtype imports back to itself
    EXPECT_EQ(back.dtype(), dtype);
    EXPECT_EQ(raw(back), raw(t));
  }
}

TEST(DLPack, RoundTripSharesMemoryBothWays) {
  Tensor a = tensor<double>({1, 2, 3, 4, 5, 6}).view({2, 3});
  Tensor b = from_dlpack(to_dlpack(a.t()));
  EXPECT_EQ(b.sizes().vec(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(b.raw_data_ptr(), a.raw_data_ptr());
  b.select(0, 1).fill_(-1.0);  // b[1, :] is a[:, 1]
  EXPECT_TRUE(kiln::testing::matches(a, {2, 3}, {1, -1, 3, 4, -1, 6}));
  a.select(0, 0).fill_(9.0);
  EXPECT_TRUE(kiln::testing::matches(b, {3, 2}, {9, 4, 9, -1, 9, 6}));
}

TEST(DLPack, ExportKeepsTheStorageAliveUntilTheDeleterRuns) {
  DLManagedTensor* m = nullptr;
  {
    Tensor t = full({1000}, 4.0f);
    m = to_dlpack(t);
  }
  const float* p = static_cast<const float*>(m->dl_tensor.data);
  EXPECT_EQ(p[0], 4.f);
  EXPECT_EQ(p[999], 4.f);
  m->deleter(m);
}

TEST(DLPack, ImportCallsTheDeleterOnceWhenTheLastViewDies) {
  Producer prod;
  Tensor t = from_dlpack(&prod.managed);
  Tensor view = t.select(1, 2);
  t = Tensor();
  EXPECT_EQ(g_deleted, 0);
  EXPECT_TRUE(kiln::testing::matches(view, {2}, {2, 5}));
  view.fill_(42.0f);  // writes land in the producer's buffer
  EXPECT_EQ(prod.buffer[2], 42.f);
  EXPECT_EQ(prod.buffer[5], 42.f);
  prod.buffer[2] = -7.f;  // and the producer's writes are visible
  EXPECT_TRUE(kiln::testing::matches(view, {2}, {-7, 42}));
  view = Tensor();
  EXPECT_EQ(g_deleted, 1);
}

TEST(DLPack, ImportHonoursNullStridesByteOffsetAndStrides) {
  Producer prod;
  prod.managed.dl_tensor.strides = nullptr;  // row-major
  prod.managed.dl_tensor.byte_offset = 2 * sizeof(float);
  {
    Tensor t = from_dlpack(&prod.managed);
    EXPECT_TRUE(kiln::testing::matches(t, {2, 3}, {2, 3, 4, 5, 6, 7}));
    EXPECT_TRUE(t.is_contiguous());
  }
  EXPECT_EQ(g_deleted, 1);

  Producer col;
  col.shape = {3, 2};
  col.strides = {1, 3};  // column-major view of the first six floats
  col.managed.dl_tensor.shape = col.shape.data();
  col.managed.dl_tensor.strides = col.strides.data();
  Tensor t = from_dlpack(&col.managed);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_TRUE(kiln::testing::matches(t, {3, 2}, {0, 3, 1, 4, 2, 5}));
}

TEST(DLPack, ImportAcceptsANullDeleter) {
  Producer prod;
  prod.managed.deleter = nullptr;
  {
    Tensor t = from_dlpack(&prod.managed);
    EXPECT_EQ(t.numel(), 6);
  }
  EXPECT_EQ(g_deleted, 0);
}

TEST(DLPack, ZeroDimAndEmptyTensorsRoundTrip) {
  Tensor s = scalar_tensor(int64_t{7});
  Tensor s2 = from_dlpack(to_dlpack(s));
  EXPECT_EQ(s2.dim(), 0);
  EXPECT_EQ(s2.item<int64_t>(), 7);
  Tensor e = zeros({0, 3});
  Tensor e2 = from_dlpack(to_dlpack(e));
  EXPECT_EQ(e2.sizes().vec(), (std::vector<int64_t>{0, 3}));
}

TEST(DLPack, VersionedRoundTripAndDeleter) {
  Tensor a = tensor<int32_t>({1, 2, 3});
  DLManagedTensorVersioned* m = to_dlpack_versioned(a);
  EXPECT_EQ(m->version.major, 1u);
  EXPECT_EQ(m->version.minor, 0u);
  EXPECT_EQ(m->flags, 0u);
  Tensor b = from_dlpack(m);
  b.fill_(5);
  EXPECT_TRUE(kiln::testing::matches(a, {3}, {5, 5, 5}));

  std::vector<float> buffer = {1, 2};
  int64_t shape[1] = {2};
  DLManagedTensorVersioned v{};
  v.version = {1, 3};  // a newer minor version is compatible
  v.deleter = &count_deletion_versioned;
  v.dl_tensor = {buffer.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0};
  g_deleted = 0;
  {
    Tensor t = from_dlpack(&v);
    EXPECT_TRUE(kiln::testing::matches(t, {2}, {1, 2}));
  }
  EXPECT_EQ(g_deleted, 1);

  g_deleted = 0;
  v.version = {2, 0};
  EXPECT_THROW(from_dlpack(&v), ValueError);
  v.version = {1, 0};
  v.flags = DLPACK_FLAG_BITMASK_READ_ONLY;
  EXPECT_THROW(from_dlpack(&v), ValueError);
  EXPECT_EQ(g_deleted, 0);  // on failure the caller keeps ownership
}

TEST(DLPack, ExportRejectsTensorsRequiringGradAndUndefinedTensors) {
  Tensor w = ones({2});
  w.requires_grad_();
  EXPECT_THROW(to_dlpack(w), ValueError);
  EXPECT_THROW(to_dlpack_versioned(w), ValueError);
  EXPECT_THROW(to_dlpack(Tensor()), ValueError);
}

TEST(DLPack, ImportRejectsUnsupportedTensorsAndKeepsOwnershipWithTheCaller) {
  EXPECT_THROW(from_dlpack(static_cast<DLManagedTensor*>(nullptr)), ValueError);
  EXPECT_THROW(from_dlpack(static_cast<DLManagedTensorVersioned*>(nullptr)), ValueError);

  auto rejects = [](auto mutate) {
    Producer prod;
    mutate(prod);
    try {
      from_dlpack(&prod.managed);
    } catch (const Error& e) {
      EXPECT_EQ(g_deleted, 0) << e.what();
      EXPECT_NE(std::string(e.what()).find("[kiln::from_dlpack]"), std::string::npos);
      throw;
    }
  };
  EXPECT_THROW(rejects([](Producer& p) { p.managed.dl_tensor.dtype.lanes = 4; }), DTypeError);
  EXPECT_THROW(rejects([](Producer& p) {
                 p.managed.dl_tensor.dtype = {kDLComplex, 64, 1};
               }),
               DTypeError);
  EXPECT_THROW(rejects([](Producer& p) {
                 p.managed.dl_tensor.dtype = {kDLInt, 16, 1};
               }),
               DTypeError);
  EXPECT_THROW(rejects([](Producer& p) {
                 p.managed.dl_tensor.dtype = {kDLBool, 1, 1};
               }),
               DTypeError);
  EXPECT_THROW(rejects([](Producer& p) {
                 p.managed.dl_tensor.device = {kDLOpenCL, 0};
               }),
               DeviceError);
  EXPECT_THROW(rejects([](Producer& p) {
                 p.managed.dl_tensor.device = {kDLCUDA, 99};
               }),
               DeviceError);
  EXPECT_THROW(rejects([](Producer& p) { p.strides = {3, -1}; }), ValueError);
  EXPECT_THROW(rejects([](Producer& p) { p.shape = {2, -3}; }), ValueError);
  EXPECT_THROW(rejects([](Producer& p) { p.managed.dl_tensor.ndim = -1; }), ValueError);
  EXPECT_THROW(rejects([](Producer& p) { p.managed.dl_tensor.shape = nullptr; }), ValueError);
  EXPECT_THROW(rejects([](Producer& p) { p.managed.dl_tensor.data = nullptr; }), ValueError);
  EXPECT_THROW(rejects([](Producer& p) { p.managed.dl_tensor.byte_offset = 1; }),
               ValueError);  // misaligned
  EXPECT_THROW(rejects([](Producer& p) { p.shape = {INT64_MAX, 2}; }), ValueError);
  EXPECT_THROW(rejects([](Producer& p) { p.strides = {INT64_MAX / 2, 1}; }), ValueError);
}
