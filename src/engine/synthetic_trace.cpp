#include "engine/synthetic_trace.h"

#include <cmath>
#include <new>
#include <random>
#include <string>
#include <vector>

namespace replayssm {

namespace {

// Portable draws (std distributions differ between standard libraries): 53-bit uniforms and
// Box-Muller normals, so a seed gives the same trace everywhere.
class TraceRng {
 public:
  explicit TraceRng(std::uint64_t seed) : engine_(seed) {}
  double uniform(double lo, double hi) {
    // (0, 1]: never 0, so log() below is finite.
    const double u = (double(engine_() >> 11) + 1.0) * 0x1.0p-53;
    return lo + (hi - lo) * u;
  }
  double normal(double sd) {
    const double r = std::sqrt(-2.0 * std::log(uniform(0.0, 1.0)));
    return sd * r * std::cos(6.283185307179586 * uniform(0.0, 1.0));
  }
  std::vector<float> normals(std::int64_t n, double sd) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = static_cast<float>(normal(sd));
    return v;
  }

 private:
  std::mt19937_64 engine_;
};

// A dt_bias whose softplus is a log-uniform step size in [1e-3, 0.1] (the models' init).
float dt_bias_init(TraceRng& rng) {
  const double dt0 = std::exp(rng.uniform(std::log(1e-3), std::log(0.1)));
  return static_cast<float>(std::log(std::expm1(dt0)));
}

double softplus(double u) { return u > 20.0 ? u : std::log1p(std::exp(u)); }

Status check(int num_steps, int batch) {
  if (num_steps < 1 || batch < 1) {
    return invalid_argument("a synthetic trace needs num_steps >= 1 and batch >= 1");
  }
  return Status::ok();
}

Status make_mamba2(const Mamba2Shape& shape, const SyntheticTraceOptions& options,
                   LayerTrace* out) {
  TraceRng rng(options.seed);
  LayerTrace trace;
  trace.kind = LayerKind::kMamba2;
  Mamba2Trace& t = trace.mamba2;
  t.shape = shape;
  t.num_steps = options.num_steps;
  t.batch = options.batch;
  const std::int64_t tokens = std::int64_t{options.num_steps} * options.batch;
  const int H = shape.nheads;
  t.x = rng.normals(tokens * H * shape.head_dim, 1.0);
  t.dt = rng.normals(tokens * H, 0.5);
  t.B = rng.normals(tokens * shape.ngroups * shape.dstate, 1.0);
  t.C = rng.normals(tokens * shape.ngroups * shape.dstate, 1.0);
  if (options.mamba2_gate) t.z = rng.normals(tokens * H * shape.head_dim, 1.0);
  for (int h = 0; h < H; ++h) {
    t.A.push_back(static_cast<float>(-rng.uniform(1.0, 16.0)));
    t.D.push_back(static_cast<float>(rng.uniform(0.5, 1.5)));
    t.dt_bias.push_back(dt_bias_init(rng));
  }
  t.state0 = rng.normals(std::int64_t{options.batch} * state_dims(shape).state_elems(), 0.1);
  REPLAYSSM_RETURN_IF_ERROR(trace_validate(trace));
  *out = std::move(trace);
  return Status::ok();
}

Status make_gdn(const GdnShape& shape, const SyntheticTraceOptions& options, LayerTrace* out) {
  TraceRng rng(options.seed);
  LayerTrace trace;
  trace.kind = LayerKind::kGdn;
  GdnTrace& t = trace.gdn;
  t.shape = shape;
  t.num_steps = options.num_steps;
  t.batch = options.batch;
  const std::int64_t tokens = std::int64_t{options.num_steps} * options.batch;
  const int Hv = shape.num_v_heads;
  t.q = rng.normals(tokens * shape.num_k_heads * shape.head_k_dim, 1.0);
  t.k = rng.normals(tokens * shape.num_k_heads * shape.head_k_dim, 1.0);
  t.v = rng.normals(tokens * Hv * shape.head_v_dim, 1.0);
  std::vector<double> a(static_cast<std::size_t>(Hv)), bias(static_cast<std::size_t>(Hv));
  for (int h = 0; h < Hv; ++h) {
    a[static_cast<std::size_t>(h)] = rng.uniform(1.0, 16.0);
    bias[static_cast<std::size_t>(h)] = dt_bias_init(rng);
  }
  for (std::int64_t i = 0; i < tokens * Hv; ++i) {
    const auto h = static_cast<std::size_t>(i % Hv);
    t.g.push_back(static_cast<float>(-a[h] * softplus(rng.normal(1.0) + bias[h])));
    t.beta.push_back(static_cast<float>(1.0 / (1.0 + std::exp(-rng.normal(1.0)))));
  }
  t.state0 = rng.normals(std::int64_t{options.batch} * state_dims(shape).state_elems(), 0.1);
  REPLAYSSM_RETURN_IF_ERROR(trace_validate(trace));
  *out = std::move(trace);
  return Status::ok();
}

// Runs a generator with the arguments checked and allocation failures reported.
template <typename Shape, typename Make>
Status generate(const char* what, const Shape& shape, const SyntheticTraceOptions& options,
                LayerTrace* out, Make make) {
  if (out == nullptr) return invalid_argument(std::string(what) + ": out is null");
  REPLAYSSM_RETURN_IF_ERROR(check(options.num_steps, options.batch));
  try {
    return make(shape, options, out);
  } catch (const std::bad_alloc&) {
    return {StatusCode::kOutOfMemory, std::string(what) + ": not enough host memory"};
  }
}

}  // namespace

Status synthetic_trace_mamba2(const Mamba2Shape& shape, const SyntheticTraceOptions& options,
                              LayerTrace* out) {
  return generate("synthetic_trace_mamba2", shape, options, out, make_mamba2);
}

Status synthetic_trace_gdn(const GdnShape& shape, const SyntheticTraceOptions& options,
                           LayerTrace* out) {
  return generate("synthetic_trace_gdn", shape, options, out, make_gdn);
}

}  // namespace replayssm
