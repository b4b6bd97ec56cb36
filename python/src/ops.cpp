// replayssm._C.mamba2_decode / gdn_decode: every array checked against the cache's
// configuration (shape, dtype, device, layout) before the library, which checks the rest
// (layer, slots, window, values) before it writes anything.

#include "ops.h"

#include "replayssm/ops.h"

namespace replayssm::python {

namespace {

// The arrays of one decode call: the slot ids give the batch, the first activation the window
// (T); every further array is read and checked against the cache's configuration on the way
// in. Then the stream, the cache (or a view over copies of its buffers) and the call.
class DecodeCall {
 public:
  DecodeCall(PyCache& self, const char* op, nb::handle slot_ids, nb::handle first,
             const char* first_name, std::int64_t heads, std::int64_t dim, const char* layout)
      : self_(self), op_(op), act_(elem_of(self.config().input_dtype)) {
    ids = reader_.read(slot_ids, op, "slot_ids", Access::kRead);
    batch = dim_of(op, ids, 1, 0, "([batch])");
    first_ = reader_.read(first, op, first_name, Access::kRead);
    T = dim_of(op, first_, 4, 1, layout);
    check_array(ids, Elem::kI32, {batch}, "([batch])");
    check_array(first_, act_, {batch, T, heads, dim}, layout);
  }

  /// Activation [batch, T, heads, dim] in the cache's input dtype.
  const void* activation(nb::handle h, const char* name, std::int64_t heads, std::int64_t dim,
                         const char* layout, Access access = Access::kRead) {
    return read(h, name, act_, {batch, T, heads, dim}, layout, access);
  }
  /// fp32 [batch, T, heads].
  const float* per_token(nb::handle h, const char* name, std::int64_t heads, const char* layout) {
    return static_cast<const float*>(read(h, name, Elem::kF32, {batch, T, heads}, layout));
  }
  /// fp32 [heads] (a layer parameter).
  const float* per_head(nb::handle h, const char* name, std::int64_t heads, const char* layout) {
    return static_cast<const float*>(read(h, name, Elem::kF32, {heads}, layout));
  }
  const void* first() const { return first_.data; }

  /// Runs `call(target, stream)` on the cache the op acts on. CPU decodes run without the GIL
  /// (they take milliseconds and threads of their own); CUDA decodes only enqueue kernels.
  template <typename Call>
  void run(nb::handle stream, nb::handle buffers, Call&& call) {
    void* st = op_stream(self_, stream, reader_, first_);
    std::unique_ptr<StateCache> holder;
    StateCache& target = op_target(self_, buffers, reader_, op_, st, &holder);
    Status status;
    if (self_.config().device == Device::kCpu) {
      nb::gil_scoped_release unlocked;
      status = call(target, st);
    } else {
      status = call(target, st);
    }
    check(status);
  }

  Array ids;
  std::int64_t batch = 0;
  std::int64_t T = 0;

 private:
  const void* read(nb::handle h, const char* name, Elem elem,
                   std::initializer_list<std::int64_t> shape, const char* layout,
                   Access access = Access::kRead) {
    const Array a = reader_.read(h, op_, name, access);
    check_array(a, elem, shape, layout);
    return a.data;
  }
  void check_array(const Array& a, Elem elem, std::initializer_list<std::int64_t> shape,
                   const char* layout) {
    expect(op_, a, elem, shape, layout, self_.config().device, self_.device_id);
  }

  PyCache& self_;
  const char* op_;
  Elem act_;
  ArrayReader reader_;
  Array first_;
};

void mamba2_decode(PyCache& self, int layer, nb::handle slot_ids, nb::handle x, nb::handle dt,
                   nb::handle B, nb::handle C, nb::handle A, nb::handle D, nb::handle dt_bias,
                   nb::handle z, nb::handle out, nb::handle stream, nb::handle buffers) {
  // On a cache of the other kind, the library's own message.
  if (self.config().kind != LayerKind::kMamba2) check(replayssm::mamba2_decode(*self.cache, {}));
  const Mamba2Shape& s = self.config().mamba2;
  constexpr const char* kHeads = "([batch, T, nheads, head_dim])";
  constexpr const char* kGroups = "([batch, T, ngroups, dstate])";
  DecodeCall call(self, "mamba2_decode", slot_ids, x, "x", s.nheads, s.head_dim, kHeads);
  Mamba2DecodeArgs args;
  args.layer = layer;
  args.batch = static_cast<int>(call.batch);
  args.num_tokens = static_cast<int>(call.T);
  args.slot_ids = static_cast<const std::int32_t*>(call.ids.data);
  args.x = call.first();
  args.dt = call.per_token(dt, "dt", s.nheads, "([batch, T, nheads])");
  args.B = call.activation(B, "B", s.ngroups, s.dstate, kGroups);
  args.C = call.activation(C, "C", s.ngroups, s.dstate, kGroups);
  if (!z.is_none()) args.z = call.activation(z, "z", s.nheads, s.head_dim, kHeads);
  args.A = call.per_head(A, "A", s.nheads, "([nheads])");
  args.D = call.per_head(D, "D", s.nheads, "([nheads])");
  args.dt_bias = call.per_head(dt_bias, "dt_bias", s.nheads, "([nheads])");
  args.y = const_cast<void*>(
      call.activation(out, "out", s.nheads, s.head_dim, kHeads, Access::kWrite));
  call.run(stream, buffers, [&](StateCache& target, void* st) {
    return replayssm::mamba2_decode(target, args, st);
  });
}

void gdn_decode(PyCache& self, int layer, nb::handle slot_ids, nb::handle q, nb::handle k,
                nb::handle v, nb::handle g, nb::handle beta, float scale, bool qk_l2norm,
                nb::handle out, nb::handle stream, nb::handle buffers) {
  if (self.config().kind != LayerKind::kGdn) check(replayssm::gdn_decode(*self.cache, {}));
  const GdnShape& s = self.config().gdn;
  constexpr const char* kKeys = "([batch, T, num_k_heads, head_k_dim])";
  constexpr const char* kValues = "([batch, T, num_v_heads, head_v_dim])";
  constexpr const char* kScalars = "([batch, T, num_v_heads])";
  DecodeCall call(self, "gdn_decode", slot_ids, q, "q", s.num_k_heads, s.head_k_dim, kKeys);
  GdnDecodeArgs args;
  args.layer = layer;
  args.batch = static_cast<int>(call.batch);
  args.num_tokens = static_cast<int>(call.T);
  args.slot_ids = static_cast<const std::int32_t*>(call.ids.data);
  args.q = call.first();
  args.k = call.activation(k, "k", s.num_k_heads, s.head_k_dim, kKeys);
  args.v = call.activation(v, "v", s.num_v_heads, s.head_v_dim, kValues);
  args.g = call.per_token(g, "g", s.num_v_heads, kScalars);
  args.beta = call.per_token(beta, "beta", s.num_v_heads, kScalars);
  args.qk_l2norm = qk_l2norm;
  args.scale = scale;
  args.o = const_cast<void*>(
      call.activation(out, "out", s.num_v_heads, s.head_v_dim, kValues, Access::kWrite));
  call.run(stream, buffers, [&](StateCache& target, void* st) {
    return replayssm::gdn_decode(target, args, st);
  });
}

}  // namespace

void bind_ops(nb::module_& m) {
  m.def("mamba2_decode", &mamba2_decode, nb::arg("cache"), nb::arg("layer"), nb::arg("slot_ids"),
        nb::arg("x"), nb::arg("dt"), nb::arg("B"), nb::arg("C"), nb::arg("A"), nb::arg("D"),
        nb::arg("dt_bias"), nb::arg("z").none(), nb::arg("out"), nb::arg("stream").none(),
        nb::arg("buffers").none());
  m.def("gdn_decode", &gdn_decode, nb::arg("cache"), nb::arg("layer"), nb::arg("slot_ids"),
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("scale"),
        nb::arg("qk_l2norm"), nb::arg("out"), nb::arg("stream").none(), nb::arg("buffers").none());
}

}  // namespace replayssm::python
