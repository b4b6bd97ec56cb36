// The CUDA backend's state-cache operations (src/backend.h) for both layer kinds:
//   can_implement            which layer family's kernels judge a configuration;
//   commit                   the committed-cursor move on the device (graph-capturable, no
//                            host copy; `folded` moves inside each replay launch, cursors.cuh);
//   fold                     the layer family's fold;
//   load_state, export_state the prefill hand-off and materialisation: whole-state copies
//                            with dtype conversion on the host, through the row helpers of
//                            common/checkpoint_rows.h, so that a CUDA cache rounds its
//                            checkpoint copies (bf16, fp8 + per-row scale) exactly as a CPU
//                            cache does.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend.h"
#include "common/checkpoint_rows.h"
#include "common/numeric.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/stream.cuh"
#include "cuda/families.h"
#include "validate.h"

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

// committed += k, pending = 0 in every layer, and an eager window's copy after token k made
// current. k is clamped to [0, the fewest tokens any layer decoded]: the CPU backend rejects
// anything else up front, but device-resident counts cannot be checked without a host round
// trip, and a bad count must not move a cursor past the ring, over a record some layer never
// wrote, or onto a state copy some layer did not write. A programmatic launch (launch.cuh): at small batch
// a step is a few short kernels, and this one's launch overlaps the last decode's tail.
__global__ void commit_kernel(const __grid_constant__ CommitParams p) {
  grid_dependency_wait();
  allow_dependents();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  const StateCacheLayout& l = p.cache;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0) return;
  // Every layer's pending count is read before any is cleared, so the loads are in flight
  // together instead of one memory round trip per layer.
  int pending = 255;
#pragma unroll 4
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    pending = min(pending, int(l.pending[l.layer_slot(layer, slot)]));
  }
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    l.pending[l.layer_slot(layer, slot)] = 0;
  }
  const int k = std::min(std::max(p.accepted[b], 0), pending);
  l.committed[slot] += static_cast<std::uint32_t>(k);
  // An eager window's copy after token k becomes the current state (no state moves).
  if (l.state_current != nullptr) {
    l.state_current[slot] = static_cast<std::uint32_t>(l.after_tokens(l.current_copy(slot), k));
  }
}

// Host <-> device copies on the caller's stream, so that they order against the kernels; the
// host side may be pageable. Either side may also be device memory (cudaMemcpyDefault).
Status copy_sync(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
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
    if (l.ckpt.has_hi) hi.resize(n);
    if (l.ckpt.has_lo && l.ckpt.lo_dtype == DType::kBF16) lo_bf16.resize(n);
    if (l.ckpt.has_lo && l.ckpt.lo_dtype == DType::kF8E4M3) lo_fp8.resize(n);
    if (l.ckpt.lo_row_scale) scale.resize(static_cast<std::size_t>(l.state_rows()));
  }
  // checkpoint_rows.h's view of head h of this staging.
  ::replayssm::CheckpointHead head(const StateCacheLayout& l, int h) {
    ::replayssm::CheckpointHead c;
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

// A one-element device copy of `slot`, for the fold kernels (whose slot ids live on the device).
class DeviceSlotId {
 public:
  Status init(int slot, cudaStream_t stream) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, sizeof(std::int32_t)));
    const std::int32_t id = slot;
    return copy_sync(ptr_, &id, sizeof id, stream);
  }
  ~DeviceSlotId() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  const std::int32_t* get() const { return ptr_; }

 private:
  std::int32_t* ptr_ = nullptr;
};

Status fold_layers(StateCacheLayout& cache, int first_layer, int num_layers,
                   const std::int32_t* slot_ids, int batch, cudaStream_t stream) {
  switch (cache.config.kind) {
    case LayerKind::kMamba2:
      return mamba2::fold_layers(cache, first_layer, num_layers, slot_ids, batch, stream);
    case LayerKind::kGdn:
      return gdn::fold_layers(cache, first_layer, num_layers, slot_ids, batch, stream);
  }
  return invalid_argument("unknown layer kind");
}

}  // namespace

Status can_implement(const StateCacheConfig& config) {
  if (!device_present()) return unsupported("a CUDA state cache needs a GPU; none was found");
  switch (config.kind) {
    case LayerKind::kMamba2: return mamba2::can_implement(config);
    case LayerKind::kGdn: return gdn::can_implement(config);
  }
  return invalid_argument("unknown layer kind");
}

Status commit(StateCacheLayout& cache, const CommitArgs& args, Stream stream) {
  if (args.batch == 0) return Status::ok();
  const CommitParams p{cache, args.batch, args.slot_ids, args.accepted};
  return launch_programmatic(commit_kernel, dim3(cursor_blocks(args.batch)), dim3(kCursorThreads),
                             0, to_cuda(stream), p, "commit kernel");
}

Status fold(StateCacheLayout& cache, const FoldArgs& args, Stream stream) {
  return fold_layers(cache, 0, cache.config.num_layers, args.slot_ids, args.batch,
                     to_cuda(stream));
}

namespace {

// Element offset of (layer, slot)'s current eager state copy (reads state_current; synchronises).
Status eager_state_offset(const StateCacheLayout& l, int layer, int slot, cudaStream_t stream,
                          std::int64_t* offset) {
  int current = 0;
  if (l.state_current != nullptr) {
    std::uint32_t raw = 0;
    REPLAYSSM_RETURN_IF_ERROR(copy_sync(&raw, l.state_current + slot, sizeof raw, stream));
    current = int(raw % std::uint32_t(l.state_copies()));
  }
  *offset = l.state_offset(layer, slot, current);
  return Status::ok();
}

}  // namespace

Status load_state(StateCacheLayout& l, int layer, int slot, const float* state, Stream s) {
  const cudaStream_t stream = to_cuda(s);
  const std::int64_t n = l.state_elems();
  const std::int64_t ls = l.layer_slot(layer, slot);
  std::vector<float> host(static_cast<std::size_t>(n));
  REPLAYSSM_RETURN_IF_ERROR(copy_sync(host.data(), state, host.size() * 4, stream));
  REPLAYSSM_RETURN_IF_ERROR(validate_finite_state(l, host.data()));
  if (l.config.mode == DecodeMode::kEager) {
    std::int64_t offset = 0;
    REPLAYSSM_RETURN_IF_ERROR(eager_state_offset(l, layer, slot, stream, &offset));
    return StateDTypes::dispatch(l.config.state_dtype, "state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      std::vector<state_t> converted(host.size());
      for (std::size_t i = 0; i < host.size(); ++i) converted[i] = from_float<state_t>(host[i]);
      return copy_sync(static_cast<state_t*>(l.state) + offset, converted.data(),
                       converted.size() * sizeof(state_t), stream);
    });
  }
  // The layer's checkpoint is replaced: it stops sharing (its borrowers get copies first).
  REPLAYSSM_RETURN_IF_ERROR(
      release_slot_checkpoints(l, slot, layer, 1, ReleaseFor::kOverwrite, s));
  HostCheckpoint staging(l);
  for (int h = 0; h < l.dims.heads; ++h) {
    const ::replayssm::CheckpointHead c = staging.head(l, h);
    for (int r = 0; r < l.dims.rows; ++r) {
      write_row(c, r, host.data() + (std::int64_t{h} * l.dims.rows + r) * l.dims.cols);
    }
  }
  if (!staging.hi.empty()) {
    REPLAYSSM_RETURN_IF_ERROR(copy_sync(l.ckpt_hi + ls * n, staging.hi.data(), n * 4, stream));
  }
  if (!staging.lo_bf16.empty()) {
    REPLAYSSM_RETURN_IF_ERROR(copy_sync(static_cast<bf16_t*>(l.ckpt_lo) + ls * n,
                                        staging.lo_bf16.data(), n * 2, stream));
  }
  if (!staging.lo_fp8.empty()) {
    REPLAYSSM_RETURN_IF_ERROR(copy_sync(static_cast<fp8e4m3_t*>(l.ckpt_lo) + ls * n,
                                        staging.lo_fp8.data(), n, stream));
    REPLAYSSM_RETURN_IF_ERROR(copy_sync(l.ckpt_lo_scale + ls * l.state_rows(),
                                        staging.scale.data(), l.state_rows() * 4, stream));
  }
  // The layer's ring starts empty at the slot's committed position.
  std::uint32_t committed = 0;
  REPLAYSSM_RETURN_IF_ERROR(copy_sync(&committed, l.committed + slot, 4, stream));
  return copy_sync(l.folded + ls, &committed, 4, stream);
}

Status export_state(StateCacheLayout& l, int layer, int slot, float* state, Stream s) {
  const cudaStream_t stream = to_cuda(s);
  const std::int64_t n = l.state_elems();
  const std::int64_t ls = l.layer_slot(layer, slot);
  std::vector<float> host(static_cast<std::size_t>(n));
  if (l.config.mode == DecodeMode::kEager) {
    std::int64_t offset = 0;
    REPLAYSSM_RETURN_IF_ERROR(eager_state_offset(l, layer, slot, stream, &offset));
    REPLAYSSM_RETURN_IF_ERROR(StateDTypes::dispatch(l.config.state_dtype, "state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      std::vector<state_t> raw(host.size());
      REPLAYSSM_RETURN_IF_ERROR(copy_sync(raw.data(), static_cast<state_t*>(l.state) + offset,
                                          raw.size() * sizeof(state_t), stream));
      for (std::size_t i = 0; i < raw.size(); ++i) host[i] = to_float(raw[i]);
      return Status::ok();
    }));
  } else {
    // Materialise: fold this layer's committed history first, as the CPU backend does.
    DeviceSlotId id;
    REPLAYSSM_RETURN_IF_ERROR(id.init(slot, stream));
    REPLAYSSM_RETURN_IF_ERROR(fold_layers(l, layer, 1, id.get(), 1, stream));
    // The rows the slot reads: its own, or while it shares them since a fork, its source's.
    std::int64_t region = ls;
    if (l.ckpt_source != nullptr) {
      std::uint32_t source = 0;
      REPLAYSSM_RETURN_IF_ERROR(copy_sync(&source, l.ckpt_source + ls, 4, stream));
      if (l.lender_slot(source) >= 0) region = l.layer_slot(layer, l.lender_slot(source));
    }
    if (l.ckpt.has_hi) {
      REPLAYSSM_RETURN_IF_ERROR(copy_sync(host.data(), l.ckpt_hi + region * n, n * 4, stream));
    } else {
      // Shared bf16: the low copy is the master.
      std::vector<bf16_t> raw(host.size());
      REPLAYSSM_RETURN_IF_ERROR(copy_sync(
          raw.data(), static_cast<const bf16_t*>(l.ckpt_lo) + region * n, n * 2, stream));
      for (std::size_t i = 0; i < raw.size(); ++i) host[i] = to_float(raw[i]);
    }
  }
  return copy_sync(state, host.data(), host.size() * 4, stream);
}

}  // namespace replayssm::cuda
