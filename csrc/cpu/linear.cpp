// Linear layers on the CPU: out[M, N] = x[M, K] · w[N, K]ᵀ (+ bias), x and out float32, w
// float32 or bfloat16 (half the bytes to read; widened in registers, float32 accumulation).
//
// The weight is repacked once, at load, into panels of kPanel = 32 output columns laid out
// k-major ([N / 32][K][32]): the kernel then reads each panel as one contiguous stream and
// computes an outer-product tile, MR rows of x × 32 columns, where each weight vector loaded
// feeds MR FMAs and each broadcast x value feeds 32 / lanes. That keeps a decode step's
// few rows at the memory bandwidth and a prefill's many rows near the FMA peak, where
// BLAS on the unpacked weight managed about a third of either at 8 to 64 rows.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "cpu/ops.h"

#include "cpu/vec.h"

namespace pyserve::cpu {
namespace {

constexpr int64_t kPanel = 32;

#ifdef PYSERVE_VEC
using namespace simd;
// AVX-512: 24 accumulators + 2 weight vectors + 1 broadcast of 32 zmm; AVX2: 12 of 16 ymm
constexpr int kMaxRows = PYSERVE_VEC == 16 ? 12 : 3;
#endif

#ifdef PYSERVE_VEC
constexpr int kVecs = kPanel / PYSERVE_VEC;
// A memory stream needs more misses in flight than one core's hardware prefetcher keeps:
// ask for the panel this far ahead (only the first row tile pays DRAM; later ones hit cache).
constexpr int64_t kPrefetchBytes = 2048;

// out[MR, 32] = x[MR, K] · panel[K, 32]; `cols` of the 32 columns are stored.
template <int MR, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* out, int64_t ldo,
                 int64_t cols, const float* bias) {
  vec acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = zero();
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchBytes;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t line = 0; line < kPanel * int64_t(sizeof(W)); line += 64)
      _mm_prefetch(ahead + k * kPanel * sizeof(W) + line, _MM_HINT_T0);
    vec w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = load(panel + k * kPanel + v * PYSERVE_VEC);
    for (int m = 0; m < MR; ++m) {
      const vec xb = set1(x[m * ldx + k]);
      for (int v = 0; v < kVecs; ++v) acc[m][v] = fma(xb, w[v], acc[m][v]);
    }
  }
  alignas(64) float row[kPanel];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kVecs; ++v) store(row + v * PYSERVE_VEC, acc[m][v]);
    float* o = out + m * ldo;
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) o[c] = row[c] + bias[c];
    else
      std::memcpy(o, row, cols * sizeof(float));
  }
}

template <typename W, int... R>
inline void tile_rows(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx,
                      const W* panel, int64_t K, float* out, int64_t ldo, int64_t cols,
                      const float* bias) {
  ((rows == R + 1 ? tile<R + 1>(x, ldx, panel, K, out, ldo, cols, bias) : void()), ...);
}
#else
// no SIMD: the same tile, written plainly
constexpr int kMaxRows = 4;
template <typename W>
void tile_plain(int rows, const float* x, int64_t ldx, const W* panel, int64_t K, float* out,
                int64_t ldo, int64_t cols, const float* bias) {
  for (int m = 0; m < rows; ++m) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kPanel; ++c)
        acc[c] += x[m * ldx + k] * static_cast<float>(panel[k * kPanel + c]);
    for (int64_t c = 0; c < cols; ++c) out[m * ldo + c] = acc[c] + (bias ? bias[c] : 0.f);
  }
}
#endif

template <typename W>
void packed_linear_impl(const float* x, const W* packed, const float* bias, float* out, int64_t M,
                        int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Rows are taken in chunks whose x (chunk × K float32) stays in a core's L2 while every
  // panel passes over it; within a chunk each panel meets the rows kMaxRows at a time.
  const int64_t chunk = std::max<int64_t>(kMaxRows, (256 * 1024 / (K * 4)) / kMaxRows * kMaxRows);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = packed + p * K * kPanel;
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        const float* b = bias ? bias + n0 : nullptr;
        for (int64_t m = m0; m < m1; m += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
#ifdef PYSERVE_VEC
          tile_rows(rows, std::make_integer_sequence<int, kMaxRows>{}, x + m * K, K, panel, K,
                    out + m * N + n0, N, cols, b);
#else
          tile_plain(rows, x + m * K, K, panel, K, out + m * N + n0, N, cols, b);
#endif
        }
      }
    });
  }
}

template <typename W>
void pack_impl(const W* w, W* packed, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < kPanel; ++c) {
          const int64_t n = p * kPanel + c;
          packed[(p * K + k) * kPanel + c] = n < N ? w[n * K + k] : W(0.f);
        }
  });
}

template <typename W>
void unpack_impl(const W* packed, float* w, int64_t N, int64_t K) {
  // 16 k at a time: a 2 KB block of the panel is read once and every output row gets one
  // whole cache line of it
  constexpr int64_t kStep = 16;
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + p * K * kPanel;
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t k0 = 0; k0 < K; k0 += kStep) {
        const int64_t k1 = std::min(K, k0 + kStep);
        for (int64_t c = 0; c < cols; ++c) {
          float* dst = w + (p * kPanel + c) * K;
          for (int64_t k = k0; k < k1; ++k) dst[k] = static_cast<float>(panel[k * kPanel + c]);
        }
      }
    }
  });
}

}  // namespace

at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  (N + kPanel - 1) / kPanel == packed.size(0),
              "unpack_linear_weight: a weight from pack_linear_weight with N rows expected");
  const int64_t K = packed.size(1);
  at::Tensor w = at::empty({N, K}, packed.options().dtype(at::kFloat));
  if (packed.scalar_type() == at::kBFloat16)
    unpack_impl(packed.data_ptr<c10::BFloat16>(), w.data_ptr<float>(), N, K);
  else
    unpack_impl(packed.data_ptr<float>(), w.data_ptr<float>(), N, K);
  return w;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear_weight: a CPU [N, K] weight expected");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight: weight must be float32 or bfloat16");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::empty({(N + kPanel - 1) / kPanel, K, kPanel}, w.options());
  if (w.scalar_type() == at::kBFloat16)
    pack_impl(w.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), N, K);
  else
    pack_impl(w.data_ptr<float>(), packed.data_ptr<float>(), N, K);
  return packed;
}

void packed_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel,
              "packed_linear: x [M, K], out [M, N] and a weight from pack_linear_weight expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "packed_linear: x and out must be float32");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && packed.is_contiguous(),
              "packed_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(packed.size(1) == K, "packed_linear: x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(out.size(0) == M && (N + kPanel - 1) / kPanel == packed.size(0),
              "packed_linear: out must be [M, N] with N within the packed weight's panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "packed_linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  if (packed.scalar_type() == at::kBFloat16) {
    packed_linear_impl(x.data_ptr<float>(), packed.data_ptr<c10::BFloat16>(), b, out.data_ptr<float>(),
                       M, N, K);
  } else {
    TORCH_CHECK(packed.scalar_type() == at::kFloat, "packed_linear: weight must be float32 or bfloat16");
    packed_linear_impl(x.data_ptr<float>(), packed.data_ptr<float>(), b, out.data_ptr<float>(), M, N, K);
  }
}

}  // namespace pyserve::cpu
