#include "cuda/nccl_communicator.h"

#include <cstring>
#include <stdexcept>

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

namespace pyserve::cuda {

namespace {

void check(ncclResult_t result, const char* what) {
  if (result != ncclSuccess)
    throw std::runtime_error(std::string("NCCL ") + what + ": " + ncclGetErrorString(result));
}

ncclDataType_t nccl_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    default: throw std::runtime_error("NCCL: unsupported dtype " + std::string(c10::toString(type)));
  }
}

void check_tensor(const torch::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "NcclCommunicator.", op, ": undefined tensor");
  TORCH_CHECK(t.is_cuda(), "NcclCommunicator.", op, ": tensor must be on a CUDA device");
  TORCH_CHECK(t.is_contiguous(), "NcclCommunicator.", op, ": tensor must be contiguous");
}

}  // namespace

ncclComm_t NcclCommunicator::handle() const {
  TORCH_CHECK(comm_ != nullptr, "NCCL communicator was aborted: a tensor-parallel rank is gone");
  return static_cast<ncclComm_t>(comm_);
}

std::string nccl_unique_id() {
  ncclUniqueId id;
  check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int64_t rank, int64_t world_size)
    : rank_(rank), world_size_(world_size) {
  TORCH_CHECK(unique_id.size() == sizeof(ncclUniqueId), "NCCL unique id must be ",
              sizeof(ncclUniqueId), " bytes");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclComm_t comm;
  check(ncclCommInitRank(&comm, static_cast<int>(world_size), id, static_cast<int>(rank)),
        "ncclCommInitRank");
  comm_ = comm;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

void NcclCommunicator::all_reduce(torch::Tensor& tensor) {
  check_tensor(tensor, "all_reduce");
  auto stream = c10::cuda::getCurrentCUDAStream(tensor.device().index());
  check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                      nccl_type(tensor.scalar_type()), ncclSum, handle(),
                      stream.stream()),
        "ncclAllReduce");
}

torch::Tensor NcclCommunicator::all_gather(const torch::Tensor& tensor) {
  check_tensor(tensor, "all_gather");
  std::vector<int64_t> shape{world_size_};
  for (auto d : tensor.sizes()) shape.push_back(d);
  auto out = torch::empty(shape, tensor.options());
  auto stream = c10::cuda::getCurrentCUDAStream(tensor.device().index());
  check(ncclAllGather(tensor.data_ptr(), out.data_ptr(), tensor.numel(),
                      nccl_type(tensor.scalar_type()), handle(), stream.stream()),
        "ncclAllGather");
  return out;
}

torch::Tensor NcclCommunicator::gather(const torch::Tensor& tensor, int64_t root) {
  // NCCL has no gather; an all-gather costs the same on NVLink and keeps one code path.
  auto all = all_gather(tensor);
  return rank_ == root ? all : torch::empty({0}, tensor.options());
}

void NcclCommunicator::broadcast(torch::Tensor& tensor, int64_t root) {
  check_tensor(tensor, "broadcast");
  auto stream = c10::cuda::getCurrentCUDAStream(tensor.device().index());
  check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                      nccl_type(tensor.scalar_type()), static_cast<int>(root),
                      handle(), stream.stream()),
        "ncclBroadcast");
}

void NcclCommunicator::abort() {
  if (comm_ != nullptr) {
    ncclCommAbort(static_cast<ncclComm_t>(comm_));
    comm_ = nullptr;
  }
}

}  // namespace pyserve::cuda
