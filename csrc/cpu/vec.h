// The few float32 SIMD operations the CPU kernels use, on the widest vectors the build
// targets: AVX-512 (16 lanes) or AVX2 + FMA (8 lanes). Without either, PYSERVE_VEC is left
// undefined and the kernels take their plain C++ paths.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PYSERVE_VEC 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYSERVE_VEC 8
#endif

#ifdef PYSERVE_VEC
namespace pyserve::cpu::simd {

constexpr int kLanes = PYSERVE_VEC;

#if PYSERVE_VEC == 16
using vec = __m512;
using ivec = __m512i;
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift into place
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vec load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec load(const c10::Float8_e5m2* p) {
  // float8 e5m2 is the top byte of a float16: widen, shift into place, convert
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
}
inline vec set1(float v) { return _mm512_set1_ps(v); }
inline vec zero() { return _mm512_setzero_ps(); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec round_nearest(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vec v) { return _mm512_reduce_max_ps(v); }
// 2^n for integral n in [-126, 127], built in the exponent field
inline vec pow2i(vec n) {
  ivec e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(e);
}
#else
using vec = __m256;
using ivec = __m256i;
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vec load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vec load(const c10::Float8_e5m2* p) {
  __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
}
inline vec set1(float v) { return _mm256_set1_ps(v); }
inline vec zero() { return _mm256_setzero_ps(); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec min(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec round_nearest(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline vec pow2i(vec n) {
  ivec e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}
#endif

// e^x within about 2 float32 ulps of std::exp for x in [-87, 88]; outside, x is clamped to
// that range (about 1.6e-38 below, 1.7e38 above), which softmax numerators and SiLU's
// 1 / (1 + e^-x) do not notice.
inline vec exp_clamped(vec x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const vec n = round_nearest(mul(x, set1(1.44269504088896341f)));  // x / ln 2
  // r = x - n ln 2 in two steps (Cody-Waite), |r| <= ln2 / 2
  vec r = fma(n, set1(-0.693145751953125f), x);
  r = fma(n, set1(-1.428606765330187045e-06f), r);
  // e^r by its Taylor series to r^7: relative error below 1e-8 on |r| <= 0.347
  vec p = set1(1.f / 5040);
  p = fma(p, r, set1(1.f / 720));
  p = fma(p, r, set1(1.f / 120));
  p = fma(p, r, set1(1.f / 24));
  p = fma(p, r, set1(1.f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.f));
  p = fma(p, r, set1(1.f));
  return mul(p, pow2i(n));
}

}  // namespace pyserve::cpu::simd
#endif
