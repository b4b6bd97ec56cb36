#include "validate.h"

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

// What both decode ops check: layer, batch, window width, slots, cursors.
Status validate_decode_common(const StateCache& cache, const char* op, int layer, int batch,
                              int num_tokens, const std::int32_t* slot_ids) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  const StateCacheConfig& c = cache.config();
  if (num_tokens < 1) {
    return invalid_argument(std::string(op) + ": num_tokens must be >= 1, got " + str(num_tokens));
  }
  if (c.mode == DecodeMode::kEager && num_tokens != 1) {
    return unsupported(std::string(op) +
                       ": an eager cache decodes one token at a time (num_tokens = 1); "
                       "speculative windows need a replay cache");
  }
  if (c.mode == DecodeMode::kReplay && num_tokens > c.max_spec_tokens) {
    return invalid_argument(std::string(op) + ": window of " + str(num_tokens) +
                            " tokens is wider than the cache's max_spec_tokens (" +
                            str(c.max_spec_tokens) + ")");
  }
  return validate_batch_slots(cache, batch, slot_ids);
}

}  // namespace

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

Status validate_no_pending(const StateCache& cache, int slot, const char* what) {
  std::uint8_t pending = 0;
  REPLAYSSM_RETURN_IF_ERROR(memory_to_host(cache.config().device, &pending,
                                           cache.layout().pending + slot, 1));
  if (pending == 0 || cache.config().mode == DecodeMode::kEager) return Status::ok();
  return invalid_argument(std::string("cannot ") + what + " slot " + str(slot) +
                          " while it has an uncommitted window of " + str(pending) +
                          " tokens; commit first");
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
    const std::int32_t k = args.accepted[b];
    if (k < 0 || k > l.pending[s]) {
      return invalid_argument("row " + str(b) + " (slot " + str(s) + "): cannot commit " +
                              str(k) + " tokens; the last decode appended " +
                              str(l.pending[s]));
    }
  }
  return Status::ok();
}

Status validate_mamba2_decode(const StateCache& cache, const Mamba2DecodeArgs& a) {
  constexpr const char* op = "mamba2_decode";
  if (cache.config().kind != LayerKind::kMamba2) {
    return invalid_argument("mamba2_decode on a gdn state cache");
  }
  REPLAYSSM_RETURN_IF_ERROR(
      validate_decode_common(cache, op, a.layer, a.batch, a.num_tokens, a.slot_ids));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(require(a.x, op, "x"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.dt, op, "dt"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.B, op, "B"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.C, op, "C"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.A, op, "A"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.D, op, "D"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.dt_bias, op, "dt_bias"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.y, op, "y"));
  return Status::ok();
}

Status validate_gdn_decode(const StateCache& cache, const GdnDecodeArgs& a) {
  constexpr const char* op = "gdn_decode";
  if (cache.config().kind != LayerKind::kGdn) {
    return invalid_argument("gdn_decode on a mamba2 state cache");
  }
  REPLAYSSM_RETURN_IF_ERROR(
      validate_decode_common(cache, op, a.layer, a.batch, a.num_tokens, a.slot_ids));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(require(a.q, op, "q"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.k, op, "k"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.v, op, "v"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.g, op, "g"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.beta, op, "beta"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.o, op, "o"));
  if (!(a.scale >= 0.0f)) return invalid_argument("gdn_decode: scale must be >= 0");
  return Status::ok();
}

Status reset_slot(StateCacheLayout& l, int slot) {
  const Device dev = l.config.device;
  const std::int64_t se = l.state_elems();
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    const std::int64_t ls = l.layer_slot(layer, slot);
    if (l.state != nullptr) {
      const std::size_t bytes = se * dtype_size(l.config.state_dtype);
      REPLAYSSM_RETURN_IF_ERROR(memory_zero(dev, static_cast<char*>(l.state) + ls * bytes, bytes));
    }
    if (l.ckpt_hi != nullptr) {
      REPLAYSSM_RETURN_IF_ERROR(memory_zero(dev, l.ckpt_hi + ls * se, se * 4));
    }
    if (l.ckpt_lo != nullptr) {
      const std::size_t bytes = se * dtype_size(l.lo_dtype());
      REPLAYSSM_RETURN_IF_ERROR(
          memory_zero(dev, static_cast<char*>(l.ckpt_lo) + ls * bytes, bytes));
    }
    if (l.ckpt_lo_scale != nullptr) {
      REPLAYSSM_RETURN_IF_ERROR(
          memory_zero(dev, l.ckpt_lo_scale + ls * l.state_rows(), l.state_rows() * 4));
    }
    REPLAYSSM_RETURN_IF_ERROR(memory_zero(dev, l.folded + ls, 4));
  }
  REPLAYSSM_RETURN_IF_ERROR(memory_zero(dev, l.committed + slot, 4));
  REPLAYSSM_RETURN_IF_ERROR(memory_zero(dev, l.pending + slot, 1));
  const std::uint8_t one = 1;
  return memory_from_host(dev, l.allocated + slot, &one, 1);
}

}  // namespace replayssm
