// Lets the event loop await a CUDA stream without a thread blocked on it: a host function
// queued on the stream writes to an eventfd when everything before it has run, and the loop
// watches that file descriptor like a socket.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdint>

#include "cuda/ops.h"

namespace pyserve::cuda {
namespace {

void CUDART_CB write_eventfd(void* user_data) {
  // Runs on a CUDA driver thread: no CUDA calls here, only the write.
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(user_data));
  const uint64_t one = 1;
  ssize_t written = ::write(fd, &one, sizeof(one));
  (void)written;  // an eventfd write of 8 bytes only fails on counter overflow
}

}  // namespace

void notify_when_done(int64_t eventfd, int64_t device) {
  auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream.stream(), write_eventfd,
                                    reinterpret_cast<void*>(static_cast<intptr_t>(eventfd))));
}

}  // namespace pyserve::cuda
