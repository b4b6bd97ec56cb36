#pragma once
// The stream the CUDA backend launches on. Host-only: tests, benchmarks and an engine include
// this to choose the stream (e.g. one being captured into a CUDA graph).

#include <cuda_runtime.h>

namespace replayssm::cuda {

/// The calling thread's launch stream: its per-thread default stream unless a caller set
/// another with ScopedLaunchStream. The legacy default stream cannot be captured into a CUDA
/// graph; the per-thread one can, and it still orders itself against the synchronous
/// cudaMemcpy/cudaMemset that slot allocation uses (it is a blocking stream).
inline cudaStream_t& launch_stream_ref() {
  static thread_local cudaStream_t stream = cudaStreamPerThread;
  return stream;
}
inline cudaStream_t launch_stream() { return launch_stream_ref(); }

/// Sets the calling thread's launch stream for a scope.
class ScopedLaunchStream {
 public:
  explicit ScopedLaunchStream(cudaStream_t stream) : saved_(launch_stream_ref()) {
    launch_stream_ref() = stream;
  }
  ~ScopedLaunchStream() { launch_stream_ref() = saved_; }
  ScopedLaunchStream(const ScopedLaunchStream&) = delete;
  ScopedLaunchStream& operator=(const ScopedLaunchStream&) = delete;

 private:
  cudaStream_t saved_;
};

}  // namespace replayssm::cuda
