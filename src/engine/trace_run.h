#pragma once
/// \file trace_run.h
/// Runs a layer trace (io/trace.h) through a StateCache, the way a serving engine drives one
/// layer: plain decoding, or speculative verify windows with a seeded acceptance pattern
/// (TRACE_FORMAT.md, "The command"). The output holds the real token stream only, so every
/// mode must reproduce plain eager decoding.
///
/// Speculative runs (spec_tokens = T > 1). Each row of the trace keeps its own position `pos`
/// in the trace. Each step, every row with tokens left verifies a window of T tokens: the
/// first k are the real tokens pos .. pos+k-1, the other T-k are random drafts (uniform in
/// [min, max] of the same tensor over the trace: finite, in the domain the tensor allows, of
/// the right scale, and different from the real values) that must be rejected; the row
/// commits k. Rows with no tokens left become pad rows (slot id -1).
/// The exact draw, so that any implementation can reproduce a run:
///   std::mt19937_64 accept(accept_seed);
///   for each step, for each row b = 0 .. batch-1 with tokens left (left = num_steps - pos):
///       k = 1 + accept() % min(T, left)
/// Draft values come from a second generator, std::mt19937_64(accept_seed ^
/// kTraceRunDraftSeedMix), so the acceptance pattern depends on the seed, T and the trace's
/// length and batch only.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/trace.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

/// Mixed into accept_seed to seed the draft values' generator (see the file comment).
constexpr std::uint64_t kTraceRunDraftSeedMix = 0x9e3779b97f4a7c15ULL;

struct TraceRunOptions {
  DecodeMode mode = DecodeMode::kReplay;
  int buffer_len = 16;  ///< L (replay)
  /// T, the verify window; 1 = plain decoding. An eager cache keeps T + 1 state copies per
  /// slot for it and the commit selects one (per-draft-state speculation).
  int spec_tokens = 1;
  std::uint64_t accept_seed = 0;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  Device device = Device::kCpu;
  /// The activations' dtype in the cache (f32, bf16, f16): the trace's fp32 inputs are
  /// rounded to it, and outputs come back in it.
  DType input_dtype = DType::kF32;
  /// Called after every decode step with (tokens of the real stream done, total); may be empty.
  std::function<void(std::int64_t, std::int64_t)> progress;
};

struct TraceRunResult {
  /// Mamba-2 y [num_steps, batch, nheads, head_dim] or GDN o [num_steps, batch, num_v_heads,
  /// head_v_dim]: the real stream's outputs.
  std::vector<float> out;
  /// [batch, heads, rows, cols]: the state after the last token, exported by the cache (replay:
  /// the checkpoint with the rest of the ring folded in), fp32.
  std::vector<float> state;
  int decode_steps = 0;  ///< decode calls made (= num_steps for plain decoding)
  /// Seconds spent in the decode and commit calls and in copying their outputs back (the copy
  /// waits for a GPU to finish); excludes building input windows.
  double decode_seconds = 0.0;
};

/// Runs the trace; `trace` is validated first (trace_validate).
Status trace_run(const LayerTrace& trace, const TraceRunOptions& options, TraceRunResult* out);

/// Writes an output file (TRACE_FORMAT.md, "Output file"): `y` or `o` and `state` as F32, and
/// metadata layer, mode, buffer_len and checkpoint (replay only), spec_tokens, accept_seed
/// (T > 1 only), device, input_dtype and version (REPLAYSSM_VERSION).
Status trace_run_save(const std::string& path, const LayerTrace& trace,
                      const TraceRunOptions& options, const TraceRunResult& result);

}  // namespace replayssm
