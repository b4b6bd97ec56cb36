// The public decode ops: validate what varies per call, then hand to the cache's backend.

#include "replayssm/ops.h"

#include "backend.h"
#include "conv_window.h"
#include "validate.h"

namespace replayssm {

bool cuda_available() { return cuda::device_present(); }

namespace {

// The layout one decode runs on: the cache's, with the call's fold cadence (ops.h,
// fold_every), so that the release pass, the backends' fold rule and the kernels all see it.
template <typename Args>
StateCacheLayout decode_layout(StateCache& cache, const Args& args) {
  StateCacheLayout l = cache.layout();
  l.fold_every = args.fold_every;
  return l;
}

// Rows whose fold is due stop sharing a checkpoint first (checkpoint_sharing.h).
template <typename Args>
Status release_before_decode(StateCacheLayout& l, const Args& args, Stream stream) {
  return release_checkpoints(l,
                             {.first_layer = args.layer, .num_layers = 1, .batch = args.batch,
                              .slot_ids = args.slot_ids, .why = ReleaseFor::kFold,
                              .num_tokens = args.num_tokens},
                             stream);
}

// A CPU decode on a conv cache: the window convolved on the host into the inputs the decode
// takes, the decode, then the window's pre-conv inputs into the conv ring (the CUDA kernels do
// all three in their one launch).
template <typename Args, typename Decode>
void cpu_decode(StateCacheLayout& l, const Args& args, Decode decode) {
  if (args.conv.in == nullptr) {
    decode(args, nullptr);
    return;
  }
  const cpu::ConvOutputs convolved =
      cpu::conv_outputs(l, args.layer, args.batch, args.num_tokens, args.slot_ids, args.conv);
  Args plain = args;
  plain.conv = {};
  decode(plain, &convolved);
  cpu::append_conv_inputs(l, args.layer, args.batch, args.num_tokens, args.slot_ids, args.conv);
}

}  // namespace

Status mamba2_decode(StateCache& cache, const Mamba2DecodeArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_mamba2_decode(cache, args));
  if (args.batch == 0) return Status::ok();
  StateCacheLayout l = decode_layout(cache, args);
  REPLAYSSM_RETURN_IF_ERROR(release_before_decode(l, args, stream));
  switch (cache.config().device) {
    case Device::kCpu:
      cpu_decode(l, args, [&](Mamba2DecodeArgs a, const cpu::ConvOutputs* in) {
        if (in != nullptr) a.x = in->vec.data(), a.B = in->key.data(), a.C = in->query.data();
        cpu::mamba2_decode(l, a);
      });
      return Status::ok();
    case Device::kCuda: return cuda::mamba2_decode(l, args, stream);
  }
  return invalid_argument("unknown device");
}

Status gdn_decode(StateCache& cache, const GdnDecodeArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_gdn_decode(cache, args));
  if (args.batch == 0) return Status::ok();
  StateCacheLayout l = decode_layout(cache, args);
  REPLAYSSM_RETURN_IF_ERROR(release_before_decode(l, args, stream));
  switch (cache.config().device) {
    case Device::kCpu:
      cpu_decode(l, args, [&](GdnDecodeArgs a, const cpu::ConvOutputs* in) {
        if (in != nullptr) a.q = in->query.data(), a.k = in->key.data(), a.v = in->vec.data();
        cpu::gdn_decode(l, a);
      });
      return Status::ok();
    case Device::kCuda: return cuda::gdn_decode(l, args, stream);
  }
  return invalid_argument("unknown device");
}

}  // namespace replayssm
