#pragma once
// The float64 oracle (ALGORITHM.md §1, §2, §10): one token of one sequence, plain loops in the
// order the math is written, no tiling, no replay, no shortcuts. Every other path of the
// library (eager, replay, spec, dual precision, CPU or CUDA) is checked against these.
//
// Inputs are fp32 (a test rounds them to the cache's input dtype first, so that the oracle
// and the library see the same values); the state and the outputs are float64.

#include "replayssm/types.h"

namespace replayssm::reference {

/// softplus(u) = log(1 + e^u), = u past 20 (as the models do), in float64.
double softplus(double u);
/// silu(u) = u / (1 + e^-u), in float64.
double silu(double u);

/// One Mamba-2 decode step (ALGORITHM.md §1) of one sequence:
///   Δ = softplus(dt + dt_bias),  S ← exp(A·Δ)·S + Δ·x·Bᵀ,  y = S·C + D·x,  y ← y·silu(z).
/// state: [nheads, head_dim, dstate], updated in place.
/// x, z: [nheads, head_dim] (z may be null: no gate); dt: [nheads] raw;
/// B, C: [ngroups, dstate]; A, D, dt_bias: [nheads]; y: [nheads, head_dim].
void mamba2_reference_step(const Mamba2Shape& shape, double* state, const float* x,
                           const float* dt, const float* B, const float* C, const float* z,
                           const float* A, const float* D, const float* dt_bias, double* y);

/// One Gated DeltaNet decode step (ALGORITHM.md §2) of one sequence:
///   q̂ = scale·q/sqrt(|q|²+1e-6), k̂ = k/sqrt(|k|²+1e-6) (when qk_l2norm; else q̂ = scale·q,
///   k̂ = k), α = e^g, d = β·(v − α·S·k̂), S ← α·S + d·k̂ᵀ, o = S·q̂.
/// state: [num_v_heads, head_v_dim, head_k_dim], updated in place.
/// q, k: [num_k_heads, head_k_dim]; v: [num_v_heads, head_v_dim]; g, beta: [num_v_heads];
/// scale: 0 = head_k_dim^-1/2; o: [num_v_heads, head_v_dim].
void gdn_reference_step(const GdnShape& shape, double* state, const float* q, const float* k,
                        const float* v, const float* g, const float* beta, bool qk_l2norm,
                        float scale, double* o);

}  // namespace replayssm::reference
