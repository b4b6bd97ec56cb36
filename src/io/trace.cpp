// Layer traces: one table per layer kind lists every tensor with its shape in named dimensions
// and the values it may hold; loading, shape checks and value checks all walk that table, so
// the rules of TRACE_FORMAT.md are written once.

#include "io/trace.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "common/layer_kind.h"

namespace replayssm {

namespace {

enum class ValueRule {
  kFinite,       // any finite value
  kNegative,     // finite and < 0 (Mamba-2 A)
  kNonPositive,  // finite and <= 0 (GDN g, a log-decay)
  kOpenUnit,     // finite and in (0, 1) (GDN beta)
};

enum class Presence {
  kRequired,
  kOptional,      // absent: the vector stays empty (Mamba-2's gate z)
  kZerosIfAbsent  // absent: zero-filled (state0)
};

template <typename TraceT>
struct TensorSpec {
  const char* name;
  std::vector<float> TraceT::*member;
  Presence presence;
  std::vector<const char*> dims;  // named dimensions, resolved through a SymbolTable
  ValueRule rule;
};

using SymbolTable = std::map<std::string, std::int64_t>;

// Mamba-2: T steps, batch rows, H heads of P channels, G groups of N state columns.
const std::vector<TensorSpec<Mamba2Trace>>& mamba2_tensors() {
  using T = Mamba2Trace;
  static const std::vector<TensorSpec<T>> specs = {
      {"x", &T::x, Presence::kRequired, {"T", "batch", "H", "P"}, ValueRule::kFinite},
      {"dt", &T::dt, Presence::kRequired, {"T", "batch", "H"}, ValueRule::kFinite},
      {"B", &T::B, Presence::kRequired, {"T", "batch", "G", "N"}, ValueRule::kFinite},
      {"C", &T::C, Presence::kRequired, {"T", "batch", "G", "N"}, ValueRule::kFinite},
      {"z", &T::z, Presence::kOptional, {"T", "batch", "H", "P"}, ValueRule::kFinite},
      {"A", &T::A, Presence::kRequired, {"H"}, ValueRule::kNegative},
      {"D", &T::D, Presence::kRequired, {"H"}, ValueRule::kFinite},
      {"dt_bias", &T::dt_bias, Presence::kRequired, {"H"}, ValueRule::kFinite},
      {"state0",
       &T::state0,
       Presence::kZerosIfAbsent,
       {"batch", "H", "P", "N"},
       ValueRule::kFinite},
  };
  return specs;
}

// GDN: Hk key heads of K, Hv value heads of V.
const std::vector<TensorSpec<GdnTrace>>& gdn_tensors() {
  using T = GdnTrace;
  static const std::vector<TensorSpec<T>> specs = {
      {"q", &T::q, Presence::kRequired, {"T", "batch", "Hk", "K"}, ValueRule::kFinite},
      {"k", &T::k, Presence::kRequired, {"T", "batch", "Hk", "K"}, ValueRule::kFinite},
      {"v", &T::v, Presence::kRequired, {"T", "batch", "Hv", "V"}, ValueRule::kFinite},
      {"g", &T::g, Presence::kRequired, {"T", "batch", "Hv"}, ValueRule::kNonPositive},
      {"beta", &T::beta, Presence::kRequired, {"T", "batch", "Hv"}, ValueRule::kOpenUnit},
      {"state0",
       &T::state0,
       Presence::kZerosIfAbsent,
       {"batch", "Hv", "V", "K"},
       ValueRule::kFinite},
  };
  return specs;
}

SymbolTable symbols_of(const Mamba2Trace& t) {
  return {{"T", t.num_steps},      {"batch", t.batch},     {"H", t.shape.nheads},
          {"P", t.shape.head_dim}, {"G", t.shape.ngroups}, {"N", t.shape.dstate}};
}
SymbolTable symbols_of(const GdnTrace& t) {
  return {{"T", t.num_steps},          {"batch", t.batch},        {"Hk", t.shape.num_k_heads},
          {"Hv", t.shape.num_v_heads}, {"K", t.shape.head_k_dim}, {"V", t.shape.head_v_dim}};
}

// Symbols were bound from the file and each checked to fit an int.
void set_symbols(const SymbolTable& s, Mamba2Trace* t) {
  t->num_steps = static_cast<int>(s.at("T"));
  t->batch = static_cast<int>(s.at("batch"));
  t->shape = {static_cast<int>(s.at("H")), static_cast<int>(s.at("P")), static_cast<int>(s.at("N")),
              static_cast<int>(s.at("G"))};
}
void set_symbols(const SymbolTable& s, GdnTrace* t) {
  t->num_steps = static_cast<int>(s.at("T"));
  t->batch = static_cast<int>(s.at("batch"));
  t->shape = {static_cast<int>(s.at("Hk")), static_cast<int>(s.at("Hv")),
              static_cast<int>(s.at("K")), static_cast<int>(s.at("V"))};
}

Status shape_error(const std::string& tensor, const std::string& what) {
  return invalid_argument("trace tensor '" + tensor + "' " + what);
}

std::string join(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
std::string join(const std::vector<const char*>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += std::string(i ? ", " : "") + v[i];
  return s + "]";
}

template <typename TraceT>
std::vector<std::int64_t> resolve(const TensorSpec<TraceT>& spec, const SymbolTable& symbols) {
  std::vector<std::int64_t> shape;
  for (const char* d : spec.dims) shape.push_back(symbols.at(d));
  return shape;
}

std::int64_t product(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// Where each value of a named dimension was seen: value -> tensors, in table order.
using Sightings = std::map<std::int64_t, std::vector<std::string>>;

std::string names_text(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "'" : ", '") + n + "'";
  return s;
}

// Binds each named dimension to the value most of the tensors that have it agree on, so that a
// mismatch blames the tensor that is off (v with Hv = 3 beside g, beta and state0 with Hv = 4
// blames v), then checks every tensor against those bindings. Where the tensors split evenly
// (x and state0 are the only ones with P) nothing says which one is wrong: the error names both.
template <typename TraceT>
Status bind_shapes(const SafetensorsFile& file, const std::vector<TensorSpec<TraceT>>& specs,
                   SymbolTable* symbols) {
  std::map<std::string, Sightings> seen;
  for (const auto& spec : specs) {
    const SafetensorsTensor* t = file.find(spec.name);
    if (t == nullptr) continue;
    if (t->shape.size() != spec.dims.size()) {
      return shape_error(spec.name,
                         "has shape " + join(t->shape) + "; expected " + join(spec.dims));
    }
    for (std::size_t i = 0; i < spec.dims.size(); ++i) {
      const std::int64_t size = t->shape[i];
      if (size < 1 || size > INT_MAX) {
        return shape_error(spec.name, "has shape " + join(t->shape) + ": dimension " +
                                          spec.dims[i] + " must be in [1, " +
                                          std::to_string(INT_MAX) + "]");
      }
      std::vector<std::string>& names = seen[spec.dims[i]][size];
      if (names.empty() || names.back() != spec.name) names.push_back(spec.name);
    }
  }
  std::map<std::string, bool> split_evenly;
  for (const auto& [symbol, sightings] : seen) {
    std::size_t best = 0, runner_up = 0;
    for (const auto& [size, names] : sightings) {
      if (names.size() > best) {
        runner_up = best;
        best = names.size();
        (*symbols)[symbol] = size;
      } else {
        runner_up = std::max(runner_up, names.size());
      }
    }
    split_evenly[symbol] = runner_up == best;
  }
  for (const auto& spec : specs) {
    const SafetensorsTensor* t = file.find(spec.name);
    if (t == nullptr) continue;
    const std::vector<std::int64_t> expected = resolve(spec, *symbols);
    if (t->shape == expected) continue;
    std::size_t i = 0;
    while (t->shape[i] == expected[i]) ++i;
    const std::string symbol = spec.dims[i];
    const Sightings& sightings = seen.at(symbol);
    if (split_evenly.at(symbol)) {
      std::string values;
      for (const auto& [size, names] : sightings) {
        values += (values.empty() ? "" : "; ") + std::to_string(size) + " in " + names_text(names);
      }
      return invalid_argument("trace tensors disagree on dimension " + symbol + ": " + values);
    }
    return shape_error(spec.name, "has shape " + join(t->shape) + "; expected " +
                                      join(spec.dims) + " = " + join(expected) + " (" + symbol +
                                      " = " + std::to_string(expected[i]) + " in " +
                                      names_text(sightings.at(expected[i])) + ")");
  }
  return Status::ok();
}

template <typename TraceT>
Status load_tensors(const SafetensorsFile& file, const std::vector<TensorSpec<TraceT>>& specs,
                    const char* layer, TraceT* trace) {
  for (const auto& spec : specs) {
    if (spec.presence == Presence::kRequired && file.find(spec.name) == nullptr) {
      return invalid_argument(std::string("trace is missing tensor '") + spec.name + "' (" + layer +
                              " layer)");
    }
  }
  for (const auto& [name, unused] : file.tensors) {
    bool known = false;
    for (const auto& spec : specs) known = known || name == spec.name;
    if (!known) {
      std::string names;
      for (const auto& spec : specs) names += std::string(names.empty() ? "" : ", ") + spec.name;
      return invalid_argument("trace has unexpected tensor '" + printable_excerpt(name) +
                              "'; a " + layer + " trace holds " + names);
    }
  }
  SymbolTable symbols;
  REPLAYSSM_RETURN_IF_ERROR(bind_shapes(file, specs, &symbols));
  set_symbols(symbols, trace);
  for (const auto& spec : specs) {
    std::vector<float>& values = trace->*spec.member;
    if (const SafetensorsTensor* t = file.find(spec.name)) {
      values = t->to_f32();
    } else if (spec.presence == Presence::kZerosIfAbsent) {
      values.assign(static_cast<std::size_t>(product(resolve(spec, symbols))), 0.0f);
    }  // other optional tensors stay empty (absent)
  }
  return Status::ok();
}

std::string multi_index(std::int64_t flat, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> index(shape.size());
  for (std::size_t i = shape.size(); i-- > 0;) {
    index[i] = flat % shape[i];
    flat /= shape[i];
  }
  return join(index);
}

// Empty string when `v` obeys `rule`, else what is wrong with it.
std::string rule_violation(float v, ValueRule rule) {
  if (!std::isfinite(v)) return "has a non-finite value";
  switch (rule) {
    case ValueRule::kFinite: return "";
    case ValueRule::kNegative: return v < 0.0f ? "" : "must be < 0";
    case ValueRule::kNonPositive: return v <= 0.0f ? "" : "must be <= 0";
    case ValueRule::kOpenUnit: return v > 0.0f && v < 1.0f ? "" : "must be in (0, 1)";
  }
  return "";
}

template <typename TraceT>
Status validate_tensors(const TraceT& trace, const std::vector<TensorSpec<TraceT>>& specs) {
  const SymbolTable symbols = symbols_of(trace);
  for (const auto& [name, size] : symbols) {
    if (size < 1) {
      return invalid_argument("trace dimension " + name + " = " + std::to_string(size) +
                              " must be >= 1");
    }
  }
  for (const auto& spec : specs) {
    const std::vector<float>& values = trace.*spec.member;
    const std::vector<std::int64_t> shape = resolve(spec, symbols);
    if (spec.presence == Presence::kOptional && values.empty()) continue;
    if (static_cast<std::int64_t>(values.size()) != product(shape)) {
      return shape_error(spec.name, "holds " + std::to_string(values.size()) +
                                        " values; its shape " + join(spec.dims) + " = " +
                                        join(shape) + " needs " + std::to_string(product(shape)));
    }
    for (std::size_t i = 0; i < values.size(); ++i) {
      const std::string what = rule_violation(values[i], spec.rule);
      if (!what.empty()) {
        return invalid_argument("trace tensor '" + std::string(spec.name) + "' " + what + " (" +
                                std::to_string(values[i]) + " at " +
                                multi_index(static_cast<std::int64_t>(i), shape) + ")");
      }
    }
  }
  return Status::ok();
}

Status parse_gdn_metadata(const std::map<std::string, std::string>& metadata, GdnTrace* t) {
  if (const auto it = metadata.find("qk_l2norm"); it != metadata.end()) {
    if (it->second != "true" && it->second != "false") {
      return invalid_argument("trace metadata 'qk_l2norm' is '" + printable_excerpt(it->second) +
                              "'; expected 'true' or 'false'");
    }
    t->qk_l2norm = it->second == "true";
  }
  if (const auto it = metadata.find("scale"); it != metadata.end()) {
    const char* text = it->second.c_str();
    char* end = nullptr;
    const double scale = std::strtod(text, &end);
    if (end == text || *end != '\0') {
      return invalid_argument("trace metadata 'scale' is '" + printable_excerpt(it->second) +
                              "', not a number");
    }
    if (!std::isfinite(scale) || scale <= 0.0) {
      return invalid_argument("trace metadata 'scale' is " + printable_excerpt(it->second) +
                              "; it must be a finite number > 0");
    }
    t->scale = static_cast<float>(scale);
  }
  return Status::ok();
}

Status convert_trace(const SafetensorsFile& file, LayerTrace* out) {
  LayerTrace trace;
  if (const auto it = file.metadata.find("layer"); it != file.metadata.end()) {
    if (it->second == layer_kind_name(LayerKind::kMamba2)) {
      trace.kind = LayerKind::kMamba2;
    } else if (it->second == layer_kind_name(LayerKind::kGdn)) {
      trace.kind = LayerKind::kGdn;
    } else {
      return invalid_argument("trace metadata 'layer' is '" + printable_excerpt(it->second) +
                              "'; expected 'mamba2' or 'gdn'");
    }
  } else if (file.find("x") != nullptr) {
    trace.kind = LayerKind::kMamba2;
  } else if (file.find("q") != nullptr) {
    trace.kind = LayerKind::kGdn;
  } else {
    return invalid_argument(
        "cannot tell the trace's layer: no metadata 'layer' and neither tensor 'x' (mamba2) "
        "nor 'q' (gdn)");
  }
  const Status loaded = visit_kind(
      trace.kind, [&] { return load_tensors(file, mamba2_tensors(), "mamba2", &trace.mamba2); },
      [&] {
        REPLAYSSM_RETURN_IF_ERROR(load_tensors(file, gdn_tensors(), "gdn", &trace.gdn));
        return parse_gdn_metadata(file.metadata, &trace.gdn);
      });
  REPLAYSSM_RETURN_IF_ERROR(loaded);
  REPLAYSSM_RETURN_IF_ERROR(trace_validate(trace));
  *out = std::move(trace);
  return Status::ok();
}

}  // namespace

int LayerTrace::num_steps() const {
  return visit_kind(kind, [&] { return mamba2.num_steps; }, [&] { return gdn.num_steps; });
}
int LayerTrace::batch() const {
  return visit_kind(kind, [&] { return mamba2.batch; }, [&] { return gdn.batch; });
}
StateDims LayerTrace::dims() const {
  return visit_kind(
      kind, [&] { return state_dims(mamba2.shape); }, [&] { return state_dims(gdn.shape); });
}

Status trace_from_safetensors(const SafetensorsFile& file, LayerTrace* out) {
  if (out == nullptr) return invalid_argument("trace_from_safetensors: out is null");
  // A small file can still describe a huge trace (state0 is zero-filled when absent, and its
  // shape multiplies dimensions of different tensors): report that, never throw.
  try {
    return convert_trace(file, out);
  } catch (const std::bad_alloc&) {
    return {StatusCode::kOutOfMemory, "not enough host memory for the trace's tensors"};
  }
}

Status trace_load(const std::string& path, LayerTrace* out) {
  SafetensorsFile file;
  REPLAYSSM_RETURN_IF_ERROR(safetensors_read(path, &file));
  const Status status = trace_from_safetensors(file, out);
  if (!status.is_ok()) return {status.code(), path + ": " + status.message()};
  return Status::ok();
}

Status trace_validate(const LayerTrace& trace) {
  return visit_kind(
      trace.kind,
      [&] {
        const Mamba2Trace& t = trace.mamba2;
        REPLAYSSM_RETURN_IF_ERROR(validate_tensors(t, mamba2_tensors()));
        if (t.shape.nheads % t.shape.ngroups != 0) {
          return invalid_argument("trace has H = " + std::to_string(t.shape.nheads) +
                                  " heads ('x') and G = " + std::to_string(t.shape.ngroups) +
                                  " groups ('B', 'C'): G must divide H");
        }
        return Status::ok();
      },
      [&] {
        const GdnTrace& t = trace.gdn;
        REPLAYSSM_RETURN_IF_ERROR(validate_tensors(t, gdn_tensors()));
        if (t.shape.num_v_heads % t.shape.num_k_heads != 0) {
          return invalid_argument("trace has Hv = " + std::to_string(t.shape.num_v_heads) +
                                  " value heads ('v') and Hk = " +
                                  std::to_string(t.shape.num_k_heads) +
                                  " key heads ('q', 'k'): Hv must be a multiple of Hk");
        }
        if (!std::isfinite(t.scale) || t.scale < 0.0f) {  // 0 stands for the default K^-1/2
          return invalid_argument("trace scale " + std::to_string(t.scale) +
                                  " must be a finite number > 0");
        }
        return Status::ok();
      });
}

}  // namespace replayssm
