// replayssm._C.mamba2_decode / gdn_decode: every array checked against the cache's
// configuration (shape, dtype, device, layout) before the library, which checks the rest
// (layer, slots, window, values) before it writes anything.

#include "ops.h"

#include "replayssm/ops.h"

namespace replayssm::python {

namespace {

// Runs `call` on the cache; CPU decodes run without the GIL (they take milliseconds and
// threads of their own), CUDA decodes only enqueue kernels and keep it.
template <typename Call>
void run(const StateCacheConfig& c, Call&& call) {
  Status st;
  if (c.device == Device::kCpu) {
    nb::gil_scoped_release unlocked;
    st = call();
  } else {
    st = call();
  }
  check(st);
}

void mamba2_decode(PyCache& self, int layer, nb::handle slot_ids, nb::handle x, nb::handle dt,
                   nb::handle B, nb::handle C, nb::handle A, nb::handle D, nb::handle dt_bias,
                   nb::handle z, nb::handle out, nb::handle stream, nb::handle buffers) {
  constexpr const char* op = "mamba2_decode";
  const StateCacheConfig& c = self.config();
  // On a cache of the other kind, the library's own message.
  if (c.kind != LayerKind::kMamba2) check(replayssm::mamba2_decode(*self.cache, {}));
  const Mamba2Shape& s = c.mamba2;
  const Elem act = elem_of(c.input_dtype);
  const Device dev = c.device;
  const std::int32_t id = self.device_id;
  ArrayReader r;
  const Array ids = r.read(slot_ids, op, "slot_ids", Access::kRead);
  const std::int64_t batch = dim_of(op, ids, 1, 0, "([batch])");
  const Array ax = r.read(x, op, "x", Access::kRead);
  const std::int64_t T = dim_of(op, ax, 4, 1, "([batch, T, nheads, head_dim])");
  expect(op, ids, Elem::kI32, {batch}, "([batch])", dev, id);
  expect(op, ax, act, {batch, T, s.nheads, s.head_dim}, "([batch, T, nheads, head_dim])", dev, id);
  const Array adt = r.read(dt, op, "dt", Access::kRead);
  expect(op, adt, Elem::kF32, {batch, T, s.nheads}, "([batch, T, nheads])", dev, id);
  const Array aB = r.read(B, op, "B", Access::kRead);
  expect(op, aB, act, {batch, T, s.ngroups, s.dstate}, "([batch, T, ngroups, dstate])", dev, id);
  const Array aC = r.read(C, op, "C", Access::kRead);
  expect(op, aC, act, {batch, T, s.ngroups, s.dstate}, "([batch, T, ngroups, dstate])", dev, id);
  Array az;
  if (!z.is_none()) {
    az = r.read(z, op, "z", Access::kRead);
    expect(op, az, act, {batch, T, s.nheads, s.head_dim}, "([batch, T, nheads, head_dim])", dev, id);
  }
  const Array aA = r.read(A, op, "A", Access::kRead);
  expect(op, aA, Elem::kF32, {s.nheads}, "([nheads])", dev, id);
  const Array aD = r.read(D, op, "D", Access::kRead);
  expect(op, aD, Elem::kF32, {s.nheads}, "([nheads])", dev, id);
  const Array abias = r.read(dt_bias, op, "dt_bias", Access::kRead);
  expect(op, abias, Elem::kF32, {s.nheads}, "([nheads])", dev, id);
  const Array ay = r.read(out, op, "out", Access::kWrite);
  expect(op, ay, act, {batch, T, s.nheads, s.head_dim}, "([batch, T, nheads, head_dim])", dev, id);

  void* st = op_stream(self, stream, r, ax);
  std::unique_ptr<StateCache> holder;
  StateCache& target = op_target(self, buffers, r, op, st, &holder);
  Mamba2DecodeArgs args;
  args.layer = layer;
  args.batch = static_cast<int>(batch);
  args.num_tokens = static_cast<int>(T);
  args.slot_ids = static_cast<const std::int32_t*>(ids.data);
  args.x = ax.data;
  args.dt = static_cast<const float*>(adt.data);
  args.B = aB.data;
  args.C = aC.data;
  args.z = z.is_none() ? nullptr : az.data;
  args.A = static_cast<const float*>(aA.data);
  args.D = static_cast<const float*>(aD.data);
  args.dt_bias = static_cast<const float*>(abias.data);
  args.y = ay.data;
  run(c, [&] { return replayssm::mamba2_decode(target, args, st); });
}

void gdn_decode(PyCache& self, int layer, nb::handle slot_ids, nb::handle q, nb::handle k,
                nb::handle v, nb::handle g, nb::handle beta, float scale, bool qk_l2norm,
                nb::handle out, nb::handle stream, nb::handle buffers) {
  constexpr const char* op = "gdn_decode";
  const StateCacheConfig& c = self.config();
  if (c.kind != LayerKind::kGdn) check(replayssm::gdn_decode(*self.cache, {}));
  const GdnShape& s = c.gdn;
  const Elem act = elem_of(c.input_dtype);
  const Device dev = c.device;
  const std::int32_t id = self.device_id;
  ArrayReader r;
  const Array ids = r.read(slot_ids, op, "slot_ids", Access::kRead);
  const std::int64_t batch = dim_of(op, ids, 1, 0, "([batch])");
  const Array aq = r.read(q, op, "q", Access::kRead);
  const std::int64_t T = dim_of(op, aq, 4, 1, "([batch, T, num_k_heads, head_k_dim])");
  expect(op, ids, Elem::kI32, {batch}, "([batch])", dev, id);
  expect(op, aq, act, {batch, T, s.num_k_heads, s.head_k_dim},
         "([batch, T, num_k_heads, head_k_dim])", dev, id);
  const Array ak = r.read(k, op, "k", Access::kRead);
  expect(op, ak, act, {batch, T, s.num_k_heads, s.head_k_dim},
         "([batch, T, num_k_heads, head_k_dim])", dev, id);
  const Array av = r.read(v, op, "v", Access::kRead);
  expect(op, av, act, {batch, T, s.num_v_heads, s.head_v_dim},
         "([batch, T, num_v_heads, head_v_dim])", dev, id);
  const Array ag = r.read(g, op, "g", Access::kRead);
  expect(op, ag, Elem::kF32, {batch, T, s.num_v_heads}, "([batch, T, num_v_heads])", dev, id);
  const Array abeta = r.read(beta, op, "beta", Access::kRead);
  expect(op, abeta, Elem::kF32, {batch, T, s.num_v_heads}, "([batch, T, num_v_heads])", dev, id);
  const Array ao = r.read(out, op, "out", Access::kWrite);
  expect(op, ao, act, {batch, T, s.num_v_heads, s.head_v_dim},
         "([batch, T, num_v_heads, head_v_dim])", dev, id);

  void* st = op_stream(self, stream, r, aq);
  std::unique_ptr<StateCache> holder;
  StateCache& target = op_target(self, buffers, r, op, st, &holder);
  GdnDecodeArgs args;
  args.layer = layer;
  args.batch = static_cast<int>(batch);
  args.num_tokens = static_cast<int>(T);
  args.slot_ids = static_cast<const std::int32_t*>(ids.data);
  args.q = aq.data;
  args.k = ak.data;
  args.v = av.data;
  args.g = static_cast<const float*>(ag.data);
  args.beta = static_cast<const float*>(abeta.data);
  args.qk_l2norm = qk_l2norm;
  args.scale = scale;
  args.o = ao.data;
  run(c, [&] { return replayssm::gdn_decode(target, args, st); });
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
