// Float32 GEMMs on AMX tiles as three bfloat16 products ("bf16x3", what torch's "high"
// float32 matmul precision permits): each float32 a is split into hi = bf16(a) and lo =
// bf16(a - hi), so a ≈ hi + lo to about 16 significant bits, and
//   a · w ≈ hi_a · hi_w + hi_a · lo_w + lo_a · hi_w,
// the dropped lo_a · lo_w and the splits' remainders leaving a relative error of a few 1e-6
// (float32's own GEMMs: a few 1e-7). Accumulation is float32 in the tiles. On two Sapphire
// Rapids-class cores this ran 830-900 GFLOP/s of float32 work from 256 rows (MKL's float32
// GEMM: 320-390; our packed float32 panels: 300-370), and beat both from 32 rows (at 16 rows
// in three of MiniLM's four shapes: 384-413 against 268-281 GFLOP/s; 384 x 384: 199 against
// 249). Rows are padded to 32 with zeros, so a step of a few rows pays for 32.
//
// Not IEEE in one corner: an infinite operand (or a finite one that rounds to infinity in
// bfloat16, |a| > 3.39e38) gives NaN where a float32 GEMM gives ±inf (its lo is inf - inf,
// and inf · 0 is NaN in the tiles); a model whose hidden states overflow float32 is broken
// either way.
//
// Layout of a packed weight [N, K] (N and K multiples of 32): for each block of 32 output
// columns, for each block of 32 k, four AMX B tiles of 16 k-pairs × 16 columns × 2 (the
// pair along k, the operand order of tdpbf16ps): hi for columns 0-15, hi for 16-31, lo for
// 0-15, lo for 16-31; 2,048 bfloat16 = 4 KiB a (column block, k block).
#include "cpu/ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PYSERVE_BF16X3 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu/vec.h"
#endif

namespace pyserve::cpu {
namespace {

// what the epilogue applies to each output after the bias (an encoder's up projection)
enum class Activation { kNone, kGelu, kGeluTanh, kRelu };

Activation activation_named(const std::string& name) {
  if (name == "none") return Activation::kNone;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK(name == "relu", "bf16x3_linear: activation must be none, gelu, gelu_tanh or relu, not ", name);
  return Activation::kRelu;
}

constexpr int64_t kBlock = 32;  // rows, columns and k of one step of the kernel
constexpr int64_t kTileElems = 512;  // bfloat16 in one B tile
constexpr int64_t kBlockElems = 4 * kTileElems;  // a (column block, k block): 4 B tiles
constexpr int64_t kRowBlocksPerPanel = 4;  // row blocks that share one column block's panel in L2

uint16_t bf16_bits(float v) {  // round to nearest even, as the AVX-512 conversion does
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>(bits >> 16 | ((bits & 0xffff) ? 0x40 : 0));
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

#ifdef PYSERVE_BF16X3
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: the float32 accumulators of a 32 × 32 block (16 × 16 each); 4, 5: two A tiles
// (16 rows × 32 k); 6, 7: two B tiles (16 k-pairs × 16 columns × 2)
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] (row stride ldx) -> hi, lo [Mpad, K] bfloat16, rows from M zero
void split_rows(const float* x, int64_t ldx, int64_t M, int64_t Mpad, int64_t K, uint16_t* hi,
                uint16_t* lo) {
  at::parallel_for(0, Mpad, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* h = hi + r * K;
      uint16_t* l = lo + r * K;
      if (r >= M) {
        std::memset(h, 0, K * 2);
        std::memset(l, 0, K * 2);
        continue;
      }
      const float* xr = x + r * ldx;
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_loadu_ps(xr + k);
        const __m256bh vh = _mm512_cvtneps_pbh(v);
        const __m512 back = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(vh)), 16));
        const __m256bh vl = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + k), reinterpret_cast<__m256i>(vh));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + k), reinterpret_cast<__m256i>(vl));
      }
    }
  });
}

// tiles 0-3 += A tiles 4, 5 (rows 0-15, 16-31) × B tiles 6, 7 (columns 0-15, 16-31)
inline void accumulate_2x2() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// c (row stride ldc) = the 32 × 32 block of rows a_hi / a_lo (row stride K) against the
// column block's panel w
inline void block_product(const uint16_t* a_hi, const uint16_t* a_lo, const uint16_t* w,
                          int64_t K, float* c, int64_t ldc) {
  const int64_t lda = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += kBlock, w += kBlockElems) {
    _tile_loadd(4, a_hi + k, lda);
    _tile_loadd(5, a_hi + 16 * K + k, lda);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kTileElems, 64);
    accumulate_2x2();
    _tile_loadd(4, a_lo + k, lda);  // lo_a · hi_w
    _tile_loadd(5, a_lo + 16 * K + k, lda);
    accumulate_2x2();
    _tile_loadd(4, a_hi + k, lda);  // hi_a · lo_w
    _tile_loadd(5, a_hi + 16 * K + k, lda);
    _tile_loadd(6, w + 2 * kTileElems, 64);
    _tile_loadd(7, w + 3 * kTileElems, 64);
    accumulate_2x2();
  }
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  _tile_stored(2, c + 16 * ldc, ldc * 4);
  _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}
// erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), the formula of
// PyTorch's vectorized erf, which its CPU GELU uses: 1 - t (p1 + t (p2 + ... p5)) e^(-x^2),
// t = 1 / (1 + p |x|), the sign put back
inline __m512 erf_approx(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 t = _mm512_div_ps(simd::set1(1.f), simd::fma(simd::set1(0.3275911f), ax, simd::set1(1.f)));
  __m512 r = simd::fma(simd::set1(1.061405429f), t, simd::set1(-1.453152027f));
  r = simd::fma(r, t, simd::set1(1.421413741f));
  r = simd::fma(r, t, simd::set1(-0.284496736f));
  r = simd::fma(r, t, simd::set1(0.254829592f));
  const __m512 e = simd::exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(x, x)));
  const __m512 y = _mm512_sub_ps(simd::set1(1.f), _mm512_mul_ps(_mm512_mul_ps(r, t), e));
  return _mm512_or_ps(y, _mm512_and_ps(x, simd::set1(-0.f)));
}

inline __m512 activate(Activation act, __m512 x) {
  const __m512 half_x = _mm512_mul_ps(x, simd::set1(0.5f));
  switch (act) {
    case Activation::kGelu:  // x/2 (1 + erf(x / sqrt 2))
      return _mm512_mul_ps(half_x, _mm512_add_ps(simd::set1(1.f),
                                                 erf_approx(_mm512_mul_ps(x, simd::set1(0.70710678118654752f)))));
    case Activation::kGeluTanh: {  // x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); tanh(u) = 1 - 2 / (e^2u + 1)
      const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 u = _mm512_mul_ps(simd::set1(0.79788456080286536f), simd::fma(simd::set1(0.044715f), x3, x));
      const __m512 e = simd::exp_clamped(_mm512_add_ps(u, u));
      const __m512 th = _mm512_sub_ps(simd::set1(1.f), _mm512_div_ps(simd::set1(2.f), _mm512_add_ps(e, simd::set1(1.f))));
      return _mm512_mul_ps(half_x, _mm512_add_ps(simd::set1(1.f), th));
    }
    case Activation::kRelu:
      return _mm512_max_ps(x, _mm512_setzero_ps());
    default:
      return x;
  }
}
#endif

}  // namespace

bool bf16x3_supported() {
#ifdef PYSERVE_BF16X3
  // Linux hands out AMX's tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA), once
  // for the whole process
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
#else
  return false;
#endif
}

at::Tensor pack_bf16x3_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_bf16x3_weight: weight must be a float32 [N, K] CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kBlock == 0 && K % kBlock == 0,
              "pack_bf16x3_weight: N and K must be multiples of 32, got ", N, " and ", K);
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  at::Tensor packed = at::empty({N / kBlock * (K / kBlock) * kBlockElems}, weight.options().dtype(at::kBFloat16));
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      for (int64_t kb = 0; kb < K / kBlock; ++kb) {
        uint16_t* tiles = dst + (nb * (K / kBlock) + kb) * kBlockElems;
        for (int64_t half = 0; half < 2; ++half) {
          for (int64_t pair = 0; pair < 16; ++pair) {
            for (int64_t col = 0; col < 16; ++col) {
              for (int64_t p = 0; p < 2; ++p) {
                const float v = src[(nb * kBlock + half * 16 + col) * K + kb * kBlock + 2 * pair + p];
                const uint16_t hi = bf16_bits(v);
                const int64_t at = pair * 32 + col * 2 + p;
                tiles[half * kTileElems + at] = hi;
                tiles[(2 + half) * kTileElems + at] = bf16_bits(v - from_bf16(hi));
              }
            }
          }
        }
      }
    }
  });
  return packed;
}

at::Tensor bf16x3_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias, const std::string& activation) {
  const Activation act = activation_named(activation);
  TORCH_CHECK(bf16x3_supported(), "bf16x3_linear: this CPU (or build) has no AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "bf16x3_linear: x must be a float32 [M, K] tensor with unit column stride");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0 && N % kBlock == 0 && packed.numel() == N * K * 2,
              "bf16x3_linear: the packed weight is not [", N, ", ", K, "]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "bf16x3_linear: bias must be a contiguous float32 [N]");
#ifdef PYSERVE_BF16X3
  const int64_t Mpad = (M + kBlock - 1) / kBlock * kBlock;
  const auto bf16 = x.options().dtype(at::kBFloat16);
  at::Tensor hi = at::empty({Mpad, K}, bf16), lo = at::empty({Mpad, K}, bf16);
  auto* a_hi = reinterpret_cast<uint16_t*>(hi.data_ptr());
  auto* a_lo = reinterpret_cast<uint16_t*>(lo.data_ptr());
  split_rows(x.data_ptr<float>(), x.stride(0), M, Mpad, K, a_hi, a_lo);
  at::Tensor out = at::empty({Mpad, N}, x.options());
  float* c = out.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t row_blocks = Mpad / kBlock, col_blocks = N / kBlock;
  const int64_t row_chunks = (row_blocks + kRowBlocksPerPanel - 1) / kRowBlocksPerPanel;
  // a work item: one column block's panel against up to kRowBlocksPerPanel row blocks
  at::parallel_for(0, row_chunks * col_blocks, 1, [&](int64_t i0, int64_t i1) {
    configure_tiles();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t chunk = i / col_blocks, nb = i % col_blocks;
      const uint16_t* panel = w + nb * (K / kBlock) * kBlockElems;
      const int64_t last = std::min(row_blocks, (chunk + 1) * kRowBlocksPerPanel);
      for (int64_t mb = chunk * kRowBlocksPerPanel; mb < last; ++mb) {
        float* block = c + mb * kBlock * N + nb * kBlock;
        block_product(a_hi + mb * kBlock * K, a_lo + mb * kBlock * K, panel, K, block, N);
        if (b != nullptr || act != Activation::kNone) {  // the block is still in L1
          const float* bb = b == nullptr ? nullptr : b + nb * kBlock;
          for (int64_t r = 0; r < kBlock; ++r) {
            for (int64_t half = 0; half < kBlock; half += 16) {
              float* at = block + r * N + half;
              __m512 v = _mm512_loadu_ps(at);
              if (bb != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bb + half));
              _mm512_storeu_ps(at, activate(act, v));
            }
          }
        }
      }
    }
    _tile_release();  // no tile state left for the kernel to save at switches
  });
  return out.narrow(0, 0, M);
#else
  return at::Tensor();
#endif
}

}  // namespace pyserve::cpu
