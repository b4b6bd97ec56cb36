#pragma once
/// \file safetensors.h
/// Our own reader and writer of the safetensors format, for layer traces and the tools' output
/// files (TRACE_FORMAT.md): an 8-byte little-endian header length, a JSON header mapping each
/// tensor name to {dtype, shape, data_offsets} (plus an optional "__metadata__" map of
/// strings), then the raw little-endian row-major data, offsets relative to its start.
///
/// The reader validates the whole file before it returns anything: every problem is one
/// Status with a one-line message (kIoError for a file that is not valid safetensors,
/// including one with bytes after its last tensor's data, which the reference implementation
/// refuses too; kInvalidArgument for a valid file holding a dtype we do not take). Messages
/// quote what the file holds only through printable_excerpt. Floating-point tensors
/// (F32, F16, BF16, F64) are accepted; convert them with to_f32() / to_f64().

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "replayssm/status.h"

namespace replayssm {

/// The safetensors dtypes this library reads and writes.
enum class SafetensorsDType : std::uint8_t { kF32, kF64, kF16, kBF16 };

const char* safetensors_dtype_name(SafetensorsDType dtype);  ///< "F32", "F64", "F16", "BF16"
std::size_t safetensors_dtype_size(SafetensorsDType dtype);

struct SafetensorsTensor {
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<std::int64_t> shape;  ///< empty for a scalar
  std::vector<std::uint8_t> data;   ///< raw little-endian bytes: numel() × dtype size

  [[nodiscard]] std::int64_t numel() const;
  /// The values as fp32: exact for F32, F16 and BF16; F64 rounds to nearest.
  [[nodiscard]] std::vector<float> to_f32() const;
  /// The values as fp64 (always exact).
  [[nodiscard]] std::vector<double> to_f64() const;
};

/// An F32 (or F64) tensor holding `values`, which must have the shape's element count.
SafetensorsTensor safetensors_tensor_f32(std::vector<std::int64_t> shape,
                                         std::span<const float> values);
SafetensorsTensor safetensors_tensor_f64(std::vector<std::int64_t> shape,
                                         std::span<const double> values);

struct SafetensorsFile {
  std::map<std::string, SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;  ///< the header's "__metadata__"

  /// The tensor called `name`, or nullptr.
  [[nodiscard]] const SafetensorsTensor* find(const std::string& name) const;
};

/// Largest header the reader accepts: a real header is a few kB; anything near this size is
/// a corrupt length field, and refusing it avoids a huge allocation.
constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// Parses and validates a whole file held in memory.
Status safetensors_parse(std::span<const std::uint8_t> bytes, SafetensorsFile* out);
/// Reads and parses `path`; messages start with the path.
Status safetensors_read(const std::string& path, SafetensorsFile* out);

/// `text` with every byte outside printable ASCII written as \xNN, cut to at most `max_chars`
/// characters (then "..." follows): how error messages quote anything read from a file.
std::string printable_excerpt(std::string_view text, std::size_t max_chars = 64);

/// Serialises tensors (in name order) and metadata; the header is padded with spaces so that
/// the data starts 8-byte aligned, as the reference implementation does.
Status safetensors_serialize(const SafetensorsFile& file, std::vector<std::uint8_t>* out);
/// Writes through output_file_write: a failed write leaves no file (or the old one) behind.
Status safetensors_write(const std::string& path, const SafetensorsFile& file);

}  // namespace replayssm
