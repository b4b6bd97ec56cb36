#pragma once
// The state cache as the Python module holds it: the library's StateCache, its buffer list,
// and for a view the caller's arrays (kept alive as long as the cache).

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "arrays.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"

namespace replayssm::python {

/// Raises the Python exception for a non-ok Status, with the library's message:
/// invalid argument -> ValueError, unsupported -> NotImplementedError, out of memory ->
/// MemoryError, anything else -> RuntimeError ("cuda error: ...").
void check(const Status& status);

/// A StateCacheConfig built from the Python CacheConfig's fields (names as Python spells them:
/// "mamba2", "float32", "fp32+bf16"...), validated by the library.
struct PyConfig {
  StateCacheConfig config;
  std::vector<CacheBufferSpec> specs;
};

PyConfig make_config(const std::string& kind, std::int64_t d0, std::int64_t d1, std::int64_t d2,
                     std::int64_t d3, int num_layers, int capacity, int buffer_len,
                     int max_spec_tokens, const std::string& checkpoint, const std::string& mode,
                     const std::string& input_dtype, const std::string& state_dtype,
                     const std::string& device, bool share_forked_checkpoints, int conv_kernel);

const char* python_dtype_name(DType dtype);  ///< "float32", "bfloat16", ..., "uint32"

struct PyCache {
  std::unique_ptr<StateCache> cache;
  std::vector<CacheBufferSpec> specs;
  /// CUDA views: the device their buffers are on (the one the kernels run on); -1 for owning
  /// caches, whose device is the one current at creation.
  std::int32_t device_id = -1;
  nb::object views;  ///< a view's buffers (the caller's arrays); None for an owning cache
  /// Ops that ran on buffers other than the cache's own (a copy handed to a registered op by a
  /// graph transform): each built a temporary view over them.
  std::uint64_t calls_on_other_buffers = 0;

  [[nodiscard]] const StateCacheConfig& config() const { return cache->config(); }
};

/// An owning cache (`buffers` None) or a view over `buffers` (a dict: buffer name -> array).
void cache_init(PyCache* self, const PyConfig& config, nb::handle buffers, bool adopt,
                nb::handle stream);

/// The stream of a call on `self` whose arrays `reader` has read (`any` one of them): `stream`
/// when given, else for a CUDA cache the arrays' framework's current stream (CUDA's default
/// stream when they have none).
void* op_stream(const PyCache& self, nb::handle stream, const ArrayReader& reader,
                const Array& any);

/// The cache an op runs on: `self`'s own, or when `buffers` (a sequence in buffer-list order)
/// is not None and differs from the cache's buffers, a temporary view over them that adopts
/// their contents. `holder` keeps that view alive for the call.
StateCache& op_target(PyCache& self, nb::handle buffers, ArrayReader& reader, const char* op,
                      void* stream, std::unique_ptr<StateCache>* holder);

/// Slot ids (and per-row counts or positions) of a batched call: a [batch] array of `elem` in
/// the cache's memory; `batch` < 0 takes it from the array.
Array read_rows(ArrayReader& reader, const PyCache& self, nb::handle obj, const char* op,
                const char* name, std::int64_t batch, Elem elem = Elem::kI32);

/// A batch as the library's int; ValueError past INT32_MAX.
int batch_of(std::int64_t n);

void bind_cache(nb::module_& m);

/// The prefix-caching methods of _C.StateCache (prefix.cpp).
void bind_prefix(nb::class_<PyCache>& cls);

}  // namespace replayssm::python
