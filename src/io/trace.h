#pragma once
/// \file trace.h
/// Layer traces (TRACE_FORMAT.md): the per-token inputs of one SSM layer for a batch of
/// sequences over `num_steps` decode steps, loaded from safetensors into fp32 host vectors.
///
/// Naming: the file format calls the step count T; here it is `num_steps`, because T is the
/// speculative window width everywhere else in the library. Per-token tensors keep the file's
/// layout [num_steps, batch, ...]; the decode ops take [batch, T, ...] windows, which the
/// engine (engine/trace_run.h) builds step by step.

#include <string>
#include <vector>

#include "io/safetensors.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

struct Mamba2Trace {
  Mamba2Shape shape;
  int num_steps = 0;
  int batch = 0;
  std::vector<float> x;        ///< [num_steps, batch, nheads, head_dim]   post-conv x
  std::vector<float> dt;       ///< [num_steps, batch, nheads]             raw dt
  std::vector<float> B;        ///< [num_steps, batch, ngroups, dstate]
  std::vector<float> C;        ///< [num_steps, batch, ngroups, dstate]
  std::vector<float> z;        ///< [num_steps, batch, nheads, head_dim]   empty: no gate
  std::vector<float> A;        ///< [nheads], < 0
  std::vector<float> D;        ///< [nheads]
  std::vector<float> dt_bias;  ///< [nheads]
  std::vector<float> state0;   ///< [batch, nheads, head_dim, dstate]; zeros when not given
};

struct GdnTrace {
  GdnShape shape;
  int num_steps = 0;
  int batch = 0;
  std::vector<float> q;       ///< [num_steps, batch, num_k_heads, head_k_dim]
  std::vector<float> k;       ///< [num_steps, batch, num_k_heads, head_k_dim]
  std::vector<float> v;       ///< [num_steps, batch, num_v_heads, head_v_dim]
  std::vector<float> g;       ///< [num_steps, batch, num_v_heads]  log-decay <= 0
  std::vector<float> beta;    ///< [num_steps, batch, num_v_heads]  in (0, 1)
  std::vector<float> state0;  ///< [batch, num_v_heads, head_v_dim, head_k_dim]; zeros if absent
  bool qk_l2norm = true;      ///< metadata "qk_l2norm" ("true" / "false")
  float scale = 0.0f;         ///< metadata "scale"; 0 = head_k_dim^-1/2 (as GdnDecodeArgs)
};

/// One trace of either layer kind; only the member named by `kind` is filled.
struct LayerTrace {
  LayerKind kind = LayerKind::kMamba2;
  Mamba2Trace mamba2;
  GdnTrace gdn;

  [[nodiscard]] int num_steps() const;
  [[nodiscard]] int batch() const;
  [[nodiscard]] StateDims dims() const;
};

/// Reads, checks (trace_validate) and converts a trace file; every error is one line naming
/// the file and the offending tensor.
Status trace_load(const std::string& path, LayerTrace* out);
/// The same from a parsed file: the layer kind comes from metadata "layer" ("mamba2" / "gdn"),
/// or, when absent, from which of `x` / `q` is present. Tensors the layer does not define are
/// an error (a misspelt optional tensor would otherwise be silently ignored).
Status trace_from_safetensors(const SafetensorsFile& file, LayerTrace* out);

/// Checks an in-memory trace: positive dimensions that fit the ops, vector sizes that match
/// them, finite inputs, A < 0, g <= 0, 0 < beta < 1, a finite positive scale.
Status trace_validate(const LayerTrace& trace);

}  // namespace replayssm
