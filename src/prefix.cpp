// The prefix ops (include/replayssm/prefix.h): validate, then hand to the cache's backend.
// Everything a CPU cache can refuse is found here, before anything is written.

#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"
#include "checkpoint_sharing.h"
#include "conv_window.h"
#include "prefix_backend.h"
#include "validate.h"

namespace replayssm {

namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

// A CPU cache's memory (its cursors, the calls' lists and states) is host memory, checked
// here; a CUDA cache's is device memory, checked by its kernels.
bool host_memory(const StateCache& cache) { return cache.config().device == Device::kCpu; }

constexpr auto require = validate_not_null;

Status require_replay(const StateCache& cache, const char* op) {
  if (cache.config().mode == DecodeMode::kReplay) return Status::ok();
  return unsupported(std::string(op) +
                     " needs a replay cache: an eager cache holds only the state at its "
                     "committed end (copy an eager slot's rows to fork it)");
}

Status require_batch(const char* op, int batch) {
  if (batch >= 0) return Status::ok();
  return invalid_argument(std::string(op) + ": batch must be >= 0, got " + str(batch));
}

// The cursors of a cache as host memory, with a layout over them: a CPU cache's own, a CUDA
// cache's copied (synchronising the stream), so that the reach rule runs on the host for both.
class HostCursors {
 public:
  Status init(const StateCache& cache, Stream stream) {
    layout_ = cache.layout();
    if (host_memory(cache)) return Status::ok();
    const auto slots = std::size_t(layout_.config.capacity);
    const auto regions = slots * std::size_t(layout_.config.num_layers);
    committed_.resize(slots);
    folded_.resize(regions);
    pending_.resize(regions);
    const Device dev = layout_.config.device;
    REPLAYSSM_RETURN_IF_ERROR(
        memory_to_host(dev, committed_.data(), layout_.committed, slots * 4, stream));
    REPLAYSSM_RETURN_IF_ERROR(
        memory_to_host(dev, folded_.data(), layout_.folded, regions * 4, stream));
    REPLAYSSM_RETURN_IF_ERROR(
        memory_to_host(dev, pending_.data(), layout_.pending, regions, stream));
    layout_.committed = committed_.data();
    layout_.folded = folded_.data();
    layout_.pending = pending_.data();
    return Status::ok();
  }
  const StateCacheLayout& layout() const { return layout_; }

 private:
  StateCacheLayout layout_;
  std::vector<std::uint32_t> committed_, folded_;
  std::vector<std::uint8_t> pending_;
};

// "position 12 is out of reach of slot 3 (folded 8 in layer 1, committed 11)".
Status check_reach(const StateCacheLayout& l, int slot, std::uint32_t p, const std::string& what) {
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    if (prefix_records_to(l, layer, slot, p) >= 0) continue;
    return invalid_argument(what + "position " + str(p) + " is out of reach of slot " +
                            str(slot) + ": layer " + str(layer) + " is folded to " +
                            str(l.folded[l.layer_slot(layer, slot)]) + " and the slot is "
                            "committed to " + str(l.committed[slot]) +
                            " (a position must lie in [folded, committed] of every layer)");
  }
  return Status::ok();
}

std::string row_tag(const char* op, int b) {
  return std::string(op) + ": row " + str(b) + ": ";
}

// A slot id of a row of a host list: -1 (pad) or allocated.
Status check_row_slot(const StateCache& cache, const char* op, int b, std::int32_t slot) {
  if (slot == -1) return Status::ok();
  const Status st = validate_slot(cache, slot);
  if (st.is_ok()) return st;
  return invalid_argument(row_tag(op, b) + st.message());
}

Status check_records(const StateCache& cache, const char* op, const CacheRecords& r,
                     int max_count) {
  if (r.count < 0 || r.count > max_count) {
    return invalid_argument(std::string(op) + ": " + str(r.count) +
                            " records; a slot holds 0 to " + str(max_count) +
                            " committed records (buffer_len - 1 + max_spec_tokens)");
  }
  if (r.count == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(require(r.vec, op, "records.vec"));
  REPLAYSSM_RETURN_IF_ERROR(require(r.key, op, "records.key"));
  REPLAYSSM_RETURN_IF_ERROR(require(r.write, op, "records.write"));
  REPLAYSSM_RETURN_IF_ERROR(require(r.decay, op, "records.decay"));
  switch (cache.config().kind) {
    case LayerKind::kMamba2: return Status::ok();
    case LayerKind::kGdn: return require(r.key_scale, op, "records.key_scale");
  }
  return Status::ok();
}

Status validate_materialize(const StateCache& cache, const MaterializeArgs& a) {
  constexpr const char* op = "state_cache_materialize";
  REPLAYSSM_RETURN_IF_ERROR(require_replay(cache, op));
  REPLAYSSM_RETURN_IF_ERROR(require_batch(op, a.batch));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(require(a.slot_ids, op, "slot_ids"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.positions, op, "positions"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.states, op, "states"));
  if (!host_memory(cache)) return Status::ok();  // device lists: checked by the kernels
  for (int b = 0; b < a.batch; ++b) {
    REPLAYSSM_RETURN_IF_ERROR(check_row_slot(cache, op, b, a.slot_ids[b]));
    if (a.slot_ids[b] == -1) continue;
    REPLAYSSM_RETURN_IF_ERROR(
        check_reach(cache.layout(), a.slot_ids[b], a.positions[b], row_tag(op, b)));
  }
  return Status::ok();
}

Status validate_fork(const StateCache& cache, const ForkArgs& a) {
  constexpr const char* op = "state_cache_fork";
  REPLAYSSM_RETURN_IF_ERROR(require_replay(cache, op));
  REPLAYSSM_RETURN_IF_ERROR(require_batch(op, a.batch));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(require(a.src_slots, op, "src_slots"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.dst_slots, op, "dst_slots"));
  REPLAYSSM_RETURN_IF_ERROR(require(a.positions, op, "positions"));
  if (!host_memory(cache)) return Status::ok();
  const auto capacity = std::size_t(cache.config().capacity);
  std::vector<bool> is_src(capacity, false), is_dst(capacity, false);
  for (int b = 0; b < a.batch; ++b) {
    const std::int32_t src = a.src_slots[b], dst = a.dst_slots[b];
    REPLAYSSM_RETURN_IF_ERROR(check_row_slot(cache, op, b, src));
    if (src == -1) continue;
    if (dst == -1) {
      return invalid_argument(row_tag(op, b) + "dst slot is -1 but src slot " + str(src) +
                              " is not (a pad row has -1 as its src)");
    }
    REPLAYSSM_RETURN_IF_ERROR(check_row_slot(cache, op, b, dst));
    if (dst == src) return invalid_argument(row_tag(op, b) + "slot " + str(src) + " forked onto itself");
    REPLAYSSM_RETURN_IF_ERROR(check_reach(cache.layout(), src, a.positions[b], row_tag(op, b)));
    is_src[std::size_t(src)] = true;
    if (is_dst[std::size_t(dst)]) {
      return invalid_argument(row_tag(op, b) + "dst slot " + str(dst) +
                              " appears twice in one batch");
    }
    is_dst[std::size_t(dst)] = true;
  }
  for (int b = 0; b < a.batch; ++b) {
    const std::int32_t dst = a.dst_slots[b];
    if (a.src_slots[b] != -1 && is_src[std::size_t(dst)]) {
      return invalid_argument(row_tag(op, b) + "dst slot " + str(dst) +
                              " is the src of a row of the same batch (fork it in a later call)");
    }
  }
  return Status::ok();
}

Status validate_truncate(const StateCache& cache, const TruncateArgs& a) {
  constexpr const char* op = "state_cache_truncate";
  REPLAYSSM_RETURN_IF_ERROR(require_replay(cache, op));
  REPLAYSSM_RETURN_IF_ERROR(validate_batch_slots(cache, a.batch, a.slot_ids));
  if (a.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(require(a.positions, op, "positions"));
  if (!host_memory(cache)) return Status::ok();
  for (int b = 0; b < a.batch; ++b) {
    if (a.slot_ids[b] == -1) continue;
    REPLAYSSM_RETURN_IF_ERROR(
        check_reach(cache.layout(), a.slot_ids[b], a.positions[b], row_tag(op, b)));
  }
  return Status::ok();
}

// Runs the op on the cache's backend: `on_cpu()` (which cannot fail once validated) or
// `on_cuda()`.
template <typename Cpu, typename Cuda>
Status on_backend(const StateCache& cache, Cpu on_cpu, Cuda on_cuda) {
  switch (cache.config().device) {
    case Device::kCpu:
      on_cpu();
      return Status::ok();
    case Device::kCuda: return on_cuda();
  }
  return invalid_argument("unknown device");
}

}  // namespace

Status state_cache_materialize(StateCache& cache, const MaterializeArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_materialize(cache, args));
  if (args.batch == 0) return Status::ok();
  StateCacheLayout& l = cache.layout();
  return on_backend(
      cache, [&] { cpu::materialize(l, args); },
      [&] { return cuda::materialize(l, args, stream); });
}

Status state_cache_read_records(StateCache& cache, int slot, std::uint32_t first,
                                const CacheRecords& out, Stream stream) {
  constexpr const char* op = "state_cache_read_records";
  REPLAYSSM_RETURN_IF_ERROR(require_replay(cache, op));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  const StateCacheLayout& l = cache.layout();
  REPLAYSSM_RETURN_IF_ERROR(check_records(cache, op, out, l.max_history()));
  if (out.count == 0) return Status::ok();
  HostCursors cursors;
  REPLAYSSM_RETURN_IF_ERROR(cursors.init(cache, stream));
  const std::string tag = std::string(op) + ": ";
  REPLAYSSM_RETURN_IF_ERROR(check_reach(cursors.layout(), slot, first, tag));
  REPLAYSSM_RETURN_IF_ERROR(
      check_reach(cursors.layout(), slot, first + std::uint32_t(out.count), tag));
  return on_backend(
      cache, [&] { cpu::read_records(l, slot, first, out); },
      [&] { return cuda::read_records(l, slot, first, out, stream); });
}

Status state_cache_restore(StateCache& cache, const RestoreArgs& args, Stream stream) {
  constexpr const char* op = "state_cache_restore";
  REPLAYSSM_RETURN_IF_ERROR(require_replay(cache, op));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, args.slot));
  REPLAYSSM_RETURN_IF_ERROR(require(args.states, op, "states"));
  StateCacheLayout& l = cache.layout();
  REPLAYSSM_RETURN_IF_ERROR(check_records(cache, op, args.records, l.max_history()));
  if ((args.conv_window != nullptr) != (l.conv_window != nullptr)) {
    return invalid_argument(std::string(op) + (l.conv_window != nullptr
                                                   ? ": conv_window is null; a conv cache "
                                                     "restores each layer's conv window"
                                                   : ": conv_window given but the cache has no "
                                                     "conv window (conv_kernel = 0)"));
  }
  HostCursors cursors;
  REPLAYSSM_RETURN_IF_ERROR(cursors.init(cache, stream));
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    const int pending = cursors.layout().pending[l.layer_slot(layer, args.slot)];
    if (pending != 0) {
      return invalid_argument(std::string(op) + ": layer " + str(layer) + " of slot " +
                              str(args.slot) + " has an uncommitted window of " + str(pending) +
                              " tokens; commit first");
    }
  }
  if (host_memory(cache)) {
    for (int layer = 0; layer < l.config.num_layers; ++layer) {
      const Status st = validate_finite_state(l, args.states + layer * l.state_elems());
      if (!st.is_ok()) {
        return invalid_argument(std::string(op) + ": layer " + str(layer) + ": " + st.message());
      }
    }
  }
  REPLAYSSM_RETURN_IF_ERROR(on_backend(
      cache,
      [&] {
        // The slot's checkpoint is replaced: it stops sharing (its borrowers get copies).
        (void)release_slot_checkpoints(l, args.slot, 0, l.config.num_layers,
                                       ReleaseFor::kOverwrite, stream);
        cpu::restore(l, args);
      },
      [&] { return cuda::restore(l, args, stream); }));
  if (args.conv_window == nullptr) return Status::ok();
  const std::uint32_t end = args.position + std::uint32_t(args.records.count);
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    const auto* window =
        static_cast<const char*>(args.conv_window) + layer * conv_window_bytes(l);
    REPLAYSSM_RETURN_IF_ERROR(write_conv_window(l, layer, args.slot, end, window, stream));
  }
  return Status::ok();
}

Status state_cache_fork(StateCache& cache, const ForkArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_fork(cache, args));
  if (args.batch == 0) return Status::ok();
  StateCacheLayout& l = cache.layout();
  // What a dst slot lends goes to its borrowers first; the fork then repoints the dst.
  REPLAYSSM_RETURN_IF_ERROR(release_checkpoints(
      l, {.num_layers = l.config.num_layers, .batch = args.batch, .slot_ids = args.dst_slots,
          .why = ReleaseFor::kHandOff},
      stream));
  return on_backend(
      cache,
      [&] {
        cpu::fork(l, args);
        if (l.conv_window != nullptr) cpu::fork_conv_window(l, args);
      },
      [&] { return cuda::fork(l, args, stream); });
}

Status state_cache_truncate(StateCache& cache, const TruncateArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_truncate(cache, args));
  if (args.batch == 0) return Status::ok();
  StateCacheLayout& l = cache.layout();
  return on_backend(
      cache, [&] { cpu::truncate(l, args); }, [&] { return cuda::truncate(l, args, stream); });
}

}  // namespace replayssm
