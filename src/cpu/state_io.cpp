// Moving whole states in and out of a CPU cache (prefill hand-off, preemption, debugging),
// and the cursor move of a commit (with an eager window's copy selection).

#include "backend.h"
#include "cpu_common.h"

namespace replayssm::cpu {

namespace {

// The copy of (layer, slot)'s eager state that holds its committed state.
template <typename state_t>
state_t* eager_state(const StateCacheLayout& l, int layer, int slot) {
  return static_cast<state_t*>(l.state) + l.state_offset(layer, slot, l.current_copy(slot));
}

}  // namespace

void load_state(StateCacheLayout& l, int layer, int slot, const float* state) {
  const std::int64_t n = l.state_elems();
  if (l.config.mode == DecodeMode::kEager) {
    dispatch_activation(l.config.state_dtype, [&](auto tag) {
      using state_t = typename decltype(tag)::type;
      state_t* dst = eager_state<state_t>(l, layer, slot);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = from_float<state_t>(state[i]);
    });
    return;
  }
  const int rows = l.dims.rows, cols = l.dims.cols;
  for (int h = 0; h < l.dims.heads; ++h) {
    const CheckpointHead c = checkpoint_head(l, layer, slot, h);
    for (int r = 0; r < rows; ++r) {
      write_row(c, r, state + (std::int64_t{h} * rows + r) * cols);
    }
  }
  // The ring of this layer starts empty at the slot's committed position.
  l.folded[l.layer_slot(layer, slot)] = l.committed[slot];
}

void export_state(const StateCacheLayout& l, int layer, int slot, float* state) {
  const std::int64_t n = l.state_elems();
  if (l.config.mode == DecodeMode::kEager) {
    dispatch_activation(l.config.state_dtype, [&](auto tag) {
      using state_t = typename decltype(tag)::type;
      const state_t* src = eager_state<state_t>(l, layer, slot);
      for (std::int64_t i = 0; i < n; ++i) state[i] = to_float(src[i]);
    });
    return;
  }
  const int rows = l.dims.rows, cols = l.dims.cols;
  for (int h = 0; h < l.dims.heads; ++h) {
    const CheckpointHead c = checkpoint_head(l, layer, slot, h);
    for (int r = 0; r < rows; ++r) {
      read_master_row(c, r, state + (std::int64_t{h} * rows + r) * cols);
    }
  }
}

void commit(StateCacheLayout& l, const CommitArgs& args) {
  for (int b = 0; b < args.batch; ++b) {
    const std::int32_t slot = args.slot_ids[b];
    if (slot < 0) continue;
    l.committed[slot] += static_cast<std::uint32_t>(args.accepted[b]);
    for (int layer = 0; layer < l.config.num_layers; ++layer) l.pending[l.layer_slot(layer, slot)] = 0;
    if (l.state_current != nullptr) {
      l.state_current[slot] = std::uint32_t(l.after_tokens(l.current_copy(slot), args.accepted[b]));
    }
  }
}

}  // namespace replayssm::cpu
