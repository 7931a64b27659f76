// Paged KV-cache writes on the GPU: one thread block per token, threads striding over
// (head, element). Same layout and contract as the CPU kernel in csrc/cpu/attention.cpp.
// Only c10's CUDA headers: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers that a
// bare toolkit may lack.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/ops.h"

namespace pyserve::cuda {
namespace {

template <typename scalar_t>
__global__ void reshape_and_cache_kernel(const scalar_t* __restrict__ key,
                                         const scalar_t* __restrict__ value,
                                         scalar_t* __restrict__ key_cache,
                                         scalar_t* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int64_t key_stride, int64_t key_head_stride,
                                         int64_t value_stride, int64_t value_head_stride, int num_heads,
                                         int head_size, int block_size, int64_t cache_block_stride,
                                         int64_t cache_head_stride) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding
  const int64_t block = slot / block_size, offset = slot % block_size;
  for (int i = threadIdx.x; i < num_heads * head_size; i += blockDim.x) {
    const int head = i / head_size, d = i % head_size;
    const int64_t dst = block * cache_block_stride + head * cache_head_stride + offset * head_size + d;
    key_cache[dst] = key[token * key_stride + head * key_head_stride + d];
    value_cache[dst] = value[token * value_stride + head * value_head_stride + d];
  }
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  // key and value may have different strides: k comes out of the rotary embedding, v is a
  // view of the fused qkv projection.
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must both be [num_tokens, num_kv_heads, head_size], contiguous in head_size");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const c10::cuda::CUDAGuard guard(key.device());
  const int num_tokens = key.size(0), num_heads = key.size(1), head_size = key.size(2);
  if (num_tokens == 0) return;
  const int threads = std::min(num_heads * head_size, 512);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache_cuda", [&] {
    reshape_and_cache_kernel<scalar_t><<<num_tokens, threads, 0, stream>>>(
        key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
        value_cache.data_ptr<scalar_t>(), slot_mapping.data_ptr<int64_t>(), key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), num_heads, head_size, key_cache.size(2),
        key_cache.stride(0),
        key_cache.stride(1));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pyserve::cuda
