#pragma once
// Checks shared by the CUDA decode tests (test_mamba2_cuda.cpp, test_gdn_cuda.cpp), generic in
// the family's call type: header-only, so that the helper library needs no CUDA runtime.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/require_gpu.h"
#include "testing/test_util.h"

namespace replayssm::testing {

/// A whole decode step (every layer's call and the commit of `accepted`) issued `steps` times
/// on a stream to `direct`, and captured once into a CUDA graph on `graphed` (a cache of the
/// same config and slots) and replayed `steps` times: the two caches must end with the same
/// bytes and every layer's call the same output bytes. decode(cache, call, stream) runs one call;
/// output_bytes(call) is its output buffer's bytes.
template <typename Call, typename Decode, typename OutputBytes>
void expect_graph_matches_stream(StateCache& direct, StateCache& graphed,
                                 const std::vector<std::int32_t>& slots,
                                 const std::vector<std::int32_t>& accepted,
                                 const std::vector<Call>& direct_calls,
                                 const std::vector<Call>& graph_calls, int steps, Decode decode,
                                 OutputBytes output_bytes) {
  const StateCacheConfig& cfg = graphed.config();
  CacheBuffer slot_buf = CacheBuffer::from_vector(Device::kCuda, slots);
  CacheBuffer accepted_buf = CacheBuffer::from_vector(Device::kCuda, accepted);
  CommitArgs commit;
  commit.batch = int(slots.size());
  commit.slot_ids = slot_buf.as<const std::int32_t>();
  commit.accepted = accepted_buf.as<const std::int32_t>();

  for (int step = 0; step < steps; ++step) {
    for (const Call& c : direct_calls) ASSERT_TRUE(decode(direct, c, kDefaultStream).is_ok());
    ASSERT_TRUE(state_cache_commit(direct, commit).is_ok());
  }

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // The caches' set-up ran on the default stream, which a non-blocking stream does not wait for.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  for (const Call& c : graph_calls) {
    const Status st = decode(graphed, c, stream);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  ASSERT_TRUE(state_cache_commit(graphed, commit, stream).is_ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int step = 0; step < steps; ++step) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_GT(cursor_committed(graphed, slots[0]), std::uint32_t(cfg.buffer_len));
  EXPECT_EQ(diff(snapshot(graphed), snapshot(direct)), "");
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    EXPECT_EQ(output_bytes(graph_calls[layer]), output_bytes(direct_calls[layer]));
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

/// A verify that commits nothing: the decode call make_call() returns (layer and tokens fixed
/// by the caller), then a commit of 0 for every slot, twice. The checkpoint buffers and cursors
/// must stay bit-identical to what they were before, and the second verify's outputs must be
/// bit-identical to the first's.
template <typename MakeCall, typename Decode, typename OutputBytes>
void expect_verify_commits_nothing(StateCache& cache, const std::vector<std::int32_t>& slots,
                                   MakeCall make_call, Decode decode, OutputBytes output_bytes) {
  const std::vector<std::string> ckpt = {"ckpt_hi", "ckpt_lo", "ckpt_lo_scale", "folded",
                                         "committed"};
  const CacheBytes before = snapshot(cache, ckpt);
  const std::vector<std::int32_t> none(slots.size(), 0);
  std::vector<std::uint8_t> first;
  for (int rep = 0; rep < 2; ++rep) {
    const auto call = make_call();
    ASSERT_TRUE(decode(cache, call).is_ok());
    ASSERT_TRUE(commit(cache, slots, none).is_ok());
    EXPECT_EQ(diff(snapshot(cache, ckpt), before), "");
    // The same window verified again gives bit-identical outputs.
    if (rep == 0) {
      first = output_bytes(call);
    } else {
      EXPECT_EQ(output_bytes(call), first);
    }
  }
}

}  // namespace replayssm::testing
