#pragma once
/// \file types.h
/// The glossary: dtypes, devices, layer shapes and cache modes, named as the models name them.
///
/// Mamba-2 state S[nheads, head_dim, dstate]; head h reads group h / (nheads / ngroups).
/// Gated DeltaNet state S[num_v_heads, head_v_dim, head_k_dim] (rows = value dim); value head
/// hv reads key head hv / (num_v_heads / num_k_heads).
/// Both are "heads × rows × cols" with a key vector shared by a group of heads, and the library
/// treats them through that common view (StateDims) wherever the math allows.

#include <cstddef>
#include <cstdint>
#include <string>

namespace replayssm {

/// Element types. Activations and states use the floating-point ones; a cache's cursor and
/// flag buffers (state_cache_buffers) are kU32 / kU8.
enum class DType : std::uint8_t { kF32, kBF16, kF16, kF8E4M3, kU8, kU32 };
enum class Device : std::uint8_t { kCpu, kCuda };
enum class LayerKind : std::uint8_t { kMamba2, kGdn };

/// Eager: the cache holds the state and every token reads and writes it.
/// Replay: the cache holds a checkpoint plus a ring of recent inputs (ALGORITHM.md §3).
enum class DecodeMode : std::uint8_t { kEager, kReplay };

/// Which copies of the checkpoint a replay cache keeps (ALGORITHM.md §6).
enum class CheckpointPrecision : std::uint8_t {
  kFp32,      ///< one fp32 copy, read by outputs and folds
  kBf16,      ///< one shared bf16 copy: folds round into it, so rounding accumulates
  kFp32Bf16,  ///< fp32 master for folds + bf16 read copy for outputs
  kFp32Fp8,   ///< fp32 master for folds + fp8 e4m3 read copy (one scale per state row)
};

/// The stream an op's device work is ordered on: a `cudaStream_t` cast to `void*` for CUDA
/// caches (kept opaque so that these headers need no CUDA), ignored by CPU caches. nullptr is
/// CUDA's default stream, as 0 is in CUDA's own APIs. Ops that launch work only enqueue it
/// (no host synchronisation), so they can be captured into a CUDA graph on the caller's stream.
using Stream = void*;
inline constexpr Stream kDefaultStream = nullptr;

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  ///< "f32", "bf16", "f16", "f8e4m3", "u8", "u32"
const char* device_name(Device device);              ///< "cpu", "cuda"
const char* layer_kind_name(LayerKind kind);         ///< "mamba2", "gdn"
const char* decode_mode_name(DecodeMode mode);       ///< "eager", "replay"
const char* checkpoint_precision_name(CheckpointPrecision precision);  ///< "fp32+bf16", ...
bool parse_checkpoint_precision(const std::string& text, CheckpointPrecision* out);

struct Mamba2Shape {
  int nheads = 0;    ///< H
  int head_dim = 0;  ///< P
  int dstate = 0;    ///< N
  int ngroups = 0;   ///< G, divides H
};

struct GdnShape {
  int num_k_heads = 0;  ///< Hk
  int num_v_heads = 0;  ///< Hv, a multiple of Hk
  int head_k_dim = 0;   ///< K
  int head_v_dim = 0;   ///< V
};

/// The common view of both layers' state: S[heads, rows, cols], key vectors of length `cols`
/// shared by groups of heads/ (heads / key_heads) consecutive heads.
struct StateDims {
  int heads = 0;      ///< Mamba-2 nheads, GDN num_v_heads
  int rows = 0;       ///< Mamba-2 head_dim, GDN head_v_dim
  int cols = 0;       ///< Mamba-2 dstate, GDN head_k_dim
  int key_heads = 0;  ///< Mamba-2 ngroups, GDN num_k_heads
  [[nodiscard]] std::int64_t state_elems() const {
    return std::int64_t{heads} * rows * cols;
  }
  [[nodiscard]] int heads_per_key() const { return heads / key_heads; }
};

inline StateDims state_dims(const Mamba2Shape& s) {
  return {s.nheads, s.head_dim, s.dstate, s.ngroups};
}
inline StateDims state_dims(const GdnShape& s) {
  return {s.num_v_heads, s.head_v_dim, s.head_k_dim, s.num_k_heads};
}

}  // namespace replayssm
