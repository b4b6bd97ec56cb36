#pragma once
/// \file ops.h
/// The decode ops. One Args struct per op; the CPU and CUDA backends take the same Args, with
/// pointers into the cache's memory (host for Device::kCpu, device for Device::kCuda).
/// Tensors are dense and row-major in the shapes given; activations (and outputs) have the
/// cache's input_dtype; per-head scalars and layer parameters are fp32.
///
/// A decode appends `num_tokens` (T) tokens per row after the row's committed position and
/// computes all T outputs:
///   - eager caches with max_spec_tokens = 1 (T = 1 only) update the state in place;
///   - eager caches with max_spec_tokens > 1 (per-draft-state speculation) read the current
///     state copy once and write the state after each token t of the window into its own copy
///     (the state stays fp32 across the window; each copy is rounded to the state dtype as it
///     is stored); state_cache_commit(k) makes the copy after token k current;
///   - replay caches compute every output from the unchanged checkpoint and the ring
///     (ALGORITHM.md §4); the only state write is a fold of committed history that was due
///     (committed - folded >= buffer_len), fused into the start of the step.
/// T = 1 is plain decoding; T > 1 verifies a speculative window (1 real token + T-1 drafts).
/// After the decodes of all layers, state_cache_commit(k) accepts k of the T tokens.
///
/// Slot ids: a CPU cache rejects an out-of-range, unallocated or repeated id with an error and
/// writes nothing. On a CUDA cache the ids are device memory: rows whose id is out of range or
/// not allocated are skipped on the device (nothing of theirs is written or read beyond the id
/// itself); repeated ids are not detected there.
///
/// A replay layer, or an eager layer with max_spec_tokens > 1, that already holds an uncommitted
/// window (decoded, not yet committed) must be committed before it decodes again: a CPU cache
/// refuses such a row with an error; on a CUDA cache the new window replaces the old one (the
/// committed state is untouched; outputs are those of a window starting at the committed
/// position).
///
/// What a decode checks on the host is only what varies per call (layer, batch, window width,
/// pointers; on CPU caches the slot ids): everything about the configuration was checked when
/// the cache was created. Nothing in a CUDA decode allocates or synchronises: its launches are
/// enqueued on `stream`, so whole steps can be captured in a CUDA graph on the caller's stream.

#include <cstdint>

#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

/// The pre-conv inputs of a decode on a conv cache (StateCacheConfig::conv_kernel = K > 0),
/// which then takes no x, B, C (Mamba-2) or q, k, v (GDN): token t of row b has
///   u = SiLU(bias + sum_{i<K} weight[c][i] · in(position committed + t - (K - 1) + i)),
/// accumulated in fp32 in that order (fmaf) and rounded to the input dtype, for every channel
/// c, where in(p) is the window's own token or, before the window, the cache's conv ring.
/// The window's inputs go into the ring at committed + t (a rejected draft's are overwritten
/// by the next window, as ring records are).
struct ConvInputs {
  const void* in = nullptr;        ///< [batch, T, conv_channels] input dtype, tokens `stride` apart
  std::int64_t stride = 0;         ///< elements from one token's row to the next; 0 = conv_channels
                                   ///< (a slice of a wider projection: its row length)
  const float* weight = nullptr;   ///< [conv_channels, K]: the model's conv1d weight [C, 1, K]
  const float* bias = nullptr;     ///< [conv_channels], or null for none
};

/// Both ops' `fold_every` (replay caches): this call first folds a row's committed history
/// into its checkpoint once at least `fold_every` tokens of it wait, in [1, buffer_len]; 0 =
/// buffer_len. It may change from call to call (a row holding more history than a shorter
/// setting allows folds all of it); eager caches take 0 only. Outputs equal a cache of
/// buffer_len = fold_every. A shorter cycle writes the checkpoint more often and leaves each
/// step less history to stage and replay: on an H200 GDN single-token steps at batch 1-128 ran
/// 2-15% faster folding every 8 than every 16, Mamba-2 steps slower (docs/BENCHMARKS.md). A
/// shared bf16 checkpoint rounds once per fold, and a low-precision read copy serves more of
/// each output as the ring part shrinks, so short cadences cost accuracy there
/// (docs/BENCHMARKS.md measures it). `replayssm.models` sets it by batch.
struct Mamba2DecodeArgs {
  int layer = 0;
  int batch = 0;
  int num_tokens = 1;                      ///< T
  int fold_every = 0;                      ///< replay: fold cadence of this call (see above)
  const std::int32_t* slot_ids = nullptr;  ///< [batch]; -1 = pad row (skipped, nothing written)
  const void* x = nullptr;                 ///< [batch, T, nheads, head_dim]   input dtype
  const float* dt = nullptr;               ///< [batch, T, nheads]             raw dt
  const void* B = nullptr;                 ///< [batch, T, ngroups, dstate]    input dtype
  const void* C = nullptr;                 ///< [batch, T, ngroups, dstate]    input dtype
  const void* z = nullptr;                 ///< [batch, T, nheads, head_dim]   optional gate
  const float* A = nullptr;                ///< [nheads], < 0
  const float* D = nullptr;                ///< [nheads]
  const float* dt_bias = nullptr;          ///< [nheads]
  void* y = nullptr;                       ///< [batch, T, nheads, head_dim]   input dtype
  /// Conv caches: x, B, C before the conv (channels x, B, C), instead of x, B and C.
  ConvInputs conv;
};

struct GdnDecodeArgs {
  int layer = 0;
  int batch = 0;
  int num_tokens = 1;                      ///< T
  int fold_every = 0;                      ///< replay: fold cadence of this call (see above)
  const std::int32_t* slot_ids = nullptr;  ///< [batch]; -1 = pad row
  const void* q = nullptr;                 ///< [batch, T, num_k_heads, head_k_dim]  input dtype
  const void* k = nullptr;                 ///< [batch, T, num_k_heads, head_k_dim]  input dtype
  const void* v = nullptr;                 ///< [batch, T, num_v_heads, head_v_dim]  input dtype
  const float* g = nullptr;                ///< [batch, T, num_v_heads]  log-decay <= 0
  const float* beta = nullptr;             ///< [batch, T, num_v_heads]  in (0, 1)
  bool qk_l2norm = true;                   ///< L2-normalise q and k (eps 1e-6 under the root)
  float scale = 0.0f;                      ///< applied to q (after normalising); 0 = K^-1/2
  void* o = nullptr;                       ///< [batch, T, num_v_heads, head_v_dim]  input dtype
  /// Conv caches: q, k, v before the conv (channels q, k, v), instead of q, k and v.
  ConvInputs conv;
};

Status mamba2_decode(StateCache& cache, const Mamba2DecodeArgs& args,
                     Stream stream = kDefaultStream);
Status gdn_decode(StateCache& cache, const GdnDecodeArgs& args, Stream stream = kDefaultStream);

/// Whether this build has the CUDA backend and a usable GPU is present.
bool cuda_available();

}  // namespace replayssm
