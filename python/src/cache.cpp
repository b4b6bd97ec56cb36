// replayssm._C.Config and replayssm._C.StateCache: the library's configuration and state cache,
// with the buffer list, views over caller arrays, slots, load/export, commit and fold.

#include "cache.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>

namespace replayssm::python {

namespace {

// `name` as one of `choices` (Python's spelling), else ValueError listing them.
template <typename T, std::size_t N>
T parse_choice(const char* what, const std::string& name,
               const std::pair<const char*, T> (&choices)[N]) {
  std::string listed;
  for (const auto& [text, value] : choices) {
    if (name == text) return value;
    listed += (listed.empty() ? "" : ", ") + std::string(text);
  }
  throw nb::value_error((std::string("unknown ") + what + " '" + name + "'; choose " + listed).c_str());
}

constexpr std::pair<const char*, DType> kActivationDtypes[] = {
    {"float32", DType::kF32}, {"bfloat16", DType::kBF16}, {"float16", DType::kF16}};

CacheBufferId buffer_id(const std::string& name, const std::vector<CacheBufferSpec>& specs) {
  for (int i = 0; i < kNumCacheBuffers; ++i) {
    const auto id = static_cast<CacheBufferId>(i);
    if (name == cache_buffer_name(id)) return id;
  }
  std::string listed;
  for (const CacheBufferSpec& s : specs) listed += (listed.empty() ? "" : ", ") + std::string(s.name);
  throw nb::value_error(("unknown cache buffer '" + name + "'; this configuration has " + listed).c_str());
}

// One caller buffer of a view, checked for place and layout (the library checks bytes and
// alignment against the spec).
CacheBufferBinding bind_buffer(ArrayReader& reader, CacheBufferId id, nb::handle array,
                               Device device, std::int32_t* device_id) {
  const char* name = cache_buffer_name(id);
  const Array a = reader.read(array, "StateCache", name, Access::kWrite);
  expect_buffer(name, a, device);
  if (device == Device::kCuda && a.device.device_type == kDLCUDA) {
    if (*device_id >= 0 && a.device.device_id != *device_id) {
      throw nb::value_error((std::string("cache buffer ") + name + " is on " + a.device_text() +
                             " but other buffers are on cuda:" + std::to_string(*device_id))
                                .c_str());
    }
    *device_id = a.device.device_id;
  }
  return {id, a.data, a.nbytes()};
}

// The cache's stream for calls with no array to take a framework's stream from.
void* plain_stream(nb::handle stream) { return stream_arg(stream, nullptr); }

// A Python array over one of an owning cache's buffers, with `owner` keeping the cache alive.
// Element types NumPy has (bf16 as uint16 bits, fp8 as uint8 bits), so CPU buffers come back
// as NumPy arrays.
nb::object buffer_array(PyCache& self, const CacheBufferSpec& spec, nb::handle owner) {
  nb::dlpack::dtype dtype{};
  switch (spec.dtype) {
    case DType::kF32: dtype = nb::dtype<float>(); break;
    case DType::kBF16: dtype = nb::dtype<std::uint16_t>(); break;
    case DType::kF16: dtype = {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}; break;
    case DType::kF8E4M3: dtype = nb::dtype<std::uint8_t>(); break;
    case DType::kU8: dtype = nb::dtype<std::uint8_t>(); break;
    case DType::kU32: dtype = nb::dtype<std::uint32_t>(); break;
  }
  std::vector<std::size_t> shape(spec.shape.begin(), spec.shape.end());
  void* data = self.cache->buffer(spec.id);
  if (self.config().device == Device::kCpu) {
    nb::ndarray<nb::numpy> nd(data, shape.size(), shape.data(), owner, nullptr, dtype, kDLCPU, 0);
    return nb::cast(nd, nb::rv_policy::reference);
  }
  nb::ndarray<> nd(data, shape.size(), shape.data(), owner, nullptr, dtype, kDLCUDA,
                   std::max(self.device_id, 0));
  return nb::cast(nd, nb::rv_policy::reference);
}

// load_state / export_state (one layer's fp32 state [heads, rows, cols]) and load_conv_window /
// export_conv_window (one layer's conv window [K - 1, conv_channels] in the input dtype): host
// memory or (CUDA caches) device memory; all synchronise the stream, so they run without the GIL.
template <typename Call>
void slot_io(PyCache& self, const char* op, const char* name, nb::handle array, Access access,
             nb::handle stream, Elem elem, std::initializer_list<std::int64_t> shape,
             const char* layout, Call&& call) {
  ArrayReader reader;
  const Array a = reader.read(array, op, name, access);
  expect(op, a, elem, shape, layout, self.config().device, self.device_id,
         Placement::kHostOrCacheDevice);
  void* s = op_stream(self, stream, reader, a);
  Status st;
  {
    nb::gil_scoped_release unlocked;
    st = call(a.data, s);
  }
  check(st);
}

constexpr const char* kStateLayout = "([heads, rows, cols])";
constexpr const char* kConvLayout = "([conv_kernel - 1, conv_channels])";

void load_state(PyCache& self, int layer, int slot, nb::handle state, nb::handle stream) {
  const StateDims d = self.config().dims();
  slot_io(self, "load_state", "state", state, Access::kRead, stream, Elem::kF32,
          {d.heads, d.rows, d.cols}, kStateLayout, [&](void* p, void* s) {
            return state_cache_load_state(*self.cache, layer, slot, static_cast<float*>(p), s);
          });
}

void export_state(PyCache& self, int layer, int slot, nb::handle out, nb::handle stream) {
  const StateDims d = self.config().dims();
  slot_io(self, "export_state", "out", out, Access::kWrite, stream, Elem::kF32,
          {d.heads, d.rows, d.cols}, kStateLayout, [&](void* p, void* s) {
            return state_cache_export_state(*self.cache, layer, slot, static_cast<float*>(p), s);
          });
}

// A cache without a conv window: the library's refusal (its window's shape does not exist).
void load_conv_window(PyCache& self, int layer, int slot, nb::handle window, nb::handle stream) {
  const StateCacheConfig& c = self.config();
  if (c.conv_kernel == 0) check(state_cache_load_conv_window(*self.cache, layer, slot, nullptr));
  slot_io(self, "load_conv_window", "window", window, Access::kRead, stream,
          elem_of(c.input_dtype), {c.conv_kernel - 1, c.conv_channels()}, kConvLayout,
          [&](void* p, void* s) {
            return state_cache_load_conv_window(*self.cache, layer, slot, p, s);
          });
}

void export_conv_window(PyCache& self, int layer, int slot, nb::handle out, nb::handle stream) {
  const StateCacheConfig& c = self.config();
  if (c.conv_kernel == 0) check(state_cache_export_conv_window(*self.cache, layer, slot, nullptr));
  slot_io(self, "export_conv_window", "out", out, Access::kWrite, stream, elem_of(c.input_dtype),
          {c.conv_kernel - 1, c.conv_channels()}, kConvLayout, [&](void* p, void* s) {
            return state_cache_export_conv_window(*self.cache, layer, slot, p, s);
          });
}

void commit(PyCache& self, nb::handle slot_ids, nb::handle accepted, nb::handle stream,
            nb::handle buffers) {
  ArrayReader reader;
  const Array ids = read_rows(reader, self, slot_ids, "commit", "slot_ids", -1);
  const Array acc = read_rows(reader, self, accepted, "commit", "accepted", ids.shape[0]);
  void* s = op_stream(self, stream, reader, ids);
  std::unique_ptr<StateCache> holder;
  StateCache& target = op_target(self, buffers, reader, "commit", s, &holder);
  CommitArgs args;
  args.batch = batch_of(ids.shape[0]);
  args.slot_ids = static_cast<const std::int32_t*>(ids.data);
  args.accepted = static_cast<const std::int32_t*>(acc.data);
  check(state_cache_commit(target, args, s));
}

void fold(PyCache& self, nb::handle slot_ids, nb::handle stream, nb::handle buffers) {
  ArrayReader reader;
  const Array ids = read_rows(reader, self, slot_ids, "fold", "slot_ids", -1);
  void* s = op_stream(self, stream, reader, ids);
  std::unique_ptr<StateCache> holder;
  StateCache& target = op_target(self, buffers, reader, "fold", s, &holder);
  FoldArgs args;
  args.batch = batch_of(ids.shape[0]);
  args.slot_ids = static_cast<const std::int32_t*>(ids.data);
  Status st;
  {
    nb::gil_scoped_release unlocked;
    st = state_cache_fold(target, args, s);
  }
  check(st);
}

}  // namespace

Array read_rows(ArrayReader& reader, const PyCache& self, nb::handle obj, const char* op,
                const char* name, std::int64_t batch, Elem elem) {
  const Array a = reader.read(obj, op, name, Access::kRead);
  if (batch < 0) batch = dim_of(op, a, 1, 0, "([batch])");
  expect(op, a, elem, {batch}, "([batch])", self.config().device, self.device_id);
  return a;
}

int batch_of(std::int64_t n) {
  if (n > INT32_MAX) throw nb::value_error("batch is too large");
  return static_cast<int>(n);
}

void check(const Status& status) {
  if (status.is_ok()) return;
  PyObject* type = PyExc_RuntimeError;
  std::string message = status.message();
  switch (status.code()) {
    case StatusCode::kInvalidArgument: type = PyExc_ValueError; break;
    case StatusCode::kUnsupported: type = PyExc_NotImplementedError; break;
    case StatusCode::kOutOfMemory: type = PyExc_MemoryError; break;
    default: message = status.to_string(); break;
  }
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

const char* python_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kU8: return "uint8";
    case DType::kU32: return "uint32";
  }
  return "?";
}

PyConfig make_config(const std::string& kind, std::int64_t d0, std::int64_t d1, std::int64_t d2,
                     std::int64_t d3, int num_layers, int capacity, int buffer_len,
                     int max_spec_tokens, const std::string& checkpoint, const std::string& mode,
                     const std::string& input_dtype, const std::string& state_dtype,
                     const std::string& device, bool share_forked_checkpoints, int conv_kernel) {
  static constexpr std::pair<const char*, LayerKind> kKinds[] = {{"mamba2", LayerKind::kMamba2},
                                                                 {"gdn", LayerKind::kGdn}};
  static constexpr std::pair<const char*, DecodeMode> kModes[] = {{"replay", DecodeMode::kReplay},
                                                                  {"eager", DecodeMode::kEager}};
  static constexpr std::pair<const char*, Device> kDevices[] = {{"cpu", Device::kCpu},
                                                                {"cuda", Device::kCuda}};
  for (std::int64_t v : {d0, d1, d2, d3}) {
    if (v < 1 || v > INT32_MAX) throw nb::value_error("layer dimensions must be in [1, 2^31)");
  }
  PyConfig out;
  StateCacheConfig& c = out.config;
  c.kind = parse_choice("kind", kind, kKinds);
  const int a = static_cast<int>(d0), b = static_cast<int>(d1), e = static_cast<int>(d2),
            f = static_cast<int>(d3);
  switch (c.kind) {
    case LayerKind::kMamba2: c.mamba2 = {a, b, e, f}; break;  // nheads, head_dim, dstate, ngroups
    case LayerKind::kGdn: c.gdn = {a, b, e, f}; break;  // num_k_heads, num_v_heads, K, V
  }
  c.num_layers = num_layers;
  c.capacity = capacity;
  c.buffer_len = buffer_len;
  c.max_spec_tokens = max_spec_tokens;
  if (!parse_checkpoint_precision(checkpoint, &c.checkpoint)) {
    throw nb::value_error(
        ("unknown checkpoint '" + checkpoint + "'; choose fp32, bf16, fp32+bf16, fp32+fp8").c_str());
  }
  c.mode = parse_choice("mode", mode, kModes);
  c.input_dtype = parse_choice("input_dtype", input_dtype, kActivationDtypes);
  c.state_dtype = parse_choice("state_dtype", state_dtype, kActivationDtypes);
  c.device = parse_choice("device", device, kDevices);
  c.share_forked_checkpoints = share_forked_checkpoints;
  c.conv_kernel = conv_kernel;
  check(state_cache_buffers(c, &out.specs));
  return out;
}

void cache_init(PyCache* self, const PyConfig& config, nb::handle buffers, bool adopt,
                nb::handle stream) {
  // Built aside and moved in at the end: nanobind runs no destructor for an __init__ that
  // raised.
  PyCache made;
  made.specs = config.specs;
  const StateCacheConfig& c = config.config;
  if (buffers.is_none()) {
    if (adopt) throw nb::value_error("adopt=True needs buffers to adopt");
    check(state_cache_create(c, &made.cache, plain_stream(stream)));
    made.views = nb::none();
  } else {
    if (!nb::isinstance<nb::dict>(buffers)) {
      throw nb::type_error("buffers must be a dict: buffer name -> array");
    }
    ArrayReader reader;
    std::vector<CacheBufferBinding> bindings;
    for (auto [key, value] : nb::borrow<nb::dict>(buffers)) {
      const CacheBufferId id = buffer_id(nb::cast<std::string>(key), config.specs);
      bindings.push_back(bind_buffer(reader, id, value, c.device, &made.device_id));
    }
    // Zeroing (or adopting) runs on the given stream, else on the current stream of the
    // buffers' framework.
    void* s = stream.is_none() && c.device == Device::kCuda
                  ? reader.framework_stream(std::max(made.device_id, 0))
                  : plain_stream(stream);
    check(state_cache_create_view(c, bindings, adopt ? ViewInit::kAdopt : ViewInit::kZero,
                                  &made.cache, s));
    made.views = nb::borrow(buffers);
  }
  new (self) PyCache(std::move(made));
}

void* op_stream(const PyCache& self, nb::handle stream, const ArrayReader& reader,
                const Array& any) {
  if (!stream.is_none() || self.config().device != Device::kCuda) return stream_arg(stream, nullptr);
  return reader.framework_stream(any.device.device_type == kDLCUDA ? any.device.device_id
                                                                    : std::max(self.device_id, 0));
}

StateCache& op_target(PyCache& self, nb::handle buffers, ArrayReader& reader, const char* op,
                      void* stream, std::unique_ptr<StateCache>* holder) {
  if (buffers.is_none()) return *self.cache;
  const std::size_t n = self.specs.size();
  if (nb::len(buffers) != n) {
    throw nb::value_error((std::string(op) + ": buffers must list the cache's " +
                           std::to_string(n) + " buffers, got " + std::to_string(nb::len(buffers)))
                              .c_str());
  }
  std::array<Array, kNumCacheBuffers> arrays;
  bool own = true;
  for (std::size_t i = 0; i < n; ++i) {
    arrays[i] = reader.read(buffers[i], op, self.specs[i].name, Access::kWrite);
    own = own && arrays[i].data == self.cache->buffer(self.specs[i].id);
  }
  if (own) return *self.cache;
  // The op was handed other buffers (e.g. copies made by a graph transform): its declared
  // effect is on those, so it runs on a view that adopts their contents. Slow (a host read of
  // the slots' flags), correct, and counted so that tests can tell it never happens where it
  // must not.
  std::vector<CacheBufferBinding> bindings;
  for (std::size_t i = 0; i < n; ++i) {
    expect_buffer(self.specs[i].name, arrays[i], self.config().device);
    bindings.push_back({self.specs[i].id, arrays[i].data, arrays[i].nbytes()});
  }
  check(state_cache_create_view(self.config(), bindings, ViewInit::kAdopt, holder, stream));
  ++self.calls_on_other_buffers;
  return **holder;
}

void bind_cache(nb::module_& m) {
  nb::class_<PyConfig>(m, "Config")
      .def(nb::new_([](const std::string& kind, std::int64_t d0, std::int64_t d1, std::int64_t d2,
                       std::int64_t d3, int num_layers, int capacity, int buffer_len,
                       int max_spec_tokens, const std::string& checkpoint, const std::string& mode,
                       const std::string& input_dtype, const std::string& state_dtype,
                       const std::string& device, bool share_forked_checkpoints, int conv_kernel) {
             return make_config(kind, d0, d1, d2, d3, num_layers, capacity, buffer_len,
                                max_spec_tokens, checkpoint, mode, input_dtype, state_dtype, device,
                                share_forked_checkpoints, conv_kernel);
           }),
           nb::arg("kind"), nb::arg("d0"), nb::arg("d1"), nb::arg("d2"), nb::arg("d3"),
           nb::arg("num_layers"), nb::arg("capacity"), nb::arg("buffer_len"),
           nb::arg("max_spec_tokens"), nb::arg("checkpoint"), nb::arg("mode"),
           nb::arg("input_dtype"), nb::arg("state_dtype"), nb::arg("device"),
           nb::arg("share_forked_checkpoints") = false, nb::arg("conv_kernel") = 0)
      .def("buffers",
           [](const PyConfig& c) {
             std::vector<std::tuple<std::string, std::string, std::vector<std::int64_t>,
                                    std::int64_t, std::int64_t, int>>
                 out;
             for (const CacheBufferSpec& s : c.specs) {
               out.emplace_back(s.name, python_dtype_name(s.dtype), s.shape, s.bytes, s.alignment,
                                s.slot_axis);
             }
             return out;
           })
      .def("can_implement", [](const PyConfig& c) { check(state_cache_can_implement(c.config)); })
      .def_prop_ro("ring_capacity", [](const PyConfig& c) {
        for (const CacheBufferSpec& s : c.specs) {
          if (s.id == CacheBufferId::kRingVec) return static_cast<int>(s.shape[2]);
        }
        return 0;
      });

  nb::class_<PyCache> cache_class(m, "StateCache");
  cache_class
      .def("__init__", &cache_init, nb::arg("config"), nb::arg("buffers").none(),
           nb::arg("adopt"), nb::arg("stream").none())
      .def("allocate",
           [](PyCache& self, nb::handle stream) {
             int slot = -1;
             check(state_cache_allocate_slot(*self.cache, &slot, plain_stream(stream)));
             return slot;
           },
           nb::arg("stream").none())
      .def("claim",
           [](PyCache& self, int slot, nb::handle stream) {
             check(state_cache_claim_slot(*self.cache, slot, plain_stream(stream)));
           },
           nb::arg("slot"), nb::arg("stream").none())
      .def("free",
           [](PyCache& self, int slot, nb::handle stream) {
             check(state_cache_free_slot(*self.cache, slot, plain_stream(stream)));
           },
           nb::arg("slot"), nb::arg("stream").none())
      .def("load_state", &load_state, nb::arg("layer"), nb::arg("slot"), nb::arg("state"),
           nb::arg("stream").none())
      .def("export_state", &export_state, nb::arg("layer"), nb::arg("slot"), nb::arg("out"),
           nb::arg("stream").none())
      // None arrays reach the functions: a cache without a conv is refused before they are read.
      .def("load_conv_window", &load_conv_window, nb::arg("layer"), nb::arg("slot"),
           nb::arg("window").none(), nb::arg("stream").none())
      .def("export_conv_window", &export_conv_window, nb::arg("layer"), nb::arg("slot"),
           nb::arg("out").none(), nb::arg("stream").none())
      .def("commit", &commit, nb::arg("slot_ids"), nb::arg("accepted"), nb::arg("stream").none(),
           nb::arg("buffers").none())
      .def("fold", &fold, nb::arg("slot_ids"), nb::arg("stream").none(), nb::arg("buffers").none())
      .def("is_allocated", [](const PyCache& self, int slot) { return self.cache->is_allocated(slot); })
      .def("buffer_arrays",
           [](nb::handle self_obj) {
             PyCache& self = nb::cast<PyCache&>(self_obj);
             nb::dict out;
             for (const CacheBufferSpec& s : self.specs) {
               out[s.name] = self.views.is_none() ? buffer_array(self, s, self_obj)
                                                  : self.views[s.name];
             }
             return out;
           })
      .def_prop_ro("free_slots", [](const PyCache& self) { return self.cache->free_slots(); })
      .def_prop_ro("nbytes", [](const PyCache& self) { return self.cache->bytes(); })
      .def_prop_ro("owns_memory", [](const PyCache& self) { return self.cache->owns_memory(); })
      .def_prop_ro("ring_capacity", [](const PyCache& self) { return self.cache->ring_capacity(); })
      .def_prop_ro("device_id", [](const PyCache& self) { return self.device_id; })
      .def_prop_ro("calls_on_other_buffers",
                   [](const PyCache& self) { return self.calls_on_other_buffers; });
  bind_prefix(cache_class);
}

}  // namespace replayssm::python
