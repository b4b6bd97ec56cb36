// release_checkpoints on a CUDA cache (checkpoint_sharing.h): one programmatic dependent launch
// (launch.cuh: it overlaps the previous kernel's tail), a block per (row, layer), which a graph
// captures. A block that finds its row shares nothing, or writes no checkpoint in the op that
// follows, returns after a few loads: all a decode pays in the common case. Otherwise:
//   - a borrower copies what it reads into its own rows (before a fold), then clears its
//     ckpt_source and counts itself off its lender;
//   - a lender finds its borrowers by scanning the layer's ckpt_source (a few KB), copies its
//     rows to each, then clears their ckpt_source and its count.
// Each block copies before it repoints (__syncthreads between), and only lenders' rows are
// read, only borrowers' written, so blocks of one launch never race: a lender and its borrower
// in one call both copy the same bytes to the borrower, whoever repoints it first has finished
// its copy, and the atomics count each borrow off once. One block per row copies a whole
// checkpoint (MBs) alone when it must: that happens at most once per fork, and many rows at
// once (parallel sampling folding together) fill the GPU.

#include <cuda_runtime.h>

#include <cstdint>

#include "backend.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/stream.cuh"
#include "prefix_backend.h"

namespace replayssm::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread, so one block streams a copy

struct ReleaseParams {
  StateCacheLayout cache;
  SlotRuns ckpt;
  ReleaseArgs args;
};

// Every checkpoint copy of region `from` onto region `to`, by the whole block.
__device__ void copy_checkpoint(const SlotRuns& ckpt, std::int64_t from, std::int64_t to) {
  for (int f = 0; f < ckpt.count; ++f) {
    const ByteRun& r = ckpt.run[f];
    const char* src = r.base + from * r.bytes;
    char* dst = r.base + to * r.bytes;
    const auto bits = reinterpret_cast<std::uintptr_t>(dst) |
                      reinterpret_cast<std::uintptr_t>(src) | std::uintptr_t(r.bytes);
    if ((bits & 15u) != 0) {  // tiny test shapes only: every real run is 16-byte aligned
      for (std::int64_t i = threadIdx.x; i < r.bytes; i += kThreads) dst[i] = src[i];
      continue;
    }
    const auto* s = reinterpret_cast<const uint4*>(src);
    auto* d = reinterpret_cast<uint4*>(dst);
    const std::int64_t words = r.bytes / 16;
    std::int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < words; i += kUnroll * kThreads) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * kThreads] = v[u];
    }
    for (; i < words; i += kThreads) d[i] = s[i];
  }
}

__global__ void __launch_bounds__(kThreads) release_kernel(const __grid_constant__ ReleaseParams p) {
  grid_dependency_wait();
  allow_dependents();
  const StateCacheLayout& l = p.cache;
  const int slot = p.args.slot_ids != nullptr ? resolve_slot(l, p.args.slot_ids, int(blockIdx.x))
                                              : p.args.slot;  // one slot, checked by the host
  const int layer = p.args.first_layer + int(blockIdx.y);
  if (slot < 0 || !shares_checkpoint(l, layer, slot) || !release_applies(l, layer, slot, p.args)) {
    return;
  }
  const std::int64_t ls = l.layer_slot(layer, slot);
  const std::uint32_t mine = std::uint32_t(slot) + 1;  // how a borrower names this slot
  const std::uint32_t source = l.ckpt_source[ls];
  const bool lends = l.ckpt_borrowers[ls] != 0;
  if (source != 0 && release_copies_borrowed(p.args)) {
    copy_checkpoint(p.ckpt, l.checkpoint_region(layer, slot), ls);
  }
  if (lends) {
    for (int x = 0; x < l.config.capacity; ++x) {
      const std::int64_t lx = l.layer_slot(layer, x);
      if (l.ckpt_source[lx] == mine) copy_checkpoint(p.ckpt, ls, lx);
    }
  }
  __syncthreads();  // every copy of this block is done before any row is repointed
  if (threadIdx.x != 0) return;
  __threadfence();
  if (source != 0 && release_drops_borrow(p.args)) {
    const int before = l.lender_slot(atomicExch(l.ckpt_source + ls, 0u));
    if (before >= 0) atomicSub(l.ckpt_borrowers + l.layer_slot(layer, before), 1u);
  }
  if (lends) {
    for (int x = 0; x < l.config.capacity; ++x) {
      if (atomicCAS(l.ckpt_source + l.layer_slot(layer, x), mine, 0u) == mine) {
        atomicSub(l.ckpt_borrowers + ls, 1u);
      }
    }
  }
}

}  // namespace

Status release_checkpoints(StateCacheLayout& l, const ReleaseArgs& a, Stream s) {
  const int rows = a.slot_ids != nullptr ? a.batch : 1;
  if (a.num_layers > 65535) {
    return unsupported("a CUDA cache that shares checkpoints releases at most 65535 layers "
                       "per call");
  }
  const ReleaseParams p{l, slot_runs(l, SlotPart::kCheckpoint), a};
  return launch_programmatic(release_kernel, dim3(rows, a.num_layers), dim3(kThreads), 0,
                             to_cuda(s), p, "checkpoint release kernel");
}

}  // namespace replayssm::cuda
