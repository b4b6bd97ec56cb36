// Placeholder until the CUDA state-cache ops land (issue 3): compiles, links, and answers
// kUnsupported so a CUDA cache fails cleanly instead of silently doing nothing.

#include "backend.h"

namespace replayssm::cuda {

Status fold(StateCacheLayout&, const FoldArgs&) {
  return unsupported("state_cache_fold has no CUDA implementation in this build yet");
}
Status commit(StateCacheLayout&, const CommitArgs&) {
  return unsupported("state_cache_commit has no CUDA implementation in this build yet");
}
Status load_state(StateCacheLayout&, int, int, const float*) {
  return unsupported("state_cache_load_state has no CUDA implementation in this build yet");
}
Status export_state(StateCacheLayout&, int, int, float*) {
  return unsupported("state_cache_export_state has no CUDA implementation in this build yet");
}

}  // namespace replayssm::cuda
