#pragma once
/// \file prefix.h
/// Prefix caching on a replay cache: the state of a slot at any committed position since its
/// last fold, and slots built from other slots or from stored entries.
///
/// A replay slot holds its checkpoint (the state at folded[layer]) and the ring records of the
/// tokens since, so the exact state after any committed position p with
/// folded[layer] <= p <= committed is one partial fold away, and nothing has to be kept at
/// block boundaries in advance:
///   state_cache_materialize   the state at p of (slot, p) pairs into caller buffers (an
///                             engine's prefix-cache entry), nothing in the cache changed;
///   state_cache_read_records  ring records of committed tokens, stored beside an entry;
///   state_cache_restore       a slot from an entry: its state, and optionally the records of
///                             tokens after it, so that a hit inside a block continues exactly;
///   state_cache_fork          slot t as a copy of slot s at position p (parallel sampling,
///                             beams);
///   state_cache_truncate      a slot's committed end moved back to p (a rollback longer than
///                             a speculative window).
///
/// Positions are the slot's cursor values (state_cache.h): absolute, unsigned and compared
/// modulo 2^32, counted from 0 when the slot was allocated (or from the position a restore
/// set). A position p of slot s is "in reach" when folded[layer][s] <= p <= committed[s] for
/// every layer: these ops accept no other. The `committed` and `folded` buffers of the buffer
/// list hold the current values.
///
/// Memory and checks follow ops.h. Pointers are cache memory (host for CPU caches, device for
/// CUDA caches). CPU caches check everything and refuse a bad call with an error, having
/// written nothing. On a CUDA cache the batched ops (materialize, fork, truncate) take their
/// slot and position lists in device memory and only enqueue kernels (graph-capturable, no
/// host synchronisation); their rows are checked on the device, each op saying below what a
/// bad row does. The single-slot ops (read_records, restore) check on the host and
/// synchronise the stream, as state_cache_load_state does.
///
/// Eager caches hold only the state at their committed end: these ops refuse them
/// (kUnsupported); an eager slot is forked by copying its rows (state_cache.h, Memory). On CUDA,
/// materialize and restore hold state rows in registers: they take up to 128 state columns
/// (every target shape's dstate / head_k_dim) and refuse wider ones (kUnsupported).

#include <cstdint>

#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

/// Ring records of `count` consecutive tokens of every layer of a slot, outside the cache:
/// the ring buffers' (state_cache_buffers) dtypes and record layout, the ring axis replaced by
/// the tokens. A few tens of KB per token and layer at the real shapes, against MBs of state.
struct CacheRecords {
  int count = 0;
  void* vec = nullptr;         ///< [num_layers, count, heads, rows]      input dtype
  void* key = nullptr;         ///< [num_layers, count, key_heads, cols]  input dtype
  float* key_scale = nullptr;  ///< [num_layers, count, key_heads]  GDN only; null for Mamba-2
  float* write = nullptr;      ///< [num_layers, count, heads]  Mamba-2 Δ, GDN β
  float* decay = nullptr;      ///< [num_layers, count, heads]  Mamba-2 A·Δ, GDN g
};

struct MaterializeArgs {
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;  ///< [batch]; -1 = pad row (nothing written)
  const std::uint32_t* positions = nullptr;  ///< [batch]; each in reach of its slot
  float* states = nullptr;  ///< [batch, num_layers, heads, rows, cols] fp32 output
};

/// Writes the exact state of every layer of slot_ids[b] after position positions[b] (the
/// checkpoint folded with the records folded..p-1) as fp32 into states[b]; the cache is only
/// read. Pairs may repeat a slot. Cost per pair and layer: one read of the checkpoint's master
/// copy and of p - folded ring records, one fp32 state write.
/// CPU: the fold's own arithmetic, so that for a cache with an fp32 master the state equals,
/// bit for bit, the checkpoint a fold to p would store (shared bf16: the fold stores this
/// state rounded to bf16). Refused with nothing written: a slot not allocated, a position out
/// of reach. CUDA: rows whose slot is out of range or not allocated are skipped (nothing
/// written); a layer whose position is out of reach gets a state of NaNs, so that a bad entry
/// can never pass for a real one (state_cache_restore refuses non-finite states).
Status state_cache_materialize(StateCache& cache, const MaterializeArgs& args,
                               Stream stream = kDefaultStream);

/// Copies the ring records of positions first .. first + out.count - 1 of `slot` (every layer)
/// into `out`. Every position must be committed and at or after every layer's fold:
/// [first, first + count] in reach. Synchronises the stream on CUDA caches.
Status state_cache_read_records(StateCache& cache, int slot, std::uint32_t first,
                                const CacheRecords& out, Stream stream = kDefaultStream);

struct RestoreArgs {
  int slot = 0;                  ///< an allocated slot without an uncommitted window
  std::uint32_t position = 0;    ///< the position of `states`; the slot's cursors move there
  const float* states = nullptr;  ///< [num_layers, heads, rows, cols] fp32, finite
  /// The records of positions position .. position + count - 1, or count = 0 for none; count
  /// at most buffer_len - 1 + max_spec_tokens (what a slot's ring holds committed).
  CacheRecords records;
  /// Conv caches (conv_kernel = K > 0): every layer's conv window at the restored committed end
  /// (position + count), as state_cache_load_conv_window takes it: [num_layers, K - 1,
  /// conv_channels] input dtype. Null for other caches.
  const void* conv_window = nullptr;
};

/// Loads an entry into a slot, replacing everything of it: every layer's checkpoint copies
/// are written from `states` (the master as is, the low copy rounded as a fold rounds it),
/// the records go into the ring, and folded = position, committed = position + count. Decoding
/// from there equals decoding on from the slot the entry was taken from. Refused with nothing
/// written: a slot not allocated or holding an uncommitted window, a non-finite state, too
/// many records, a missing record field. Synchronises the stream on CUDA caches (the cursors,
/// and a flag a kernel sets for a non-finite state, are read back before anything is written).
Status state_cache_restore(StateCache& cache, const RestoreArgs& args,
                           Stream stream = kDefaultStream);

struct ForkArgs {
  int batch = 0;
  const std::int32_t* src_slots = nullptr;   ///< [batch]; -1 = pad row
  const std::int32_t* dst_slots = nullptr;   ///< [batch]; allocated slots, overwritten
  const std::uint32_t* positions = nullptr;  ///< [batch]; in reach of the source slot
};

/// Makes each dst slot a copy of its src slot at `position`: every layer's checkpoint copies,
/// the ring records folded..position-1, folded as the source's, committed = position, no
/// uncommitted window. The source is only read (a sharing cache counts its borrowers).
/// Decoding the copy then equals decoding the source from `position` on. By default the
/// checkpoint copies are copied now, to the dst slot's index of every buffer. A cache with
/// StateCacheConfig::share_forked_checkpoints copies them on fold instead: the dst reads the
/// source's checkpoint (ckpt_source) until either writes its own, and the fork moves only the
/// records and cursors (a dst that lends its own checkpoint hands it to its borrowers first).
/// CPU: refused with nothing written when a slot is not allocated, a dst equals its src,
/// repeats, or is the src of another row, or a position is out of reach. CUDA: rows whose
/// slots are out of range, not allocated or equal, or whose position is out of reach, are
/// skipped (nothing written); a dst that repeats or is another row's src is not detected there.
Status state_cache_fork(StateCache& cache, const ForkArgs& args, Stream stream = kDefaultStream);

struct TruncateArgs {
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;    ///< [batch]; -1 = pad row
  const std::uint32_t* positions = nullptr;  ///< [batch]; in reach of the slot
};

/// Moves each slot's committed end back to `position` (any position since the last fold; the
/// tokens after it are dropped, with any uncommitted window): decoding on equals decoding from
/// that position. CPU: refused with nothing changed when a slot is not allocated or repeats,
/// or a position is out of reach. CUDA: such rows are skipped (a repeated slot is not detected).
Status state_cache_truncate(StateCache& cache, const TruncateArgs& args,
                            Stream stream = kDefaultStream);

}  // namespace replayssm
