#pragma once
// Shared test helpers: seeded realistic inputs, dtype conversions, raw views of a cache's
// buffers (for bit-exact and guard-band checks), and the drivers that run a StateCache and the
// float64 oracle (src/cpu/reference.h) side by side over many steps.
//
// Error norm everywhere: max_i |out_i − ref_i| / max_i |ref_i| over one output tensor (one
// decode call of one layer: [batch, T, heads, rows], real rows only).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "replayssm/types.h"
#include "state_cache_layout.h"

namespace replayssm::testing {

// ---------------------------------------------------------------------------------------------
// Random numbers

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}
  double uniform(double lo, double hi);
  double normal(double mean = 0.0, double sd = 1.0);
  int uniform_int(int lo, int hi);  ///< inclusive
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

// ---------------------------------------------------------------------------------------------
// Dtypes

/// v as `dtype` stores it (round to nearest even; fp8 saturates), back in fp32.
float round_to(DType dtype, float v);
void round_all(DType dtype, std::vector<float>* v);
/// Packs fp32 values into `dtype` bytes.
std::vector<std::uint8_t> encode(DType dtype, const std::vector<float>& v);
/// Element i of a `dtype` array, as fp32.
float decode_elem(DType dtype, const void* data, std::size_t i);
std::vector<float> decode(DType dtype, const void* data, std::size_t n);

bool all_finite(const float* v, std::size_t n);
inline bool all_finite(const std::vector<float>& v) { return all_finite(v.data(), v.size()); }
/// max|out − ref| / max|ref|; +inf when out holds a NaN/Inf; the absolute error when ref = 0.
double rel_error(const float* out, const double* ref, std::size_t n);
double rel_error(const std::vector<float>& out, const std::vector<double>& ref);
/// max|a − b| / max|b| over [begin, end) of two fp32 arrays (the comparisons of two backends,
/// or of two caches, where b is the one taken as the reference); +inf when a holds a NaN or an
/// Inf; the absolute difference when b is all zero.
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, std::size_t begin,
                    std::size_t end);

// ---------------------------------------------------------------------------------------------
// Cache memory (host for CPU caches, device for CUDA ones), owned.

class CacheBuffer {
 public:
  CacheBuffer() = default;
  CacheBuffer(Device device, std::size_t bytes);
  ~CacheBuffer();
  CacheBuffer(CacheBuffer&& o) noexcept;
  CacheBuffer& operator=(CacheBuffer&& o) noexcept;
  CacheBuffer(const CacheBuffer&) = delete;
  CacheBuffer& operator=(const CacheBuffer&) = delete;

  static CacheBuffer from_host(Device device, const void* data, std::size_t bytes);
  template <typename T>
  static CacheBuffer from_vector(Device device, const std::vector<T>& v) {
    return from_host(device, v.data(), v.size() * sizeof(T));
  }
  void upload(const void* data, std::size_t bytes);
  void download(void* data, std::size_t bytes) const;
  std::vector<std::uint8_t> bytes() const;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const { return size_; }

 private:
  Device device_ = Device::kCpu;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Raw views of a cache's buffers

/// One buffer of a StateCacheLayout: `layers` × capacity regions of `slot_bytes` bytes each,
/// region (layer, slot) at byte offset (layer·capacity + slot)·slot_bytes.
struct BufferView {
  std::string name;
  const void* ptr = nullptr;
  int layers = 1;
  std::size_t slot_bytes = 0;
  [[nodiscard]] std::size_t total_bytes(int capacity) const {
    return std::size_t(layers) * std::size_t(capacity) * slot_bytes;
  }
};
/// Every non-null buffer of the layout (state, ckpt_hi, ckpt_lo, ckpt_lo_scale, ring_*, cursors).
std::vector<BufferView> layout_buffers(const StateCacheLayout& layout);

/// A host copy of every buffer of a cache, by name.
struct CacheBytes {
  std::vector<std::string> names;
  std::vector<std::vector<std::uint8_t>> data;
  [[nodiscard]] const std::vector<std::uint8_t>& operator[](const std::string& name) const;
};
CacheBytes snapshot(const StateCache& cache);
/// Only the named buffers (e.g. {"ckpt_hi", "ckpt_lo", "ckpt_lo_scale"}); missing ones skipped.
CacheBytes snapshot(const StateCache& cache, const std::vector<std::string>& names);
/// "" when equal, else the first differing buffer and byte offset.
std::string diff(const CacheBytes& a, const CacheBytes& b);
/// Every byte a slot owns, in every buffer and layer, concatenated.
std::vector<std::uint8_t> slot_bytes(const StateCache& cache, int slot);

/// Host copies of the cursors.
std::uint32_t cursor_committed(const StateCache& cache, int slot);
std::uint32_t cursor_folded(const StateCache& cache, int layer, int slot);
int cursor_pending(const StateCache& cache, int slot);

// ---------------------------------------------------------------------------------------------
// Layer parameters and token inputs

/// How to draw parameters and inputs. Defaults are realistic: A = −exp(U(−1, 1)), dt_bias ≈ −4,
/// raw dt, x, B, C, z ~ N(0, 1); GDN q, k, v ~ N(0, 1), g = −softplus-like in [−1, 0) mostly
/// small, β = sigmoid(N(0, 1)).
struct Recipe {
  // Mamba-2
  double a_fixed = 0.0;          ///< A of every head when != 0
  double dt_bias_center = -4.0;  ///< dt_bias = center + U(−0.5, 0.5)
  double dt_sd = 1.0;            ///< raw dt ~ N(0, dt_sd)
  double d_scale = 1.0;          ///< D ~ d_scale·U(0.5, 1.5); 0 leaves only the state path
  // GDN
  double g_fixed = 0.0;          ///< g ≈ g_fixed·(1 + U(−0.1, 0.1)) when != 0
  double beta_lo = 0.0;          ///< β ~ U(beta_lo, beta_hi) when beta_hi > 0
  double beta_hi = 0.0;
  /// When > 0, every token's key is one fixed direction (the same for all tokens and rows)
  /// plus key_spread·N(0, 1) noise: nearly parallel keys, the ill-conditioned case for folds
  /// that solve the delta rule's recurrence over many tokens at once.
  double key_spread = 0.0;
  /// Without qk_l2norm the raw keys are used, so they are drawn with |k| ≈ 1 (a delta rule
  /// with β|k|² > 2 diverges); with it, k ~ N(0, 1) of any norm.
  bool unit_keys = false;
  /// Activations as sin(0.731·i + c) of their flat index instead of noise: a layout bug
  /// (swapped axes, wrong stride) moves values to where a different one is expected.
  bool structured = false;
};

struct Mamba2Layer {
  std::vector<float> A, D, dt_bias;  ///< [nheads]
};

/// One decode call's inputs, [batch, T, ...], activations already exact in the input dtype.
struct Mamba2Tokens {
  int batch = 0, T = 0;
  std::vector<float> x, dt, B, C, z;  ///< z empty: no gate
};
struct GdnTokens {
  int batch = 0, T = 0;
  std::vector<float> q, k, v, g, beta;
};

Mamba2Layer make_mamba2_layer(const Mamba2Shape& shape, const Recipe& recipe, Rng& rng);
Mamba2Tokens make_mamba2_tokens(const Mamba2Shape& shape, int batch, int T, DType input_dtype,
                                bool gate, const Recipe& recipe, Rng& rng);
GdnTokens make_gdn_tokens(const GdnShape& shape, int batch, int T, DType input_dtype,
                          const Recipe& recipe, Rng& rng);

/// A decode call's buffers in the cache's memory, and the Args pointing at them. The output
/// buffer starts filled with NaN (the poison pad rows must keep).
struct Mamba2Call {
  Mamba2DecodeArgs args;
  CacheBuffer slots, x, dt, B, C, z, A, D, dt_bias, y;
  DType dtype = DType::kF32;  ///< of y
  std::size_t out_elems = 0;
  /// The outputs [batch, T, nheads, head_dim] as fp32.
  std::vector<float> output() const;
};
struct GdnCall {
  GdnDecodeArgs args;
  CacheBuffer slots, q, k, v, g, beta, o;
  DType dtype = DType::kF32;  ///< of o
  std::size_t out_elems = 0;
  std::vector<float> output() const;
};
Mamba2Call make_mamba2_call(const StateCache& cache, int layer,
                            const std::vector<std::int32_t>& slot_ids, const Mamba2Layer& params,
                            const Mamba2Tokens& tokens);
GdnCall make_gdn_call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slot_ids,
                      const GdnTokens& tokens, bool qk_l2norm, float scale);

/// state_cache_commit with host vectors (copied into cache memory).
Status commit(StateCache& cache, const std::vector<std::int32_t>& slot_ids,
              const std::vector<std::int32_t>& accepted);
Status fold(StateCache& cache, const std::vector<std::int32_t>& slot_ids);

/// Creates a cache, throwing std::runtime_error on failure (tests only).
std::unique_ptr<StateCache> create_cache(const StateCacheConfig& config);
int allocate_slot(StateCache& cache);

/// state_cache_export_state into `out`, sized to the cache's state.
Status export_state(StateCache& cache, int layer, int slot, std::vector<float>* out);

// ---------------------------------------------------------------------------------------------
// Naive same-precision loops: §1/§2 in fp32 with the state stored in `state_dtype` after every
// update and the outputs rounded to `out_dtype`. The yardstick for long runs: a path's
// error vs the oracle should be no more than about twice this loop's.

void naive_mamba2_step(const Mamba2Shape& shape, DType state_dtype, DType out_dtype,
                       std::vector<float>& state, const float* x, const float* dt, const float* B,
                       const float* C, const float* z, const float* A, const float* D,
                       const float* dt_bias, float* y);
void naive_gdn_step(const GdnShape& shape, DType state_dtype, DType out_dtype,
                    std::vector<float>& state, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, bool qk_l2norm, float scale, float* o);

// ---------------------------------------------------------------------------------------------
// Drivers: a cache and the oracle on the same inputs

struct RunSpec {
  StateCacheConfig cache;  ///< capacity is set by the driver (batch + guard slots + 1 free)
  int batch = 2;
  int steps = 64;
  std::uint64_t seed = 1;
  Recipe recipe;
  bool gate = false;        ///< Mamba-2: pass z
  bool qk_l2norm = true;    ///< GDN
  float scale = 0.0f;       ///< GDN
  /// Window T of every decode (<= cache.max_spec_tokens). T = 1: plain decoding, every token
  /// committed. T > 1: each row accepts k ~ U{0..T} (a separate seeded stream).
  int window = 1;
  /// Row r joins at step r·stagger (a pad row −1 before), so rows sit at different ring fill
  /// levels in one batch.
  int stagger = 0;
  /// Also run a same-precision naive loop (state in naive_state_dtype).
  bool naive = false;
  DType naive_state_dtype = DType::kF32;
  /// Spec only: rerun the accepted stream through a plain (T = 1) cache of the same config and
  /// compare its outputs with the window's at accepted positions.
  bool compare_plain = false;
  /// Extra allocated slots no row uses: their bytes must stay as allocated.
  int guard_slots = 1;
};

struct RunResult {
  /// Empty when every call returned ok and every integrity check held; else what went wrong
  /// first (a Status, a NaN output, a written pad row, a touched guard slot).
  std::string failure;
  std::vector<double> step_error;  ///< per step, max over layers of the error vs the oracle
  double max_error = 0.0;
  std::vector<double> naive_step_error;
  double naive_max_error = 0.0;
  /// compare_plain: max over steps of max|y_window − y_plain| / max|ref| at accepted positions.
  double plain_max_error = 0.0;
  /// After the run: exported state of every (layer, row) vs the oracle's, max|ΔS| / max|S|.
  double export_error = 0.0;
  std::int64_t tokens_committed = 0;
  /// The most distinct (committed − folded) values among real rows at the start of a step.
  int max_distinct_fill_levels = 0;
};

RunResult run_mamba2(const RunSpec& spec);
RunResult run_gdn(const RunSpec& spec);

/// The long-run rule for a low-precision run: the naive same-precision loop ran and really saw an
/// error, and the run's error is at most twice it (+ `floor`, for errors exactly zero in both).
void expect_within_naive(const RunResult& r, double floor);
/// The bounds of a short fp32-input replay run by checkpoint precision, with u the unit
/// roundoff of the read copy (bf16 2^-8, fp8 e4m3 2^-4): fp32, outputs and exported state
/// within fp32_tol; fp32+bf16 / fp32+fp8, outputs within 2u and above fp32_tol (the low copy is
/// what outputs read), exported state within fp32_tol (folds use the fp32 master); shared bf16,
/// outputs within 4u and exported state within 4u but above fp32_tol (no master).
void expect_checkpoint_bounds(const RunResult& r, CheckpointPrecision precision, double fp32_tol);

/// GDN over a long memory (the dual-precision study, ALGORITHM.md §6, §10): g ≈ −0.001 and
/// small β ~ U(0.02, 0.06), about 500-1,000 tokens of memory; Hk=2, Hv=4, K=32, V=16, replay
/// with `buffer_len`, fp32 inputs, 2 rows, `steps` steps, seed 901, no guard slots, on the CPU
/// (callers set cache.device and cache.checkpoint).
RunSpec gdn_long_memory_spec(int buffer_len, int steps);
/// The mean of v[from, to): the error of a stretch of steps.
double mean_of(const std::vector<double>& v, int from, int to);

/// Two caches of one config (kind and shape from it, capacity >= batch) driven on the same
/// tokens, `batch` rows each: one decodes T-token windows and commits all T, the other decodes
/// the same tokens one at a time, committing 1 each. Row b sits in slot ws[b] of `window` and
/// ss[b] of `single`: different slots (ss is ws reversed).
struct WindowPair {
  std::unique_ptr<StateCache> window, single;
  std::vector<std::int32_t> ws, ss;
};
WindowPair make_window_pair(const StateCacheConfig& config, int batch);
/// `rounds` rounds of T = config.max_spec_tokens tokens (fp32, default recipe; Mamba-2 with a
/// gate and its layer drawn first from `seed`'s stream; GDN with qk_l2norm and the default
/// scale). *worst: max over rounds and positions t of max|o_window − o_single| / max|o_window|
/// over the batch's outputs at t. Fatal assertions on any failed call or non-finite output.
void run_window_vs_single(WindowPair& p, std::uint64_t seed, int rounds, double* worst);
/// Every row's exported layer-0 state of the single-step cache against the window cache's:
/// max|ΔS| / max|S_window| <= tol, and S_window not all zero.
void expect_window_states_match(WindowPair& p, double tol);

/// The CUDA backend against the CPU backend on the same inputs: `config` (a CPU config; the
/// CUDA cache is its copy on Device::kCuda) with capacity batch + 2, slot 0 and the last one
/// guards no row uses; rows in slots 1..batch plus one pad row; row r joins at step r·stagger;
/// windows of T = config.max_spec_tokens with accepted ~ U{0..T} (1 each for T = 1).
struct CudaVsCpuSpec {
  StateCacheConfig config;
  int batch = 3;
  int steps = 24;
  int stagger = 0;
  std::uint64_t seed = 1;
  bool load_initial = true;  ///< start every row from a loaded N(0, initial_sd) state
  double initial_sd = 0.5;
  bool gate = true;          ///< Mamba-2
  bool qk_l2norm = true;     ///< GDN (raw keys drawn with |k| ≈ 1 without it)
  double output_tol = 0.0;   ///< per decode call and row, max|o_cuda − o_cpu| / max|o_cpu|
  double state_tol = 0.0;    ///< every exported state at the end, likewise
};
/// Fatal assertions on outputs past output_tol, a written pad row, a cursor differing after a
/// commit, a failed call; non-fatal ones on written guard slots and exported states past
/// state_tol. *worst: the largest output difference seen.
void compare_cuda_vs_cpu(const CudaVsCpuSpec& spec, double* worst);

/// prefix + decimal value ("L16") for test names. (Out of line: GCC 12 warns falsely about
/// "L" + std::to_string(v) inlined at -O3, PR 105651.)
std::string int_tag(const char* prefix, int value);
/// "f32" → "F32" etc. for test names.
std::string dtype_tag(DType dtype);
std::string precision_tag(CheckpointPrecision precision);

}  // namespace replayssm::testing
