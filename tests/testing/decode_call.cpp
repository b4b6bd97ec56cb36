#include "testing/decode_call.h"

#include <cmath>

#include "testing/dtypes.h"

namespace replayssm::testing {

namespace {

CacheBuffer upload_activation(Device dev, DType dtype, const std::vector<float>& v) {
  const std::vector<std::uint8_t> bytes = encode(dtype, v);
  return CacheBuffer::from_host(dev, bytes.data(), bytes.size());
}

CacheBuffer poisoned_output(Device dev, DType dtype, std::size_t n) {
  return upload_activation(dev, dtype, std::vector<float>(n, std::nanf("")));
}

}  // namespace

Mamba2Call make_mamba2_call(const StateCache& cache, int layer,
                            const std::vector<std::int32_t>& slot_ids, const Mamba2Layer& p,
                            const Mamba2Tokens& t) {
  const StateCacheConfig& c = cache.config();
  const Device dev = c.device;
  const DType in = c.input_dtype;
  Mamba2Call call;
  call.slots = CacheBuffer::from_vector(dev, slot_ids);
  call.x = upload_activation(dev, in, t.x);
  call.dt = CacheBuffer::from_vector(dev, t.dt);
  call.B = upload_activation(dev, in, t.B);
  call.C = upload_activation(dev, in, t.C);
  if (!t.z.empty()) call.z = upload_activation(dev, in, t.z);
  call.A = CacheBuffer::from_vector(dev, p.A);
  call.D = CacheBuffer::from_vector(dev, p.D);
  call.dt_bias = CacheBuffer::from_vector(dev, p.dt_bias);
  call.y = poisoned_output(dev, in, t.x.size());
  call.dtype = in;
  call.out_elems = t.x.size();
  Mamba2DecodeArgs& a = call.args;
  a.layer = layer;
  a.batch = t.batch;
  a.num_tokens = t.T;
  a.slot_ids = call.slots.as<const std::int32_t>();
  a.x = call.x.get();
  a.dt = call.dt.as<const float>();
  a.B = call.B.get();
  a.C = call.C.get();
  a.z = t.z.empty() ? nullptr : call.z.get();
  a.A = call.A.as<const float>();
  a.D = call.D.as<const float>();
  a.dt_bias = call.dt_bias.as<const float>();
  a.y = call.y.get();
  return call;
}

GdnCall make_gdn_call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slot_ids,
                      const GdnTokens& t, bool qk_l2norm, float scale) {
  const StateCacheConfig& c = cache.config();
  const Device dev = c.device;
  const DType in = c.input_dtype;
  GdnCall call;
  call.slots = CacheBuffer::from_vector(dev, slot_ids);
  call.q = upload_activation(dev, in, t.q);
  call.k = upload_activation(dev, in, t.k);
  call.v = upload_activation(dev, in, t.v);
  call.g = CacheBuffer::from_vector(dev, t.g);
  call.beta = CacheBuffer::from_vector(dev, t.beta);
  call.o = poisoned_output(dev, in, t.v.size());
  call.dtype = in;
  call.out_elems = t.v.size();
  GdnDecodeArgs& a = call.args;
  a.layer = layer;
  a.batch = t.batch;
  a.num_tokens = t.T;
  a.slot_ids = call.slots.as<const std::int32_t>();
  a.q = call.q.get();
  a.k = call.k.get();
  a.v = call.v.get();
  a.g = call.g.as<const float>();
  a.beta = call.beta.as<const float>();
  a.qk_l2norm = qk_l2norm;
  a.scale = scale;
  a.o = call.o.get();
  return call;
}

std::vector<float> Mamba2Call::output() const {
  std::vector<std::uint8_t> bytes = y.bytes();
  return decode(dtype, bytes.data(), out_elems);
}

std::vector<float> GdnCall::output() const {
  std::vector<std::uint8_t> bytes = o.bytes();
  return decode(dtype, bytes.data(), out_elems);
}

}  // namespace replayssm::testing
