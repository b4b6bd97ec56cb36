// replayssm._C.mamba2_decode / gdn_decode: every array checked against the cache's
// configuration (shape, dtype, device, layout) before the library, which checks the rest
// (layer, slots, window, values) before it writes anything.

#include "ops.h"

#include "replayssm/ops.h"

namespace replayssm::python {

namespace {

// The arrays of one decode call: the slot ids give the batch, the first activation (or, on a
// conv cache, the pre-conv inputs) the window (T); every further array is read and checked
// against the cache's configuration on the way in. Then the stream, the cache (or a view over
// copies of its buffers) and the call.
class DecodeCall {
 public:
  /// `inputs` names the activations the conv replaces, for the messages ("x, B, C").
  DecodeCall(PyCache& self, const char* op, nb::handle slot_ids, const char* inputs)
      : self_(self), op_(op), inputs_(inputs), act_(elem_of(self.config().input_dtype)) {
    ids = reader_.read(slot_ids, op, "slot_ids", Access::kRead);
    batch = dim_of(op, ids, 1, 0, "([batch])");
    check_array(ids, Elem::kI32, {batch}, "([batch])");
  }

  [[nodiscard]] bool conv_cache() const { return self_.config().conv_kernel > 0; }

  /// The window: on a conv cache its pre-conv inputs (into `conv`; `first_h` must be None),
  /// else the first activation, whose pointer it returns (null on a conv cache). Gives T.
  const void* window(nb::handle first_h, const char* name, std::int64_t heads, std::int64_t dim,
                     const char* layout, nb::handle conv_in, nb::handle conv_weight,
                     nb::handle conv_bias, ConvInputs* conv_out) {
    if (conv_cache()) {
      *conv_out = conv(conv_in, conv_weight, conv_bias);
      return after_conv(first_h, name, heads, dim, layout);  // None, or refused
    }
    refuse_conv(conv_in);
    return first(first_h, name, heads, dim, layout);
  }

  /// Further activations after the conv (x's B and C, GDN's k and v): None on a conv cache.
  const void* after_conv(nb::handle h, const char* name, std::int64_t heads, std::int64_t dim,
                         const char* layout) {
    if (conv_cache()) {
      if (!h.is_none()) {
        raise_value(std::string(op_) + ": a conv cache (conv_kernel > 0) takes the pre-conv "
                    "inputs (conv_in), not " + inputs_);
      }
      return nullptr;
    }
    if (h.is_none()) raise_value(std::string(op_) + ": " + name + " is required");
    return activation(h, name, heads, dim, layout);
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
  /// The window's first activation [batch, T, heads, dim] (a cache without a conv): gives T.
  const void* first(nb::handle h, const char* name, std::int64_t heads, std::int64_t dim,
                    const char* layout) {
    if (h.is_none()) raise_value(std::string(op_) + ": " + name + " is required");
    first_ = reader_.read(h, op_, name, Access::kRead);
    T = dim_of(op_, first_, 4, 1, layout);
    check_array(first_, act_, {batch, T, heads, dim}, layout);
    return first_.data;
  }

  /// A conv cache's pre-conv inputs [batch, T, conv_channels] (token rows: a column slice of
  /// the in-projection's output), its conv1d weight float32 [conv_channels, conv_kernel] and
  /// bias [conv_channels] or None: gives T.
  ConvInputs conv(nb::handle in, nb::handle weight, nb::handle bias) {
    if (in.is_none() || weight.is_none()) {
      raise_value(std::string(op_) + ": a conv cache needs conv_in and conv_weight");
    }
    const StateCacheConfig& c = self_.config();
    const std::int64_t C = c.conv_channels(), K = c.conv_kernel;
    constexpr const char* kLayout = "([batch, T, conv_channels])";
    first_ = reader_.read(in, op_, "conv_in", Access::kRead);
    T = dim_of(op_, first_, 3, 1, kLayout);
    expect(op_, first_, act_, {batch, T, C}, kLayout, c.device, self_.device_id,
           Placement::kCacheDevice, Contiguity::kTokenRows);
    ConvInputs out;
    out.in = first_.data;
    out.stride = token_row_stride(first_);
    out.weight = static_cast<const float*>(
        read(weight, "conv_weight", Elem::kF32, {C, K}, "([conv_channels, conv_kernel])"));
    if (!bias.is_none()) {
      out.bias = static_cast<const float*>(
          read(bias, "conv_bias", Elem::kF32, {C}, "([conv_channels])"));
    }
    return out;
  }

  /// A cache without a conv refuses pre-conv inputs.
  void refuse_conv(nb::handle in) const {
    if (!in.is_none()) {
      raise_value(std::string(op_) + ": conv_in needs a cache with conv_kernel > 0; this one "
                  "takes " + inputs_ + " after the conv");
    }
  }

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
  const char* inputs_;
  Elem act_;
  ArrayReader reader_;
  Array first_;
};

void mamba2_decode(PyCache& self, int layer, nb::handle slot_ids, nb::handle x, nb::handle dt,
                   nb::handle B, nb::handle C, nb::handle A, nb::handle D, nb::handle dt_bias,
                   nb::handle z, nb::handle out, nb::handle stream, nb::handle buffers,
                   nb::handle conv_in, nb::handle conv_weight, nb::handle conv_bias,
                   int fold_every) {
  // On a cache of the other kind, the library's own message.
  if (self.config().kind != LayerKind::kMamba2) check(replayssm::mamba2_decode(*self.cache, {}));
  const Mamba2Shape& s = self.config().mamba2;
  constexpr const char* kHeads = "([batch, T, nheads, head_dim])";
  constexpr const char* kGroups = "([batch, T, ngroups, dstate])";
  DecodeCall call(self, "mamba2_decode", slot_ids, "x, B, C");
  Mamba2DecodeArgs args;
  args.x = call.window(x, "x", s.nheads, s.head_dim, kHeads, conv_in, conv_weight, conv_bias,
                       &args.conv);
  args.layer = layer;
  args.batch = static_cast<int>(call.batch);
  args.num_tokens = static_cast<int>(call.T);
  args.fold_every = fold_every;
  args.slot_ids = static_cast<const std::int32_t*>(call.ids.data);
  args.dt = call.per_token(dt, "dt", s.nheads, "([batch, T, nheads])");
  args.B = call.after_conv(B, "B", s.ngroups, s.dstate, kGroups);
  args.C = call.after_conv(C, "C", s.ngroups, s.dstate, kGroups);
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
                nb::handle out, nb::handle stream, nb::handle buffers, nb::handle conv_in,
                nb::handle conv_weight, nb::handle conv_bias, int fold_every) {
  if (self.config().kind != LayerKind::kGdn) check(replayssm::gdn_decode(*self.cache, {}));
  const GdnShape& s = self.config().gdn;
  constexpr const char* kKeys = "([batch, T, num_k_heads, head_k_dim])";
  constexpr const char* kValues = "([batch, T, num_v_heads, head_v_dim])";
  constexpr const char* kScalars = "([batch, T, num_v_heads])";
  DecodeCall call(self, "gdn_decode", slot_ids, "q, k, v");
  GdnDecodeArgs args;
  args.q = call.window(q, "q", s.num_k_heads, s.head_k_dim, kKeys, conv_in, conv_weight,
                       conv_bias, &args.conv);
  args.layer = layer;
  args.batch = static_cast<int>(call.batch);
  args.num_tokens = static_cast<int>(call.T);
  args.fold_every = fold_every;
  args.slot_ids = static_cast<const std::int32_t*>(call.ids.data);
  args.k = call.after_conv(k, "k", s.num_k_heads, s.head_k_dim, kKeys);
  args.v = call.after_conv(v, "v", s.num_v_heads, s.head_v_dim, kValues);
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
        nb::arg("x").none(), nb::arg("dt"), nb::arg("B").none(), nb::arg("C").none(), nb::arg("A"),
        nb::arg("D"), nb::arg("dt_bias"), nb::arg("z").none(), nb::arg("out"),
        nb::arg("stream").none(), nb::arg("buffers").none(), nb::arg("conv_in").none() = nb::none(),
        nb::arg("conv_weight").none() = nb::none(), nb::arg("conv_bias").none() = nb::none(),
        nb::arg("fold_every") = 0);
  m.def("gdn_decode", &gdn_decode, nb::arg("cache"), nb::arg("layer"), nb::arg("slot_ids"),
        nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(), nb::arg("g"),
        nb::arg("beta"), nb::arg("scale"), nb::arg("qk_l2norm"), nb::arg("out"),
        nb::arg("stream").none(), nb::arg("buffers").none(), nb::arg("conv_in").none() = nb::none(),
        nb::arg("conv_weight").none() = nb::none(), nb::arg("conv_bias").none() = nb::none(),
        nb::arg("fold_every") = 0);
}

}  // namespace replayssm::python
