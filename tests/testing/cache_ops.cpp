#include "testing/cache_ops.h"

#include "testing/device_buffer.h"

namespace replayssm::testing {

std::unique_ptr<StateCache> create_cache(const StateCacheConfig& config) {
  std::unique_ptr<StateCache> cache;
  throw_if_error(state_cache_create(config, &cache), "state_cache_create");
  return cache;
}

int allocate_slot(StateCache& cache) {
  int slot = -1;
  throw_if_error(state_cache_allocate_slot(cache, &slot), "state_cache_allocate_slot");
  return slot;
}

Status commit(StateCache& cache, const std::vector<std::int32_t>& slot_ids,
              const std::vector<std::int32_t>& accepted) {
  const Device dev = cache.config().device;
  CacheBuffer s = CacheBuffer::from_vector(dev, slot_ids);
  CacheBuffer a = CacheBuffer::from_vector(dev, accepted);
  CommitArgs args;
  args.batch = static_cast<int>(slot_ids.size());
  args.slot_ids = s.as<const std::int32_t>();
  args.accepted = a.as<const std::int32_t>();
  return state_cache_commit(cache, args);
}

Status fold(StateCache& cache, const std::vector<std::int32_t>& slot_ids) {
  CacheBuffer s = CacheBuffer::from_vector(cache.config().device, slot_ids);
  FoldArgs args;
  args.batch = static_cast<int>(slot_ids.size());
  args.slot_ids = s.as<const std::int32_t>();
  return state_cache_fold(cache, args);
}

Status export_state(StateCache& cache, int layer, int slot, std::vector<float>* out) {
  out->assign(std::size_t(cache.config().dims().state_elems()), 0.0f);
  return state_cache_export_state(cache, layer, slot, out->data());
}

}  // namespace replayssm::testing
