// The CUDA entry points of the prefix ops (prefix_backend.h) in a build without CUDA. No CUDA
// cache can be created in such a build, so they are never reached with one; each refuses with
// the build's reason, as every other CUDA entry point does (cuda_unavailable.cpp).

#include "backend.h"
#include "prefix_backend.h"

namespace replayssm::cuda {

Status materialize(const StateCacheLayout& l, const MaterializeArgs&, Stream) {
  return can_implement(l.config);
}
Status read_records(const StateCacheLayout& l, int, std::uint32_t, const CacheRecords&, Stream) {
  return can_implement(l.config);
}
Status restore(StateCacheLayout& l, const RestoreArgs&, Stream) { return can_implement(l.config); }
Status fork(StateCacheLayout& l, const ForkArgs&, Stream) { return can_implement(l.config); }
Status truncate(StateCacheLayout& l, const TruncateArgs&, Stream) {
  return can_implement(l.config);
}

}  // namespace replayssm::cuda
