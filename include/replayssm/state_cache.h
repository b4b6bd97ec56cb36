#pragma once
/// \file state_cache.h
/// The per-layer-kind state cache: every decoding sequence owns a slot; a slot holds, for each
/// of the cache's layers, either the eager state or (replay) the checkpoint copies and the ring
/// of recent inputs, plus cursors (ALGORITHM.md §3, §8).
///
/// Memory. Every buffer a configuration needs is listed by state_cache_buffers() (name, dtype,
/// shape, bytes, alignment). A cache either owns its buffers (state_cache_create allocates
/// them) or is a view over buffers the caller allocated and keeps owning
/// (state_cache_create_view): an engine can keep the state in its own memory pool. Every op
/// works on both kinds alike. Each buffer's leading axes are [num_layers, capacity] or
/// [capacity], so everything of slot s (checkpoint copies, ring records, cursors) is addressed
/// by s in every buffer: copying or swapping a slot is copying or swapping those rows. The one
/// exception: with share_forked_checkpoints, ckpt_source[layer][s] = t + 1 says that the
/// checkpoint of (layer, s) is slot t's rows (0: its own), and ckpt_borrowers[layer][t] counts
/// the slots that read t's; a slot with borrowers must not be overwritten by a row copy.
///
/// Cursors (all in the cache's memory: host for CPU caches, device for CUDA caches):
///   committed[slot]         absolute position of the next token to commit (shared by layers)
///   folded[layer][slot]     position through which that layer's checkpoint is folded
///   pending[layer][slot]    tokens the layer's last decode appended and not yet committed
///   state_current[slot]     eager caches with max_spec_tokens > 1: which state copy is current
/// A layer's ring holds positions folded..committed+pending-1 at index pos & (ring_capacity-1).
/// Each layer folds its own committed history at the start of a decode when
/// committed - folded >= buffer_len, so folds need no cross-layer step and no host decision;
/// every layer of a slot takes the same decision because they share `committed`.
///
/// Streams. Every call that touches a CUDA cache's memory takes a Stream (types.h) and orders
/// its work on it. Calls that must return host data (export) or host decisions (a view that
/// adopts existing contents) synchronise that stream; the others only enqueue work.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

/// The ranges a cache configuration may take (one source: the library checks them at creation,
/// tools check them before any work and quote them in --help).
inline constexpr int kMaxBufferLen = 4096;  ///< buffer_len (L) in [1, kMaxBufferLen]
inline constexpr int kMaxSpecTokens = 64;   ///< max_spec_tokens (T) in [1, kMaxSpecTokens]
inline constexpr int kMaxConvKernel = 8;    ///< conv_kernel in {0} ∪ [2, kMaxConvKernel]

struct StateCacheConfig {
  LayerKind kind = LayerKind::kMamba2;
  Mamba2Shape mamba2;  ///< used when kind == kMamba2
  GdnShape gdn;        ///< used when kind == kGdn
  int num_layers = 1;  ///< layers of this kind and shape that share the slots' cursors
  int capacity = 0;    ///< slots
  Device device = Device::kCpu;
  DecodeMode mode = DecodeMode::kReplay;
  /// Activation dtype: inputs, ring records and outputs (f32, bf16 or f16).
  DType input_dtype = DType::kF32;
  /// Eager only: the state's dtype (f32, bf16 or f16).
  DType state_dtype = DType::kF32;
  /// Replay only: tokens per fold cycle (L >= 1).
  int buffer_len = 16;
  /// The widest speculative window a decode may verify (T >= 1; 1 = plain decode). An eager
  /// cache with T > 1 keeps T + 1 copies of each layer's state per slot (per-draft-state
  /// speculation): a window reads the current copy once and writes the state after each of
  /// its tokens into its own copy; commit(k) makes the copy after token k current.
  int max_spec_tokens = 1;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  /// Replay only: state_cache_fork (prefix.h) lets the copy read its source's checkpoint
  /// instead of copying it (copy on fold). A fork then moves only ring records and cursors;
  /// the checkpoint is copied when the copy or the slot it reads from is about to write its
  /// own (a fold, load_state, restore, a fork onto it, free), and never when the copy is freed
  /// first. Costs two u32 buffers (ckpt_source, ckpt_borrowers) and, before every op that
  /// writes a checkpoint, a release pass (on CUDA one small launch per decode, fold, load,
  /// restore, fork and free, which returns at once for rows that share nothing). While a slot
  /// reads another's checkpoint, its own rows of ckpt_hi / ckpt_lo / ckpt_lo_scale are unused:
  /// an engine that copies slot rows itself must copy through ckpt_source (see Memory above).
  bool share_forked_checkpoints = false;
  /// Replay only: the width of the layer's causal conv1d when the decodes apply it (0: they do
  /// not; the caller convolves and passes x, B, C or q, k, v). With conv_kernel = K > 0 every
  /// decode takes the pre-conv inputs (ConvInputs in ops.h), applies conv + bias + SiLU to the
  /// window's tokens inside its one launch, and keeps each layer's conv inputs in the cache's
  /// conv_window ring: no separate conv state is read and written and no conv kernel runs.
  /// The ring holds K - 1 + max_records positions (the next power of two), so that fork and
  /// truncate find the conv window at every position they accept; a slot's window starts as
  /// zeros (a fresh sequence's left padding) and is set by state_cache_load_conv_window after
  /// a prefill, and by state_cache_restore's conv_window.
  int conv_kernel = 0;

  [[nodiscard]] StateDims dims() const;
  /// Channels of the layer's causal conv1d, in the models' order: Mamba-2 x, B, C
  /// (nheads·head_dim + 2·ngroups·dstate); GDN q, k, v (2·num_k_heads·head_k_dim +
  /// num_v_heads·head_v_dim).
  [[nodiscard]] int conv_channels() const;
};

/// Whether some backend of this build can run `config` (shape, dtypes, precision, window width
/// on its device): kOk, or an error naming what is supported. state_cache_create and
/// state_cache_create_view refuse what this refuses, so decodes only check what varies per call.
Status state_cache_can_implement(const StateCacheConfig& config);

// ---- the buffer list ------------------------------------------------------------------------

/// The buffers a cache may have. Which ones a configuration uses: state_cache_buffers().
enum class CacheBufferId : std::uint8_t {
  kState,         ///< eager: [layers, capacity, heads, rows, cols]  state_dtype; with
                  ///< max_spec_tokens T > 1: [layers, capacity, T + 1, heads, rows, cols]
  kStateCurrent,  ///< eager with T > 1: [capacity]  u32 (the state copy that is current)
  kCkptHi,        ///< replay fp32 master: [layers, capacity, heads, rows, cols]  f32
  kCkptLo,        ///< replay low copy: [layers, capacity, heads, rows, cols]  bf16 or f8e4m3
  kCkptLoScale,   ///< fp8 copy's per-row scales: [layers, capacity, heads, rows]  f32
  kRingVec,       ///< [layers, capacity, ring, heads, rows]  input dtype (Mamba-2 x, GDN v)
  kRingKey,       ///< [layers, capacity, ring, key_heads, cols]  input dtype (B, raw k)
  kRingKeyScale,  ///< GDN: [layers, capacity, ring, key_heads]  f32 (k normalisation)
  kRingWrite,     ///< [layers, capacity, ring, heads]  f32 (Mamba-2 Δ, GDN β)
  kRingDecay,     ///< [layers, capacity, ring, heads]  f32 (Mamba-2 A·Δ, GDN g)
  kCommitted,     ///< [capacity]  u32
  kFolded,        ///< [layers, capacity]  u32
  kPending,       ///< [layers, capacity]  u8
  kAllocated,     ///< [capacity]  u8 (1 = the slot is in use)
  kCkptSource,    ///< share_forked_checkpoints: [layers, capacity]  u32 (0 = own checkpoint,
                  ///< t + 1 = slot t's)
  kCkptBorrowers, ///< share_forked_checkpoints: [layers, capacity]  u32 (slots reading this
                  ///< slot's checkpoint)
  kConvWindow,    ///< conv_kernel > 0: [layers, capacity, conv_ring, conv_channels]  input dtype
                  ///< (pre-conv inputs; position p at p & (conv_ring - 1))
};
inline constexpr int kNumCacheBuffers = 17;

/// "ckpt_hi", "ring_vec", ... (the names used in messages and by the Python package).
const char* cache_buffer_name(CacheBufferId id);

struct CacheBufferSpec {
  CacheBufferId id{};
  const char* name = "";
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;  ///< leading axes [layers, capacity] or [capacity]
  std::int64_t bytes = 0;           ///< product(shape) · dtype_size(dtype)
  std::int64_t alignment = 0;       ///< bytes the start must be aligned to (256 CUDA, 64 CPU)
  /// Index of the capacity (slot) axis in `shape`: 1 for per-layer buffers, 0 for per-slot ones.
  int slot_axis = 1;
};

/// Every buffer `config` needs, in CacheBufferId order; validates the config first.
Status state_cache_buffers(const StateCacheConfig& config, std::vector<CacheBufferSpec>* out);

/// A caller's buffer for a view: its address (host memory for CPU caches, device memory for
/// CUDA caches) and usable size in bytes (checked against the spec).
struct CacheBufferBinding {
  CacheBufferId id{};
  void* data = nullptr;
  std::int64_t bytes = 0;
};

/// What a view does with the caller's buffers' contents at creation.
enum class ViewInit : std::uint8_t {
  kZero,   ///< zero every buffer: all slots free (fresh memory)
  kAdopt,  ///< keep the contents (a cache moved or rebuilt over the same memory): the slots
           ///< marked in `allocated` stay allocated, with their state, ring and cursors
};

// ---- the cache ------------------------------------------------------------------------------

struct StateCacheLayout;  // the raw buffers, shared by the backends (src/state_cache_layout.h)
struct OwnedCacheMemory;  // the buffers of an owning cache

class StateCache {
 public:
  ~StateCache();
  StateCache(const StateCache&) = delete;
  StateCache& operator=(const StateCache&) = delete;

  [[nodiscard]] const StateCacheConfig& config() const;
  /// Ring entries per slot and layer: next power of two >= buffer_len + 2*max_spec_tokens - 1.
  /// (Committed history reaches buffer_len - 1 + T before the fold fused into the next decode,
  /// which then appends its own window of up to T tokens.) 0 for eager caches.
  [[nodiscard]] int ring_capacity() const;
  [[nodiscard]] int free_slots() const;
  [[nodiscard]] bool is_allocated(int slot) const;
  /// Bytes of the cache's buffers (device memory for CUDA caches, host memory for CPU caches).
  [[nodiscard]] std::int64_t bytes() const;
  /// Whether the cache allocated its buffers (state_cache_create) or views the caller's.
  [[nodiscard]] bool owns_memory() const;
  /// The address of one of the cache's buffers, or nullptr when the configuration has none.
  [[nodiscard]] void* buffer(CacheBufferId id) const;

  /// For the backends and tests; not for users.
  [[nodiscard]] StateCacheLayout& layout();
  [[nodiscard]] const StateCacheLayout& layout() const;

 private:
  friend struct StateCacheAccess;
  StateCache();
  std::unique_ptr<StateCacheLayout> layout_;
  std::unique_ptr<OwnedCacheMemory> owned_;   // null for a view
  std::vector<int> free_list_;                // host-side: allocation is a host decision
  std::vector<std::uint8_t> host_allocated_;  // host mirror of the `allocated` buffer
};

/// Validates the config (as state_cache_can_implement) and allocates every buffer of
/// state_cache_buffers() (zeroed: every slot free).
Status state_cache_create(const StateCacheConfig& config, std::unique_ptr<StateCache>* out,
                          Stream stream = kDefaultStream);

/// A cache over the caller's buffers, which must outlive it and are not freed by it. `buffers`
/// binds every buffer of state_cache_buffers(config) exactly once (any order), each at least
/// the spec's bytes and aligned to its alignment. Refused with nothing written when the config
/// cannot be run or a binding is missing, repeated, null, short or misaligned.
Status state_cache_create_view(const StateCacheConfig& config,
                               std::span<const CacheBufferBinding> buffers, ViewInit init,
                               std::unique_ptr<StateCache>* out, Stream stream = kDefaultStream);

/// Takes a free slot: zero state in every layer, empty ring, cursors at 0.
Status state_cache_allocate_slot(StateCache& cache, int* slot, Stream stream = kDefaultStream);
/// Takes the given free slot (for an engine that assigns slot ids itself), reset as above.
Status state_cache_claim_slot(StateCache& cache, int slot, Stream stream = kDefaultStream);
Status state_cache_free_slot(StateCache& cache, int slot, Stream stream = kDefaultStream);

/// Prefill hand-off: writes a full fp32 state ([heads, rows, cols]; host memory, or for a CUDA
/// cache also device memory) into one layer of a slot: the eager state (its current copy), or
/// S_hi and the rounded S_lo; that layer's ring is emptied. Only allowed while the layer has no
/// uncommitted window (replay caches, and eager caches with max_spec_tokens > 1).
/// The state must be finite. Synchronises the stream.
Status state_cache_load_state(StateCache& cache, int layer, int slot, const float* state,
                              Stream stream = kDefaultStream);

/// Materialises one layer's current state as fp32 [heads, rows, cols] into `state` (host
/// memory, or for a CUDA cache also device memory): an eager cache its current state copy
/// (an uncommitted window's copies are not exported); a replay cache first folds the layer's
/// committed history into its checkpoint (for preemption and debugging), so this writes the
/// checkpoint. Synchronises the stream.
Status state_cache_export_state(StateCache& cache, int layer, int slot, float* state,
                                Stream stream = kDefaultStream);

/// Conv caches (StateCacheConfig::conv_kernel = K > 0): writes a layer's conv window, the
/// pre-conv inputs of the K - 1 positions before the slot's committed one ([K - 1, conv_channels]
/// in the input dtype, oldest first; host memory, or for a CUDA cache also device memory).
/// The prefill hand-off beside state_cache_load_state; a sequence shorter than K - 1 tokens
/// passes zeros for the positions before its first. Synchronises the stream.
Status state_cache_load_conv_window(StateCache& cache, int layer, int slot, const void* window,
                                    Stream stream = kDefaultStream);
/// Reads the same K - 1 rows of a layer's conv window (preemption, debugging). Synchronises.
Status state_cache_export_conv_window(StateCache& cache, int layer, int slot, void* window,
                                      Stream stream = kDefaultStream);

struct CommitArgs {
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;  ///< [batch], cache memory; -1 = pad row
  const std::int32_t* accepted = nullptr;  ///< [batch], cache memory; 0 <= k <= pending tokens
};

/// Accepts k of the tokens the last decode appended, for every layer at once: committed += k.
/// Rejected drafts stay in the ring to be overwritten: rollback is a cursor move. An eager cache
/// with max_spec_tokens > 1 makes the state copy written after token k current (k = 0: the
/// current copy stays; no state is copied). An eager cache with max_spec_tokens = 1 updated its
/// state in place: commit only moves `committed` there. Every layer
/// must have decoded the window (pending[layer][slot] is the same for all layers).
/// CPU caches reject k outside [0, pending] and a window some layer did not decode with an
/// error; CUDA caches, whose counts are device memory (no host round trip, graph-capturable),
/// clamp k to [0, min over layers of pending] on the device.
Status state_cache_commit(StateCache& cache, const CommitArgs& args,
                          Stream stream = kDefaultStream);

struct FoldArgs {
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;  ///< [batch], cache memory; -1 = pad row
};

/// Folds the committed history of every layer of these slots into their checkpoints now
/// (decodes also fold by themselves once buffer_len tokens are due). Eager caches: no-op.
Status state_cache_fold(StateCache& cache, const FoldArgs& args, Stream stream = kDefaultStream);

}  // namespace replayssm
