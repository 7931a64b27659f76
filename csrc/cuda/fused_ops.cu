// The small fused ops of a decoder layer on the GPU, with vLLM's contracts: RMSNorm (with the
// residual add fused in), rotary embedding in place, and SiLU-and-multiply. Their
// specification is the PyTorch code of pyserve/model/layers/ (norm.py, rotary.py,
// activation.py); the tests hold these kernels to it and to their CPU twins (cpu/fused.cpp).
//
// Each kernel takes one token row per CTA and walks it with 16-byte vectors when the row's
// length, strides and pointers allow (else element by element). Arithmetic is float32; results
// are rounded to the tensor's dtype where the PyTorch code rounds them, so half-precision
// outputs agree with it to the last bit or one.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace pyserve::cuda {
namespace {

// W consecutive elements to and from float32: one 16-byte access when W is the vector width.
// Plain (coherent) loads: fused_add_rms_norm re-reads what it wrote.
template <typename T, int W>
__device__ __forceinline__ void load(const T* p, float* f) {
  if constexpr (W == kVecElems<T>) {
    unpack<T>(*reinterpret_cast<const uint4*>(p), f);
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) f[e] = static_cast<float>(p[e]);
  }
}

template <typename T, int W>
__device__ __forceinline__ void store(T* p, const float* f) {
  if constexpr (W == kVecElems<T>) {
    *reinterpret_cast<uint4*>(p) = pack<T>(f);
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) p[e] = static_cast<T>(f[e]);
  }
}

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)); with `residual`, x = T(input + residual) is
// first stored to residual and the normalised row to out (which may alias input).
template <typename T, int W, bool kAddResidual>
__global__ void rms_norm_kernel(T* out, int64_t out_stride, const T* input, int64_t in_stride,
                                T* residual, int64_t res_stride, const T* weight, int hidden,
                                float eps) {
  __shared__ float scratch[32];
  const T* x = input + blockIdx.x * in_stride;
  T* res = kAddResidual ? residual + blockIdx.x * res_stride : nullptr;
  T* y = out + blockIdx.x * out_stride;
  float sum_sq = 0.f;
  for (int i = threadIdx.x * W; i < hidden; i += blockDim.x * W) {
    float v[W];
    load<T, W>(x + i, v);
    if constexpr (kAddResidual) {
      float r[W];
      load<T, W>(res + i, r);
#pragma unroll
      for (int e = 0; e < W; ++e) v[e] = round_to<T>(v[e] + r[e]);
      store<T, W>(res + i, v);
    }
#pragma unroll
    for (int e = 0; e < W; ++e) sum_sq += v[e] * v[e];
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
  const T* src = kAddResidual ? res : x;  // each thread re-reads only what it read or wrote
  for (int i = threadIdx.x * W; i < hidden; i += blockDim.x * W) {
    float v[W], w[W];
    load<T, W>(src + i, v);
    load<T, W>(weight + i, w);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] = round_to<T>(v[e] * inv_rms) * w[e];
    store<T, W>(y + i, v);
  }
}

// out = T(T(silu(gate)) * up): silu rounded to the dtype first, as F.silu(x) * y rounds.
template <typename T, int W>
__global__ void silu_and_mul_kernel(T* out, int64_t out_stride, const T* input, int64_t in_stride,
                                    int d) {
  const T* gate = input + blockIdx.x * in_stride;
  const T* up = gate + d;
  T* y = out + blockIdx.x * out_stride;
  for (int i = threadIdx.x * W; i < d; i += blockDim.x * W) {
    float g[W], u[W];
    load<T, W>(gate + i, g);
    load<T, W>(up + i, u);
#pragma unroll
    for (int e = 0; e < W; ++e) g[e] = round_to<T>(g[e] / (1.f + expf(-g[e]))) * u[e];
    store<T, W>(y + i, g);
  }
}

// One CTA per token; threads walk the (head, pair) rotations of its query and key heads.
template <typename T, typename C>
__global__ void rotary_kernel(const int64_t* positions, T* query, int64_t q_stride_token,
                              int64_t q_stride_head, int num_q_heads, T* key,
                              int64_t k_stride_token, int64_t k_stride_head, int num_k_heads,
                              const C* cos_sin_cache, int rot_dim, bool is_neox) {
  const int64_t token = blockIdx.x;
  const int half = rot_dim / 2;
  const C* cos_row = cos_sin_cache + positions[token] * rot_dim;
  const C* sin_row = cos_row + half;
  const int pairs = (num_q_heads + num_k_heads) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int head = i / half, j = i % half;
    T* x = head < num_q_heads
               ? query + token * q_stride_token + head * q_stride_head
               : key + token * k_stride_token + (head - num_q_heads) * k_stride_head;
    const int a = is_neox ? j : 2 * j, b = is_neox ? j + half : 2 * j + 1;
    const float c = static_cast<float>(cos_row[j]), s = static_cast<float>(sin_row[j]);
    const float xa = static_cast<float>(x[a]), xb = static_cast<float>(x[b]);
    x[a] = static_cast<T>(xa * c - xb * s);
    x[b] = static_cast<T>(xb * c + xa * s);
  }
}

int threads_for(int64_t items) {
  return static_cast<int>(std::clamp<int64_t>((items + 31) / 32 * 32, 32, 1024));
}

bool vectorizable(std::initializer_list<const at::Tensor*> rows, int64_t length) {
  for (const at::Tensor* t : rows) {
    const int64_t vec = 16 / t->element_size();
    if (length % vec || reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 ||
        (t->dim() > 1 && t->stride(0) % vec))
      return false;
  }
  return true;
}

// [..., n] with the last dimension contiguous -> a [rows, n] view (rows may be strided) or, for
// a tensor no such view describes, nothing.
std::optional<at::Tensor> as_rows(const at::Tensor& t) {
  if (t.dim() == 0 || t.stride(-1) != 1) return std::nullopt;
  if (t.dim() == 1) return t.view({1, t.size(0)});
  if (t.dim() == 2) return t;
  if (t.is_contiguous()) return t.view({-1, t.size(-1)});
  return std::nullopt;
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.device() == b.device(), op, ": all tensors must be on one device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": all tensors must share one dtype");
}

void launch_rms_norm(at::Tensor& out, const at::Tensor& in, at::Tensor* residual,
                     const at::Tensor& weight, double eps) {
  const int64_t rows = in.size(0), hidden = in.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
              "weight must be a contiguous [hidden_size] tensor");
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = residual ? vectorizable({&out, &in, residual, &weight}, hidden)
                            : vectorizable({&out, &in, &weight}, hidden);
  PYSERVE_DISPATCH_FLOAT_TYPES(in.scalar_type(), "rms_norm_cuda", [&] {
    constexpr int V = kVecElems<scalar_t>;
    const int threads = threads_for(vec ? hidden / V : hidden);
    scalar_t* res = residual ? residual->data_ptr<scalar_t>() : nullptr;
    const int64_t res_stride = residual ? residual->stride(0) : 0;
    auto run = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(out.data_ptr<scalar_t>(), out.stride(0),
                                           in.data_ptr<scalar_t>(), in.stride(0), res, res_stride,
                                           weight.data_ptr<scalar_t>(), static_cast<int>(hidden),
                                           static_cast<float>(eps));
    };
    if (residual) {
      vec ? run(rms_norm_kernel<scalar_t, V, true>) : run(rms_norm_kernel<scalar_t, 1, true>);
    } else {
      vec ? run(rms_norm_kernel<scalar_t, V, false>) : run(rms_norm_kernel<scalar_t, 1, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_same(input, out, "rms_norm");
  check_same(input, weight, "rms_norm");
  TORCH_CHECK(out.sizes() == input.sizes() && out.is_contiguous(),
              "rms_norm: out must be contiguous with input's shape");
  const std::optional<at::Tensor> in = as_rows(input);
  const at::Tensor in_rows = in ? *in : input.contiguous().view({-1, input.size(-1)});
  at::Tensor out_rows = out.view({-1, out.size(-1)});
  launch_rms_norm(out_rows, in_rows, nullptr, weight, epsilon);
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  check_same(input, residual, "fused_add_rms_norm");
  check_same(input, weight, "fused_add_rms_norm");
  TORCH_CHECK(input.sizes() == residual.sizes(), "fused_add_rms_norm: input and residual differ in shape");
  std::optional<at::Tensor> in = as_rows(input), res = as_rows(residual);
  TORCH_CHECK(in && res, "fused_add_rms_norm: input and residual must be [..., hidden] rows "
              "contiguous in hidden (2-D, or contiguous)");
  launch_rms_norm(*in, *in, &*res, weight, epsilon);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  check_same(input, out, "silu_and_mul");
  const int64_t d = input.size(-1) / 2;
  TORCH_CHECK(input.size(-1) % 2 == 0, "silu_and_mul: input's last dimension must be even (gate | up)");
  TORCH_CHECK(out.dim() == input.dim() && out.size(-1) == d &&
                  out.sizes().slice(0, out.dim() - 1) == input.sizes().slice(0, input.dim() - 1),
              "silu_and_mul: out must be input's shape with the last dimension halved");
  const std::optional<at::Tensor> in_view = as_rows(input), out_view = as_rows(out);
  TORCH_CHECK(out_view, "silu_and_mul: out must be contiguous in its last dimension (2-D, or contiguous)");
  const at::Tensor in = in_view ? *in_view : input.contiguous().view({-1, input.size(-1)});
  const at::Tensor o = *out_view;
  const int64_t rows = in.size(0);
  if (rows == 0 || d == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The up half starts d elements in: it must be aligned as well.
  const bool vec = vectorizable({&in, &o}, d);
  PYSERVE_DISPATCH_FLOAT_TYPES(input.scalar_type(), "silu_and_mul_cuda", [&] {
    constexpr int V = kVecElems<scalar_t>;
    const int threads = threads_for(vec ? d / V : d);
    auto run = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(o.data_ptr<scalar_t>(), o.stride(0),
                                           in.data_ptr<scalar_t>(), in.stride(0), static_cast<int>(d));
    };
    vec ? run(silu_and_mul_kernel<scalar_t, V>) : run(silu_and_mul_kernel<scalar_t, 1>);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// [num_tokens, heads * head_size] or [num_tokens, heads, head_size] -> (heads, token stride,
// head stride); each head's elements must be contiguous.
struct HeadLayout {
  int heads;
  int64_t stride_token, stride_head;
};

HeadLayout head_layout(const at::Tensor& t, int64_t num_tokens, int64_t head_size, const char* name) {
  TORCH_CHECK(t.size(0) == num_tokens, "rotary_embedding: ", name, " has ", t.size(0),
              " tokens, positions ", num_tokens);
  TORCH_CHECK(t.stride(-1) == 1, "rotary_embedding: ", name, " must be contiguous in head_size");
  if (t.dim() == 2) {
    TORCH_CHECK(t.size(1) % head_size == 0, "rotary_embedding: ", name,
                "'s last dimension is not a multiple of head_size");
    return {static_cast<int>(t.size(1) / head_size), t.stride(0), head_size};
  }
  TORCH_CHECK(t.dim() == 3 && t.size(2) == head_size, "rotary_embedding: ", name,
              " must be [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]");
  return {static_cast<int>(t.size(1)), t.stride(0), t.stride(1)};
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rotary_embedding: positions must be a contiguous int64 tensor");
  TORCH_CHECK(positions.device() == query.device() && cos_sin_cache.device() == query.device(),
              "rotary_embedding: all tensors must be on one device");
  const int64_t num_tokens = positions.numel();
  const int64_t rot_dim = cos_sin_cache.dim() == 2 ? cos_sin_cache.size(1) : 0;
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() && rot_dim % 2 == 0 &&
                  rot_dim > 0 && rot_dim <= head_size,
              "rotary_embedding: cos_sin_cache must be a contiguous [max_position, rot_dim] tensor "
              "with an even rot_dim <= head_size");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat || cos_sin_cache.scalar_type() == query.scalar_type(),
              "rotary_embedding: cos_sin_cache must be float32 or query's dtype");
  const HeadLayout q = head_layout(query, num_tokens, head_size, "query");
  HeadLayout k{0, 0, 0};
  if (key) {
    check_same(query, *key, "rotary_embedding");
    k = head_layout(*key, num_tokens, head_size, "key");
  }
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = threads_for((q.heads + k.heads) * rot_dim / 2);
  PYSERVE_DISPATCH_FLOAT_TYPES(query.scalar_type(), "rotary_embedding_cuda", [&] {
    scalar_t* key_ptr = key ? key->data_ptr<scalar_t>() : nullptr;
    auto run = [&](const auto* cache) {
      rotary_kernel<<<static_cast<unsigned>(num_tokens), threads, 0, stream>>>(
          positions.data_ptr<int64_t>(), query.data_ptr<scalar_t>(), q.stride_token, q.stride_head,
          q.heads, key_ptr, k.stride_token, k.stride_head, k.heads, cache,
          static_cast<int>(rot_dim), is_neox);
    };
    if (cos_sin_cache.scalar_type() == at::kFloat) run(cos_sin_cache.data_ptr<float>());
    else run(cos_sin_cache.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pyserve::cuda
