// Helpers shared by the CUDA kernels: the dtype dispatch (float32, float16, bfloat16 only, to
// keep instantiations few) and 16-byte vector loads unpacked to float32.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp16.h>

#include <cstdint>

#define PYSERVE_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)               \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                     \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)       \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)        \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace pyserve::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVecElems = 16 / sizeof(T);

__device__ __forceinline__ uint4 load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16 bytes of T -> kVecElems<T> floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float* f);

template <>
__device__ __forceinline__ void unpack<float>(const uint4& v, float* f) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}

template <>
__device__ __forceinline__ void unpack<c10::BFloat16>(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void unpack<c10::Half>(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// kVecElems<T> floats -> 16 bytes of T, each rounded to nearest even as torch rounds.
template <typename T>
__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 v;
  T* out = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < kVecElems<T>; ++i) out[i] = static_cast<T>(f[i]);
  return v;
}

// Sum over the CTA; every thread gets the result. `scratch` holds 32 floats; the CTA's size is
// a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) v += __shfl_xor_sync(kFullMask, v, mask);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : 0.f;
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) v += __shfl_xor_sync(kFullMask, v, mask);
  return v;
}

}  // namespace pyserve::cuda
