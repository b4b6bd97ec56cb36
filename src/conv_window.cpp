#include "conv_window.h"

#include <cstring>

#include "backend.h"
#include "common/activation_types.h"
#include "common/causal_conv.h"

namespace replayssm {

namespace {

std::size_t conv_row_bytes(const StateCacheLayout& l) {
  return std::size_t(l.conv_channels()) * dtype_size(l.config.input_dtype);
}

char* conv_row(const StateCacheLayout& l, int layer, int slot, std::uint32_t pos) {
  return static_cast<char*>(l.conv_window) +
         l.conv_record(layer, slot, pos) * std::int64_t(conv_row_bytes(l));
}

// Copies row i of the window before `end` by copy(cache row, i) for i < K - 1.
template <typename Copy>
Status for_conv_window_rows(const StateCacheLayout& l, int layer, int slot, std::uint32_t end,
                            Copy copy) {
  const int K = l.conv_kernel();
  for (int i = 0; i < K - 1; ++i) {
    REPLAYSSM_RETURN_IF_ERROR(copy(conv_row(l, layer, slot, end - std::uint32_t(K - 1 - i)),
                                   std::size_t(i) * conv_row_bytes(l)));
  }
  return Status::ok();
}

Status copy_bytes(Device device, void* dst, const void* src, std::size_t bytes, Stream stream) {
  switch (device) {
    case Device::kCpu: std::memcpy(dst, src, bytes); return Status::ok();
    case Device::kCuda: return cuda::memory_copy(dst, src, bytes, stream);
  }
  return invalid_argument("unknown device");
}

}  // namespace

std::size_t conv_window_bytes(const StateCacheLayout& l) {
  return std::size_t(l.conv_kernel() - 1) * conv_row_bytes(l);
}

Status write_conv_window(StateCacheLayout& l, int layer, int slot, std::uint32_t end,
                         const void* rows, Stream stream) {
  return for_conv_window_rows(l, layer, slot, end, [&](char* cached, std::size_t at) {
    return copy_bytes(l.config.device, cached, static_cast<const char*>(rows) + at,
                      conv_row_bytes(l), stream);
  });
}

Status read_conv_window(const StateCacheLayout& l, int layer, int slot, std::uint32_t end,
                        void* rows, Stream stream) {
  return for_conv_window_rows(l, layer, slot, end, [&](const char* cached, std::size_t at) {
    return copy_bytes(l.config.device, static_cast<char*>(rows) + at, cached, conv_row_bytes(l),
                      stream);
  });
}

namespace cpu {

ConvOutputs conv_outputs(const StateCacheLayout& l, int layer, int batch, int T,
                         const std::int32_t* slot_ids, const ConvInputs& conv) {
  ConvOutputs out;
  const StateDims& d = l.dims;
  const int vec = d.heads * d.rows, key = d.key_heads * d.cols;
  const std::size_t in_bytes = dtype_size(l.config.input_dtype);
  const std::size_t tokens = std::size_t(batch) * std::size_t(T);
  out.vec.assign(tokens * std::size_t(vec) * in_bytes, std::byte{0});
  out.key.assign(tokens * std::size_t(key) * in_bytes, std::byte{0});
  out.query.assign(tokens * std::size_t(key) * in_bytes, std::byte{0});
  with_activation_type(l.config.input_dtype, [&](auto tag) {
    using input_t = decltype(tag);
    // Each part: its first conv channel, its width, its output.
    const struct {
      int first, width;
      input_t* out;
    } parts[] = {{l.conv_vec_channel(), vec, reinterpret_cast<input_t*>(out.vec.data())},
                 {l.conv_key_channel(), key, reinterpret_cast<input_t*>(out.key.data())},
                 {l.conv_query_channel(), key, reinterpret_cast<input_t*>(out.query.data())}};
#pragma omp parallel for schedule(static)
    for (int b = 0; b < batch; ++b) {
      const int slot = slot_ids[b];
      if (slot < 0) continue;
      const std::uint32_t committed = l.committed[slot];
      for (int t = 0; t < T; ++t) {
        const std::int64_t bt = std::int64_t{b} * T + t;
        for (const auto& part : parts) {
          for (int c = 0; c < part.width; ++c) {
            part.out[bt * part.width + c] = conv_output<input_t>(l, conv, layer, slot, b, T,
                                                                 committed, t, part.first + c);
          }
        }
      }
    }
  });
  return out;
}

void append_conv_inputs(StateCacheLayout& l, int layer, int batch, int T,
                        const std::int32_t* slot_ids, const ConvInputs& conv) {
  const std::size_t row_bytes = conv_row_bytes(l);
  const std::int64_t stride = conv_in_stride(conv, l.conv_channels());
  const std::size_t in_bytes = dtype_size(l.config.input_dtype);
  for (int b = 0; b < batch; ++b) {
    const int slot = slot_ids[b];
    if (slot < 0) continue;
    for (int t = 0; t < T; ++t) {
      const auto* src = static_cast<const char*>(conv.in) +
                        (std::int64_t{b} * T + t) * stride * std::int64_t(in_bytes);
      std::memcpy(conv_row(l, layer, slot, l.committed[slot] + std::uint32_t(t)), src, row_bytes);
    }
  }
}

void fork_conv_window(StateCacheLayout& l, const ForkArgs& a) {
  const std::size_t row_bytes = conv_row_bytes(l);
  const int K = l.conv_kernel();
  for (int b = 0; b < a.batch; ++b) {
    const int src = a.src_slots[b], dst = a.dst_slots[b];
    if (src < 0) continue;
    for (int layer = 0; layer < l.config.num_layers; ++layer) {
      for (int i = 1; i < K; ++i) {
        const std::uint32_t pos = a.positions[b] - std::uint32_t(i);
        std::memcpy(conv_row(l, layer, dst, pos), conv_row(l, layer, src, pos), row_bytes);
      }
    }
  }
}

}  // namespace cpu
}  // namespace replayssm
