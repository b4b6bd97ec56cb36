// safetensors reader and writer. nlohmann-json parses the header; its exceptions are caught
// here and become Status, so nothing throws across this file's functions.

#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/numeric.h"
#include "io/output_file.h"

namespace replayssm {

// The data is little-endian on file and copied as is.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace {

using json = nlohmann::json;

constexpr std::size_t kLengthBytes = 8;  // the u64 header length in front of the JSON
constexpr std::size_t kReasonChars = 120;  // the JSON parser's reason, at most

struct DTypeInfo {
  const char* name;
  SafetensorsDType dtype;
};
// The accepted dtypes, in the order of the error text.
constexpr std::array<DTypeInfo, 4> kAcceptedDTypes = {{{"F32", SafetensorsDType::kF32},
                                                       {"F16", SafetensorsDType::kF16},
                                                       {"BF16", SafetensorsDType::kBF16},
                                                       {"F64", SafetensorsDType::kF64}}};
// Dtypes the format defines that we do not take: a different error than an unknown name.
constexpr std::array<const char*, 13> kOtherFormatDTypes = {
    "BOOL", "U8",  "I8",      "U16",     "I16",     "U32", "I32",
    "U64",  "I64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"};

Status io_error(std::string message) { return {StatusCode::kIoError, std::move(message)}; }

Status out_of_memory(std::size_t file_bytes) {
  return {StatusCode::kOutOfMemory,
          "not enough host memory for a " + std::to_string(file_bytes) + "-byte file"};
}

// Names, keys and values from a file are quoted through printable_excerpt: a corrupt header
// must not send raw bytes (escape sequences) to a terminal, nor a megabyte to a log line.
std::string quoted(const std::string& name) {
  std::string text = "'";  // appended, not "'" + ...: GCC 12 warns (-Wrestrict) on that form
  text += printable_excerpt(name);
  return text + "'";
}
std::string excerpt(const json& value) { return printable_excerpt(value.dump(-1, ' ', true)); }

std::string accepted_dtypes_text() {
  std::string text;
  for (const DTypeInfo& info : kAcceptedDTypes) {
    if (!text.empty()) text += ", ";
    text += info.name;
  }
  return text;
}

Status parse_dtype(const std::string& tensor, const json& value, SafetensorsDType* out) {
  if (!value.is_string()) return io_error("tensor " + quoted(tensor) + ": dtype is not a string");
  const auto& text = value.get_ref<const std::string&>();
  for (const DTypeInfo& info : kAcceptedDTypes) {
    if (text == info.name) {
      *out = info.dtype;
      return Status::ok();
    }
  }
  if (std::find(kOtherFormatDTypes.begin(), kOtherFormatDTypes.end(), text) !=
      kOtherFormatDTypes.end()) {
    return invalid_argument("tensor " + quoted(tensor) + " has dtype " + text +
                            "; accepted: " + accepted_dtypes_text());
  }
  return io_error("tensor " + quoted(tensor) + " has unknown dtype " + quoted(text));
}

// A JSON array of non-negative integers, each <= limit.
Status parse_uint_array(const std::string& tensor, const char* field, const json& value,
                        std::uint64_t limit, std::vector<std::uint64_t>* out) {
  if (!value.is_array()) {
    return io_error("tensor " + quoted(tensor) + ": " + field + " is not an array");
  }
  out->clear();
  for (const json& item : value) {
    if (!item.is_number_unsigned() || item.get<std::uint64_t>() > limit) {
      return io_error("tensor " + quoted(tensor) + ": " + field + " holds " + excerpt(item) +
                      ", not an integer in [0, " + std::to_string(limit) + "]");
    }
    out->push_back(item.get<std::uint64_t>());
  }
  return Status::ok();
}

struct Entry {
  std::string name;
  SafetensorsTensor tensor;  // data not yet copied
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

Status parse_entry(const std::string& name, const json& value, std::uint64_t data_bytes,
                   Entry* entry) {
  if (!value.is_object()) return io_error("tensor " + quoted(name) + ": entry is not an object");
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return io_error("tensor " + quoted(name) + ": unexpected field " + quoted(key));
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) {
      return io_error("tensor " + quoted(name) + ": missing field " + quoted(field));
    }
  }
  entry->name = name;
  REPLAYSSM_RETURN_IF_ERROR(parse_dtype(name, value["dtype"], &entry->tensor.dtype));

  // Dimensions up to 2^40 and their product up to 2^56 elements keep every byte count below
  // 2^59: no overflow in the size check below, whatever the file claims.
  constexpr std::uint64_t kMaxDim = std::uint64_t{1} << 40;
  constexpr std::uint64_t kMaxElems = std::uint64_t{1} << 56;
  std::vector<std::uint64_t> dims;
  REPLAYSSM_RETURN_IF_ERROR(parse_uint_array(name, "shape", value["shape"], kMaxDim, &dims));
  std::uint64_t numel = 1;
  for (std::uint64_t d : dims) {
    if (d != 0 && numel > kMaxElems / d) {
      return io_error("tensor " + quoted(name) + ": shape has too many elements");
    }
    numel *= d;
    entry->tensor.shape.push_back(static_cast<std::int64_t>(d));
  }

  std::vector<std::uint64_t> offsets;
  REPLAYSSM_RETURN_IF_ERROR(parse_uint_array(name, "data_offsets", value["data_offsets"],
                                             std::numeric_limits<std::uint64_t>::max(), &offsets));
  if (offsets.size() != 2 || offsets[0] > offsets[1]) {
    return io_error("tensor " + quoted(name) + ": data_offsets " +
                    excerpt(value["data_offsets"]) + " is not [begin, end] with begin <= end");
  }
  entry->begin = offsets[0];
  entry->end = offsets[1];
  if (entry->end > data_bytes) {
    return io_error("tensor " + quoted(name) + ": data_offsets " +
                    excerpt(value["data_offsets"]) + " run past the data (" +
                    std::to_string(data_bytes) + " bytes; truncated file?)");
  }
  const std::uint64_t expected = numel * safetensors_dtype_size(entry->tensor.dtype);
  if (entry->end - entry->begin != expected) {
    return io_error("tensor " + quoted(name) + ": data_offsets span " +
                    std::to_string(entry->end - entry->begin) + " bytes but shape " +
                    excerpt(value["shape"]) + " of " + safetensors_dtype_name(entry->tensor.dtype) +
                    " needs " + std::to_string(expected));
  }
  return Status::ok();
}

Status parse_metadata(const json& value, std::map<std::string, std::string>* out) {
  if (!value.is_object()) return io_error("__metadata__ is not an object");
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return io_error("__metadata__ value of " + quoted(key) + " is not a string");
    }
    (*out)[key] = item.get<std::string>();
  }
  return Status::ok();
}

// The header and entries of a file; throws nlohmann exceptions only through json::parse,
// which the caller catches.
Status parse_header(std::span<const std::uint8_t> bytes, SafetensorsFile* file,
                    std::vector<Entry>* entries, std::uint64_t* data_start) {
  if (bytes.size() < kLengthBytes) {
    return io_error("file too short (" + std::to_string(bytes.size()) +
                    " bytes): a safetensors file starts with an 8-byte header length");
  }
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), kLengthBytes);
  if (header_bytes > kSafetensorsMaxHeaderBytes) {
    return io_error("header length " + std::to_string(header_bytes) + " is absurd (limit " +
                    std::to_string(kSafetensorsMaxHeaderBytes) + " bytes)");
  }
  const std::uint64_t after_length = bytes.size() - kLengthBytes;
  if (header_bytes > after_length) {
    return io_error("header length " + std::to_string(header_bytes) + " exceeds the " +
                    std::to_string(after_length) + " bytes that follow it (truncated file?)");
  }
  const auto* text = reinterpret_cast<const char*>(bytes.data() + kLengthBytes);
  json header;
  try {
    header = json::parse(text, text + header_bytes);
  } catch (const json::exception& e) {
    // e.what() quotes the bytes last read, which may be anything the file holds.
    std::string reason = e.what();
    if (const std::size_t tag_end = reason.find("] "); reason.rfind("[json.", 0) == 0 &&
                                                      tag_end != std::string::npos) {
      reason.erase(0, tag_end + 2);
    }
    return io_error("invalid JSON header: " + printable_excerpt(reason, kReasonChars));
  }
  if (!header.is_object()) return io_error("JSON header is not an object");

  *data_start = kLengthBytes + header_bytes;
  const std::uint64_t data_bytes = bytes.size() - *data_start;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      REPLAYSSM_RETURN_IF_ERROR(parse_metadata(value, &file->metadata));
      continue;
    }
    Entry entry;
    REPLAYSSM_RETURN_IF_ERROR(parse_entry(name, value, data_bytes, &entry));
    entries->push_back(std::move(entry));
  }

  // The data ends where the last tensor ends, as the reference implementation requires:
  // bytes past it are a damaged file (two files run together, a header rewritten shorter),
  // and accepting them would take a file other readers refuse.
  std::uint64_t data_end = 0;
  for (const Entry& e : *entries) data_end = std::max(data_end, e.end);
  if (data_end != data_bytes) {
    const std::uint64_t extra = data_bytes - data_end;
    return io_error(std::to_string(extra) + (extra == 1 ? " byte follows" : " bytes follow") +
                    " the end of the tensors' data (byte " +
                    std::to_string(*data_start + data_end) + " of " +
                    std::to_string(bytes.size()) +
                    "); a safetensors file ends with its last tensor");
  }

  // No two tensors may share bytes (gaps are harmless and allowed).
  std::vector<const Entry*> by_offset;
  for (const Entry& e : *entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      return io_error("tensors " + quoted(by_offset[i - 1]->name) + " and " +
                      quoted(by_offset[i]->name) + " have overlapping data_offsets");
    }
  }
  return Status::ok();
}

template <typename Out>
std::vector<Out> convert(const SafetensorsTensor& t) {
  const std::size_t n = static_cast<std::size_t>(t.numel());
  std::vector<Out> out(n);
  const std::uint8_t* src = t.data.data();
  // Element-wise memcpy: the data of a tensor need not be aligned for its dtype.
  auto load = [src]<typename T>(std::size_t i, T* value) {
    std::memcpy(value, src + i * sizeof(T), sizeof(T));
  };
  switch (t.dtype) {
    case SafetensorsDType::kF32:
      for (std::size_t i = 0; i < n; ++i) {
        float v;
        load(i, &v);
        out[i] = static_cast<Out>(v);
      }
      break;
    case SafetensorsDType::kF64:
      for (std::size_t i = 0; i < n; ++i) {
        double v;
        load(i, &v);
        out[i] = static_cast<Out>(v);
      }
      break;
    case SafetensorsDType::kF16:
      for (std::size_t i = 0; i < n; ++i) {
        f16_t v;
        load(i, &v);
        out[i] = static_cast<Out>(to_float(v));
      }
      break;
    case SafetensorsDType::kBF16:
      for (std::size_t i = 0; i < n; ++i) {
        bf16_t v;
        load(i, &v);
        out[i] = static_cast<Out>(to_float(v));
      }
      break;
  }
  return out;
}

template <typename T>
SafetensorsTensor make_tensor(SafetensorsDType dtype, std::vector<std::int64_t> shape,
                              std::span<const T> values) {
  SafetensorsTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(values.size_bytes());
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), values.size_bytes());
  return t;
}

// Closes a FILE* on scope exit.
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

std::string printable_excerpt(std::string_view text, std::size_t max_chars) {
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    char piece[5] = {c, '\0'};
    if (byte < 0x20 || byte > 0x7e) std::snprintf(piece, sizeof piece, "\\x%02x", byte);
    if (out.size() + std::strlen(piece) > max_chars) return out + "...";
    out += piece;
  }
  return out;
}

const char* safetensors_dtype_name(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kAcceptedDTypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "?";
}

std::size_t safetensors_dtype_size(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kF32: return 4;
    case SafetensorsDType::kF64: return 8;
    case SafetensorsDType::kF16: return 2;
    case SafetensorsDType::kBF16: return 2;
  }
  return 0;
}

std::int64_t SafetensorsTensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::vector<float> SafetensorsTensor::to_f32() const { return convert<float>(*this); }
std::vector<double> SafetensorsTensor::to_f64() const { return convert<double>(*this); }

SafetensorsTensor safetensors_tensor_f32(std::vector<std::int64_t> shape,
                                         std::span<const float> values) {
  return make_tensor(SafetensorsDType::kF32, std::move(shape), values);
}

SafetensorsTensor safetensors_tensor_f64(std::vector<std::int64_t> shape,
                                         std::span<const double> values) {
  return make_tensor(SafetensorsDType::kF64, std::move(shape), values);
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  const auto it = tensors.find(name);
  return it == tensors.end() ? nullptr : &it->second;
}

Status safetensors_parse(std::span<const std::uint8_t> bytes, SafetensorsFile* out) {
  if (out == nullptr) return invalid_argument("safetensors_parse: out is null");
  SafetensorsFile file;
  std::vector<Entry> entries;
  std::uint64_t data_start = 0;
  try {
    REPLAYSSM_RETURN_IF_ERROR(parse_header(bytes, &file, &entries, &data_start));
    for (Entry& e : entries) {
      const std::uint8_t* begin = bytes.data() + data_start + e.begin;
      e.tensor.data.assign(begin, begin + (e.end - e.begin));
      file.tensors.emplace(std::move(e.name), std::move(e.tensor));
    }
  } catch (const std::bad_alloc&) {
    return out_of_memory(bytes.size());
  } catch (const std::exception& e) {  // a json accessor we did not guard: a bug, not bad input
    return {StatusCode::kInternal, std::string("safetensors header: ") + e.what()};
  }
  *out = std::move(file);
  return Status::ok();
}

Status safetensors_read(const std::string& path, SafetensorsFile* out) {
  if (out == nullptr) return invalid_argument("safetensors_read: out is null");
  FilePtr f(std::fopen(path.c_str(), "rb"));
  if (!f) return io_error("cannot open " + quoted(path) + ": " + std::strerror(errno));
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return io_error("cannot read " + quoted(path) + ": not a regular file");
  }
  long size = -1;
  if (std::fseek(f.get(), 0, SEEK_END) == 0) size = std::ftell(f.get());
  if (size < 0 || std::fseek(f.get(), 0, SEEK_SET) != 0) {
    return io_error("cannot read " + quoted(path) + ": " + std::strerror(errno));
  }
  std::vector<std::uint8_t> bytes;
  try {
    bytes.resize(static_cast<std::size_t>(size));
  } catch (const std::bad_alloc&) {
    return out_of_memory(static_cast<std::size_t>(size));
  }
  if (std::fread(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    return io_error("cannot read " + quoted(path));
  }
  const Status status = safetensors_parse(bytes, out);
  if (!status.is_ok()) return {status.code(), path + ": " + status.message()};
  return Status::ok();
}

Status safetensors_serialize(const SafetensorsFile& file, std::vector<std::uint8_t>* out) {
  if (out == nullptr) return invalid_argument("safetensors_serialize: out is null");
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (name.empty() || name == "__metadata__") {
      return invalid_argument("cannot write a tensor named " + quoted(name));
    }
    for (std::int64_t d : t.shape) {
      if (d < 0) return invalid_argument("tensor " + quoted(name) + " has a negative dimension");
    }
    const std::uint64_t bytes =
        static_cast<std::uint64_t>(t.numel()) * safetensors_dtype_size(t.dtype);
    if (bytes != t.data.size()) {
      return invalid_argument("tensor " + quoted(name) + " holds " + std::to_string(t.data.size()) +
                              " bytes; its shape needs " + std::to_string(bytes));
    }
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // invalid UTF-8 in a name or a metadata value
    return invalid_argument(std::string("cannot encode the header: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t header_bytes = text.size();

  out->clear();
  try {
    out->reserve(kLengthBytes + header_bytes + offset);
  } catch (const std::bad_alloc&) {
    return out_of_memory(kLengthBytes + header_bytes + offset);
  }
  const auto* length = reinterpret_cast<const std::uint8_t*>(&header_bytes);
  out->insert(out->end(), length, length + kLengthBytes);
  out->insert(out->end(), text.begin(), text.end());
  for (const auto& [name, t] : file.tensors) out->insert(out->end(), t.data.begin(), t.data.end());
  return Status::ok();
}

Status safetensors_write(const std::string& path, const SafetensorsFile& file) {
  std::vector<std::uint8_t> bytes;
  REPLAYSSM_RETURN_IF_ERROR(safetensors_serialize(file, &bytes));
  return output_file_write(path, bytes);
}

}  // namespace replayssm
