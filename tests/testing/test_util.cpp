#include "testing/test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

#include "backend.h"
#include "common/numeric.h"
#include "cpu/reference.h"

namespace replayssm::testing {

// ---------------------------------------------------------------------------------------------
// Random numbers

double Rng::uniform(double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(engine_);
}
double Rng::normal(double mean, double sd) {
  return std::normal_distribution<double>(mean, sd)(engine_);
}
int Rng::uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine_); }

// ---------------------------------------------------------------------------------------------
// Dtypes

float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kF32: return v;
    case DType::kBF16: return to_float(float_to_bf16(v));
    case DType::kF16: return to_float(float_to_f16(v));
    case DType::kF8E4M3: return to_float(float_to_fp8e4m3(v));
  }
  return v;
}

void round_all(DType dtype, std::vector<float>* v) {
  for (float& e : *v) e = round_to(dtype, e);
}

std::vector<std::uint8_t> encode(DType dtype, const std::vector<float>& v) {
  const std::size_t es = dtype_size(dtype);
  std::vector<std::uint8_t> out(v.size() * es);
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint8_t* dst = out.data() + i * es;
    switch (dtype) {
      case DType::kF32: std::memcpy(dst, &v[i], 4); break;
      case DType::kBF16: {
        const bf16_t b = float_to_bf16(v[i]);
        std::memcpy(dst, &b.bits, 2);
        break;
      }
      case DType::kF16: {
        const f16_t h = float_to_f16(v[i]);
        std::memcpy(dst, &h.bits, 2);
        break;
      }
      case DType::kF8E4M3: *dst = float_to_fp8e4m3(v[i]).bits; break;
    }
  }
  return out;
}

float decode_elem(DType dtype, const void* data, std::size_t i) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::kBF16: {
      bf16_t b;
      std::memcpy(&b.bits, p + 2 * i, 2);
      return to_float(b);
    }
    case DType::kF16: {
      f16_t h;
      std::memcpy(&h.bits, p + 2 * i, 2);
      return to_float(h);
    }
    case DType::kF8E4M3: return to_float(fp8e4m3_t{p[i]});
  }
  return 0.0f;
}

std::vector<float> decode(DType dtype, const void* data, std::size_t n) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = decode_elem(dtype, data, i);
  return out;
}

bool all_finite(const float* v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return false;
  }
  return true;
}

double rel_error(const float* out, const double* ref, std::size_t n) {
  double max_diff = 0.0, max_ref = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(double(out[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

double rel_error(const std::vector<float>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  return rel_error(out.data(), ref.data(), out.size());
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, std::size_t begin,
                    std::size_t end) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = begin; i < end; ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return den > 0.0 ? num / den : num;
}

// ---------------------------------------------------------------------------------------------
// Cache memory

namespace {
void throw_if_error(const Status& s, const char* what) {
  if (!s.is_ok()) throw std::runtime_error(std::string(what) + ": " + s.to_string());
}
}  // namespace

CacheBuffer::CacheBuffer(Device device, std::size_t bytes) : device_(device), size_(bytes) {
  throw_if_error(memory_alloc(device, bytes == 0 ? 1 : bytes, &ptr_), "CacheBuffer alloc");
}

CacheBuffer::~CacheBuffer() {
  if (ptr_ != nullptr) memory_free(device_, ptr_);
}

CacheBuffer::CacheBuffer(CacheBuffer&& o) noexcept
    : device_(o.device_), ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}

CacheBuffer& CacheBuffer::operator=(CacheBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) memory_free(device_, ptr_);
    device_ = o.device_;
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

CacheBuffer CacheBuffer::from_host(Device device, const void* data, std::size_t bytes) {
  CacheBuffer b(device, bytes);
  if (bytes > 0) b.upload(data, bytes);
  return b;
}

void CacheBuffer::upload(const void* data, std::size_t bytes) {
  throw_if_error(memory_from_host(device_, ptr_, data, bytes), "CacheBuffer upload");
}

void CacheBuffer::download(void* data, std::size_t bytes) const {
  throw_if_error(memory_to_host(device_, data, ptr_, bytes), "CacheBuffer download");
}

std::vector<std::uint8_t> CacheBuffer::bytes() const {
  std::vector<std::uint8_t> out(size_);
  if (size_ > 0) download(out.data(), size_);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Raw views of a cache's buffers

std::vector<BufferView> layout_buffers(const StateCacheLayout& l) {
  const int L = l.config.num_layers;
  const std::size_t se = static_cast<std::size_t>(l.state_elems());
  const std::size_t rc = static_cast<std::size_t>(l.ring_capacity);
  const std::size_t in = dtype_size(l.config.input_dtype);
  std::vector<BufferView> v;
  auto add = [&](const char* name, const void* p, int layers, std::size_t per_slot) {
    if (p != nullptr) v.push_back({name, p, layers, per_slot});
  };
  add("state", l.state, L, se * dtype_size(l.config.state_dtype));
  add("ckpt_hi", l.ckpt_hi, L, se * 4);
  add("ckpt_lo", l.ckpt_lo, L, se * dtype_size(l.lo_dtype()));
  add("ckpt_lo_scale", l.ckpt_lo_scale, L, static_cast<std::size_t>(l.state_rows()) * 4);
  add("ring_vec", l.ring_vec, L, rc * static_cast<std::size_t>(l.vec_elems()) * in);
  add("ring_key", l.ring_key, L, rc * static_cast<std::size_t>(l.key_elems()) * in);
  add("ring_key_scale", l.ring_key_scale, L,
      rc * static_cast<std::size_t>(l.dims.key_heads) * 4);
  add("ring_write", l.ring_write, L, rc * static_cast<std::size_t>(l.dims.heads) * 4);
  add("ring_decay", l.ring_decay, L, rc * static_cast<std::size_t>(l.dims.heads) * 4);
  add("committed", l.committed, 1, 4);
  add("folded", l.folded, L, 4);
  add("pending", l.pending, 1, 1);
  add("allocated", l.allocated, 1, 1);
  return v;
}

const std::vector<std::uint8_t>& CacheBytes::operator[](const std::string& name) const {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return data[i];
  }
  throw std::runtime_error("CacheBytes: no buffer " + name);
}

CacheBytes snapshot(const StateCache& cache, const std::vector<std::string>& names) {
  const StateCacheLayout& l = cache.layout();
  CacheBytes out;
  for (const BufferView& b : layout_buffers(l)) {
    if (!names.empty() && std::find(names.begin(), names.end(), b.name) == names.end()) continue;
    std::vector<std::uint8_t> bytes(b.total_bytes(l.config.capacity));
    throw_if_error(memory_to_host(l.config.device, bytes.data(), b.ptr, bytes.size()),
                   "snapshot");
    out.names.push_back(b.name);
    out.data.push_back(std::move(bytes));
  }
  return out;
}

CacheBytes snapshot(const StateCache& cache) { return snapshot(cache, {}); }

std::string diff(const CacheBytes& a, const CacheBytes& b) {
  if (a.names != b.names) return "different buffer sets";
  for (std::size_t i = 0; i < a.names.size(); ++i) {
    if (a.data[i].size() != b.data[i].size()) return a.names[i] + ": sizes differ";
    for (std::size_t j = 0; j < a.data[i].size(); ++j) {
      if (a.data[i][j] != b.data[i][j]) {
        return a.names[i] + " differs at byte " + std::to_string(j) + " (of " +
               std::to_string(a.data[i].size()) + ")";
      }
    }
  }
  return "";
}

std::vector<std::uint8_t> slot_bytes(const StateCache& cache, int slot) {
  const StateCacheLayout& l = cache.layout();
  std::vector<std::uint8_t> out;
  for (const BufferView& b : layout_buffers(l)) {
    for (int layer = 0; layer < b.layers; ++layer) {
      const std::size_t off =
          (std::size_t(layer) * std::size_t(l.config.capacity) + std::size_t(slot)) * b.slot_bytes;
      const std::size_t at = out.size();
      out.resize(at + b.slot_bytes);
      throw_if_error(memory_to_host(l.config.device, out.data() + at,
                                    static_cast<const std::uint8_t*>(b.ptr) + off, b.slot_bytes),
                     "slot_bytes");
    }
  }
  return out;
}

std::uint32_t cursor_committed(const StateCache& cache, int slot) {
  std::uint32_t v = 0;
  throw_if_error(memory_to_host(cache.config().device, &v, cache.layout().committed + slot, 4),
                 "cursor");
  return v;
}

std::uint32_t cursor_folded(const StateCache& cache, int layer, int slot) {
  std::uint32_t v = 0;
  const StateCacheLayout& l = cache.layout();
  throw_if_error(
      memory_to_host(cache.config().device, &v, l.folded + l.layer_slot(layer, slot), 4),
      "cursor");
  return v;
}

int cursor_pending(const StateCache& cache, int slot) {
  std::uint8_t v = 0;
  throw_if_error(memory_to_host(cache.config().device, &v, cache.layout().pending + slot, 1),
                 "cursor");
  return v;
}

// ---------------------------------------------------------------------------------------------
// Layer parameters and token inputs

namespace {

// n activations: N(0, sd) or, structured, sin(0.731·i + phase)·sd.
std::vector<float> activations(std::size_t n, double sd, const Recipe& recipe, Rng& rng) {
  std::vector<float> v(n);
  if (recipe.structured) {
    const double phase = rng.uniform(0.0, 6.283185307179586);
    for (std::size_t i = 0; i < n; ++i) v[i] = float(sd * std::sin(0.731 * double(i) + phase));
  } else {
    for (float& e : v) e = float(rng.normal(0.0, sd));
  }
  return v;
}

double softplus_d(double u) { return u > 20.0 ? u : std::log1p(std::exp(u)); }

}  // namespace

Mamba2Layer make_mamba2_layer(const Mamba2Shape& s, const Recipe& r, Rng& rng) {
  Mamba2Layer p;
  for (int h = 0; h < s.nheads; ++h) {
    p.A.push_back(r.a_fixed != 0.0 ? float(r.a_fixed) : float(-std::exp(rng.uniform(-1.0, 1.0))));
    p.D.push_back(float(r.d_scale * rng.uniform(0.5, 1.5)));
    p.dt_bias.push_back(float(r.dt_bias_center + rng.uniform(-0.5, 0.5)));
  }
  return p;
}

Mamba2Tokens make_mamba2_tokens(const Mamba2Shape& s, int batch, int T, DType input_dtype,
                                bool gate, const Recipe& r, Rng& rng) {
  Mamba2Tokens t;
  t.batch = batch;
  t.T = T;
  const std::size_t bt = std::size_t(batch) * T;
  t.x = activations(bt * s.nheads * s.head_dim, 1.0, r, rng);
  t.dt.resize(bt * s.nheads);
  for (float& e : t.dt) e = float(rng.normal(0.0, r.dt_sd));
  t.B = activations(bt * s.ngroups * s.dstate, 1.0, r, rng);
  t.C = activations(bt * s.ngroups * s.dstate, 1.0, r, rng);
  if (gate) t.z = activations(bt * s.nheads * s.head_dim, 1.0, r, rng);
  round_all(input_dtype, &t.x);
  round_all(input_dtype, &t.B);
  round_all(input_dtype, &t.C);
  round_all(input_dtype, &t.z);
  return t;
}

GdnTokens make_gdn_tokens(const GdnShape& s, int batch, int T, DType input_dtype,
                          const Recipe& r, Rng& rng) {
  GdnTokens t;
  t.batch = batch;
  t.T = T;
  const std::size_t bt = std::size_t(batch) * T;
  const double key_sd = r.unit_keys ? 1.0 / std::sqrt(double(s.head_k_dim)) : 1.0;
  t.q = activations(bt * s.num_k_heads * s.head_k_dim, key_sd, r, rng);
  t.k = activations(bt * s.num_k_heads * s.head_k_dim, key_sd, r, rng);
  if (r.key_spread > 0.0) {
    const std::size_t per_token = std::size_t(s.num_k_heads) * s.head_k_dim;
    for (std::size_t i = 0; i < t.k.size(); ++i) {
      const double direction = std::sin(0.37 * double(i % per_token) + 1.0);
      t.k[i] = float(key_sd * (direction + r.key_spread * rng.normal()));
    }
  }
  t.v = activations(bt * s.num_v_heads * s.head_v_dim, 1.0, r, rng);
  t.g.resize(bt * s.num_v_heads);
  t.beta.resize(bt * s.num_v_heads);
  for (float& g : t.g) {
    if (r.g_fixed != 0.0) {
      g = float(r.g_fixed * (1.0 + rng.uniform(-0.1, 0.1)));
    } else {
      // −exp(A_log)·softplus(a + dt_bias), as a model computes it, clamped to [−1, 0).
      const double v = std::exp(rng.uniform(-1.0, 0.5)) * softplus_d(rng.normal() - 3.0);
      g = float(-std::clamp(v, 1e-6, 1.0));
    }
  }
  for (float& b : t.beta) {
    b = r.beta_hi > 0.0 ? float(rng.uniform(r.beta_lo, r.beta_hi))
                        : float(1.0 / (1.0 + std::exp(-rng.normal())));
  }
  round_all(input_dtype, &t.q);
  round_all(input_dtype, &t.k);
  round_all(input_dtype, &t.v);
  return t;
}

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

Status commit(StateCache& cache, const std::vector<std::int32_t>& slot_ids,
              const std::vector<std::int32_t>& accepted) {
  const Device dev = cache.config().device;
  CacheBuffer s = CacheBuffer::from_vector(dev, slot_ids);
  CacheBuffer a = CacheBuffer::from_vector(dev, accepted);
  CommitArgs args;
  args.batch = static_cast<int>(slot_ids.size());
  args.slot_ids = s.as<const std::int32_t>();
  args.accepted = a.as<const std::int32_t>();
  return state_cache_commit(cache, args);
}

Status fold(StateCache& cache, const std::vector<std::int32_t>& slot_ids) {
  CacheBuffer s = CacheBuffer::from_vector(cache.config().device, slot_ids);
  FoldArgs args;
  args.batch = static_cast<int>(slot_ids.size());
  args.slot_ids = s.as<const std::int32_t>();
  return state_cache_fold(cache, args);
}

std::unique_ptr<StateCache> create_cache(const StateCacheConfig& config) {
  std::unique_ptr<StateCache> cache;
  throw_if_error(state_cache_create(config, &cache), "state_cache_create");
  return cache;
}

int allocate_slot(StateCache& cache) {
  int slot = -1;
  throw_if_error(state_cache_allocate_slot(cache, &slot), "state_cache_allocate_slot");
  return slot;
}

Status export_state(StateCache& cache, int layer, int slot, std::vector<float>* out) {
  out->assign(std::size_t(cache.config().dims().state_elems()), 0.0f);
  return state_cache_export_state(cache, layer, slot, out->data());
}

// ---------------------------------------------------------------------------------------------
// Naive same-precision loops

void naive_mamba2_step(const Mamba2Shape& s, DType state_dtype, DType out_dtype,
                       std::vector<float>& state, const float* x, const float* dt, const float* B,
                       const float* C, const float* z, const float* A, const float* D,
                       const float* dt_bias, float* y) {
  const int H = s.nheads, P = s.head_dim, N = s.dstate;
  const int per_group = H / s.ngroups;
  for (int h = 0; h < H; ++h) {
    const int g = h / per_group;
    const float delta = softplus(dt[h] + dt_bias[h]);
    const float a = std::exp(A[h] * delta);
    for (int p = 0; p < P; ++p) {
      const float xp = x[h * P + p];
      float* row = state.data() + (std::size_t(h) * P + p) * N;
      float acc = 0.0f;
      for (int n = 0; n < N; ++n) {
        row[n] = round_to(state_dtype, a * row[n] + delta * xp * B[g * N + n]);
        acc += row[n] * C[g * N + n];
      }
      float out = acc + D[h] * xp;
      if (z != nullptr) out *= silu(z[h * P + p]);
      y[h * P + p] = round_to(out_dtype, out);
    }
  }
}

void naive_gdn_step(const GdnShape& s, DType state_dtype, DType out_dtype,
                    std::vector<float>& state, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, bool qk_l2norm, float scale, float* o) {
  const int Hk = s.num_k_heads, Hv = s.num_v_heads, K = s.head_k_dim, V = s.head_v_dim;
  const int per_key = Hv / Hk;
  const float sc = scale == 0.0f ? 1.0f / std::sqrt(float(K)) : scale;
  std::vector<float> qh(std::size_t(Hk) * K), kh(std::size_t(Hk) * K);
  for (int hk = 0; hk < Hk; ++hk) {
    float qq = 0.0f, kk = 0.0f;
    for (int i = 0; i < K; ++i) {
      qq += q[hk * K + i] * q[hk * K + i];
      kk += k[hk * K + i] * k[hk * K + i];
    }
    const float qn = qk_l2norm ? 1.0f / std::sqrt(qq + 1e-6f) : 1.0f;
    const float kn = qk_l2norm ? 1.0f / std::sqrt(kk + 1e-6f) : 1.0f;
    for (int i = 0; i < K; ++i) {
      qh[hk * K + i] = q[hk * K + i] * qn * sc;
      kh[hk * K + i] = k[hk * K + i] * kn;
    }
  }
  for (int hv = 0; hv < Hv; ++hv) {
    const float* kv = kh.data() + std::size_t(hv / per_key) * K;
    const float* qv = qh.data() + std::size_t(hv / per_key) * K;
    const float alpha = std::exp(g[hv]);
    for (int r = 0; r < V; ++r) {
      float* row = state.data() + (std::size_t(hv) * V + r) * K;
      float sk = 0.0f;
      for (int i = 0; i < K; ++i) sk += row[i] * kv[i];
      const float d = beta[hv] * (v[hv * V + r] - alpha * sk);
      float out = 0.0f;
      for (int i = 0; i < K; ++i) {
        row[i] = round_to(state_dtype, alpha * row[i] + d * kv[i]);
        out += row[i] * qv[i];
      }
      o[hv * V + r] = round_to(out_dtype, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Drivers

namespace {

// Token t of every row of a [batch, T, e] field, as a [batch, 1, e] field.
std::vector<float> gather_token(const std::vector<float>& f, int batch, int T, int t) {
  if (f.empty()) return {};
  const std::size_t e = f.size() / (std::size_t(batch) * T);
  std::vector<float> out(std::size_t(batch) * e);
  for (int b = 0; b < batch; ++b) {
    std::copy_n(f.begin() + std::ptrdiff_t((std::size_t(b) * T + t) * e), e,
                out.begin() + std::ptrdiff_t(std::size_t(b) * e));
  }
  return out;
}

struct Mamba2Family {
  using Tokens = Mamba2Tokens;
  using Call = Mamba2Call;
  const RunSpec& spec;
  Mamba2Shape shape;
  std::vector<Mamba2Layer> params;

  Mamba2Family(const RunSpec& s, Rng& rng) : spec(s), shape(s.cache.mamba2) {
    for (int l = 0; l < s.cache.num_layers; ++l) params.push_back(make_mamba2_layer(shape, s.recipe, rng));
  }
  std::size_t out_per_token() const { return std::size_t(shape.nheads) * shape.head_dim; }
  std::size_t state_elems() const { return std::size_t(state_dims(shape).state_elems()); }
  Tokens tokens(int batch, int T, Rng& rng) const {
    return make_mamba2_tokens(shape, batch, T, spec.cache.input_dtype, spec.gate, spec.recipe, rng);
  }
  Tokens gather(const Tokens& s, int t) const {
    Tokens o;
    o.batch = s.batch;
    o.T = 1;
    o.x = gather_token(s.x, s.batch, s.T, t);
    o.dt = gather_token(s.dt, s.batch, s.T, t);
    o.B = gather_token(s.B, s.batch, s.T, t);
    o.C = gather_token(s.C, s.batch, s.T, t);
    o.z = gather_token(s.z, s.batch, s.T, t);
    return o;
  }
  Call call(const StateCache& c, int layer, const std::vector<std::int32_t>& slots,
            const Tokens& t) const {
    return make_mamba2_call(c, layer, slots, params[std::size_t(layer)], t);
  }
  static Status decode(StateCache& c, const Call& call) { return mamba2_decode(c, call.args); }
  static std::vector<std::uint8_t> raw_output(const Call& call) { return call.y.bytes(); }
  void oracle(int layer, double* S, const Tokens& tk, int b, int t, double* out) const {
    const std::size_t i = std::size_t(b) * tk.T + t;
    const Mamba2Shape& s = shape;
    const Mamba2Layer& p = params[std::size_t(layer)];
    reference::mamba2_reference_step(
        s, S, tk.x.data() + i * s.nheads * s.head_dim, tk.dt.data() + i * s.nheads,
        tk.B.data() + i * s.ngroups * s.dstate, tk.C.data() + i * s.ngroups * s.dstate,
        tk.z.empty() ? nullptr : tk.z.data() + i * s.nheads * s.head_dim, p.A.data(), p.D.data(),
        p.dt_bias.data(), out);
  }
  void naive(int layer, std::vector<float>& S, const Tokens& tk, int b, int t, float* out) const {
    const std::size_t i = std::size_t(b) * tk.T + t;
    const Mamba2Shape& s = shape;
    const Mamba2Layer& p = params[std::size_t(layer)];
    naive_mamba2_step(s, spec.naive_state_dtype, spec.cache.input_dtype, S,
                      tk.x.data() + i * s.nheads * s.head_dim, tk.dt.data() + i * s.nheads,
                      tk.B.data() + i * s.ngroups * s.dstate, tk.C.data() + i * s.ngroups * s.dstate,
                      tk.z.empty() ? nullptr : tk.z.data() + i * s.nheads * s.head_dim,
                      p.A.data(), p.D.data(), p.dt_bias.data(), out);
  }
};

struct GdnFamily {
  using Tokens = GdnTokens;
  using Call = GdnCall;
  const RunSpec& spec;
  GdnShape shape;

  GdnFamily(const RunSpec& s, Rng&) : spec(s), shape(s.cache.gdn) {}
  std::size_t out_per_token() const { return std::size_t(shape.num_v_heads) * shape.head_v_dim; }
  std::size_t state_elems() const { return std::size_t(state_dims(shape).state_elems()); }
  Tokens tokens(int batch, int T, Rng& rng) const {
    return make_gdn_tokens(shape, batch, T, spec.cache.input_dtype, spec.recipe, rng);
  }
  Tokens gather(const Tokens& s, int t) const {
    Tokens o;
    o.batch = s.batch;
    o.T = 1;
    o.q = gather_token(s.q, s.batch, s.T, t);
    o.k = gather_token(s.k, s.batch, s.T, t);
    o.v = gather_token(s.v, s.batch, s.T, t);
    o.g = gather_token(s.g, s.batch, s.T, t);
    o.beta = gather_token(s.beta, s.batch, s.T, t);
    return o;
  }
  Call call(const StateCache& c, int layer, const std::vector<std::int32_t>& slots,
            const Tokens& t) const {
    return make_gdn_call(c, layer, slots, t, spec.qk_l2norm, spec.scale);
  }
  static Status decode(StateCache& c, const Call& call) { return gdn_decode(c, call.args); }
  static std::vector<std::uint8_t> raw_output(const Call& call) { return call.o.bytes(); }
  void oracle(int, double* S, const Tokens& tk, int b, int t, double* out) const {
    const std::size_t i = std::size_t(b) * tk.T + t;
    const GdnShape& s = shape;
    const std::size_t qk = std::size_t(s.num_k_heads) * s.head_k_dim;
    reference::gdn_reference_step(s, S, tk.q.data() + i * qk, tk.k.data() + i * qk,
                                  tk.v.data() + i * s.num_v_heads * s.head_v_dim,
                                  tk.g.data() + i * s.num_v_heads,
                                  tk.beta.data() + i * s.num_v_heads, spec.qk_l2norm, spec.scale,
                                  out);
  }
  void naive(int, std::vector<float>& S, const Tokens& tk, int b, int t, float* out) const {
    const std::size_t i = std::size_t(b) * tk.T + t;
    const GdnShape& s = shape;
    const std::size_t qk = std::size_t(s.num_k_heads) * s.head_k_dim;
    naive_gdn_step(s, spec.naive_state_dtype, spec.cache.input_dtype, S, tk.q.data() + i * qk,
                   tk.k.data() + i * qk, tk.v.data() + i * s.num_v_heads * s.head_v_dim,
                   tk.g.data() + i * s.num_v_heads, tk.beta.data() + i * s.num_v_heads,
                   spec.qk_l2norm, spec.scale, out);
  }
};

template <typename Family>
RunResult run_driver(const RunSpec& spec) {
  RunResult res;
  auto fail = [&](const std::string& msg) {
    if (res.failure.empty()) res.failure = msg;
  };
  const int B = spec.batch, T = spec.window, NL = spec.cache.num_layers;
  const bool replay = spec.cache.mode == DecodeMode::kReplay;
  StateCacheConfig cfg = spec.cache;
  cfg.capacity = B + spec.guard_slots + 1;
  std::unique_ptr<StateCache> cache = create_cache(cfg);

  // Every slot allocated, shuffled onto rows (so row b is rarely slot b), one freed again.
  Rng slot_rng(spec.seed * 7919 + 17);
  std::vector<std::int32_t> all;
  for (int i = 0; i < cfg.capacity; ++i) all.push_back(allocate_slot(*cache));
  std::shuffle(all.begin(), all.end(), slot_rng.engine());
  const std::vector<std::int32_t> row_slot(all.begin(), all.begin() + B);
  const std::vector<std::int32_t> guards(all.begin() + B, all.end() - 1);
  const std::int32_t free_slot = all.back();
  if (Status st = state_cache_free_slot(*cache, free_slot); !st.is_ok()) {
    fail("free_slot: " + st.to_string());
    return res;
  }
  std::vector<std::vector<std::uint8_t>> guard_bytes, row_initial;
  for (std::int32_t g : guards) guard_bytes.push_back(slot_bytes(*cache, g));
  for (std::int32_t s : row_slot) row_initial.push_back(slot_bytes(*cache, s));
  const std::vector<std::uint8_t> free_bytes = slot_bytes(*cache, free_slot);

  Rng param_rng(spec.seed), input_rng(spec.seed * 1000003 + 1), accept_rng(spec.seed * 2000003 + 2);
  const Family fam(spec, param_rng);
  const std::size_t se = fam.state_elems(), ot = fam.out_per_token();
  std::vector<std::vector<double>> ref_state(std::size_t(NL) * B, std::vector<double>(se, 0.0));
  std::vector<std::vector<float>> naive_state;
  if (spec.naive) naive_state.assign(std::size_t(NL) * B, std::vector<float>(se, 0.0f));

  std::unique_ptr<StateCache> plain;
  std::vector<std::int32_t> plain_slot;
  if (spec.compare_plain && T > 1) {
    StateCacheConfig pc = cfg;
    pc.max_spec_tokens = 1;
    pc.capacity = B;
    plain = create_cache(pc);
    for (int b = 0; b < B; ++b) plain_slot.push_back(allocate_slot(*plain));
  }
  const std::vector<std::uint8_t> poison =
      encode(cfg.input_dtype, std::vector<float>(std::size_t(B) * T * ot, std::nanf("")));
  const std::size_t out_es = dtype_size(cfg.input_dtype);

  for (int step = 0; step < spec.steps; ++step) {
    const std::string at = "step " + std::to_string(step);
    std::vector<std::int32_t> slots(std::size_t(B), -1);
    std::vector<bool> active(std::size_t(B), false);
    for (int b = 0; b < B; ++b) {
      active[b] = step >= b * spec.stagger;
      if (!active[b]) continue;
      slots[b] = row_slot[b];
      if (step == b * spec.stagger && step > 0 && slot_bytes(*cache, row_slot[b]) != row_initial[b]) {
        fail(at + ": row " + std::to_string(b) + "'s slot changed while the row was padding");
      }
    }
    if (replay) {
      std::set<std::uint32_t> levels;
      for (int b = 0; b < B; ++b) {
        if (active[b]) {
          levels.insert(cursor_committed(*cache, slots[b]) - cursor_folded(*cache, 0, slots[b]));
        }
      }
      res.max_distinct_fill_levels = std::max(res.max_distinct_fill_levels, int(levels.size()));
    }
    std::vector<std::int32_t> accepted(std::size_t(B), 0);
    for (int b = 0; b < B; ++b) {
      if (active[b]) accepted[b] = T == 1 ? 1 : accept_rng.uniform_int(0, T);
    }

    double step_err = 0.0, naive_err = 0.0;
    std::vector<typename Family::Tokens> step_tokens;
    std::vector<std::vector<float>> window_out;
    std::vector<double> ref_max;
    for (int layer = 0; layer < NL; ++layer) {
      const std::string where = at + " layer " + std::to_string(layer);
      typename Family::Tokens tk = fam.tokens(B, T, input_rng);
      const typename Family::Call call = fam.call(*cache, layer, slots, tk);
      if (Status st = Family::decode(*cache, call); !st.is_ok()) {
        fail(where + ": decode: " + st.to_string());
        return res;
      }
      const std::vector<float> out = call.output();
      const std::vector<std::uint8_t> raw = Family::raw_output(call);
      const std::size_t row_bytes = std::size_t(T) * ot * out_es;
      for (int b = 0; b < B; ++b) {
        if (!active[b]) {
          if (!std::equal(raw.begin() + std::ptrdiff_t(b * row_bytes),
                          raw.begin() + std::ptrdiff_t((b + 1) * row_bytes),
                          poison.begin() + std::ptrdiff_t(b * row_bytes))) {
            fail(where + ": pad row " + std::to_string(b) + "'s output was written");
          }
        } else if (!all_finite(out.data() + std::size_t(b) * T * ot, std::size_t(T) * ot)) {
          fail(where + ": row " + std::to_string(b) + " has a non-finite (or unwritten) output");
        }
      }
      std::vector<float> got, naive_got;
      std::vector<double> want;
      std::vector<double> ref(std::size_t(T) * ot);
      std::vector<float> nref(std::size_t(T) * ot);
      for (int b = 0; b < B; ++b) {
        if (!active[b]) continue;
        std::vector<double> S = ref_state[std::size_t(layer) * B + b];
        for (int t = 0; t < T; ++t) {
          fam.oracle(layer, S.data(), tk, b, t, ref.data() + std::size_t(t) * ot);
          if (t + 1 == accepted[b]) ref_state[std::size_t(layer) * B + b] = S;
        }
        if (spec.naive) {
          std::vector<float> NS = naive_state[std::size_t(layer) * B + b];
          for (int t = 0; t < T; ++t) {
            fam.naive(layer, NS, tk, b, t, nref.data() + std::size_t(t) * ot);
            if (t + 1 == accepted[b]) naive_state[std::size_t(layer) * B + b] = NS;
          }
          naive_got.insert(naive_got.end(), nref.begin(), nref.end());
        }
        want.insert(want.end(), ref.begin(), ref.end());
        got.insert(got.end(), out.begin() + std::ptrdiff_t(std::size_t(b) * T * ot),
                   out.begin() + std::ptrdiff_t(std::size_t(b + 1) * T * ot));
      }
      step_err = std::max(step_err, rel_error(got, want));
      if (spec.naive) naive_err = std::max(naive_err, rel_error(naive_got, want));
      double m = 0.0;
      for (double w : want) m = std::max(m, std::fabs(w));
      ref_max.push_back(m);
      window_out.push_back(out);
      step_tokens.push_back(std::move(tk));
    }
    res.step_error.push_back(step_err);
    res.max_error = std::max(res.max_error, step_err);
    if (spec.naive) {
      res.naive_step_error.push_back(naive_err);
      res.naive_max_error = std::max(res.naive_max_error, naive_err);
    }
    if (replay) {
      if (Status st = commit(*cache, slots, accepted); !st.is_ok()) {
        fail(at + ": commit: " + st.to_string());
        return res;
      }
    }
    for (int b = 0; b < B; ++b) res.tokens_committed += accepted[b];

    if (plain) {
      const int max_k = *std::max_element(accepted.begin(), accepted.end());
      for (int i = 0; i < max_k; ++i) {
        std::vector<std::int32_t> ps(std::size_t(B), -1), ones(std::size_t(B), 0);
        for (int b = 0; b < B; ++b) {
          if (active[b] && accepted[b] > i) {
            ps[b] = plain_slot[b];
            ones[b] = 1;
          }
        }
        for (int layer = 0; layer < NL; ++layer) {
          const typename Family::Tokens ptk = fam.gather(step_tokens[std::size_t(layer)], i);
          const typename Family::Call call = fam.call(*plain, layer, ps, ptk);
          if (Status st = Family::decode(*plain, call); !st.is_ok()) {
            fail(at + ": plain decode: " + st.to_string());
            return res;
          }
          const std::vector<float> pout = call.output();
          const std::vector<float>& wout = window_out[std::size_t(layer)];
          double d = 0.0;
          for (int b = 0; b < B; ++b) {
            if (ps[b] < 0) continue;
            for (std::size_t e = 0; e < ot; ++e) {
              const float p = pout[std::size_t(b) * ot + e];
              const float w = wout[(std::size_t(b) * T + i) * ot + e];
              d = std::isfinite(p) ? std::max(d, double(std::fabs(p - w)))
                                   : std::numeric_limits<double>::infinity();
            }
          }
          const double m = ref_max[std::size_t(layer)];
          res.plain_max_error = std::max(res.plain_max_error, m > 0.0 ? d / m : d);
        }
        if (Status st = commit(*plain, ps, ones); !st.is_ok()) {
          fail(at + ": plain commit: " + st.to_string());
          return res;
        }
      }
    }
  }

  for (std::size_t g = 0; g < guards.size(); ++g) {
    if (slot_bytes(*cache, guards[g]) != guard_bytes[g]) {
      fail("guard slot " + std::to_string(guards[g]) + " was written");
    }
  }
  if (slot_bytes(*cache, free_slot) != free_bytes) {
    fail("free slot " + std::to_string(free_slot) + " was written");
  }
  for (int layer = 0; layer < NL; ++layer) {
    for (int b = 0; b < B; ++b) {
      if (spec.steps <= b * spec.stagger) continue;
      std::vector<float> S(se);
      if (Status st = state_cache_export_state(*cache, layer, row_slot[b], S.data()); !st.is_ok()) {
        fail("export: " + st.to_string());
        return res;
      }
      res.export_error =
          std::max(res.export_error, rel_error(S, ref_state[std::size_t(layer) * B + b]));
    }
  }
  return res;
}

}  // namespace

RunResult run_mamba2(const RunSpec& spec) { return run_driver<Mamba2Family>(spec); }
RunResult run_gdn(const RunSpec& spec) { return run_driver<GdnFamily>(spec); }

void expect_within_naive(const RunResult& r, double floor) {
  ASSERT_FALSE(r.naive_step_error.empty());
  EXPECT_GT(r.naive_max_error, 0.0);  // the low precision is really there
  EXPECT_LE(r.max_error, 2.0 * r.naive_max_error + floor)
      << "naive same-precision loop: " << r.naive_max_error;
}

void expect_checkpoint_bounds(const RunResult& r, CheckpointPrecision precision,
                              double fp32_tol) {
  const double bf16_u = std::ldexp(1.0, -8), fp8_u = std::ldexp(1.0, -4);
  switch (precision) {
    case CheckpointPrecision::kFp32:
      EXPECT_LE(r.max_error, fp32_tol);
      EXPECT_LE(r.export_error, fp32_tol);
      break;
    case CheckpointPrecision::kFp32Bf16:
      EXPECT_LE(r.max_error, 2 * bf16_u);
      EXPECT_GT(r.max_error, fp32_tol);  // the bf16 copy is what outputs read
      EXPECT_LE(r.export_error, fp32_tol);  // folds use the fp32 master
      break;
    case CheckpointPrecision::kFp32Fp8:
      EXPECT_LE(r.max_error, 2 * fp8_u);
      EXPECT_GT(r.max_error, fp32_tol);
      EXPECT_LE(r.export_error, fp32_tol);
      break;
    case CheckpointPrecision::kBf16:
      EXPECT_LE(r.max_error, 4 * bf16_u);
      EXPECT_GT(r.export_error, fp32_tol);  // no master: the state itself is bf16
      EXPECT_LE(r.export_error, 4 * bf16_u);
      break;
  }
}

RunSpec gdn_long_memory_spec(int buffer_len, int steps) {
  RunSpec spec;
  spec.cache.kind = LayerKind::kGdn;
  spec.cache.gdn = GdnShape{2, 4, 32, 16};
  spec.cache.mode = DecodeMode::kReplay;
  spec.cache.input_dtype = DType::kF32;
  spec.cache.buffer_len = buffer_len;
  spec.recipe.g_fixed = -0.001;
  spec.recipe.beta_lo = 0.02;
  spec.recipe.beta_hi = 0.06;
  spec.batch = 2;
  spec.steps = steps;
  spec.seed = 901;
  spec.guard_slots = 0;
  return spec;
}

double mean_of(const std::vector<double>& v, int from, int to) {
  return std::accumulate(v.begin() + from, v.begin() + to, 0.0) / double(to - from);
}

// ---------------------------------------------------------------------------------------------
// Window vs single steps, CUDA vs CPU: one body for both families (Mamba2Family, GdnFamily
// above give the family's tokens, calls and decode).

namespace {

// The family's per-call settings as a RunSpec, for the Family structs.
RunSpec family_spec(const StateCacheConfig& config, bool gate, bool qk_l2norm) {
  RunSpec spec;
  spec.cache = config;
  spec.gate = gate;
  spec.qk_l2norm = qk_l2norm;
  spec.recipe.unit_keys = !qk_l2norm;  // raw keys must keep β|k|² < 2
  return spec;
}

template <typename Family>
void run_window_vs_single_impl(WindowPair& p, std::uint64_t seed, int rounds, double* worst) {
  const StateCacheConfig& cfg = p.window->config();
  const int batch = int(p.ws.size());
  const int T = cfg.max_spec_tokens;
  const RunSpec spec = family_spec(cfg, /*gate=*/true, /*qk_l2norm=*/true);
  Rng rng(seed);
  const Family family(spec, rng);  // Mamba-2: the layer's A, D, dt_bias first
  const std::size_t ot = family.out_per_token();
  const std::vector<std::int32_t> full(std::size_t(batch), T), one(std::size_t(batch), 1);
  for (int round = 0; round < rounds; ++round) {
    const typename Family::Tokens tk = family.tokens(batch, T, rng);
    const typename Family::Call wc = family.call(*p.window, 0, p.ws, tk);
    ASSERT_TRUE(Family::decode(*p.window, wc).is_ok());
    ASSERT_TRUE(commit(*p.window, p.ws, full).is_ok());
    const std::vector<float> wout = wc.output();
    ASSERT_TRUE(all_finite(wout));
    for (int t = 0; t < T; ++t) {
      const typename Family::Call sc = family.call(*p.single, 0, p.ss, family.gather(tk, t));
      ASSERT_TRUE(Family::decode(*p.single, sc).is_ok());
      ASSERT_TRUE(commit(*p.single, p.ss, one).is_ok());
      const std::vector<float> sout = sc.output();
      ASSERT_TRUE(all_finite(sout));
      double diff = 0.0, mag = 0.0;
      for (int b = 0; b < batch; ++b) {
        for (std::size_t e = 0; e < ot; ++e) {
          const double w = wout[(std::size_t(b) * T + t) * ot + e];
          diff = std::max(diff, std::fabs(w - sout[std::size_t(b) * ot + e]));
          mag = std::max(mag, std::fabs(w));
        }
      }
      *worst = std::max(*worst, diff / mag);
    }
  }
}

template <typename Family>
void compare_cuda_vs_cpu_impl(const CudaVsCpuSpec& c, double* worst) {
  const StateCacheConfig& cfg = c.config;
  StateCacheConfig gcfg = cfg;
  gcfg.device = Device::kCuda;
  std::unique_ptr<StateCache> cpu = create_cache(cfg);
  std::unique_ptr<StateCache> gpu = create_cache(gcfg);
  for (int i = 0; i < cfg.capacity; ++i) {
    ASSERT_EQ(allocate_slot(*cpu), allocate_slot(*gpu));
  }
  const int guard_lo = 0, guard_hi = cfg.capacity - 1;
  const int layers = cfg.num_layers, window = cfg.max_spec_tokens;

  Rng rng(c.seed);
  const std::size_t se = std::size_t(cfg.dims().state_elems());
  if (c.load_initial) {
    for (int layer = 0; layer < layers; ++layer) {
      for (int r = 0; r < c.batch; ++r) {
        std::vector<float> s(se);
        for (float& v : s) v = float(rng.normal(0.0, c.initial_sd));
        ASSERT_TRUE(state_cache_load_state(*cpu, layer, r + 1, s.data()).is_ok());
        const Status st = state_cache_load_state(*gpu, layer, r + 1, s.data());
        ASSERT_TRUE(st.is_ok()) << st.to_string();
      }
    }
  }
  const std::vector<std::uint8_t> guard_lo_bytes = slot_bytes(*gpu, guard_lo);
  const std::vector<std::uint8_t> guard_hi_bytes = slot_bytes(*gpu, guard_hi);

  const RunSpec spec = family_spec(cfg, c.gate, c.qk_l2norm);
  const Family family(spec, rng);  // Mamba-2: every layer's A, D, dt_bias, after the states
  const int rows = c.batch + 1;  // the last row is always a pad
  const std::size_t per_row = std::size_t(window) * family.out_per_token();
  for (int step = 0; step < c.steps; ++step) {
    std::vector<std::int32_t> slots(std::size_t(rows), -1);
    for (int r = 0; r < c.batch; ++r) {
      if (step >= r * c.stagger) slots[r] = r + 1;
    }
    for (int layer = 0; layer < layers; ++layer) {
      const typename Family::Tokens tk = family.tokens(rows, window, rng);
      const typename Family::Call cc = family.call(*cpu, layer, slots, tk);
      const typename Family::Call gc = family.call(*gpu, layer, slots, tk);
      ASSERT_TRUE(Family::decode(*cpu, cc).is_ok());
      const Status st = Family::decode(*gpu, gc);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const std::vector<float> oc = cc.output(), og = gc.output();
      for (int r = 0; r < rows; ++r) {
        const std::size_t b = r * per_row, e = b + per_row;
        if (slots[r] < 0) {
          ASSERT_TRUE(std::all_of(og.begin() + b, og.begin() + e,
                                  [](float v) { return std::isnan(v); }))
              << "step " << step << ": pad row " << r << "'s output was written";
          continue;
        }
        const double err = max_rel_diff(og, oc, b, e);
        *worst = std::max(*worst, err);
        ASSERT_LE(err, c.output_tol) << "step " << step << " layer " << layer << " row " << r;
      }
    }
    std::vector<std::int32_t> accepted(std::size_t(rows), 0);
    for (int r = 0; r < c.batch; ++r) {
      if (slots[r] >= 0) accepted[r] = window == 1 ? 1 : rng.uniform_int(0, window);
    }
    ASSERT_TRUE(commit(*cpu, slots, accepted).is_ok());
    const Status st = commit(*gpu, slots, accepted);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    for (int r = 0; r < c.batch; ++r) {
      ASSERT_EQ(cursor_committed(*gpu, r + 1), cursor_committed(*cpu, r + 1));
      ASSERT_EQ(cursor_pending(*gpu, r + 1), cursor_pending(*cpu, r + 1));
      for (int layer = 0; layer < layers; ++layer) {
        ASSERT_EQ(cursor_folded(*gpu, layer, r + 1), cursor_folded(*cpu, layer, r + 1))
            << "step " << step << " layer " << layer << " row " << r;
      }
    }
  }
  EXPECT_EQ(slot_bytes(*gpu, guard_lo), guard_lo_bytes) << "guard slot written";
  EXPECT_EQ(slot_bytes(*gpu, guard_hi), guard_hi_bytes) << "guard slot written";

  // Materialised states (a replay cache folds first) agree as well.
  for (int layer = 0; layer < layers; ++layer) {
    for (int r = 0; r < c.batch; ++r) {
      std::vector<float> sc, sg;
      ASSERT_TRUE(export_state(*cpu, layer, r + 1, &sc).is_ok());
      const Status st = export_state(*gpu, layer, r + 1, &sg);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_LE(max_rel_diff(sg, sc, 0, se), c.state_tol) << "layer " << layer << " row " << r;
    }
  }
}

}  // namespace

WindowPair make_window_pair(const StateCacheConfig& config, int batch) {
  WindowPair p;
  p.window = create_cache(config);
  p.single = create_cache(config);
  for (int b = 0; b < batch; ++b) {
    p.ws.push_back(allocate_slot(*p.window));
    p.ss.push_back(allocate_slot(*p.single));
  }
  std::reverse(p.ss.begin(), p.ss.end());  // different slot per row in the two caches
  return p;
}

void run_window_vs_single(WindowPair& p, std::uint64_t seed, int rounds, double* worst) {
  if (p.window->config().kind == LayerKind::kMamba2) {
    run_window_vs_single_impl<Mamba2Family>(p, seed, rounds, worst);
  } else {
    run_window_vs_single_impl<GdnFamily>(p, seed, rounds, worst);
  }
}

void expect_window_states_match(WindowPair& p, double tol) {
  for (std::size_t b = 0; b < p.ws.size(); ++b) {
    std::vector<float> a, s;
    ASSERT_TRUE(export_state(*p.window, 0, p.ws[b], &a).is_ok());
    ASSERT_TRUE(export_state(*p.single, 0, p.ss[b], &s).is_ok());
    double diff = 0.0, mag = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      diff = std::max(diff, double(std::fabs(a[i] - s[i])));
      mag = std::max(mag, double(std::fabs(a[i])));
    }
    EXPECT_GT(mag, 0.0);
    EXPECT_LE(diff / mag, tol);
  }
}

void compare_cuda_vs_cpu(const CudaVsCpuSpec& spec, double* worst) {
  if (spec.config.kind == LayerKind::kMamba2) {
    compare_cuda_vs_cpu_impl<Mamba2Family>(spec, worst);
  } else {
    compare_cuda_vs_cpu_impl<GdnFamily>(spec, worst);
  }
}

std::string int_tag(const char* prefix, int value) {
  std::string s(prefix);
  s += std::to_string(value);
  return s;
}

std::string dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8E4M3";
  }
  return "X";
}

std::string precision_tag(CheckpointPrecision p) {
  switch (p) {
    case CheckpointPrecision::kFp32: return "Fp32";
    case CheckpointPrecision::kBf16: return "SharedBf16";
    case CheckpointPrecision::kFp32Bf16: return "Fp32Bf16";
    case CheckpointPrecision::kFp32Fp8: return "Fp32Fp8";
  }
  return "X";
}

}  // namespace replayssm::testing
