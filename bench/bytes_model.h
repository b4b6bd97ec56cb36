#pragma once
/// \file bytes_model.h
/// Bytes one decode step of one layer must move, by mode (ALGORITHM.md §5, §6, §7, §9): the
/// figure a memory-bound step is judged against. Counted: state (checkpoint) traffic and ring
/// traffic. Not counted: the step's activations in and out (x, B, C, z, dt, y, ...), which are
/// the same in every mode and below 1% of the state at the real shapes.
///
/// Per step and row, with E state elements, s = the state dtype's size, k tokens committed per
/// step (1 for plain decoding), T the verify window, c = ceil(L / k) steps per fold cycle:
///   eager (T = 1):        read E·s + write E·s
///   eager spec (T > 1):   read E·s + write T·E·s: an eager cache with max_spec_tokens >= T
///                         reads its current state copy once and writes the state after each
///                         window token into its own copy (T + 1 state transfers); the commit
///                         that selects the accepted copy moves no state
///   replay, one copy:     read E·s every step (outputs; the fold fused into a step reads the
///                         same copy) + write E·s / c
///   replay, dual:         read E·lo every step + (read E·4 + write E·4 + write E·lo) / c, and
///                         for fp8 one fp32 scale per state row read every step, written per fold
///   ring (replay):        write T records; read the history (on average k·(c−1)/2 records)
///                         and, amortised, the k records per step the fold consumes.
/// For plain decoding that is read(S) + write(S)/L and (L−1)/2 + 2 ring records per step.
/// A ring record is one token's vec [heads, rows] and key [key_heads, cols] in the activation
/// dtype plus two fp32 per head (Mamba-2 Δ and A·Δ; GDN β and g).

#include "replayssm/types.h"

namespace replayssm {

struct BytesModelCase {
  StateDims dims;
  int batch = 1;
  DecodeMode mode = DecodeMode::kReplay;
  DType state_dtype = DType::kF32;                              ///< eager state
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;  ///< replay
  int buffer_len = 16;                                          ///< L
  int spec_tokens = 1;                                          ///< T, the verify window
  /// k tokens committed per step; 0 = all T. The spec bench's random acceptance passes the
  /// mean of its draws, rounded (run_cuda_spec_bench).
  int accepted = 0;
  DType input_dtype = DType::kBF16;  ///< activations, as the ring stores them
};

/// Bytes per decode step of the whole batch.
struct StepBytes {
  double state_read = 0.0;
  double state_write = 0.0;
  double ring_read = 0.0;
  double ring_write = 0.0;
  [[nodiscard]] double total() const { return state_read + state_write + ring_read + ring_write; }
};

StepBytes bytes_model_step(const BytesModelCase& c);

/// Bytes of one ring record (one token of one row).
double bytes_model_ring_record(const StateDims& dims, DType input_dtype);

/// Bytes per state element of the copy a plain step streams (eager: the state; replay: the
/// copy outputs read). What the benches size their slot rotation by.
int bytes_model_read_copy_elem(DecodeMode mode, DType eager_state, CheckpointPrecision p);

}  // namespace replayssm
