// The trace engine: builds each step's [batch, T, ...] windows from the trace (real tokens and
// drafts), moves them to the cache's device with the backend's memory helpers (so the same
// code drives CPU and CUDA caches), decodes, commits, and scatters the accepted outputs back
// into the real stream.

#include "engine/trace_run.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <utility>

#include "backend.h"
#include "common/device_buffer.h"
#include "common/layer_kind.h"
#include "engine/activations.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/version.h"

namespace replayssm {

namespace {

// One per-token input of the layer: the trace's [num_steps, batch, elems] values, staged
// each step as a [batch, T, elems] window and moved to the device.
struct TokenInput {
  const char* name = nullptr;
  const std::vector<float>* trace = nullptr;
  std::int64_t elems = 0;     // per token and row
  DType dtype = DType::kF32;  // the cache's activation dtype, or f32 for per-head scalars
  float draft_lo = 0.0f;      // drafts are uniform in [draft_lo, draft_hi]
  float draft_hi = 0.0f;
  std::vector<float> window;  // [batch, T, elems]
  std::vector<std::uint8_t> packed;
  DeviceBuffer device;
};

// Drafts span the tensor's own range, so they are finite, in its domain (g <= 0, beta in
// (0, 1)) and of its scale; a constant tensor gets [c/2, c] (or [-1, 1] for 0), which keeps
// the sign and still differs from the real value.
void set_draft_range(TokenInput* in) {
  const auto [lo, hi] = std::minmax_element(in->trace->begin(), in->trace->end());
  in->draft_lo = *lo;
  in->draft_hi = *hi;
  if (*lo == *hi) {
    in->draft_lo = *lo == 0.0f ? -1.0f : *lo * 0.5f;
    in->draft_hi = *lo == 0.0f ? 1.0f : *lo;
  }
}

std::vector<TokenInput> token_inputs(const LayerTrace& trace, DType activation) {
  std::vector<TokenInput> inputs;
  const auto add = [&](const char* name, const std::vector<float>& values, std::int64_t elems,
                       DType dtype) {
    if (values.empty()) return;  // an absent optional input (Mamba-2 z)
    TokenInput in;
    in.name = name;
    in.trace = &values;
    in.elems = elems;
    in.dtype = dtype;
    inputs.push_back(std::move(in));
  };
  visit_kind(
      trace.kind,
      [&] {
        const Mamba2Trace& t = trace.mamba2;
        const Mamba2Shape& s = t.shape;
        add("x", t.x, std::int64_t{s.nheads} * s.head_dim, activation);
        add("dt", t.dt, s.nheads, DType::kF32);
        add("B", t.B, std::int64_t{s.ngroups} * s.dstate, activation);
        add("C", t.C, std::int64_t{s.ngroups} * s.dstate, activation);
        add("z", t.z, std::int64_t{s.nheads} * s.head_dim, activation);
      },
      [&] {
        const GdnTrace& t = trace.gdn;
        const GdnShape& s = t.shape;
        add("q", t.q, std::int64_t{s.num_k_heads} * s.head_k_dim, activation);
        add("k", t.k, std::int64_t{s.num_k_heads} * s.head_k_dim, activation);
        add("v", t.v, std::int64_t{s.num_v_heads} * s.head_v_dim, activation);
        add("g", t.g, s.num_v_heads, DType::kF32);
        add("beta", t.beta, s.num_v_heads, DType::kF32);
      });
  return inputs;
}

// The device copy of input `name`, or null when the trace does not have it.
const void* device_input(const std::vector<TokenInput>& inputs, const char* name) {
  for (const TokenInput& in : inputs) {
    if (std::string(in.name) == name) return in.device.get();
  }
  return nullptr;
}

Status validate_options(const TraceRunOptions& o) {
  if (o.spec_tokens < 1) return invalid_argument("spec_tokens (T) must be >= 1");
  if (o.buffer_len < 1) return invalid_argument("buffer_len (L) must be >= 1");
  return Status::ok();
}

// Uniform in [0, 1) from 53 random bits: portable, unlike std::uniform_real_distribution.
double unit_uniform(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

// One run of a trace: the cache, the device buffers, and each row's position in the trace.
class TraceRunner {
 public:
  TraceRunner(const LayerTrace& trace, const TraceRunOptions& options)
      : trace_(trace),
        options_(options),
        dims_(trace.dims()),
        batch_(trace.batch()),
        T_(options.spec_tokens),
        out_elems_(std::int64_t{dims_.heads} * dims_.rows),
        accept_rng_(options.accept_seed),
        draft_rng_(options.accept_seed ^ kTraceRunDraftSeedMix) {}

  // Creates the cache with one slot per row holding state0, and the step buffers.
  Status init() {
    StateCacheConfig config;
    config.kind = trace_.kind;
    config.mamba2 = trace_.mamba2.shape;
    config.gdn = trace_.gdn.shape;
    config.num_layers = 1;
    config.capacity = batch_;
    config.device = options_.device;
    config.mode = options_.mode;
    config.input_dtype = options_.input_dtype;
    config.state_dtype = DType::kF32;
    config.buffer_len = options_.buffer_len;
    config.max_spec_tokens = T_;
    config.checkpoint = options_.checkpoint;
    REPLAYSSM_RETURN_IF_ERROR(state_cache_create(config, &cache_));

    const std::vector<float>& state0 = visit_kind(
        trace_.kind, [&]() -> auto& { return trace_.mamba2.state0; },
        [&]() -> auto& { return trace_.gdn.state0; });
    for (int b = 0; b < batch_; ++b) {
      int slot = -1;
      REPLAYSSM_RETURN_IF_ERROR(state_cache_allocate_slot(*cache_, &slot));
      slots_.push_back(slot);
      REPLAYSSM_RETURN_IF_ERROR(
          state_cache_load_state(*cache_, 0, slot, state0.data() + b * dims_.state_elems()));
    }

    const Device device = options_.device;
    inputs_ = token_inputs(trace_, options_.input_dtype);
    for (TokenInput& in : inputs_) {
      in.window.assign(static_cast<std::size_t>(std::int64_t{batch_} * T_ * in.elems), 0.0f);
      in.packed.resize(in.window.size() * dtype_size(in.dtype));
      REPLAYSSM_RETURN_IF_ERROR(in.device.allocate(device, in.packed.size()));
      if (T_ > 1) set_draft_range(&in);
    }
    if (trace_.kind == LayerKind::kMamba2) {
      REPLAYSSM_RETURN_IF_ERROR(A_.assign(device, trace_.mamba2.A));
      REPLAYSSM_RETURN_IF_ERROR(D_.assign(device, trace_.mamba2.D));
      REPLAYSSM_RETURN_IF_ERROR(dt_bias_.assign(device, trace_.mamba2.dt_bias));
    }
    out_window_.resize(static_cast<std::size_t>(std::int64_t{batch_} * T_ * out_elems_));
    out_packed_.resize(out_window_.size() * dtype_size(options_.input_dtype));
    REPLAYSSM_RETURN_IF_ERROR(out_.allocate(device, out_packed_.size()));
    const std::size_t ids_bytes = slots_.size() * sizeof(std::int32_t);
    REPLAYSSM_RETURN_IF_ERROR(slot_ids_.allocate(device, ids_bytes));
    REPLAYSSM_RETURN_IF_ERROR(accepted_.allocate(device, ids_bytes));
    pos_.assign(slots_.size(), 0);
    step_slots_.resize(slots_.size());
    step_accepted_.resize(slots_.size());
    return Status::ok();
  }

  Status run(TraceRunResult* result) {
    const std::int64_t total = std::int64_t{trace_.num_steps()} * batch_;
    result->out.assign(static_cast<std::size_t>(total * out_elems_), 0.0f);
    std::int64_t done = 0;
    while (done < total) {
      plan_step();
      REPLAYSSM_RETURN_IF_ERROR(stage_inputs());
      const auto start = std::chrono::steady_clock::now();
      REPLAYSSM_RETURN_IF_ERROR(decode_and_commit());
      REPLAYSSM_RETURN_IF_ERROR(out_.download(out_packed_.data()));  // waits for a GPU
      result->decode_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ++result->decode_steps;
      done += collect_outputs(&result->out);
      if (options_.progress) options_.progress(done, total);
    }
    // The final states, exported by the cache (replay: the rest of the ring folded in).
    const std::int64_t n = dims_.state_elems();
    result->state.resize(static_cast<std::size_t>(batch_ * n));
    for (int b = 0; b < batch_; ++b) {
      REPLAYSSM_RETURN_IF_ERROR(state_cache_export_state(
          *cache_, 0, slots_[static_cast<std::size_t>(b)], result->state.data() + b * n));
    }
    return Status::ok();
  }

 private:
  // Which rows take part in this step, and how many real tokens (k) each one's window holds
  // (the draw documented in trace_run.h); rows with no tokens left are pad rows.
  void plan_step() {
    const int num_steps = trace_.num_steps();
    for (std::size_t b = 0; b < slots_.size(); ++b) {
      const int left = num_steps - pos_[b];
      step_slots_[b] = left > 0 ? slots_[b] : -1;
      if (left == 0) {
        step_accepted_[b] = 0;
      } else if (T_ == 1) {
        step_accepted_[b] = 1;
      } else {
        const auto widest = static_cast<std::uint64_t>(std::min(T_, left));
        step_accepted_[b] = static_cast<std::int32_t>(1 + accept_rng_() % widest);
      }
    }
  }

  // Builds every input's [batch, T, ...] window (k real tokens, then drafts) and uploads it.
  Status stage_inputs() {
    for (TokenInput& in : inputs_) {
      for (int b = 0; b < batch_; ++b) {
        const auto ub = static_cast<std::size_t>(b);
        if (step_slots_[ub] < 0) continue;  // pad row: skipped by the decode, left as is
        for (int i = 0; i < T_; ++i) {
          float* dst = in.window.data() + (std::int64_t{b} * T_ + i) * in.elems;
          if (i < step_accepted_[ub]) {
            const float* src =
                in.trace->data() + (std::int64_t{pos_[ub] + i} * batch_ + b) * in.elems;
            std::copy(src, src + in.elems, dst);
            continue;
          }
          const float span = in.draft_hi - in.draft_lo;
          for (std::int64_t e = 0; e < in.elems; ++e) {
            dst[e] = in.draft_lo + float(unit_uniform(draft_rng_)) * span;
          }
        }
      }
      activations_pack(in.dtype, in.window.data(), in.window.size(), in.packed.data());
      REPLAYSSM_RETURN_IF_ERROR(in.device.upload(in.packed.data()));
    }
    REPLAYSSM_RETURN_IF_ERROR(slot_ids_.upload(step_slots_.data()));
    return accepted_.upload(step_accepted_.data());
  }

  Status decode_and_commit() {
    const auto* slot_ids = static_cast<const std::int32_t*>(slot_ids_.get());
    REPLAYSSM_RETURN_IF_ERROR(visit_kind(
        trace_.kind,
        [&] {
          Mamba2DecodeArgs a;
          a.batch = batch_;
          a.num_tokens = T_;
          a.slot_ids = slot_ids;
          a.x = device_input(inputs_, "x");
          a.dt = static_cast<const float*>(device_input(inputs_, "dt"));
          a.B = device_input(inputs_, "B");
          a.C = device_input(inputs_, "C");
          a.z = device_input(inputs_, "z");
          a.A = static_cast<const float*>(A_.get());
          a.D = static_cast<const float*>(D_.get());
          a.dt_bias = static_cast<const float*>(dt_bias_.get());
          a.y = out_.get();
          return mamba2_decode(*cache_, a);
        },
        [&] {
          GdnDecodeArgs a;
          a.batch = batch_;
          a.num_tokens = T_;
          a.slot_ids = slot_ids;
          a.q = device_input(inputs_, "q");
          a.k = device_input(inputs_, "k");
          a.v = device_input(inputs_, "v");
          a.g = static_cast<const float*>(device_input(inputs_, "g"));
          a.beta = static_cast<const float*>(device_input(inputs_, "beta"));
          a.qk_l2norm = trace_.gdn.qk_l2norm;
          a.scale = trace_.gdn.scale;
          a.o = out_.get();
          return gdn_decode(*cache_, a);
        }));
    CommitArgs commit;
    commit.batch = batch_;
    commit.slot_ids = slot_ids;
    commit.accepted = static_cast<const std::int32_t*>(accepted_.get());
    return state_cache_commit(*cache_, commit);
  }

  // Stores the accepted window positions as the real stream's next outputs and advances the
  // rows; returns the number of tokens accepted.
  std::int64_t collect_outputs(std::vector<float>* stream) {
    activations_unpack(options_.input_dtype, out_packed_.data(), out_window_.size(),
                       out_window_.data());
    std::int64_t accepted = 0;
    for (int b = 0; b < batch_; ++b) {
      const auto ub = static_cast<std::size_t>(b);
      for (int i = 0; i < step_accepted_[ub]; ++i) {
        const float* src = out_window_.data() + (std::int64_t{b} * T_ + i) * out_elems_;
        std::copy(src, src + out_elems_,
                  stream->data() + (std::int64_t{pos_[ub] + i} * batch_ + b) * out_elems_);
      }
      pos_[ub] += step_accepted_[ub];
      accepted += step_accepted_[ub];
    }
    return accepted;
  }

  const LayerTrace& trace_;
  const TraceRunOptions& options_;
  const StateDims dims_;
  const int batch_;
  const int T_;
  const std::int64_t out_elems_;  // outputs per token and row: heads × rows
  std::mt19937_64 accept_rng_;
  std::mt19937_64 draft_rng_;

  std::unique_ptr<StateCache> cache_;
  std::vector<std::int32_t> slots_;  // row b's slot
  std::vector<TokenInput> inputs_;
  DeviceBuffer A_, D_, dt_bias_;  // Mamba-2 layer parameters
  DeviceBuffer out_;              // [batch, T, heads, rows], activation dtype
  DeviceBuffer slot_ids_;         // [batch] int32: this step's slots (-1 = pad row)
  DeviceBuffer accepted_;         // [batch] int32: this step's k per row
  std::vector<std::uint8_t> out_packed_;
  std::vector<float> out_window_;
  std::vector<int> pos_;  // next real token of each row
  std::vector<std::int32_t> step_slots_;
  std::vector<std::int32_t> step_accepted_;
};

}  // namespace

Status trace_run(const LayerTrace& trace, const TraceRunOptions& options, TraceRunResult* out) {
  if (out == nullptr) return invalid_argument("trace_run: out is null");
  REPLAYSSM_RETURN_IF_ERROR(validate_options(options));
  REPLAYSSM_RETURN_IF_ERROR(trace_validate(trace));
  try {  // host vectors sized by the trace; the cache's memory is Status-checked
    TraceRunner runner(trace, options);
    REPLAYSSM_RETURN_IF_ERROR(runner.init());
    TraceRunResult result;
    REPLAYSSM_RETURN_IF_ERROR(runner.run(&result));
    *out = std::move(result);
    return Status::ok();
  } catch (const std::bad_alloc&) {
    return {StatusCode::kOutOfMemory, "not enough host memory to run the trace"};
  }
}

Status trace_run_save(const std::string& path, const LayerTrace& trace,
                      const TraceRunOptions& options, const TraceRunResult& result) {
  const StateDims d = trace.dims();
  const std::int64_t batch = trace.batch();
  SafetensorsFile file;
  const char* out_name = visit_kind(trace.kind, [] { return "y"; }, [] { return "o"; });
  file.tensors[out_name] =
      safetensors_tensor_f32({trace.num_steps(), batch, d.heads, d.rows}, result.out);
  file.tensors["state"] = safetensors_tensor_f32({batch, d.heads, d.rows, d.cols}, result.state);
  if (file.tensors[out_name].numel() != static_cast<std::int64_t>(result.out.size()) ||
      file.tensors["state"].numel() != static_cast<std::int64_t>(result.state.size())) {
    return invalid_argument("trace_run_save: the result does not match the trace's shapes");
  }
  auto& m = file.metadata;
  m["layer"] = layer_kind_name(trace.kind);
  m["mode"] = decode_mode_name(options.mode);
  if (options.mode == DecodeMode::kReplay) {  // meaningless for eager: left out
    m["buffer_len"] = std::to_string(options.buffer_len);
    m["checkpoint"] = checkpoint_precision_name(options.checkpoint);
  }
  m["spec_tokens"] = std::to_string(options.spec_tokens);
  if (options.spec_tokens > 1) m["accept_seed"] = std::to_string(options.accept_seed);
  m["device"] = device_name(options.device);
  m["input_dtype"] = dtype_name(options.input_dtype);
  m["version"] = REPLAYSSM_VERSION;
  return safetensors_write(path, file);
}

}  // namespace replayssm
