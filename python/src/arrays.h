#pragma once
// Array arguments of the Python module: any object that speaks DLPack (NumPy, PyTorch, CuPy,
// JAX...), read as a borrowed DLTensor for the length of one call, zero-copy.
//
// Two ways in. Types that publish the DLPack C exchange API (`__dlpack_c_exchange_api__`:
// PyTorch from 2.10) fill a DLTensor through a C function pointer, with no Python call and no
// allocation; and the same table names the framework's current stream, so an op follows
// torch.cuda.current_stream() without a Python-side query. Every other object goes through
// nanobind's ndarray import (its `__dlpack__`), which costs a Python call per array.
//
// Checks name the op and the argument, and run before anything is written.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "replayssm/types.h"

namespace replayssm::python {

namespace nb = nanobind;

/// DLPack device types the module meets.
inline constexpr std::int32_t kDLCPU = 1;
inline constexpr std::int32_t kDLCUDA = 2;
inline constexpr std::int32_t kDLCUDAHost = 3;
inline constexpr std::int32_t kDLCUDAManaged = 13;

/// One array argument: the fields of its DLTensor, borrowed for the current call.
struct Array {
  const char* name = "";
  void* data = nullptr;  ///< data + byte_offset
  nb::dlpack::device device{};
  int ndim = 0;
  const std::int64_t* shape = nullptr;
  const std::int64_t* strides = nullptr;  ///< in elements; null = row-major
  nb::dlpack::dtype dtype{};

  [[nodiscard]] std::int64_t numel() const;
  [[nodiscard]] std::int64_t nbytes() const;
  [[nodiscard]] bool row_major() const;
  [[nodiscard]] std::string shape_text() const;
  [[nodiscard]] std::string device_text() const;
  [[nodiscard]] std::string dtype_text() const;
};

enum class Access : std::uint8_t { kRead, kWrite };

/// Whether ArrayReader takes the exchange API where a type has one (the overhead benchmark
/// turns it off to measure the `__dlpack__` path).
extern bool g_use_exchange_api;

struct DLPackExchangeAPI;

/// Reads the array arguments of one call and keeps what they borrow alive until it goes.
class ArrayReader {
 public:
  ArrayReader() = default;
  ArrayReader(const ArrayReader&) = delete;
  ArrayReader& operator=(const ArrayReader&) = delete;

  /// Raises TypeError (naming `op` and `name`) unless `obj` is a DLPack array (writable when
  /// `access` is kWrite).
  Array read(nb::handle obj, const char* op, const char* name, Access access);

  /// The stream the framework of this call's arrays takes as current on CUDA device
  /// `device_id` (PyTorch: torch.cuda.current_stream()), or nullptr (CUDA's default stream)
  /// when none of them came through an exchange API.
  [[nodiscard]] void* framework_stream(std::int32_t device_id) const;

 private:
  const DLPackExchangeAPI* api_ = nullptr;  // of the last array that had one
  std::vector<nb::ndarray<nb::ro>> held_read_;
  std::vector<nb::ndarray<>> held_write_;
};

/// Where a cache may find an array: its own device's memory only, or (load/export of a CUDA
/// cache) host or device memory.
enum class Placement : std::uint8_t { kCacheDevice, kHostOrCacheDevice };

/// Raises ValueError with `message`.
[[noreturn]] void raise_value(const std::string& message);

/// How an array's elements must lie: dense row-major, or (token rows) [batch, T, channels] with
/// the channels contiguous and every token's row the same stride from the last, as a column
/// slice of a wider projection's output is: the ops' ConvInputs::stride.
enum class Contiguity : std::uint8_t { kRowMajor, kTokenRows };

/// The element types the ops take: the cache's activation dtypes (bf16 also as its bits in a
/// uint16 view), fp32, int32 for slot ids and counts, and positions: the cursors' u32 as int32
/// (how torch holds them) or uint32 (how NumPy does), the same bits.
enum class Elem : std::uint8_t { kF32, kBF16, kF16, kI32, kPosition };
Elem elem_of(DType activation_dtype);

/// Raises ValueError naming `op` and the array unless it has element type `elem`, shape
/// `shape` (`layout` names the axes in the message), lies as `contiguity` asks, and lies where
/// `placement` allows for a cache on `device` (CUDA: on device `device_id` when it is >= 0).
void expect(const char* op, const Array& a, Elem elem, std::initializer_list<std::int64_t> shape,
            const char* layout, Device device, std::int32_t device_id,
            Placement placement = Placement::kCacheDevice,
            Contiguity contiguity = Contiguity::kRowMajor);

/// The elements from one token's row to the next of a [batch, T, channels] array that
/// expect(..., Contiguity::kTokenRows) accepted.
std::int64_t token_row_stride(const Array& a);

/// The length of `a`'s axis `axis`; ValueError unless `a` has `ndim` axes (`layout` names them).
std::int64_t dim_of(const char* op, const Array& a, int ndim, int axis, const char* layout);

/// Raises ValueError unless `a` is row-major and in memory a cache on `device` can use.
void expect_buffer(const char* what, const Array& a, Device device);

/// A stream argument: None, an int (a cudaStream_t's value), or an object with `cuda_stream`
/// (torch.cuda.Stream) or `ptr` (cupy.cuda.Stream). None picks `fallback`.
void* stream_arg(nb::handle stream, void* fallback);

}  // namespace replayssm::python
