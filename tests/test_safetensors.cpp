// The safetensors reader and writer: round trips, dtype conversion, and a clean one-line
// error (never a crash) for each way a file can be malformed.

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "io/output_file.h"
#include "io/safetensors.h"

namespace replayssm {
namespace {

// Every character printable ASCII: what error messages may send to a terminal.
bool printable(const std::string& text) {
  for (const char c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) return false;
  }
  return true;
}

// A file built by hand: 8-byte length, the header text as given, then `data_bytes` bytes.
std::vector<std::uint8_t> raw_file(const std::string& header, std::size_t data_bytes,
                                   std::uint64_t claimed_length) {
  std::vector<std::uint8_t> bytes(8 + header.size() + data_bytes, 0);
  std::memcpy(bytes.data(), &claimed_length, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}
std::vector<std::uint8_t> raw_file(const std::string& header, std::size_t data_bytes) {
  return raw_file(header, data_bytes, header.size());
}

// Parses and expects a failure with `code` whose one-line message contains `needle`.
void expect_parse_error(const std::vector<std::uint8_t>& bytes, StatusCode code,
                        const std::string& needle) {
  SafetensorsFile file;
  const Status s = safetensors_parse(bytes, &file);
  ASSERT_FALSE(s.is_ok()) << "expected an error containing '" << needle << "'";
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << "not one line: " << s.to_string();
}

SafetensorsFile sample_file() {
  SafetensorsFile file;
  const std::vector<float> a = {1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<double> b = {0.1, -1e300, 3.0};
  file.tensors["a"] = safetensors_tensor_f32({2, 3}, a);
  file.tensors["b"] = safetensors_tensor_f64({3}, b);
  file.tensors["empty"] = safetensors_tensor_f32({0, 4}, std::span<const float>{});
  file.metadata["layer"] = "mamba2";
  file.metadata["note"] = "a \"quoted\" value";
  return file;
}

TEST(Safetensors, RoundTripInMemory) {
  const SafetensorsFile file = sample_file();
  std::vector<std::uint8_t> bytes;
  ASSERT_TRUE(safetensors_serialize(file, &bytes).is_ok());
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  EXPECT_EQ((8 + header_bytes) % 8, 0u) << "data should start 8-byte aligned";

  SafetensorsFile back;
  const Status s = safetensors_parse(bytes, &back);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(back.metadata, file.metadata);
  ASSERT_EQ(back.tensors.size(), 3u);
  for (const auto& [name, t] : file.tensors) {
    const SafetensorsTensor* r = back.find(name);
    ASSERT_NE(r, nullptr) << name;
    EXPECT_EQ(r->dtype, t.dtype) << name;
    EXPECT_EQ(r->shape, t.shape) << name;
    EXPECT_EQ(r->data, t.data) << name;  // bit-exact
  }
  EXPECT_EQ(back.find("b")->to_f64(), (std::vector<double>{0.1, -1e300, 3.0}));
  EXPECT_EQ(back.find("missing"), nullptr);
}

TEST(Safetensors, RoundTripThroughDisk) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "replayssm_test_roundtrip.safetensors").string();
  const SafetensorsFile file = sample_file();
  ASSERT_TRUE(safetensors_write(path, file).is_ok());
  SafetensorsFile back;
  const Status s = safetensors_read(path, &back);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(back.find("a")->to_f32(), file.find("a")->to_f32());
  EXPECT_EQ(back.metadata, file.metadata);
  std::filesystem::remove(path);
}

TEST(Safetensors, ConvertsHalfPrecisionAndDoubleOnRead) {
  // F16 and BF16 encodings of 1.0, -2.0 and 0.5, built bit by bit.
  const std::uint16_t f16[3] = {0x3c00, 0xc000, 0x3800};
  const std::uint16_t bf16[3] = {0x3f80, 0xc000, 0x3f00};
  const double f64[3] = {1.0, -2.0, 0.1};
  const std::string header = R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
                             R"("bh":{"dtype":"BF16","shape":[3],"data_offsets":[6,12]},)"
                             R"("d":{"dtype":"F64","shape":[3],"data_offsets":[12,36]}})";
  std::vector<std::uint8_t> bytes = raw_file(header, 0);
  const auto append = [&bytes](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  };
  append(f16, sizeof f16);
  append(bf16, sizeof bf16);
  append(f64, sizeof f64);

  SafetensorsFile file;
  const Status s = safetensors_parse(bytes, &file);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(file.find("h")->to_f32(), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  EXPECT_EQ(file.find("bh")->to_f32(), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  EXPECT_EQ(file.find("d")->to_f32(), (std::vector<float>{1.0f, -2.0f, 0.1f}));
  EXPECT_EQ(file.find("d")->to_f64(), (std::vector<double>{1.0, -2.0, 0.1}));
}

TEST(Safetensors, TruncatedFile) {
  expect_parse_error({1, 2, 3}, StatusCode::kIoError, "too short");
  // Header length promises more than the file holds.
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expect_parse_error(raw_file(header, 8, header.size() + 100), StatusCode::kIoError, "exceeds");
  // Header fine, data cut short.
  expect_parse_error(raw_file(header, 5), StatusCode::kIoError, "run past the data");
}

TEST(Safetensors, TruncatedFileOnDisk) {
  SafetensorsFile file = sample_file();
  std::vector<std::uint8_t> bytes;
  ASSERT_TRUE(safetensors_serialize(file, &bytes).is_ok());
  const std::string path =
      (std::filesystem::temp_directory_path() / "replayssm_test_truncated.safetensors").string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(bytes.data(), 1, bytes.size() - 3, f);
  std::fclose(f);
  SafetensorsFile back;
  const Status s = safetensors_read(path, &back);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << "message should name the file";
  std::filesystem::remove(path);
}

TEST(Safetensors, MissingFile) {
  SafetensorsFile file;
  const Status s = safetensors_read("no/such/file.safetensors", &file);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("cannot open"), std::string::npos) << s.to_string();
}

TEST(Safetensors, AbsurdHeaderLength) {
  expect_parse_error(raw_file("{}", 0, std::uint64_t{1} << 40), StatusCode::kIoError, "absurd");
  expect_parse_error(raw_file("{}", 0, ~std::uint64_t{0}), StatusCode::kIoError, "absurd");
}

TEST(Safetensors, InvalidJson) {
  expect_parse_error(raw_file(R"({"a": {"dtype": "F32",)", 0), StatusCode::kIoError,
                     "invalid JSON");
  expect_parse_error(raw_file("[1, 2]", 0), StatusCode::kIoError, "not an object");
  expect_parse_error(raw_file(R"({"a": 3})", 0), StatusCode::kIoError, "not an object");
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[1]}})", 4), StatusCode::kIoError,
                     "missing field 'data_offsets'");
  expect_parse_error(raw_file(R"({"__metadata__":{"k":1}})", 0), StatusCode::kIoError,
                     "not a string");
}

TEST(Safetensors, WrongDataOffsets) {
  // Span does not match shape × dtype size.
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                     StatusCode::kIoError, "needs 12");
  // End before begin, and not a pair.
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 8),
                     StatusCode::kIoError, "begin <= end");
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 8),
                     StatusCode::kIoError, "begin <= end");
  // Negative offset.
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 8),
                     StatusCode::kIoError, "not an integer");
  // Overlapping tensors.
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              12),
                     StatusCode::kIoError, "overlapping");
}

TEST(Safetensors, ShapeSizeMismatch) {
  expect_parse_error(raw_file(R"({"a":{"dtype":"F64","shape":[2,2],"data_offsets":[0,16]}})", 16),
                     StatusCode::kIoError, "needs 32");
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
                     StatusCode::kIoError, "not an integer");
  // A product that would overflow 64 bits must not wrap around to a small size.
  expect_parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[1099511627776,1099511627776],)"
                              R"("data_offsets":[0,0]}})",
                              0),
                     StatusCode::kIoError, "too many elements");
}

TEST(Safetensors, WrongDtype) {
  expect_parse_error(raw_file(R"({"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})", 4),
                     StatusCode::kInvalidArgument, "accepted: F32, F16, BF16, F64");
  expect_parse_error(raw_file(R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4),
                     StatusCode::kIoError, "unknown dtype 'F33'");
  expect_parse_error(raw_file(R"({"a":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", 4),
                     StatusCode::kIoError, "dtype is not a string");
}

TEST(Safetensors, WriterRejectsInconsistentTensors) {
  SafetensorsFile file;
  SafetensorsTensor t = safetensors_tensor_f32({2}, std::vector<float>{1.0f, 2.0f});
  t.shape = {3};
  file.tensors["bad"] = t;
  std::vector<std::uint8_t> bytes;
  const Status s = safetensors_serialize(file, &bytes);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

TEST(Safetensors, TrailingBytesAreRefused) {
  // The reference implementation refuses data past the last tensor's end; so do we.
  std::vector<std::uint8_t> bytes;
  ASSERT_TRUE(safetensors_serialize(sample_file(), &bytes).is_ok());
  SafetensorsFile file;
  ASSERT_TRUE(safetensors_parse(bytes, &file).is_ok());
  bytes.push_back(0);
  expect_parse_error(bytes, StatusCode::kIoError, "1 byte follows the end of the tensors' data");
  bytes.insert(bytes.end(), {1, 2, 3});
  expect_parse_error(bytes, StatusCode::kIoError, "4 bytes follow");
  // A header without tensors is followed by no data at all.
  expect_parse_error(raw_file("{}", 3), StatusCode::kIoError, "3 bytes follow");
  EXPECT_TRUE(safetensors_parse(raw_file("{}", 0), &file).is_ok());
}

TEST(Safetensors, ErrorsQuoteNoRawBytesFromTheFile) {
  SafetensorsFile file;
  // Invalid JSON holding an escape sequence, invalid UTF-8 and a long run of bytes.
  const std::string garbage = "{\"a\": \x1b[31m\xff\xfe" + std::string(5000, 'x');
  Status s = safetensors_parse(raw_file(garbage, 0), &file);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("invalid JSON header"), std::string::npos) << s.message();
  EXPECT_TRUE(printable(s.message())) << s.message();
  EXPECT_LT(s.message().size(), 200u) << s.message();
  // Valid JSON: a tensor name holding an escape sequence (JSON's \u001b), with a bad field.
  s = safetensors_parse(
      raw_file(R"({"\u001b[2Jname":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4),
      &file);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("'\\x1b[2Jname'"), std::string::npos) << s.message();
  EXPECT_TRUE(printable(s.message())) << s.message();
  // A name too long to quote whole, and a long offsets array.
  s = safetensors_parse(raw_file("{\"" + std::string(1000, 'n') +
                                     R"(":{"dtype":"F32","shape":[1],"data_offsets":[)" +
                                     std::string(2000, '1') + "]}}",
                                 4),
                        &file);
  ASSERT_FALSE(s.is_ok());
  EXPECT_LT(s.message().size(), 300u) << s.message();
}

TEST(Safetensors, PrintableExcerpt) {
  EXPECT_EQ(printable_excerpt("abc"), "abc");
  EXPECT_EQ(printable_excerpt(std::string("a\x1b\n\xff", 4)), "a\\x1b\\x0a\\xff");
  EXPECT_EQ(printable_excerpt(std::string(100, 'z'), 10), std::string(10, 'z') + "...");
  // An escape is never cut in half.
  EXPECT_EQ(printable_excerpt("abcdefghi\x01", 11), "abcdefghi...");
}

// ---------------------------------------------------------------------------------------------
// Output files: a failed write leaves no file behind (or the old one untouched).

// An empty directory of its own under the system's temporary directory.
std::filesystem::path scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    (std::string("replayssm_") + info->name() + "_" +
                                     std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

bool empty_dir(const std::filesystem::path& dir) {
  return std::filesystem::directory_iterator(dir) == std::filesystem::directory_iterator();
}

SafetensorsFile file_of_bytes(std::size_t floats) {
  SafetensorsFile file;
  const std::vector<float> values(floats, 1.5f);
  file.tensors["t"] = safetensors_tensor_f32({static_cast<std::int64_t>(floats)}, values);
  return file;
}

// Runs `write` with the process's file size limit at `limit` bytes (ulimit -f): past it, a
// write fails with EFBIG, as it would on a full disk.
template <typename Write>
Status with_file_size_limit(rlim_t limit, Write write) {
  rlimit old{};
  getrlimit(RLIMIT_FSIZE, &old);
  rlimit low = old;
  low.rlim_cur = limit;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  EXPECT_EQ(setrlimit(RLIMIT_FSIZE, &low), 0);
  const Status s = write();
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  return s;
}

TEST(OutputFile, FailedWriteLeavesNoFile) {
  const std::filesystem::path dir = scratch_dir();
  const std::string path = (dir / "out.safetensors").string();
  const Status s = with_file_size_limit(
      4096, [&] { return safetensors_write(path, file_of_bytes(16384)); });
  ASSERT_FALSE(s.is_ok()) << "the write should have failed past the size limit";
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(empty_dir(dir)) << "the temporary file was left behind";
  std::filesystem::remove_all(dir);
}

TEST(OutputFile, FailedWriteKeepsTheOldFile) {
  const std::filesystem::path dir = scratch_dir();
  const std::string path = (dir / "out.safetensors").string();
  ASSERT_TRUE(safetensors_write(path, file_of_bytes(4)).is_ok());
  const Status s = with_file_size_limit(
      4096, [&] { return safetensors_write(path, file_of_bytes(16384)); });
  ASSERT_FALSE(s.is_ok());
  SafetensorsFile back;
  ASSERT_TRUE(safetensors_read(path, &back).is_ok());
  EXPECT_EQ(back.find("t")->numel(), 4) << "the old file was replaced";
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);
  std::filesystem::remove_all(dir);
}

TEST(OutputFile, DirectoryGoneBeforeTheWrite) {
  const std::filesystem::path dir = scratch_dir();
  const std::string path = (dir / "out.safetensors").string();
  ASSERT_TRUE(output_file_check(path).is_ok());
  EXPECT_TRUE(empty_dir(dir)) << "the check must leave nothing behind";
  std::filesystem::remove_all(dir);
  const Status s = safetensors_write(path, file_of_bytes(16));
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("cannot create"), std::string::npos) << s.message();
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(OutputFile, RefusesADirectory) {
  const std::filesystem::path dir = scratch_dir();
  for (const Status& s : {output_file_check(dir.string()),
                          safetensors_write(dir.string(), file_of_bytes(4))}) {
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("is a directory"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(empty_dir(dir));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace replayssm
