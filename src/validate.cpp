#include "validate.h"

#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "backend.h"

namespace replayssm {

namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

bool on_cpu(const StateCache& cache) { return cache.config().device == Device::kCpu; }

Status require(const void* ptr, const char* op, const char* name) {
  if (ptr != nullptr) return Status::ok();
  return invalid_argument(std::string(op) + ": " + name + " is null");
}

// The layer kind an op serves, named as the op is.
Status require_kind(const StateCache& cache, LayerKind kind, const char* op) {
  if (cache.config().kind == kind) return Status::ok();
  return invalid_argument(std::string(op) + " on a " + layer_kind_name(cache.config().kind) +
                          " state cache");
}

// On a CPU cache that holds windows (replay, eager with T > 1): no active row's layer holds a
// window that was decoded and not yet committed (a second decode would silently replace it;
// see ops.h).
Status validate_no_pending_rows(const StateCache& cache, const char* op, int layer, int batch,
                                const std::int32_t* slot_ids) {
  const StateCacheLayout& l = cache.layout();
  if (!on_cpu(cache) || !l.holds_windows()) return Status::ok();
  for (int b = 0; b < batch; ++b) {
    const std::int32_t s = slot_ids[b];
    if (s < 0) continue;
    const int pending = l.pending[l.layer_slot(layer, s)];
    if (pending != 0) {
      return invalid_argument(std::string(op) + ": row " + str(b) + " (slot " + str(s) +
                              "): layer " + str(layer) + " already holds an uncommitted window of " +
                              str(pending) + " tokens; commit it (state_cache_commit) first");
    }
  }
  return Status::ok();
}

// What both decode ops check: layer, batch, window width, fold cadence, slots, cursors.
Status validate_decode_common(const StateCache& cache, const char* op, int layer, int batch,
                              int num_tokens, int fold_every,
                              const std::int32_t* slot_ids) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  const StateCacheConfig& c = cache.config();
  if (c.mode == DecodeMode::kEager && fold_every != 0) {
    return invalid_argument(std::string(op) + ": fold_every applies to replay caches (an eager "
                            "cache writes its state every token); got " + str(fold_every));
  }
  if (fold_every < 0 || fold_every > c.buffer_len) {
    return invalid_argument(std::string(op) + ": fold_every must be in [1, buffer_len = " +
                            str(c.buffer_len) + "], or 0 for buffer_len; got " +
                            str(fold_every));
  }
  if (num_tokens < 1) {
    return invalid_argument(std::string(op) + ": num_tokens must be >= 1, got " + str(num_tokens));
  }
  if (num_tokens > c.max_spec_tokens) {
    return invalid_argument(std::string(op) + ": window of " + str(num_tokens) +
                            " tokens is wider than the cache's max_spec_tokens (" +
                            str(c.max_spec_tokens) + ")");
  }
  REPLAYSSM_RETURN_IF_ERROR(validate_batch_slots(cache, batch, slot_ids));
  return validate_no_pending_rows(cache, op, layer, batch, slot_ids);
}

// Per-head values of an active row (host memory) within [lo, hi] and finite.
Status check_range(const char* op, const char* name, const float* v, std::int64_t n, double lo,
                   double hi, const char* rule) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i]) || v[i] < lo || v[i] > hi) {
      return invalid_argument(std::string(op) + ": " + name + "[" + str(i) + "] = " +
                              std::to_string(v[i]) + "; " + rule);
    }
  }
  return Status::ok();
}

// Per-token values [batch, T, heads] of the active rows.
Status check_token_range(const char* op, const char* name, const float* v, int batch, int T,
                         int heads, const std::int32_t* slot_ids, double lo, double hi,
                         const char* rule) {
  const std::int64_t per_row = std::int64_t{T} * heads;
  for (int b = 0; b < batch; ++b) {
    if (slot_ids[b] < 0) continue;
    Status st = check_range(op, name, v + b * per_row, per_row, lo, hi, rule);
    if (!st.is_ok()) return invalid_argument("row " + str(b) + ": " + st.message());
  }
  return Status::ok();
}

constexpr double kInf = INFINITY;

struct NamedInput {
  const void* ptr;
  const char* name;
};

// The inputs a decode convolves itself (conv caches: ConvInputs) or takes convolved (the
// others): exactly one of the two is given.
Status validate_conv_inputs(const StateCache& cache, const char* op, const ConvInputs& conv,
                            std::initializer_list<NamedInput> convolved) {
  const StateCacheConfig& c = cache.config();
  if (c.conv_kernel == 0) {
    if (conv.in != nullptr || conv.weight != nullptr || conv.bias != nullptr) {
      return invalid_argument(std::string(op) + ": conv inputs given but the cache has no conv "
                              "window (conv_kernel = 0); pass the convolved inputs");
    }
    for (const NamedInput& in : convolved) REPLAYSSM_RETURN_IF_ERROR(require(in.ptr, op, in.name));
    return Status::ok();
  }
  for (const NamedInput& in : convolved) {
    if (in.ptr != nullptr) {
      return invalid_argument(std::string(op) + ": " + in.name + " given, but a conv cache " +
                              "(conv_kernel = " + str(c.conv_kernel) +
                              ") takes the pre-conv inputs in conv.in instead");
    }
  }
  REPLAYSSM_RETURN_IF_ERROR(require(conv.in, op, "conv.in"));
  REPLAYSSM_RETURN_IF_ERROR(require(conv.weight, op, "conv.weight"));
  const int channels = c.conv_channels();
  if (conv.stride != 0 && conv.stride < channels) {
    return invalid_argument(std::string(op) + ": conv.stride " + str(conv.stride) +
                            " is shorter than a row of " + str(channels) + " conv channels");
  }
  if (!on_cpu(cache)) return Status::ok();  // device memory: not read on the host
  REPLAYSSM_RETURN_IF_ERROR(check_range(op, "conv.weight", conv.weight,
                                        std::int64_t{channels} * c.conv_kernel, -kInf, kInf,
                                        "the conv weights must be finite"));
  if (conv.bias == nullptr) return Status::ok();
  return check_range(op, "conv.bias", conv.bias, channels, -kInf, kInf,
                     "the conv bias must be finite");
}

}  // namespace

Status validate_not_null(const void* ptr, const char* op, const char* name) {
  return require(ptr, op, name);
}

Status validate_layer(const StateCache& cache, int layer) {
  if (layer >= 0 && layer < cache.config().num_layers) return Status::ok();
  return invalid_argument("layer " + str(layer) + " out of range [0, " +
                          str(cache.config().num_layers) + ")");
}

Status validate_slot(const StateCache& cache, int slot) {
  if (slot < 0 || slot >= cache.config().capacity) {
    return invalid_argument("slot " + str(slot) + " out of range [0, " +
                            str(cache.config().capacity) + ")");
  }
  if (!cache.is_allocated(slot)) {
    return invalid_argument("slot " + str(slot) + " is not allocated");
  }
  return Status::ok();
}

Status validate_batch_slots(const StateCache& cache, int batch, const std::int32_t* slot_ids) {
  if (batch < 0) return invalid_argument("batch must be >= 0, got " + str(batch));
  if (batch == 0) return Status::ok();
  if (slot_ids == nullptr) return invalid_argument("slot_ids is null");
  if (!on_cpu(cache)) return Status::ok();
  std::vector<bool> seen(static_cast<std::size_t>(cache.config().capacity), false);
  for (int b = 0; b < batch; ++b) {
    const std::int32_t s = slot_ids[b];
    if (s == -1) continue;
    Status st = validate_slot(cache, s);
    if (!st.is_ok()) return invalid_argument("row " + str(b) + ": " + st.message());
    if (seen[static_cast<std::size_t>(s)]) {
      return invalid_argument("row " + str(b) + ": slot " + str(s) +
                              " appears twice in one batch");
    }
    seen[static_cast<std::size_t>(s)] = true;
  }
  return Status::ok();
}

Status validate_no_pending(const StateCache& cache, int layer, int slot, const char* what,
                           Stream stream) {
  const StateCacheLayout& l = cache.layout();
  if (!l.holds_windows()) return Status::ok();
  std::uint8_t pending = 0;
  REPLAYSSM_RETURN_IF_ERROR(memory_to_host(cache.config().device, &pending,
                                           l.pending + l.layer_slot(layer, slot), 1, stream));
  if (pending == 0) return Status::ok();
  return invalid_argument(std::string("cannot ") + what + " layer " + str(layer) + " of slot " +
                          str(slot) + " while it has an uncommitted window of " + str(pending) +
                          " tokens; commit first");
}

Status validate_finite_state(const StateCacheLayout& l, const float* state) {
  const std::int64_t n = l.state_elems();
  for (std::int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(state[i])) {
      return invalid_argument("state[" + str(i) + "] is " + std::to_string(state[i]) +
                              "; a loaded state must be finite");
    }
  }
  return Status::ok();
}

Status validate_commit(const StateCache& cache, const CommitArgs& args) {
  REPLAYSSM_RETURN_IF_ERROR(validate_batch_slots(cache, args.batch, args.slot_ids));
  if (args.batch > 0 && args.accepted == nullptr) {
    return invalid_argument("state_cache_commit: accepted is null");
  }
  if (!on_cpu(cache)) return Status::ok();
  const StateCacheLayout& l = cache.layout();
  for (int b = 0; b < args.batch; ++b) {
    const std::int32_t s = args.slot_ids[b];
    if (s < 0) continue;
    const std::string row = "row " + str(b) + " (slot " + str(s) + "): ";
    const int pending = l.pending[l.layer_slot(0, s)];
    for (int layer = 1; layer < l.config.num_layers; ++layer) {
      const int p = l.pending[l.layer_slot(layer, s)];
      if (p != pending) {
        return invalid_argument(row + "layer " + str(layer) + " decoded " + str(p) +
                                " tokens of this window but layer 0 decoded " + str(pending) +
                                "; every layer must decode the window before it is committed");
      }
    }
    const std::int32_t k = args.accepted[b];
    if (k < 0 || k > pending) {
      return invalid_argument(row + "cannot commit " + str(k) +
                              " tokens; the last decode appended " + str(pending));
    }
  }
  return Status::ok();
}

Status validate_mamba2_decode(const StateCache& cache, const Mamba2DecodeArgs& a) {
  constexpr const char* op = "mamba2_decode";
  REPLAYSSM_RETURN_IF_ERROR(require_kind(cache, LayerKind::kMamba2, op));
  REPLAYSSM_RETURN_IF_ERROR(
      validate_decode_common(cache, op, a.layer, a.batch, a.num_tokens, a.fold_every,
                             a.slot_ids));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(
      validate_conv_inputs(cache, op, a.conv, {{a.x, "x"}, {a.B, "B"}, {a.C, "C"}}));
  REPLAYSSM_RETURN_IF_ERROR(require(a.dt, op, "dt"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.A, op, "A"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.D, op, "D"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.dt_bias, op, "dt_bias"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.y, op, "y"));
  if (!on_cpu(cache)) return Status::ok();  // device memory: not read on the host
  const int H = cache.config().mamba2.nheads;
  REPLAYSSM_RETURN_IF_ERROR(
      check_range(op, "A", a.A, H, -kInf, 0.0, "A must be negative and finite (a decay)"));
  for (int h = 0; h < H; ++h) {
    if (a.A[h] == 0.0f) {
      return invalid_argument(std::string(op) + ": A[" + str(h) +
                              "] = 0; A must be negative and finite (a decay)");
    }
  }
  REPLAYSSM_RETURN_IF_ERROR(check_range(op, "D", a.D, H, -kInf, kInf, "D must be finite"));
  return check_range(op, "dt_bias", a.dt_bias, H, -kInf, kInf, "dt_bias must be finite");
}

Status validate_gdn_decode(const StateCache& cache, const GdnDecodeArgs& a) {
  constexpr const char* op = "gdn_decode";
  REPLAYSSM_RETURN_IF_ERROR(require_kind(cache, LayerKind::kGdn, op));
  REPLAYSSM_RETURN_IF_ERROR(
      validate_decode_common(cache, op, a.layer, a.batch, a.num_tokens, a.fold_every,
                             a.slot_ids));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(
      validate_conv_inputs(cache, op, a.conv, {{a.q, "q"}, {a.k, "k"}, {a.v, "v"}}));
  REPLAYSSM_RETURN_IF_ERROR(require(a.g, op, "g"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.beta, op, "beta"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.o, op, "o"));
  if (!(a.scale >= 0.0f) || !std::isfinite(a.scale)) {
    return invalid_argument("gdn_decode: scale must be finite and >= 0 (0 = head_k_dim^-1/2)");
  }
  if (!on_cpu(cache)) return Status::ok();  // device memory: not read on the host
  const int Hv = cache.config().gdn.num_v_heads;
  REPLAYSSM_RETURN_IF_ERROR(check_token_range(op, "g", a.g, a.batch, a.num_tokens, Hv,
                                              a.slot_ids, -kInf, 0.0,
                                              "g is a log-decay: it must be <= 0 and finite"));
  return check_token_range(op, "beta", a.beta, a.batch, a.num_tokens, Hv, a.slot_ids, 0.0, 1.0,
                           "beta must be in [0, 1]");
}

}  // namespace replayssm
