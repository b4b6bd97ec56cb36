#include "testing/family.h"

#include "cpu/reference.h"
#include "testing/naive.h"

namespace replayssm::testing {

namespace {

// Row b's token t of a window, as the per-token pointers the step functions take.
struct Mamba2Token {
  const float *x, *dt, *B, *C, *z;
};
Mamba2Token token_of(const Mamba2Shape& s, const Mamba2Tokens& tk, int b, int t) {
  const std::size_t i = std::size_t(b) * tk.T + t;
  const std::size_t xs = std::size_t(s.nheads) * s.head_dim, bs = std::size_t(s.ngroups) * s.dstate;
  return {tk.x.data() + i * xs, tk.dt.data() + i * s.nheads, tk.B.data() + i * bs,
          tk.C.data() + i * bs, tk.z.empty() ? nullptr : tk.z.data() + i * xs};
}

struct GdnToken {
  const float *q, *k, *v, *g, *beta;
};
GdnToken token_of(const GdnShape& s, const GdnTokens& tk, int b, int t) {
  const std::size_t i = std::size_t(b) * tk.T + t;
  const std::size_t qk = std::size_t(s.num_k_heads) * s.head_k_dim;
  return {tk.q.data() + i * qk, tk.k.data() + i * qk,
          tk.v.data() + i * s.num_v_heads * s.head_v_dim, tk.g.data() + i * s.num_v_heads,
          tk.beta.data() + i * s.num_v_heads};
}

}  // namespace

// ---- Mamba-2 ----------------------------------------------------------------------------------

Mamba2Family::Mamba2Family(const FamilySettings& s, Rng& rng) : settings(s) {
  for (int l = 0; l < s.cache.num_layers; ++l) {
    params.push_back(make_mamba2_layer(s.cache.mamba2, s.recipe, rng));
  }
}

std::size_t Mamba2Family::out_per_token() const {
  return std::size_t(settings.cache.mamba2.nheads) * settings.cache.mamba2.head_dim;
}

std::size_t Mamba2Family::state_elems() const {
  return std::size_t(state_dims(settings.cache.mamba2).state_elems());
}

Mamba2Tokens Mamba2Family::tokens(int batch, int T, Rng& rng) const {
  return make_mamba2_tokens(settings.cache.mamba2, batch, T, settings.cache.input_dtype,
                            settings.gate, settings.recipe, rng);
}

Mamba2Call Mamba2Family::call(const StateCache& c, int layer,
                              const std::vector<std::int32_t>& slots, const Tokens& t) const {
  return make_mamba2_call(c, layer, slots, params[std::size_t(layer)], t);
}

void Mamba2Family::oracle(int layer, double* S, const Tokens& tk, int b, int t,
                          double* out) const {
  const Mamba2Shape& s = settings.cache.mamba2;
  const Mamba2Layer& p = params[std::size_t(layer)];
  const Mamba2Token x = token_of(s, tk, b, t);
  reference::mamba2_reference_step(s, S, x.x, x.dt, x.B, x.C, x.z, p.A.data(), p.D.data(),
                                   p.dt_bias.data(), out);
}

void Mamba2Family::naive(int layer, std::vector<float>& S, const Tokens& tk, int b, int t,
                         float* out) const {
  const Mamba2Shape& s = settings.cache.mamba2;
  const Mamba2Layer& p = params[std::size_t(layer)];
  const Mamba2Token x = token_of(s, tk, b, t);
  naive_mamba2_step(s, settings.naive_state_dtype, settings.cache.input_dtype, S, x.x, x.dt, x.B,
                    x.C, x.z, p.A.data(), p.D.data(), p.dt_bias.data(), out);
}

// ---- Gated DeltaNet ---------------------------------------------------------------------------

GdnFamily::GdnFamily(const FamilySettings& s, Rng&) : settings(s) {}

std::size_t GdnFamily::out_per_token() const {
  return std::size_t(settings.cache.gdn.num_v_heads) * settings.cache.gdn.head_v_dim;
}

std::size_t GdnFamily::state_elems() const {
  return std::size_t(state_dims(settings.cache.gdn).state_elems());
}

GdnTokens GdnFamily::tokens(int batch, int T, Rng& rng) const {
  return make_gdn_tokens(settings.cache.gdn, batch, T, settings.cache.input_dtype,
                         settings.recipe, rng);
}

GdnCall GdnFamily::call(const StateCache& c, int layer, const std::vector<std::int32_t>& slots,
                        const Tokens& t) const {
  return make_gdn_call(c, layer, slots, t, settings.qk_l2norm, settings.scale);
}

void GdnFamily::oracle(int, double* S, const Tokens& tk, int b, int t, double* out) const {
  const GdnShape& s = settings.cache.gdn;
  const GdnToken x = token_of(s, tk, b, t);
  reference::gdn_reference_step(s, S, x.q, x.k, x.v, x.g, x.beta, settings.qk_l2norm,
                                settings.scale, out);
}

void GdnFamily::naive(int, std::vector<float>& S, const Tokens& tk, int b, int t,
                      float* out) const {
  const GdnShape& s = settings.cache.gdn;
  const GdnToken x = token_of(s, tk, b, t);
  naive_gdn_step(s, settings.naive_state_dtype, settings.cache.input_dtype, S, x.q, x.k, x.v,
                 x.g, x.beta, settings.qk_l2norm, settings.scale, out);
}

}  // namespace replayssm::testing
