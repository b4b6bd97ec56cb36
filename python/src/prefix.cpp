// The prefix-caching methods of replayssm._C.StateCache (include/replayssm/prefix.h):
// materialize, read_records, restore, fork, truncate. Every array is checked against the
// cache's configuration here; the library checks slots, positions and values before it writes
// anything.

#include <nanobind/nanobind.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "cache.h"
#include "replayssm/prefix.h"

namespace replayssm::python {

namespace {

// An eager cache is refused with the library's own message, before any array is read: a shape
// complaint would hide the real problem. `call` runs the library op with empty arguments.
template <typename Call>
void require_replay(const PyCache& self, Call&& call) {
  if (self.config().mode != DecodeMode::kReplay) check(call());
}

// A position as the cursors hold it (u32, compared modulo 2^32): a Python int in
// [-2^31, 2^32), so that an int32 cursor's value and its unsigned reading both work.
std::uint32_t position_arg(const char* op, std::int64_t p) {
  if (p < std::numeric_limits<std::int32_t>::min() ||
      p > std::numeric_limits<std::uint32_t>::max()) {
    throw nb::value_error((std::string(op) + ": position " + std::to_string(p) +
                           " is not a 32-bit cursor value")
                              .c_str());
  }
  return static_cast<std::uint32_t>(p);
}

// Runs a library call: without the GIL when it may take a while (CPU work, and CUDA calls that
// synchronise the stream); batched CUDA ops only enqueue kernels and keep it.
template <typename Call>
void run(const PyCache& self, bool synchronises, Call&& call) {
  Status status;
  if (self.config().device == Device::kCpu || synchronises) {
    nb::gil_scoped_release unlocked;
    status = call();
  } else {
    status = call();
  }
  check(status);
}

// The record arrays of read_records (written) or restore (read), in the ring buffers' dtypes
// with the ring axis replaced by the tokens; `count` is vec's axis 1. key_scale is GDN's only.
CacheRecords read_record_arrays(ArrayReader& reader, const PyCache& self, const char* op,
                                nb::handle vec, nb::handle key, nb::handle key_scale,
                                nb::handle write, nb::handle decay, Access access,
                                Array* vec_array = nullptr) {
  const StateCacheConfig& c = self.config();
  const StateDims d = c.dims();
  const std::int64_t layers = c.num_layers;
  const Elem act = elem_of(c.input_dtype);
  const auto get = [&](nb::handle h, const char* name) {
    if (h.is_none()) {
      throw nb::value_error((std::string(op) + ": records." + name + " is missing").c_str());
    }
    return reader.read(h, op, name, access);
  };
  const auto place = [&](const Array& a, Elem elem, std::initializer_list<std::int64_t> shape,
                         const char* layout) {
    expect(op, a, elem, shape, layout, c.device, self.device_id);
    return a.data;
  };
  const Array v = get(vec, "vec");
  if (vec_array != nullptr) *vec_array = v;
  constexpr const char* kVec = "([num_layers, count, heads, rows])";
  const std::int64_t count = dim_of(op, v, 4, 1, kVec);
  if (count > std::numeric_limits<int>::max()) throw nb::value_error("too many records");
  constexpr const char* kPerHead = "([num_layers, count, heads])";
  CacheRecords r;
  r.count = static_cast<int>(count);
  r.vec = place(v, act, {layers, count, d.heads, d.rows}, kVec);
  r.key = place(get(key, "key"), act, {layers, count, d.key_heads, d.cols},
                "([num_layers, count, key_heads, cols])");
  const auto per_head = [&](nb::handle h, const char* name) {
    return static_cast<float*>(place(get(h, name), Elem::kF32, {layers, count, d.heads}, kPerHead));
  };
  r.write = per_head(write, "write");
  r.decay = per_head(decay, "decay");
  switch (c.kind) {
    case LayerKind::kMamba2:
      if (!key_scale.is_none()) {
        throw nb::value_error((std::string(op) + ": records.key_scale is GDN's; a Mamba-2 "
                                                 "cache's records have none")
                                  .c_str());
      }
      break;
    case LayerKind::kGdn:
      r.key_scale = static_cast<float*>(place(get(key_scale, "key_scale"), Elem::kF32,
                                              {layers, count, d.key_heads},
                                              "([num_layers, count, key_heads])"));
      break;
  }
  return r;
}

// A batched op's row lists ([batch] in the cache's memory: slot ids, positions, fork's dst
// slots), read and checked on the way in; then the stream and the cache the op acts on.
class RowsCall {
 public:
  RowsCall(PyCache& self, const char* op, nb::handle slot_ids, const char* name)
      : self_(self), op_(op) {
    ids_ = read_rows(reader_, self, slot_ids, op, name, -1);
    batch = batch_of(ids_.shape[0]);
  }

  const std::int32_t* ids() const { return static_cast<const std::int32_t*>(ids_.data); }
  const std::int32_t* slots(nb::handle h, const char* name) {
    return static_cast<const std::int32_t*>(read_rows(reader_, self_, h, op_, name, batch).data);
  }
  const std::uint32_t* positions(nb::handle h) {
    return static_cast<const std::uint32_t*>(
        read_rows(reader_, self_, h, op_, "positions", batch, Elem::kPosition).data);
  }
  ArrayReader& reader() { return reader_; }

  /// Runs `call(target, stream)`; batched ops only enqueue on CUDA caches.
  template <typename Call>
  void run_on(nb::handle stream, nb::handle buffers, Call&& call) {
    void* s = op_stream(self_, stream, reader_, ids_);
    std::unique_ptr<StateCache> holder;
    StateCache& target = op_target(self_, buffers, reader_, op_, s, &holder);
    run(self_, false, [&] { return call(target, s); });
  }

  int batch = 0;

 private:
  PyCache& self_;
  const char* op_;
  ArrayReader reader_;
  Array ids_;
};

void materialize(PyCache& self, nb::handle slot_ids, nb::handle positions, nb::handle out,
                 nb::handle stream, nb::handle buffers) {
  constexpr const char* op = "materialize";
  require_replay(self, [&] { return state_cache_materialize(*self.cache, {}); });
  RowsCall call(self, op, slot_ids, "slot_ids");
  MaterializeArgs args;
  args.batch = call.batch;
  args.slot_ids = call.ids();
  args.positions = call.positions(positions);
  const Array o = call.reader().read(out, op, "out", Access::kWrite);
  const StateDims d = self.config().dims();
  expect(op, o, Elem::kF32, {call.batch, self.config().num_layers, d.heads, d.rows, d.cols},
         "([batch, num_layers, heads, rows, cols])", self.config().device, self.device_id);
  args.states = static_cast<float*>(o.data);
  call.run_on(stream, buffers, [&](StateCache& target, void* s) {
    return state_cache_materialize(target, args, s);
  });
}

void read_records(PyCache& self, int slot, std::int64_t first, nb::handle vec, nb::handle key,
                  nb::handle key_scale, nb::handle write, nb::handle decay, nb::handle stream,
                  nb::handle buffers) {
  constexpr const char* op = "read_records";
  require_replay(self, [&] { return state_cache_read_records(*self.cache, slot, 0, {}); });
  const std::uint32_t p = position_arg(op, first);
  ArrayReader reader;
  Array v;
  const CacheRecords r = read_record_arrays(reader, self, op, vec, key, key_scale, write, decay,
                                            Access::kWrite, &v);
  void* s = op_stream(self, stream, reader, v);
  std::unique_ptr<StateCache> holder;
  StateCache& target = op_target(self, buffers, reader, op, s, &holder);
  run(self, true, [&] { return state_cache_read_records(target, slot, p, r, s); });
}

void restore(PyCache& self, int slot, std::int64_t position, nb::handle states, nb::handle vec,
             nb::handle key, nb::handle key_scale, nb::handle write, nb::handle decay,
             nb::handle stream, nb::handle buffers, nb::handle conv_window) {
  constexpr const char* op = "restore";
  require_replay(self, [&] { return state_cache_restore(*self.cache, {}); });
  RestoreArgs args;
  args.slot = slot;
  args.position = position_arg(op, position);
  ArrayReader reader;
  const Array st = reader.read(states, op, "states", Access::kRead);
  const StateDims d = self.config().dims();
  expect(op, st, Elem::kF32, {self.config().num_layers, d.heads, d.rows, d.cols},
         "([num_layers, heads, rows, cols])", self.config().device, self.device_id);
  args.states = static_cast<const float*>(st.data);
  const bool no_records = vec.is_none() && key.is_none() && key_scale.is_none() &&
                          write.is_none() && decay.is_none();
  if (!no_records) {
    args.records =
        read_record_arrays(reader, self, op, vec, key, key_scale, write, decay, Access::kRead);
  }
  // Conv caches need it and others refuse it: the library says so; the shape is checked here.
  if (!conv_window.is_none()) {
    const StateCacheConfig& c = self.config();
    const Array w = reader.read(conv_window, op, "conv_window", Access::kRead);
    if (c.conv_kernel > 0) {
      expect(op, w, elem_of(c.input_dtype), {c.num_layers, c.conv_kernel - 1, c.conv_channels()},
             "([num_layers, conv_kernel - 1, conv_channels])", c.device, self.device_id);
    }
    args.conv_window = w.data;
  }
  void* s = op_stream(self, stream, reader, st);
  std::unique_ptr<StateCache> holder;
  StateCache& target = op_target(self, buffers, reader, op, s, &holder);
  run(self, true, [&] { return state_cache_restore(target, args, s); });
}

void fork(PyCache& self, nb::handle src_slots, nb::handle dst_slots, nb::handle positions,
          nb::handle stream, nb::handle buffers) {
  require_replay(self, [&] { return state_cache_fork(*self.cache, {}); });
  RowsCall call(self, "fork", src_slots, "src_slots");
  ForkArgs args;
  args.batch = call.batch;
  args.src_slots = call.ids();
  args.dst_slots = call.slots(dst_slots, "dst_slots");
  args.positions = call.positions(positions);
  call.run_on(stream, buffers, [&](StateCache& target, void* s) {
    return state_cache_fork(target, args, s);
  });
}

void truncate(PyCache& self, nb::handle slot_ids, nb::handle positions, nb::handle stream,
              nb::handle buffers) {
  require_replay(self, [&] { return state_cache_truncate(*self.cache, {}); });
  RowsCall call(self, "truncate", slot_ids, "slot_ids");
  TruncateArgs args;
  args.batch = call.batch;
  args.slot_ids = call.ids();
  args.positions = call.positions(positions);
  call.run_on(stream, buffers, [&](StateCache& target, void* s) {
    return state_cache_truncate(target, args, s);
  });
}

}  // namespace

void bind_prefix(nb::class_<PyCache>& cls) {
  cls.def("materialize", &materialize, nb::arg("slot_ids"), nb::arg("positions"),
          nb::arg("out"), nb::arg("stream").none(), nb::arg("buffers").none())
      .def("read_records", &read_records, nb::arg("slot"), nb::arg("first"), nb::arg("vec"),
           nb::arg("key"), nb::arg("key_scale").none(), nb::arg("write"), nb::arg("decay"),
           nb::arg("stream").none(), nb::arg("buffers").none())
      .def("restore", &restore, nb::arg("slot"), nb::arg("position"), nb::arg("states"),
           nb::arg("vec").none(), nb::arg("key").none(), nb::arg("key_scale").none(),
           nb::arg("write").none(), nb::arg("decay").none(), nb::arg("stream").none(),
           nb::arg("buffers").none(), nb::arg("conv_window").none() = nb::none())
      .def("fork", &fork, nb::arg("src_slots"), nb::arg("dst_slots"), nb::arg("positions"),
           nb::arg("stream").none(), nb::arg("buffers").none())
      .def("truncate", &truncate, nb::arg("slot_ids"), nb::arg("positions"),
           nb::arg("stream").none(), nb::arg("buffers").none());
}

}  // namespace replayssm::python
