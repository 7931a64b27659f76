// CUDA graphs of the decode forward, one per batch-size bucket, owned by the extension: the
// graphs, their shared memory pool and the stream they are captured on live here; Python
// supplies the forward to record (run on static input buffers) and fills those buffers
// before each replay.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace at::cuda {
struct CUDAGraph;
}

namespace pyserve::cuda {

class CudaGraphs {
 public:
  explicit CudaGraphs(int64_t device);
  ~CudaGraphs();
  CudaGraphs(const CudaGraphs&) = delete;
  CudaGraphs& operator=(const CudaGraphs&) = delete;

  // Records forward() as the graph of batch size `size`, on a side stream, into the pool all
  // graphs share (capture the largest size first: smaller graphs then reuse its memory).
  // forward is run once before capture, so lazy initialisations (cuBLAS handles, workspaces)
  // happen outside the graph.
  void capture(int64_t size, const std::function<void()>& forward);
  // Launches the graph of `size` on the current stream: after the copies into the static
  // inputs queued there, before whatever reads the static outputs.
  void replay(int64_t size);
  bool has(int64_t size) const { return graphs_.count(size) != 0; }
  std::vector<int64_t> sizes() const;
  void reset();

 private:
  int64_t device_;
  std::pair<unsigned long long, unsigned long long> pool_;
  std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> graphs_;
};

}  // namespace pyserve::cuda
