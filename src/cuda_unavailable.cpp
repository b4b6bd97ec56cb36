// The CUDA backend's entry points (backend.h) in a build without CUDA: each refuses with one
// message, so that device-agnostic code calls them without #if.

#include "backend.h"

namespace replayssm::cuda {

namespace {
Status no_cuda() {
  return unsupported("this build of replayssm has no CUDA backend (configure with nvcc "
                     "available and REPLAYSSM_ENABLE_CUDA=ON)");
}
}  // namespace

bool device_present() { return false; }
Status can_implement(const StateCacheConfig&) { return no_cuda(); }
Status memory_alloc(std::size_t, void**) { return no_cuda(); }
void memory_free(void*) {}
Status memory_zero_2d(void*, std::size_t, std::size_t, std::size_t, Stream) { return no_cuda(); }
Status memory_set_byte(void*, std::uint8_t, Stream) { return no_cuda(); }
Status memory_copy(void*, const void*, std::size_t, Stream) { return no_cuda(); }
Status memory_check_usable(const void*, const char*) { return no_cuda(); }
Status mamba2_decode(StateCacheLayout&, const Mamba2DecodeArgs&, Stream) { return no_cuda(); }
Status gdn_decode(StateCacheLayout&, const GdnDecodeArgs&, Stream) { return no_cuda(); }
Status fold(StateCacheLayout&, const FoldArgs&, Stream) { return no_cuda(); }
Status commit(StateCacheLayout&, const CommitArgs&, Stream) { return no_cuda(); }
Status load_state(StateCacheLayout&, int, int, const float*, Stream) { return no_cuda(); }
Status export_state(StateCacheLayout&, int, int, float*, Stream) { return no_cuda(); }
Status release_checkpoints(StateCacheLayout&, const ReleaseArgs&, Stream) { return no_cuda(); }

}  // namespace replayssm::cuda
