// Collectives among the tensor-parallel ranks on CUDA devices, through NCCL, on the current
// stream (so they can be captured in CUDA graphs). The same interface as ShmCommunicator;
// NCCL's types stay inside the .cu file so that this header compiles without NCCL's.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

struct ncclComm;  // NCCL's opaque communicator

namespace pyserve::cuda {

// A fresh NCCL unique id (128 bytes); rank 0 makes one and hands it to the workers at spawn.
std::string nccl_unique_id();

class NcclCommunicator {
 public:
  NcclCommunicator(const std::string& unique_id, int64_t rank, int64_t world_size);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  void all_reduce(torch::Tensor& tensor);
  torch::Tensor all_gather(const torch::Tensor& tensor);            // -> [world, *shape]
  torch::Tensor gather(const torch::Tensor& tensor, int64_t root);  // root: [world, *shape]
  void broadcast(torch::Tensor& tensor, int64_t root);
  void abort();

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }

 private:
  ::ncclComm* handle() const;
  void* comm_ = nullptr;  // ncclComm_t
  int64_t rank_;
  int64_t world_size_;
};

}  // namespace pyserve::cuda
