#include "cuda/graphs.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

namespace pyserve::cuda {

CudaGraphs::CudaGraphs(int64_t device) : device_(device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto handle = at::cuda::graph_pool_handle();
  pool_ = {handle.first, handle.second};
}

CudaGraphs::~CudaGraphs() { reset(); }

void CudaGraphs::capture(int64_t size, const std::function<void()>& forward) {
  TORCH_CHECK(size > 0, "CUDA graph batch size must be positive, got ", size);
  TORCH_CHECK(!has(size), "a CUDA graph of batch size ", size, " is already captured");
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
  // Warm-up outside the graph, then capture on a side stream (capture cannot use the legacy
  // default stream); the device is idle on both sides, so no cross-stream ordering is needed.
  forward();
  c10::cuda::device_synchronize();
  auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, static_cast<c10::DeviceIndex>(device_));
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  {
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    graph->capture_begin({pool_.first, pool_.second});
    try {
      forward();
    } catch (...) {
      try {
        graph->capture_end();
      } catch (...) {
      }
      throw;
    }
    graph->capture_end();
  }
  c10::cuda::device_synchronize();
  graphs_.emplace(size, std::move(graph));
}

void CudaGraphs::replay(int64_t size) {
  auto it = graphs_.find(size);
  TORCH_CHECK(it != graphs_.end(), "no CUDA graph of batch size ", size);
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
  it->second->replay();
}

std::vector<int64_t> CudaGraphs::sizes() const {
  std::vector<int64_t> out;
  for (const auto& [size, graph] : graphs_) out.push_back(size);
  return out;
}

void CudaGraphs::reset() {
  for (auto& [size, graph] : graphs_) graph->reset();
  graphs_.clear();
}

}  // namespace pyserve::cuda
