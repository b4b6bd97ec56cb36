// The CUDA backend's state-cache operations (src/backend.h) for both layer kinds:
//   commit, advance_folded   cursor moves on the device (graph-capturable, no host copy);
//   fold                     dispatch to the layer kind's fold kernel;
//   load_state, export_state the prefill hand-off and materialisation: whole-state copies
//                            with dtype conversion on the host, through cpu_common.h's row
//                            helpers so that a CUDA cache rounds its checkpoint copies (bf16,
//                            fp8 + per-row scale) exactly as a CPU cache does.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend.h"
#include "common/numeric.h"
#include "cpu/cpu_common.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/mamba2/params.cuh"
#include "cuda/state_cache/cursors.cuh"

namespace replayssm::cuda {

namespace {

constexpr int kCursorThreads = 256;

int cursor_blocks(int batch) { return (batch + kCursorThreads - 1) / kCursorThreads; }

struct CommitParams {
  StateCacheLayout cache;
  int batch;
  const std::int32_t* slot_ids;
  const std::int32_t* accepted;
};

// committed += k, pending = 0. k is clamped to [0, pending]: the CPU backend rejects anything
// else up front, but device-resident counts cannot be checked without a host round trip, and
// a bad count must not move a cursor past the ring.
__global__ void commit_kernel(const __grid_constant__ CommitParams p) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  const StateCacheLayout& l = p.cache;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0) return;
  const int pending = l.pending[slot];
  const int k = std::min(std::max(p.accepted[b], 0), pending);
  l.committed[slot] += static_cast<std::uint32_t>(k);
  l.pending[slot] = 0;
}

struct AdvanceParams {
  StateCacheLayout cache;
  int layer;
  int batch;
  int num_tokens;
  const std::int32_t* slot_ids;
};

__global__ void advance_folded_kernel(const __grid_constant__ AdvanceParams p) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  const StateCacheLayout& l = p.cache;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0) return;
  if (fold_due(l, unfolded(l, p.layer, slot), p.num_tokens)) {
    l.folded[layer_slot(l, p.layer, slot)] = l.committed[slot];
  }
}

// Host <-> device copies on the launch stream, so that they order against the kernels.
Status copy_to_host(void* dst, const void* src, std::size_t bytes) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, launch_stream()));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(launch_stream()));
  return Status::ok();
}
Status copy_to_device(void* dst, const void* src, std::size_t bytes) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, launch_stream()));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(launch_stream()));
  return Status::ok();
}

// Host staging of one (layer, slot) checkpoint: every copy the cache has, [heads, rows, cols].
struct HostCheckpoint {
  std::vector<float> hi;
  std::vector<bf16_t> lo_bf16;
  std::vector<fp8e4m3_t> lo_fp8;
  std::vector<float> scale;

  explicit HostCheckpoint(const StateCacheLayout& l) {
    const std::size_t n = static_cast<std::size_t>(l.state_elems());
    if (l.has_hi()) hi.resize(n);
    if (l.has_lo() && l.lo_dtype() == DType::kBF16) lo_bf16.resize(n);
    if (l.has_lo() && l.lo_dtype() == DType::kF8E4M3) {
      lo_fp8.resize(n);
      scale.resize(static_cast<std::size_t>(l.state_rows()));
    }
  }
  // cpu_common.h's view of head h of this staging.
  cpu::CheckpointHead head(const StateCacheLayout& l, int h) {
    cpu::CheckpointHead c;
    c.rows = l.dims.rows;
    c.cols = l.dims.cols;
    const std::size_t block = static_cast<std::size_t>(h) * l.dims.rows * l.dims.cols;
    if (!hi.empty()) c.hi = hi.data() + block;
    if (!lo_bf16.empty()) c.lo_bf16 = lo_bf16.data() + block;
    if (!lo_fp8.empty()) {
      c.lo_fp8 = lo_fp8.data() + block;
      c.lo_scale = scale.data() + static_cast<std::size_t>(h) * l.dims.rows;
    }
    return c;
  }
};

std::int64_t ls_index(const StateCacheLayout& l, int layer, int slot) {
  return l.layer_slot(layer, slot);
}

// A one-element device copy of `slot`, for the fold kernels (whose slot ids live on the device).
class DeviceSlotId {
 public:
  Status init(int slot) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, sizeof(std::int32_t)));
    const std::int32_t id = slot;
    return copy_to_device(ptr_, &id, sizeof id);
  }
  ~DeviceSlotId() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  const std::int32_t* get() const { return ptr_; }

 private:
  std::int32_t* ptr_ = nullptr;
};

}  // namespace

Status advance_folded(const StateCacheLayout& cache, int layer, const std::int32_t* slot_ids,
                      int batch, int num_tokens) {
  if (batch == 0) return Status::ok();
  const AdvanceParams p{cache, layer, batch, num_tokens, slot_ids};
  advance_folded_kernel<<<cursor_blocks(batch), kCursorThreads, 0, launch_stream()>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("advance_folded kernel");
  return Status::ok();
}

Status commit(StateCacheLayout& cache, const CommitArgs& args) {
  if (args.batch == 0) return Status::ok();
  const CommitParams p{cache, args.batch, args.slot_ids, args.accepted};
  commit_kernel<<<cursor_blocks(args.batch), kCursorThreads, 0, launch_stream()>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("commit kernel");
  return Status::ok();
}

Status fold(StateCacheLayout& cache, const FoldArgs& args) {
  if (cache.config.mode == DecodeMode::kEager || args.batch == 0) return Status::ok();
  return cache.config.kind == LayerKind::kMamba2 ? mamba2_fold(cache, args)
                                                 : gdn_fold(cache, args);
}

Status load_state(StateCacheLayout& l, int layer, int slot, const float* state) {
  const std::int64_t n = l.state_elems();
  const std::int64_t ls = ls_index(l, layer, slot);
  if (l.config.mode == DecodeMode::kEager) {
    return StateDTypes::dispatch(l.config.state_dtype, "state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      std::vector<state_t> host(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) host[i] = from_float<state_t>(state[i]);
      return copy_to_device(static_cast<state_t*>(l.state) + ls * n, host.data(),
                            host.size() * sizeof(state_t));
    });
  }
  HostCheckpoint staging(l);
  for (int h = 0; h < l.dims.heads; ++h) {
    const cpu::CheckpointHead c = staging.head(l, h);
    for (int r = 0; r < l.dims.rows; ++r) {
      cpu::write_row(c, r, state + (std::int64_t{h} * l.dims.rows + r) * l.dims.cols);
    }
  }
  if (l.has_hi()) {
    REPLAYSSM_RETURN_IF_ERROR(copy_to_device(l.ckpt_hi + ls * n, staging.hi.data(), n * 4));
  }
  if (!staging.lo_bf16.empty()) {
    REPLAYSSM_RETURN_IF_ERROR(copy_to_device(static_cast<bf16_t*>(l.ckpt_lo) + ls * n,
                                             staging.lo_bf16.data(), n * 2));
  }
  if (!staging.lo_fp8.empty()) {
    REPLAYSSM_RETURN_IF_ERROR(copy_to_device(static_cast<fp8e4m3_t*>(l.ckpt_lo) + ls * n,
                                             staging.lo_fp8.data(), n));
    REPLAYSSM_RETURN_IF_ERROR(copy_to_device(l.ckpt_lo_scale + ls * l.state_rows(),
                                             staging.scale.data(), l.state_rows() * 4));
  }
  // The layer's ring starts empty at the slot's committed position.
  std::uint32_t committed = 0;
  REPLAYSSM_RETURN_IF_ERROR(copy_to_host(&committed, l.committed + slot, 4));
  return copy_to_device(l.folded + ls, &committed, 4);
}

Status export_state(StateCacheLayout& l, int layer, int slot, float* state) {
  const std::int64_t n = l.state_elems();
  const std::int64_t ls = ls_index(l, layer, slot);
  if (l.config.mode == DecodeMode::kEager) {
    return StateDTypes::dispatch(l.config.state_dtype, "state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      std::vector<state_t> host(static_cast<std::size_t>(n));
      REPLAYSSM_RETURN_IF_ERROR(copy_to_host(host.data(), static_cast<state_t*>(l.state) + ls * n,
                                             host.size() * sizeof(state_t)));
      for (std::int64_t i = 0; i < n; ++i) state[i] = to_float(host[i]);
      return Status::ok();
    });
  }
  // Materialise: fold the committed history first. Mamba-2 folds only this layer, as the CPU
  // backend does; the GDN fold entry point folds every layer of the slot (equivalent state).
  DeviceSlotId id;
  REPLAYSSM_RETURN_IF_ERROR(id.init(slot));
  if (l.config.kind == LayerKind::kMamba2) {
    REPLAYSSM_RETURN_IF_ERROR(mamba2::fold_layer(l, layer, id.get(), 1));
  } else {
    REPLAYSSM_RETURN_IF_ERROR(gdn_fold(l, FoldArgs{1, id.get()}));
  }
  if (l.has_hi()) return copy_to_host(state, l.ckpt_hi + ls * n, n * 4);
  // Shared bf16: the low copy is the master.
  std::vector<bf16_t> host(static_cast<std::size_t>(n));
  REPLAYSSM_RETURN_IF_ERROR(
      copy_to_host(host.data(), static_cast<const bf16_t*>(l.ckpt_lo) + ls * n, n * 2));
  for (std::int64_t i = 0; i < n; ++i) state[i] = to_float(host[i]);
  return Status::ok();
}

}  // namespace replayssm::cuda
