#include "arrays.h"

#include <array>
#include <cstring>

namespace replayssm::python {

// The DLPack C exchange API table (DLPack 1.3, dlpack.h): a stable header, then function
// pointers. Only the two this module calls are typed; the others keep their slots.
struct DLPackExchangeAPIHeader {
  struct {
    std::uint32_t major;
    std::uint32_t minor;
  } version;
  DLPackExchangeAPIHeader* prev_api;
};

struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  /// Fills `out` (a DLTensor) for `py_object`, borrowed until control returns; -1 with a
  /// Python exception set on failure.
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out);
};

bool g_use_exchange_api = true;

namespace {

// The table a type publishes, or nullptr. PyTorch names the attribute
// `__dlpack_c_exchange_api__` (a capsule "dlpack_exchange_api"); its first release of the API
// named it `__c_dlpack_exchange_api__` and may hold the pointer as an int.
const DLPackExchangeAPI* lookup_exchange_api(PyTypeObject* type) {
  for (const char* attr : {"__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"}) {
    PyObject* value = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), attr);
    if (value == nullptr) {
      PyErr_Clear();
      continue;
    }
    void* ptr = nullptr;
    if (PyCapsule_CheckExact(value)) {
      ptr = PyCapsule_GetPointer(value, "dlpack_exchange_api");
    } else if (PyLong_Check(value)) {
      ptr = PyLong_AsVoidPtr(value);
    }
    Py_DECREF(value);
    if (ptr == nullptr) {
      PyErr_Clear();
      continue;
    }
    const auto* api = static_cast<const DLPackExchangeAPI*>(ptr);
    if (api->header.version.major == 1 && api->dltensor_from_py_object_no_sync != nullptr &&
        api->current_work_stream != nullptr) {
      return api;
    }
  }
  return nullptr;
}

// The exchange API of an object's type, looked up once per type (a call meets one or two
// types: torch.Tensor, nn.Parameter...). Holds a reference to each type it has seen.
const DLPackExchangeAPI* exchange_api(PyTypeObject* type) {
  struct Entry {
    PyTypeObject* type;
    const DLPackExchangeAPI* api;
  };
  static std::array<Entry, 16> seen{};
  static std::size_t count = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (seen[i].type == type) return seen[i].api;
  }
  const DLPackExchangeAPI* api = lookup_exchange_api(type);
  if (count < seen.size()) {
    Py_INCREF(type);
    seen[count++] = {type, api};
  }
  return api;
}

template <typename NdArray>
Array from_ndarray(const NdArray& nd, const char* name) {
  Array a;
  a.name = name;
  a.data = const_cast<void*>(static_cast<const void*>(nd.data()));
  a.device = {nd.device_type(), nd.device_id()};
  a.ndim = static_cast<int>(nd.ndim());
  a.shape = nd.shape_ptr();
  a.strides = nd.stride_ptr();
  a.dtype = nd.dtype();
  return a;
}

const char* elem_name(Elem e) {
  switch (e) {
    case Elem::kF32: return "float32";
    case Elem::kBF16: return "bfloat16 (or its bits as uint16)";
    case Elem::kF16: return "float16";
    case Elem::kI32: return "int32";
    case Elem::kPosition: return "int32 (or uint32)";
  }
  return "?";
}

bool elem_matches(Elem e, nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes != 1) return false;
  const auto code = static_cast<Code>(t.code);
  switch (e) {
    case Elem::kF32: return code == Code::Float && t.bits == 32;
    case Elem::kBF16: return (code == Code::Bfloat || code == Code::UInt) && t.bits == 16;
    case Elem::kF16: return code == Code::Float && t.bits == 16;
    case Elem::kI32: return code == Code::Int && t.bits == 32;
    case Elem::kPosition: return (code == Code::Int || code == Code::UInt) && t.bits == 32;
  }
  return false;
}

bool host_memory(std::int32_t type) { return type == kDLCPU || type == kDLCUDAHost; }
bool cuda_memory(std::int32_t type) { return type == kDLCUDA || type == kDLCUDAManaged; }

std::string join(const std::int64_t* v, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

void raise_value(const std::string& message) { throw nb::value_error(message.c_str()); }

std::int64_t Array::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

std::int64_t Array::nbytes() const { return numel() * ((dtype.bits * dtype.lanes + 7) / 8); }

bool Array::row_major() const {
  if (strides == nullptr || numel() == 0) return true;
  std::int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    // An axis of length 1 is never stepped along, so its stride does not matter.
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string Array::shape_text() const { return join(shape, ndim); }

std::string Array::device_text() const {
  switch (device.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(device.device_id);
    case kDLCUDAHost: return "cuda host memory";
    case kDLCUDAManaged: return "cuda managed memory";
  }
  return "DLPack device type " + std::to_string(device.device_type);
}

std::string Array::dtype_text() const {
  using Code = nb::dlpack::dtype_code;
  std::string kind;
  switch (static_cast<Code>(dtype.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Bool: return "bool";
    default: kind = "dtype code " + std::to_string(dtype.code) + " of "; break;
  }
  std::string s = kind + std::to_string(dtype.bits);
  if (dtype.lanes != 1) s += "x" + std::to_string(dtype.lanes);
  return s;
}

Array ArrayReader::read(nb::handle obj, const char* op, const char* name, Access access) {
  const DLPackExchangeAPI* api = g_use_exchange_api ? exchange_api(Py_TYPE(obj.ptr())) : nullptr;
  if (api != nullptr) {
    nb::dlpack::dltensor t;
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) throw nb::python_error();
    api_ = api;
    Array a;
    a.name = name;
    a.data = static_cast<char*>(t.data) + t.byte_offset;
    a.device = t.device;
    a.ndim = t.ndim;
    a.shape = t.shape;
    a.strides = t.strides;
    a.dtype = t.dtype;
    return a;
  }
  // No conversion (convert = false): a copy would hide writes and cost time.
  if (access == Access::kRead) {
    nb::ndarray<nb::ro> nd;
    if (nb::try_cast(obj, nd, false)) {
      held_read_.push_back(nd);
      return from_ndarray(held_read_.back(), name);
    }
  } else {
    nb::ndarray<> nd;
    if (nb::try_cast(obj, nd, false)) {
      held_write_.push_back(nd);
      return from_ndarray(held_write_.back(), name);
    }
  }
  const std::string type_name = nb::type_name(obj.type()).c_str();
  throw nb::type_error((std::string(op) + ": " + name + " must be a " +
                        (access == Access::kWrite ? "writable " : "") +
                        "DLPack array (numpy, torch, cupy...), got " + type_name)
                           .c_str());
}

void* ArrayReader::framework_stream(std::int32_t device_id) const {
  if (api_ == nullptr) return nullptr;
  void* stream = nullptr;
  if (api_->current_work_stream(kDLCUDA, device_id, &stream) != 0) throw nb::python_error();
  return stream;
}

Elem elem_of(DType activation_dtype) {
  switch (activation_dtype) {
    case DType::kBF16: return Elem::kBF16;
    case DType::kF16: return Elem::kF16;
    default: return Elem::kF32;
  }
}

namespace {

// [batch, T, channels] with contiguous channels and token rows one stride apart (axes of length
// 1 are never stepped along, so their strides do not matter).
bool token_rows(const Array& a) {
  if (a.strides == nullptr || a.numel() == 0) return true;
  if (a.ndim != 3 || (a.shape[2] != 1 && a.strides[2] != 1)) return false;
  const std::int64_t row = token_row_stride(a);
  return row >= a.shape[2] && (a.shape[1] == 1 || a.strides[1] == row) &&
         (a.shape[0] == 1 || a.strides[0] == row * a.shape[1]);
}

}  // namespace

std::int64_t token_row_stride(const Array& a) {
  if (a.strides == nullptr) return a.shape[2];
  if (a.shape[1] != 1) return a.strides[1];
  return a.shape[0] != 1 ? a.strides[0] : a.shape[2];
}

void expect(const char* op, const Array& a, Elem elem, std::initializer_list<std::int64_t> shape,
            const char* layout, Device device, std::int32_t device_id, Placement placement,
            Contiguity contiguity) {
  // The message is built only on failure: this runs for every array of every call.
  const auto fail = [&](const std::string& what) {
    raise_value(std::string(op) + ": " + a.name + what);
  };
  const bool shape_ok = a.ndim == static_cast<int>(shape.size()) &&
                        std::equal(shape.begin(), shape.end(), a.shape);
  if (!shape_ok) {
    fail(" has shape " + a.shape_text() + ", expected " +
         join(shape.begin(), static_cast<int>(shape.size())) + " " + layout);
  }
  if (!elem_matches(elem, a.dtype)) {
    fail(" has dtype " + a.dtype_text() + ", expected " + elem_name(elem));
  }
  const std::int32_t type = a.device.device_type;
  switch (device) {
    case Device::kCpu:
      if (!host_memory(type)) {
        fail(" is on " + a.device_text() + "; the cache is on the cpu");
      }
      break;
    case Device::kCuda: {
      const bool host_ok = placement == Placement::kHostOrCacheDevice && host_memory(type);
      if (!host_ok && !cuda_memory(type)) {
        fail(" is on " + a.device_text() + "; the cache is on cuda" +
             (placement == Placement::kHostOrCacheDevice ? " (host memory is also accepted)" : ""));
      }
      if (type == kDLCUDA && device_id >= 0 && a.device.device_id != device_id) {
        fail(" is on " + a.device_text() + "; the cache is on cuda:" + std::to_string(device_id));
      }
      break;
    }
  }
  if (contiguity == Contiguity::kTokenRows) {
    if (!token_rows(a)) {
      fail(" has strides " + join(a.strides, a.ndim) + " for shape " + a.shape_text() +
           "; its channels must be contiguous and its token rows one stride apart (a column "
           "slice of a [batch, T, width] array is)");
    }
  } else if (!a.row_major()) {
    fail(" is not contiguous (strides " + join(a.strides, a.ndim) + " for shape " +
         a.shape_text() + "); pass a dense row-major array");
  }
}

std::int64_t dim_of(const char* op, const Array& a, int ndim, int axis, const char* layout) {
  if (a.ndim != ndim) {
    raise_value(std::string(op) + ": " + a.name + " has shape " + a.shape_text() + ", expected " +
                std::to_string(ndim) + " axes " + layout);
  }
  return a.shape[axis];
}

void expect_buffer(const char* what, const Array& a, Device device) {
  const std::int32_t type = a.device.device_type;
  const bool placed = device == Device::kCpu ? host_memory(type) : cuda_memory(type);
  if (!placed) {
    raise_value(std::string("cache buffer ") + what + " is on " + a.device_text() +
                "; the cache's device is " + device_name(device));
  }
  if (!a.row_major()) {
    raise_value(std::string("cache buffer ") + what + " is not contiguous");
  }
}

void* stream_arg(nb::handle stream, void* fallback) {
  if (stream.is_none()) return fallback;
  nb::handle value = stream;
  nb::object attr;
  if (!PyLong_Check(stream.ptr())) {
    for (const char* name : {"cuda_stream", "ptr"}) {
      if (nb::hasattr(stream, name)) {
        attr = stream.attr(name);
        value = attr;
        break;
      }
    }
  }
  if (!PyLong_Check(value.ptr())) {
    throw nb::type_error(
        "stream must be None, an int (a cudaStream_t) or a stream object with `cuda_stream` or "
        "`ptr`");
  }
  void* ptr = PyLong_AsVoidPtr(value.ptr());
  if (ptr == nullptr && PyErr_Occurred()) throw nb::python_error();
  return ptr;
}

}  // namespace replayssm::python
