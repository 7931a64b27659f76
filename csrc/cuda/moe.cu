// The two steps of a mixture of experts' block around its experts' GEMMs on the GPU, twins of
// csrc/cpu/moe.cpp's: the (token, choice) pairs sorted by expert, and each token's weighted sum
// of its experts' rows in ascending expert order. The experts' projections between them are
// cuBLAS GEMMs over each expert's rows (layers/moe.py).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <tuple>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace pyserve::cuda {
namespace {

// One CTA: thread e counts expert e's pairs, one thread sums the counts into offsets, then
// thread e walks the pairs in order again and numbers its own: the CPU's counting sort,
// row for row (experts are few, so each thread's pass over the pairs is short).
__global__ void sort_rows_kernel(const int64_t* ids, int64_t pairs, int64_t experts,
                                 int64_t* row_of, int64_t* offsets, int* bad) {
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t count = 0;
    for (int64_t i = 0; i < pairs; ++i) count += ids[i] == e;
    offsets[e + 1] = count;
  }
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t i = 0; i < pairs; ++i)
      if (ids[i] < 0 || ids[i] >= experts) *bad = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t next = offsets[e];
    for (int64_t i = 0; i < pairs; ++i)
      if (ids[i] == e) row_of[i] = next++;
  }
}

// One CTA per token: its k choices ordered by expert (k is small), then each column's sum.
template <typename T>
__global__ void combine_kernel(T* out, const T* y, const int64_t* row_of, const int64_t* ids,
                               const float* weights, int64_t k, int64_t hidden) {
  const int64_t t = blockIdx.x;
  constexpr int kMaxK = 32;
  int order[kMaxK];
  for (int c = 0; c < k; ++c) order[c] = c;
  for (int c = 1; c < k; ++c)  // insertion sort: stable, ascending expert
    for (int j = c; j > 0 && ids[t * k + order[j - 1]] > ids[t * k + order[j]]; --j) {
      const int swap = order[j];
      order[j] = order[j - 1];
      order[j - 1] = swap;
    }
  for (int64_t col = threadIdx.x; col < hidden; col += blockDim.x) {
    float acc = 0.f;
    for (int c = 0; c < k; ++c) {
      const int choice = order[c];
      const float row = static_cast<float>(y[row_of[t * k + choice] * hidden + col]);
      acc = __fadd_rn(acc, __fmul_rn(row, weights[t * k + choice]));
    }
    out[t * hidden + col] = static_cast<T>(acc);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_sort_rows(const at::Tensor& topk_ids, int64_t num_experts) {
  TORCH_CHECK(topk_ids.is_cuda() && topk_ids.dim() == 2 && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(), "moe_sort_rows: topk_ids must be contiguous int64 [T, k] on CUDA");
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor rows = at::empty_like(topk_ids);
  at::Tensor offsets = at::empty({num_experts + 1}, topk_ids.options());
  at::Tensor bad = at::zeros({1}, topk_ids.options().dtype(at::kInt));
  sort_rows_kernel<<<1, 256, 0, stream>>>(topk_ids.data_ptr<int64_t>(), topk_ids.numel(), num_experts,
                                          rows.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                                          bad.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // the caller reads the offsets on the host anyway (its GEMM per expert): check the ids here
  TORCH_CHECK(bad.item<int>() == 0, "moe: an expert id is outside 0..", num_experts - 1);
  return {rows, offsets};
}

void moe_combine(at::Tensor& out, const at::Tensor& y, const at::Tensor& row_of,
                 const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.is_contiguous() && y.is_contiguous() &&
                  y.scalar_type() == out.scalar_type() && y.size(1) == out.size(1),
              "moe_combine: out [T, H] and y [R, H] contiguous, of one dtype");
  TORCH_CHECK(row_of.sizes() == topk_ids.sizes() && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_ids.size(0) == out.size(0) && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.size(1) <= 32 && row_of.is_contiguous() && topk_ids.is_contiguous() &&
                  topk_weights.is_contiguous(),
              "moe_combine: row_of, topk_ids and float32 topk_weights contiguous [T, k], k <= 32");
  const int64_t T = out.size(0), H = out.size(1);
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PYSERVE_DISPATCH_FLOAT_TYPES(out.scalar_type(), "moe_combine_cuda", [&] {
    combine_kernel<scalar_t><<<static_cast<unsigned>(T), 256, 0, stream>>>(
        out.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), row_of.data_ptr<int64_t>(),
        topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), topk_ids.size(1), H);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pyserve::cuda
