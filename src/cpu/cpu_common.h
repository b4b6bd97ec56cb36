#pragma once
// Pieces shared by the CPU ops: dtype dispatch, checkpoint row access, ring addressing.
// The CPU backend works per (row, head): a head's state block is independent of every other
// head's, so ops parallelise over batch × heads with OpenMP and vectorise along cols.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/checkpoint_rows.h"
#include "common/numeric.h"
#include "cpu/isa.h"
#include "replayssm/types.h"
#include "state_cache_layout.h"

#if REPLAYSSM_CPU_AVX2
#include <immintrin.h>
#endif

REPLAYSSM_CPU_BEGIN

template <typename T>
struct TypeTag {
  using type = T;
};

/// Calls f(TypeTag<T>{}) with T the C++ type of an activation/state dtype (f32, bf16, f16).
template <typename F>
void dispatch_activation(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: f(TypeTag<float>{}); return;
    case DType::kBF16: f(TypeTag<bf16_t>{}); return;
    case DType::kF16: f(TypeTag<f16_t>{}); return;
    case DType::kF8E4M3:  // never activation dtypes: rejected at cache creation
    case DType::kU8:
    case DType::kU32:
      return;
  }
}

/// out[i] = widen(codes[i]) for a row. With F16C, eight codes at a time through the hardware
/// f16 → f32 conversion: an e4m3 code is an f16 with a zero top exponent bit and three
/// mantissa bits, so shifting its bits into f16 position and scaling by 2^8 (the difference of
/// the biases, 15 − 7) is exact, subnormals included. The integer decode of widen() made the
/// fp8 mat-vec compute-bound (as slow as the fp32 one).
inline void widen_fp8_row(const fp8e4m3_t* codes, int n, float* out) {
  int i = 0;
#if REPLAYSSM_CPU_AVX512
  // GCC 12's own _mm512_cvtph_ps trips its -Wmaybe-uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
  // Sixteen at a time with 64-byte stores: the dot that reads `out` back loads 64 bytes at a
  // time, and a load spanning two 32-byte stores cannot be forwarded from them (it waits for
  // both to reach the cache: the 8-wide version below left the fp8 mat-vec stalled there).
  {
    const __m256i sign_mask = _mm256_set1_epi16(0x80), magnitude_mask = _mm256_set1_epi16(0x7f);
    const __m512 bias = _mm512_set1_ps(256.0f);
    for (; i + 16 <= n; i += 16) {
      __m128i b;
      std::memcpy(&b, codes + i, 16);
      const __m256i w = _mm256_cvtepu8_epi16(b);
      const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, sign_mask), 8),
                                        _mm256_slli_epi16(_mm256_and_si256(w, magnitude_mask), 7));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtph_ps(h), bias));
    }
  }
#pragma GCC diagnostic pop
#endif
#if REPLAYSSM_CPU_AVX2
  const __m128i sign_mask = _mm_set1_epi16(0x80), magnitude_mask = _mm_set1_epi16(0x7f);
  const __m256 bias = _mm256_set1_ps(256.0f);
  for (; i + 8 <= n; i += 8) {
    __m128i b;
    std::memcpy(&b, codes + i, 8);  // eight codes in the low half
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, sign_mask), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, magnitude_mask), 7));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(h), bias));
  }
#endif
  for (; i < n; ++i) out[i] = widen(codes[i]);
}

/// Unrolls the next loop (of at most 16 trips) completely. nvcc's front end, which reads this
/// header for the CUDA tests' host code, has its own spelling.
#if defined(__CUDACC__)
#define REPLAYSSM_UNROLL_FULLY _Pragma("unroll")
#else
#define REPLAYSSM_UNROLL_FULLY _Pragma("GCC unroll 16")
#endif

/// 16 floats as one GCC/Clang vector: one AVX-512 register, two AVX2 ones, four SSE ones,
/// whatever the build targets, without intrinsics.
constexpr int kLanes = 16;
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

/// a·b for dot products whose result is needed at once (many independent rows: RowDots).
/// Two vector accumulators: with one, the FMAs form a single dependent chain (its latency,
/// not the loads, set the speed of the GDN walks and eager rows).
inline float dot(const float* a, const float* b, int n) {
  Lanes acc0 = {}, acc1 = {};
  int i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc0 += load_lanes(a + i) * load_lanes(b + i);
    acc1 += load_lanes(a + i + kLanes) * load_lanes(b + i + kLanes);
  }
  for (; i + kLanes <= n; i += kLanes) acc0 += load_lanes(a + i) * load_lanes(b + i);
  const Lanes acc = acc0 + acc1;
  float sum = 0.0f;
  for (int k = 0; k < kLanes; ++k) sum += acc[k];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

/// 16 bf16 values as fp32 lanes, by moving their bits into the high half of each lane (exact),
/// as vector operations: element by element, GCC vectorised it 8 lanes wide and loaded each
/// block twice.
inline Lanes widen_lanes(const bf16_t* p) {
  using Bits16 = std::uint16_t __attribute__((vector_size(kLanes * sizeof(std::uint16_t))));
  using Bits32 = std::uint32_t __attribute__((vector_size(kLanes * sizeof(std::uint32_t))));
  static_assert(sizeof(bf16_t) == sizeof(std::uint16_t));
  Bits16 half;
  std::memcpy(&half, p, sizeof half);
  const Bits32 bits = __builtin_convertvector(half, Bits32) << 16;
  Lanes v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
/// Element types that RowDots widens a vector at a time. Not fp32: written the same way (two
/// 512-bit accumulators), its rows streamed ~15% slower than GCC's own vectorisation of the
/// element loop (nano4b, batch 64, 2-core EPYC, 4 paired runs); for bf16 the vector form is
/// the faster one (~10-15%).
template <typename elem_t>
constexpr bool kHasWidenLanes = std::is_same_v<elem_t, bf16_t>;

/// Lane i of the result = the sum of the 16 lanes of v[i], for 16 vectors at p[i·16]: a
/// transpose-and-add tree (4 levels of two-source shuffles and adds, 45 vector operations)
/// instead of 16 dependent scalar adds per vector. The tree leaves lane i holding the vector
/// whose index is i with its 4 bits reversed, so the vectors go in in that order. The loops
/// must unroll (v[] in registers): indexed at run time, v[] lived on the stack and this was
/// slower than the scalar adds.
inline Lanes sum_lanes_of_16(const float* p) {
  constexpr int kBitReversed[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  Lanes v[kLanes];
REPLAYSSM_UNROLL_FULLY
  for (int i = 0; i < kLanes; ++i) v[i] = load_lanes(p + kBitReversed[i] * kLanes);
  // Each level halves the vectors: the pair's lanes are regrouped so that the two halves of
  // every vector's remaining partial sums meet in one lane, then added.
REPLAYSSM_UNROLL_FULLY
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: vector 2i's 8 partial sums; 8-15: 2i+1's
    const Lanes a = v[2 * i], b = v[2 * i + 1];
    v[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7,  //
                                   16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15,  //
                                   24, 25, 26, 27, 28, 29, 30, 31);
  }
REPLAYSSM_UNROLL_FULLY
  for (int i = 0; i < 4; ++i) {  // 4 partial sums each of 4 vectors
    const Lanes a = v[2 * i], b = v[2 * i + 1];
    v[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19,  //
                                   8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23,  //
                                   12, 13, 14, 15, 28, 29, 30, 31);
  }
REPLAYSSM_UNROLL_FULLY
  for (int i = 0; i < 2; ++i) {  // 2 partial sums each of 8 vectors
    const Lanes a = v[2 * i], b = v[2 * i + 1];
    v[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21,  //
                                   8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23,  //
                                   10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22,  //
                                 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23,  //
                                 9, 25, 11, 27, 13, 29, 15, 31);
}

/// Dot products of many rows with vectors, with the horizontal reductions deferred: the
/// streaming loop only accumulates each row's 16 lanes and stores them (one vector store), and
/// the lanes are summed apart, 16 rows at a time (sum_lanes_of_16). Reducing each row's lanes
/// on the spot put a serial chain of scalar adds between the streaming loads (30% of a replay
/// step at the super120b shape); summed row by row after a head's rows, they held up the
/// next head's loads; the tree right after each 16 rows overlaps them (cheaper in a
/// standalone streaming test on the 2-core EPYC, not kept).
class RowDots {
 public:
  static constexpr int kLanes = 16;
  /// `partials` holds kLanes * rows floats.
  RowDots(int rows, float* partials) : rows_(rows), partials_(partials) {}

  /// Row r's partial sums of scale·(a·b) (n elements; a of any checkpoint element type).
  template <typename elem_t>
  void set(int r, const elem_t* a, const float* b, int n, float scale = 1.0f) {
    float* dst = partials_ + std::size_t(r) * kLanes;  // one vector store
    if constexpr (kHasWidenLanes<elem_t>) {
      Lanes acc0{}, acc1{};
      int i = 0;
      for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
        acc0 += widen_lanes(a + i) * load_lanes(b + i);
        acc1 += widen_lanes(a + i + kLanes) * load_lanes(b + i + kLanes);
      }
      for (int k = 0; i + k < n; ++k) acc0[k % kLanes] += widen(a[i + k]) * b[i + k];
      store_lanes(dst, (acc0 + acc1) * scale);
    } else {
      float lanes[kLanes] = {};
      int i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        for (int k = 0; k < kLanes; ++k) lanes[k] += widen(a[i + k]) * b[i + k];
      }
      for (int k = 0; i + k < n; ++k) lanes[k] += widen(a[i + k]) * b[i + k];
      for (int k = 0; k < kLanes; ++k) dst[k] = lanes[k] * scale;
    }
  }

  /// out[r] = the finished sum of row r, for every row.
  void reduce(float* out) const {
    int r = 0;
    for (; r + kLanes <= rows_; r += kLanes) reduce_block(r, out);
    reduce_from(r, out);
  }
  /// reduce() for rows [r0, r0 + 16) only, as soon as they are set: between the stores of a
  /// streaming loop it overlaps the loads (as one pass after a head's rows, it stalled them).
  void reduce_block(int r0, float* out) const {
    store_lanes(out + r0, sum_lanes_of_16(partials_ + std::size_t(r0) * kLanes));
  }
  /// reduce() for rows [r0, rows), one at a time.
  void reduce_from(int r0, float* out) const {
    for (int r = r0; r < rows_; ++r) {
      const float* p = partials_ + std::size_t(r) * kLanes;
      float sum = 0.0f;
      for (int k = 0; k < kLanes; ++k) sum += p[k];
      out[r] = sum;
    }
  }

 private:
  int rows_;
  float* partials_;
};

/// out[t][r] = S_read[r, :]·vecs[t, :] for every row r of one head's checkpoint read copy
/// and each of T vectors: the one pass over the checkpoint that a replay step makes. Rows are
/// read strictly in address order, one at a time: interleaving four rows to share the vector
/// loads ran 3x slower on the 2-core EPYC we develop on (7 vs 19 GB/s read in a microbenchmark:
/// the prefetcher follows one stream better than four). The low copies are widened inside the
/// dot; fp8's per-row scale factors out of the sum.
/// Asks for the cache lines of [p, p + bytes) ahead of their use (read intent, kept close).
/// always_inline: called out of line, GCC finds such a function free of side effects (it
/// models none for a prefetch) and deletes the call.
[[gnu::always_inline]] inline void prefetch_bytes(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}
/// prefetch_bytes for lines about to be overwritten whole: owned before the stores arrive, so
/// they do not wait on the read that a store miss makes.
[[gnu::always_inline]] inline void prefetch_bytes_for_write(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 1, 3);
}

/// Rows ahead that checkpoint_matvec requests, across the end of the head's block into the
/// next head's (prefetches never fault).
constexpr int kMatvecPrefetchRows = 16;

/// Floats of the `partials` scratch that checkpoint_matvec needs.
inline std::size_t checkpoint_matvec_scratch(int T, int rows, int cols) {
  return std::size_t(T) * RowDots::kLanes * rows + cols;
}

inline void checkpoint_matvec(const CheckpointHead& c, const float* vecs, int T, float* out,
                              float* partials /* checkpoint_matvec_scratch(T, rows, cols) */) {
  const std::size_t per_token = std::size_t(RowDots::kLanes) * c.rows;
  // Each block of 16 rows is summed up as soon as its last row is set.
  auto reduce_done = [&](int r) {
    if ((r + 1) % RowDots::kLanes != 0) return;
    for (int t = 0; t < T; ++t) {
      RowDots(c.rows, partials + t * per_token)
          .reduce_block(r + 1 - RowDots::kLanes, out + std::size_t(t) * c.rows);
    }
  };
  auto stream_rows = [&](const auto* copy, const float* row_scale) {
    for (int r = 0; r < c.rows; ++r) {
      const auto* row = copy + std::size_t(r) * c.cols;
      prefetch_bytes(row + std::size_t(kMatvecPrefetchRows) * c.cols, sizeof(*row) * c.cols);
      const float scale = row_scale != nullptr ? row_scale[r] : 1.0f;
      for (int t = 0; t < T; ++t) {
        RowDots(c.rows, partials + t * per_token)
            .set(r, row, vecs + std::size_t(t) * c.cols, c.cols, scale);
      }
      reduce_done(r);
    }
  };
  if (c.lo_fp8 != nullptr) {
    // fp8 rows are widened into a buffer first: inside the dot, the byte-to-float widening
    // only vectorised 4 lanes wide (measured 0.7x of eager; widened apart it runs full width).
    float* row = partials + T * per_token;  // 64-byte aligned when `partials` is (scratch())
    for (int r = 0; r < c.rows; ++r) {
      widen_fp8_row(c.lo_fp8 + std::size_t(r) * c.cols, c.cols, row);
      for (int t = 0; t < T; ++t) {
        RowDots(c.rows, partials + t * per_token)
            .set(r, row, vecs + std::size_t(t) * c.cols, c.cols, c.lo_scale[r]);
      }
      reduce_done(r);
    }
  } else if (c.lo_bf16 != nullptr) {
    stream_rows(c.lo_bf16, nullptr);
  } else {
    stream_rows(c.hi, nullptr);
  }
  const int summed = c.rows / RowDots::kLanes * RowDots::kLanes;
  for (int t = 0; t < T; ++t) {
    RowDots(c.rows, partials + t * per_token).reduce_from(summed, out + std::size_t(t) * c.rows);
  }
}

/// A batch row with a real slot (pad rows, slot -1, are dropped before any work).
struct ActiveRow {
  int b;
  int slot;
};

inline std::vector<ActiveRow> active_rows(const std::int32_t* slot_ids, int batch) {
  std::vector<ActiveRow> rows;
  rows.reserve(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    if (slot_ids[b] >= 0) rows.push_back({b, slot_ids[b]});
  }
  return rows;
}

/// Per-thread scratch buffers, so the per-(row, head) work allocates nothing in steady state.
/// Decode work uses buffers 0-7, folds (called from inside decode work) 8-15.
/// The buffers start on a 64-byte boundary: vector code stores rows into them and reads them
/// straight back, and a 64-byte access that straddles two cache lines is not forwarded from
/// the stores that wrote it (it waits for them to reach the cache: that wait was the hottest
/// spot of the GDN eager step).
inline float* scratch(int which, std::size_t n) {
  constexpr std::size_t kAlignFloats = 64 / sizeof(float);
  thread_local std::vector<float> buffers[16];
  std::vector<float>& b = buffers[which];
  if (b.size() < n + kAlignFloats) b.resize(n + kAlignFloats);
  const auto addr = reinterpret_cast<std::uintptr_t>(b.data());
  return b.data() + ((64 - addr % 64) % 64) / sizeof(float);
}

/// One ring record of (layer, slot) at absolute position `pos`, typed.
template <typename input_t>
struct RingRecord {
  input_t* vec;   // [heads, rows]
  input_t* key;   // [key_heads, cols]
  float* key_scale;  // [key_heads] (GDN only, else null)
  float* write;   // [heads]
  float* decay;   // [heads]
};

template <typename input_t>
RingRecord<input_t> ring_record(const StateCacheLayout& l, int layer, int slot,
                                std::uint32_t pos) {
  const std::int64_t rec = l.ring_record(layer, slot, pos);
  return {static_cast<input_t*>(l.ring_vec) + rec * l.vec_elems(),
          static_cast<input_t*>(l.ring_key) + rec * l.key_elems(),
          l.ring_key_scale ? l.ring_key_scale + rec * l.dims.key_heads : nullptr,
          l.ring_write + rec * l.dims.heads, l.ring_decay + rec * l.dims.heads};
}

/// Requests the ring records [first, first + count) of (layer, slot) that the heads
/// [head_begin, head_begin + heads) of key head (or group) `key_head` read: the key row, its
/// factor (GDN), and the heads' input rows, write factors and log-decays. Within a record those
/// heads sit side by side, so each is one contiguous run; no hardware prefetcher follows runs
/// a record apart, and read where used, each was a cache miss on the step's critical path.
template <typename input_t>
[[gnu::always_inline]] inline void prefetch_ring_records(const StateCacheLayout& l, int layer,
                                                          int slot, std::uint32_t first,
                                                          std::uint32_t count, int key_head,
                                                          int head_begin, int heads) {
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> rec = ring_record<input_t>(l, layer, slot, first + j);
    prefetch_bytes(rec.key + std::size_t(key_head) * l.dims.cols, sizeof(input_t) * l.dims.cols);
    if (rec.key_scale != nullptr) prefetch_bytes(rec.key_scale + key_head, sizeof(float));
    prefetch_bytes(rec.vec + std::size_t(head_begin) * l.dims.rows,
                   sizeof(input_t) * std::size_t(heads) * l.dims.rows);
    prefetch_bytes(rec.write + head_begin, sizeof(float) * heads);
    prefetch_bytes(rec.decay + head_begin, sizeof(float) * heads);
  }
}

/// Committed tokens of (layer, slot) not yet folded into its checkpoint.
inline std::uint32_t unfolded(const StateCacheLayout& l, int layer, int slot) {
  return l.unfolded(layer, slot);
}

/// The skeleton of every replay decode: decide each row's fold (committed - folded >= L),
/// append each row's window (`append(row)`, a copy into its own ring records), run
/// `work(row, unit, fold_due)` over rows × `units` (a unit being a head or a key group), then
/// move the layer's cursors: folded for rows that folded, pending = T for every row. The
/// appends and the work share one parallel region (the appends were serial: ~6% of a plain
/// GDN step at batch 64 with one core idle).
template <typename Append, typename Work>
void replay_rows(StateCacheLayout& l, int layer, int num_tokens, const std::int32_t* slot_ids,
                 int batch, int units, Append&& append, Work&& work) {
  const std::vector<ActiveRow> rows = active_rows(slot_ids, batch);
  const int num_rows = static_cast<int>(rows.size());
  std::vector<char> fold_due(rows.size());
  for (int i = 0; i < num_rows; ++i) {
    fold_due[i] = l.fold_due(l.unfolded(layer, rows[i].slot), num_tokens);
  }
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int i = 0; i < num_rows; ++i) append(rows[std::size_t(i)]);
    // (the implicit barrier: every window is in its ring before any row's work reads it)
#pragma omp for collapse(2) schedule(static)
    for (int i = 0; i < num_rows; ++i) {
      for (int u = 0; u < units; ++u) work(rows[std::size_t(i)], u, fold_due[i] != 0);
    }
  }
  for (int i = 0; i < num_rows; ++i) {
    const int slot = rows[i].slot;
    if (fold_due[i]) l.folded[l.layer_slot(layer, slot)] = l.committed[slot];
    l.pending[l.layer_slot(layer, slot)] = static_cast<std::uint8_t>(num_tokens);
  }
}

/// Runs `eager(TypeTag<input_t>, TypeTag<state_t>, std::bool_constant<in_place>)` or
/// `replay(TypeTag<input_t>)` for the cache's mode and dtypes: the one place a decode op turns
/// runtime dtypes into templates. in_place: an eager cache with one state copy (T = 1, updated
/// in place), else one with a copy per draft.
template <typename Eager, typename Replay>
void dispatch_decode(const StateCacheLayout& l, Eager&& eager, Replay&& replay) {
  dispatch_activation(l.config.input_dtype, [&](auto in_tag) {
    if (l.config.mode == DecodeMode::kReplay) {
      replay(in_tag);
      return;
    }
    dispatch_activation(l.config.state_dtype, [&](auto state_tag) {
      if (l.state_copies() == 1) {
        eager(in_tag, state_tag, std::true_type{});
      } else {
        eager(in_tag, state_tag, std::false_type{});
      }
    });
  });
}

/// The fold of heads [head_begin, head_end), which share one key head (Mamba-2: one group):
/// replays `count` ring records from position `first` into their checkpoints of (layer, slot).
/// fold.cpp.
void fold_heads(const StateCacheLayout& l, int layer, int slot, int head_begin, int head_end,
                std::uint32_t first, std::uint32_t count);
/// fold_heads for one head.
void fold_head(const StateCacheLayout& l, int layer, int slot, int head, std::uint32_t first,
               std::uint32_t count);

REPLAYSSM_CPU_END
