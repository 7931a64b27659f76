// Linear layers for the few rows of a decode step on the CPU: out[M, N] = x[M, K] · w[N, K]ᵀ
// (+ bias). At small M the time is the read of w, so each thread streams its share of w's
// rows exactly once; w may be float32 or bfloat16 (half the bytes, widened to float32 in
// registers; products and sums stay float32). Rows of x meet rows of w in tiles of at least
// 8 AVX2 accumulators (see tile), so each weight load feeds several FMAs.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstring>

#include "cpu/ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYSERVE_AVX2 1
#endif

namespace pyserve::cpu {
namespace {

#ifdef PYSERVE_AVX2
constexpr int kPrefetchBytes = 4096;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift into place
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// Dot products of MB rows of x with NB consecutive weight rows. Each (row, weight row) pair
// keeps KU accumulators over interleaved k, so that at least 8 independent FMA chains hide
// the FMA latency even when MB = 1.
template <int MB, int NB, int KU, typename W>
void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo) {
  int64_t k = 0;
  float sums[MB][NB] = {};
#ifdef PYSERVE_AVX2
  __m256 acc[KU][MB][NB];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[u][m][j] = _mm256_setzero_ps();
  for (; k + 8 * KU <= K; k += 8 * KU) {
    // one core keeps too few misses in flight for the hardware prefetcher alone to reach the
    // memory bandwidth; ask for the weights 4 KiB ahead (past this row: the next)
    for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k) + kPrefetchBytes, _MM_HINT_T0);
    for (int u = 0; u < KU; ++u) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load8(w + j * K + k + 8 * u);
      for (int m = 0; m < MB; ++m) {
        __m256 xv = _mm256_loadu_ps(x + m * ldx + k + 8 * u);
        for (int j = 0; j < NB; ++j) acc[u][m][j] = _mm256_fmadd_ps(xv, wv[j], acc[u][m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      __m256 total = acc[0][m][j];
      for (int u = 1; u < KU; ++u) total = _mm256_add_ps(total, acc[u][m][j]);
      sums[m][j] = hsum(total);
    }
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) sums[m][j] += x[m * ldx + k] * static_cast<float>(w[j * K + k]);
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) out[m * ldo + j] = sums[m][j];
}

// Weight rows n0 .. n1 against MB rows of x: NB rows at a time, then the remainder singly.
template <int MB, int NB, int KU, typename W>
void rows(const float* x, int64_t ldx, const W* w, int64_t K, int64_t n0, int64_t n1, float* out,
          int64_t ldo) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile<MB, NB, KU>(x, ldx, w + n * K, K, out + n, ldo);
  for (; n < n1; ++n) tile<MB, 1, 2>(x, ldx, w + n * K, K, out + n, ldo);
}

template <typename W>
void linear_impl(const float* x, const W* w, const float* bias, float* out, int64_t M, int64_t N,
                 int64_t K) {
  // 16 weight rows per task: 18 KB of a 576-wide bf16 matrix, enough to amortize scheduling
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 4) {
      const float* xm = x + m * K;
      float* om = out + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 4: rows<4, 2, 1>(xm, K, w, K, n0, n1, om, N); break;
        case 3: rows<3, 2, 1>(xm, K, w, K, n0, n1, om, N); break;
        case 2: rows<2, 2, 2>(xm, K, w, K, n0, n1, om, N); break;
        default: rows<1, 1, 4>(xm, K, w, K, n0, n1, om, N); break;
      }
      if (bias != nullptr)
        for (int64_t r = m; r < std::min<int64_t>(m + 4, M); ++r)
          for (int64_t n = n0; n < n1; ++n) out[r * N + n] += bias[n];
    }
  });
}

}  // namespace

void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "linear: x and out must be float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "linear: out must be [M, N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  if (weight.scalar_type() == at::kBFloat16) {
    linear_impl(x.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), b, out.data_ptr<float>(), M, N, K);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "linear: weight must be float32 or bfloat16");
    linear_impl(x.data_ptr<float>(), weight.data_ptr<float>(), b, out.data_ptr<float>(), M, N, K);
  }
}

}  // namespace pyserve::cpu
