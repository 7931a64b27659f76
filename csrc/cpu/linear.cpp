// Linear layers on the CPU: out[M, N] = x[M, K] · w[N, K]ᵀ (+ bias), x and out float32, w in
// one of these formats, all widened to float32 in registers with float32 accumulation:
// float32, bfloat16 (half the bytes), and GGUF's Q4_1 and Q8_0 blocks (5 and 8.5 bits a
// weight), kept as the file has them so that a GGUF model reads a sixth of float32's bytes;
// GGUF's Q4_0, Q5_0, Q4_K, Q5_K and Q6_K blocks too, whose formats cpu/linear_kquant.h
// describes (the kernels below take any format with a GroupReader).
//
// The weight is repacked once, at load, into panels of kPanel = 32 output columns laid out
// k-major: the kernel then reads each panel as one contiguous stream and computes an
// outer-product tile, MR rows of x × 32 columns, where each weight vector loaded feeds MR FMAs
// and each broadcast x value feeds 32 / lanes. That keeps a decode step's few rows at the
// memory bandwidth and a prefill's many rows near the FMA peak, where BLAS on the unpacked
// weight managed about a third of either at 8 to 64 rows.
//
// Panel layouts, in groups of 32 k (GGUF's blocks run along k, so each of its blocks becomes
// one column of one group, with its own scale):
//   float32 / bfloat16: [K][32] elements;
//   Q4_1: per group d[32] and m[32] (float16), then two halves of 16 columns, each 4 blocks
//         of 64 bytes: in block j, bytes 4c .. 4c + 3 hold column c's q at k = 4j .. 4j + 3
//         in their low nibbles and at k = 16 + 4j .. 16 + 4j + 3 in their high; w = d·q + m.
//         That is the operand order of AVX-512 VNNI's byte dot product (vpdpbusd), so the
//         int8 path below reads the nibbles with two masks and no shuffles;
//   Q8_0 under int8 activations: per group d[32] (float16), then two halves of 16 columns,
//         each 8 blocks of 64 bytes: in block j, bytes 4c .. 4c + 3 hold column c's q (int8)
//         at k = 4j .. 4j + 3, again vpdpbusd's order; w = d·q;
//   Q8_0 under float32 activations: d[32], then the q [32 k][32 columns], k-major, so that
//         one k's columns are consecutive bytes that one sign-extending load widens (4 uops
//         a vector of weights where picking bytes out of vpdpbusd's order took 5).
// Dequantized weights are computed exactly as the gguf package computes them (a product, then
// a sum, each rounded to float32; the product d·q is exact, so one FMA rounds the same; this
// file is compiled with -ffp-contract=off), so a Q4_1 layer gives bitwise the results of the
// float32 layer holding its dequantized weights.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/linear_kquant.h"
#include "cpu/ops.h"
#include "cpu/vec.h"

namespace pyserve::cpu {
namespace {

constexpr int64_t kPanel = 32;
constexpr int64_t kGroup = 32;  // k per quantization block

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <typename W>
struct FloatFormat {
  static constexpr bool kQuantized = false;
  static constexpr int64_t kSuperK = kGroup;  // k per group of the packed tensor's dimension 1 (below)
  static constexpr int64_t kGroupBytes = kGroup * kPanel * sizeof(W);
  static int64_t panel_bytes(int64_t K) { return K * kPanel * sizeof(W); }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    return static_cast<float>(reinterpret_cast<const W*>(panel)[k * kPanel + c]);
  }
};

struct Q4_1Format {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kSuperK = kGroup;
  static constexpr int64_t kBlockBytes = 20;  // GGUF: d, m (float16), 16 bytes of nibbles
  static constexpr int64_t kGroupBytes = 64 + 64 + kGroup * 16;
  static int64_t panel_bytes(int64_t K) { return K / kGroup * kGroupBytes; }
  // the byte holding the q of (k, column c) within a group, and its nibble's shift
  static int64_t byte_of(int64_t k, int64_t c) {
    return 128 + (c / 16) * 256 + ((k % 16) / 4) * 64 + (c % 16) * 4 + k % 4;
  }
  static int shift_of(int64_t k) { return k % kGroup < 16 ? 0 : 4; }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    const uint8_t* g = panel + k / kGroup * kGroupBytes;
    const float q = static_cast<float>((g[byte_of(k % kGroup, c)] >> shift_of(k)) & 15);
    return half_at(g + 2 * c) * q + half_at(g + 64 + 2 * c);
  }
  // GGUF block of one output row -> its column c of a group
  static void pack_block(const uint8_t* block, uint8_t* g, int64_t c) {
    std::memcpy(g + 2 * c, block, 2);
    std::memcpy(g + 64 + 2 * c, block + 2, 2);
    for (int64_t j = 0; j < kGroup; ++j) {
      const uint8_t q = j < 16 ? block[4 + j] & 15 : block[4 + j - 16] >> 4;
      uint8_t& dst = g[byte_of(j, c)];
      dst = shift_of(j) == 0 ? (dst & 0xF0) | q : (dst & 0x0F) | (q << 4);
    }
  }
};

// Q8_0's blocks in a panel's group, each q placed by Layout::byte_of (the two layouts below)
template <typename Layout>
struct Q8_0Blocks {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kSuperK = kGroup;
  static constexpr int64_t kBlockBytes = 34;  // GGUF: d (float16), 32 int8
  static constexpr int64_t kGroupBytes = 64 + kGroup * 32;
  static int64_t panel_bytes(int64_t K) { return K / kGroup * kGroupBytes; }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    const uint8_t* g = panel + k / kGroup * kGroupBytes;
    const int8_t q = static_cast<int8_t>(g[Layout::byte_of(k % kGroup, c)]);
    return half_at(g + 2 * c) * static_cast<float>(q);
  }
  static void pack_block(const uint8_t* block, uint8_t* g, int64_t c) {
    std::memcpy(g + 2 * c, block, 2);
    for (int64_t j = 0; j < kGroup; ++j) g[Layout::byte_of(j, c)] = block[2 + j];
  }
};

// vpdpbusd's order, for the int8 kernels (see the top of the file)
struct Q8_0Format : Q8_0Blocks<Q8_0Format> {
  static int64_t byte_of(int64_t k, int64_t c) {
    return 64 + (c / 16) * 512 + (k / 4) * 64 + (c % 16) * 4 + k % 4;
  }
};

// k-major, for the float32 kernels
struct Q8_0FloatFormat : Q8_0Blocks<Q8_0FloatFormat> {
  static int64_t byte_of(int64_t k, int64_t c) { return 64 + k * kPanel + c; }
};

using kquant::Q4_0Format;
using kquant::Q4_KFormat;
using kquant::Q5_0Format;
using kquant::Q5_KFormat;
using kquant::Q6_KFormat;

#ifdef PYSERVE_VEC
using namespace simd;
// AVX-512: 24 accumulators + 2 weight vectors + 1 broadcast of 32 zmm; AVX2: 12 of 16 ymm
constexpr int kMaxRows = PYSERVE_VEC == 16 ? 12 : 3;
constexpr int kVecs = kPanel / PYSERVE_VEC;
// A memory stream needs more misses in flight than one core's hardware prefetcher keeps:
// ask for the panel about this far ahead (only the first row tile pays DRAM; later ones hit
// cache).
constexpr int64_t kPrefetchBytes = 2048;
// Panels a one-row step of a quantized format computes together (tile_one_row). AVX-512: 2,
// measured on Zen 4 (`benchmarks.linear`'s decode table, runs interleaved with the plain tile:
// Q4_1 29-31 -> 37-38 GB/s; Q8_0 26.6 -> 50.3 in one pair of runs, 32 either way in two later
// pairs, when that was the memory's speed; 4 panels spill and lose). AVX2's one-row tile
// already has kVecs = 4 chains, and two panels' scales would not fit its 16 registers: 1, the
// plain tile.
constexpr int64_t kRowPanels = PYSERVE_VEC == 16 ? 2 : 1;

// The weights of one group of 32 k, a row of 32 columns (kVecs vectors) at a time.
template <typename Format>
struct GroupReader;

// the formats of cpu/linear_kquant.h bring their own reader
template <typename Format>
  requires requires { typename Format::Reader; }
struct GroupReader<Format> : Format::Reader {
  using Format::Reader::Reader;
};

template <typename W>
struct GroupReader<FloatFormat<W>> {
  const W* base;
  GroupReader(const uint8_t* group, int = 0) : base(reinterpret_cast<const W*>(group)) {}
  void row(int64_t kk, vec* w) const {
    for (int v = 0; v < kVecs; ++v) w[v] = load(base + kk * kPanel + v * kLanes);
  }
};

template <>
struct GroupReader<Q4_1Format> {
  vec d[kVecs], m[kVecs];
  const uint8_t* q;
  GroupReader(const uint8_t* group, int = 0) : q(group + 128) {
    for (int v = 0; v < kVecs; ++v) {
      d[v] = load(reinterpret_cast<const c10::Half*>(group) + v * kLanes);
      m[v] = load(reinterpret_cast<const c10::Half*>(group + 64) + v * kLanes);
    }
  }
  // w = d·q + m with one FMA: d is a float16 and q < 16, so d·q fits float32's 24 bits and
  // is exact, and the FMA rounds once, as the separate sum does. KK is a template argument so
  // that the nibble's shift is an immediate (a shift by a register costs two uops).
  template <int KK>
  void row(vec* w) const {
    constexpr int kShift = 8 * (KK % 4) + (KK % kGroup < 16 ? 0 : 4);
    const uint8_t* block = q + (KK % 16) / 4 * 64;
#if PYSERVE_VEC == 16
    // vpermps reads the low 4 bits of each index lane: the nibble indexes a table of the
    // floats 0 .. 15, one uop where masking and converting take two
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int h = 0; h < 2; ++h) {
      const __m512i raw = _mm512_loadu_si512(block + h * 256);
      const __m512i index = kShift == 0 ? raw : _mm512_srli_epi32(raw, kShift);
      w[h] = fma(d[h], _mm512_permutexvar_ps(index, values), m[h]);
    }
#else
    for (int v = 0; v < kVecs; ++v) {  // columns 8v .. 8v + 7: half v / 2, lanes 8 (v % 2) ..
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (v / 2) * 256 + (v % 2) * 32));
      const __m256i ints = _mm256_and_si256(_mm256_srli_epi32(raw, kShift), _mm256_set1_epi32(15));
      w[v] = fma(d[v], _mm256_cvtepi32_ps(ints), m[v]);
    }
#endif
  }
};

template <>
struct GroupReader<Q8_0Format> {
  vec d[kVecs];
  const uint8_t* q;
  GroupReader(const uint8_t* group, int = 0) : q(group + 64) {
    for (int v = 0; v < kVecs; ++v) d[v] = load(reinterpret_cast<const c10::Half*>(group) + v * kLanes);
  }
  template <int KK>
  void row(vec* w) const {
    // byte KK % 4 of each 32-bit lane, sign-extended: up to the top, then arithmetic shift down
    constexpr int kUp = 24 - 8 * (KK % 4);
    const uint8_t* block = q + (KK % kGroup) / 4 * 64;
#if PYSERVE_VEC == 16
    for (int h = 0; h < 2; ++h) {
      const __m512i raw = _mm512_loadu_si512(block + h * 512);
      const __m512i up = kUp == 0 ? raw : _mm512_slli_epi32(raw, kUp);
      w[h] = mul(d[h], _mm512_cvtepi32_ps(_mm512_srai_epi32(up, 24)));
    }
#else
    for (int v = 0; v < kVecs; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (v / 2) * 512 + (v % 2) * 32));
      const __m256i up = kUp == 0 ? raw : _mm256_slli_epi32(raw, kUp);
      w[v] = mul(d[v], _mm256_cvtepi32_ps(_mm256_srai_epi32(up, 24)));
    }
#endif
  }
};

template <>
struct GroupReader<Q8_0FloatFormat> {
  vec d[kVecs];
  const int8_t* q;
  GroupReader(const uint8_t* group, int = 0) : q(reinterpret_cast<const int8_t*>(group + 64)) {
    for (int v = 0; v < kVecs; ++v) d[v] = load(reinterpret_cast<const c10::Half*>(group) + v * kLanes);
  }
  template <int KK>
  void row(vec* w) const {
    for (int v = 0; v < kVecs; ++v) {
      const int8_t* bytes = q + KK * kPanel + v * kLanes;
#if PYSERVE_VEC == 16
      const __m512i ints = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      w[v] = mul(d[v], _mm512_cvtepi32_ps(ints));
#else
      const __m256i ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
      w[v] = mul(d[v], _mm256_cvtepi32_ps(ints));
#endif
    }
  }
};

// Groups of a panel hold Format::kSuperK k (a K-quant's super-block of 256, else 32); kernels
// walk them 32 k at a time. kSubBytes: a panel's bytes per 32 k, for prefetching ahead.
template <typename Format>
constexpr int64_t kSubBytes = Format::kGroupBytes * kGroup / Format::kSuperK;

// the reader of 32 k number g of a panel
template <typename Format>
inline GroupReader<Format> reader_at(const uint8_t* panel, int64_t g) {
  constexpr int64_t kSubs = Format::kSuperK / kGroup;
  return GroupReader<Format>(panel + g / kSubs * Format::kGroupBytes, static_cast<int>(g % kSubs));
}

template <typename F, int... KK>
[[gnu::always_inline]] inline void for_each_k(F&& f, std::integer_sequence<int, KK...>) {
  (f(std::integral_constant<int, KK>{}), ...);
}

// f(kk, w) for the group's rows kk = 0 .. n - 1 in order, w their kVecs weight vectors. The
// quantized readers take kk as a template argument, so their loop is unrolled (K is then a
// multiple of 32 and n is 32).
template <typename Format, typename F>
[[gnu::always_inline]] inline void for_each_row(const GroupReader<Format>& reader, int64_t n, F&& f) {
  if constexpr (Format::kQuantized) {
    for_each_k([&](auto kk) __attribute__((always_inline)) {
      vec w[kVecs];
      reader.template row<decltype(kk)::value>(w);
      f(int64_t{decltype(kk)::value}, w);
    }, std::make_integer_sequence<int, kGroup>{});
  } else {
    for (int64_t kk = 0; kk < n; ++kk) {
      vec w[kVecs];
      reader.row(kk, w);
      f(kk, w);
    }
  }
}

// The lines of a panel's 32 k kAhead<Format> groups ahead that row kk of the current group
// asks for, so that the group's 32 rows spread them out: a burst of them at once overflows
// the core's miss buffers.
template <typename Format>
constexpr int64_t kAheadGroups = (kPrefetchBytes + kSubBytes<Format> - 1) / kSubBytes<Format>;
template <typename Format>
[[gnu::always_inline]] inline void prefetch_row_share(const char* ahead, int64_t kk) {
  constexpr int64_t kLines = kSubBytes<Format> / 64, kLinesPerRow = (kLines + kGroup - 1) / kGroup;
  for (int64_t line = kk * kLinesPerRow; line < (kk + 1) * kLinesPerRow && line < kLines; ++line)
    _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
}

// out[MR, 32] = x[MR, K] · panel[K, 32]; `cols` of the 32 columns are stored.
template <int MR, typename Format>
inline void tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, float* out,
                 int64_t ldo, int64_t cols, const float* bias) {
  vec acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = zero();
  for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
    const char* ahead = reinterpret_cast<const char*>(panel + (k0 / kGroup + kAheadGroups<Format>) * kSubBytes<Format>);
    const GroupReader<Format> reader = reader_at<Format>(panel, k0 / kGroup);
    for_each_row(reader, std::min(kGroup, K - k0), [&](int64_t kk, const vec* w) __attribute__((always_inline)) {
      prefetch_row_share<Format>(ahead, kk);
      for (int m = 0; m < MR; ++m) {
        const vec xb = set1(x[m * ldx + k0 + kk]);
        for (int v = 0; v < kVecs; ++v) acc[m][v] = fma(xb, w[v], acc[m][v]);
      }
    });
  }
  alignas(64) float row[kPanel];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kVecs; ++v) store(row + v * kLanes, acc[m][v]);
    float* o = out + m * ldo;
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) o[c] = row[c] + bias[c];
    else
      std::memcpy(o, row, cols * sizeof(float));
  }
}

template <typename Format, int... P>
inline std::array<GroupReader<Format>, sizeof...(P)> readers_at(const uint8_t* panel, int64_t stride,
                                                               int64_t g, std::integer_sequence<int, P...>) {
  return {reader_at<Format>(panel + P * stride, g)...};
}

// out[1, 32] at out + p·out_stride = x[1, K] · the full panel at panel + p·stride, for p < P,
// of a quantized format. A one-row tile() has kVecs accumulators, each a chain of dependent
// FMAs, so it waits on FMA latency; P panels at once give P·kVecs independent chains. Each
// column still sums its k in order with one FMA each: bitwise tile<1>'s result.
template <int P, typename Format>
inline void tile_one_row(const float* x, const uint8_t* panel, int64_t stride, int64_t K, float* out,
                         int64_t out_stride, const float* bias) {
  vec acc[P][kVecs];
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < kVecs; ++v) acc[p][v] = zero();
  for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
    const auto readers = readers_at<Format>(panel, stride, k0 / kGroup, std::make_integer_sequence<int, P>{});
    const char* ahead = reinterpret_cast<const char*>(panel + (k0 / kGroup + kAheadGroups<Format>) * kSubBytes<Format>);
    for_each_k([&](auto kk) __attribute__((always_inline)) {
      constexpr int64_t kRow = decltype(kk)::value;
      for (int p = 0; p < P; ++p) prefetch_row_share<Format>(ahead + p * stride, kRow);
      const vec xb = set1(x[k0 + kRow]);
      for (int p = 0; p < P; ++p) {
        vec w[kVecs];
        readers[p].template row<decltype(kk)::value>(w);
        for (int v = 0; v < kVecs; ++v) acc[p][v] = fma(xb, w[v], acc[p][v]);
      }
    }, std::make_integer_sequence<int, kGroup>{});
  }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < kVecs; ++v) {
      vec r = acc[p][v];
      if (bias != nullptr) r = add(r, load(bias + p * out_stride + v * kLanes));
      store(out + p * out_stride + v * kLanes, r);
    }
}

// One row of x against panels [p0, p1) of a quantized format, P at a time: the full panels
// split into P equal runs walked side by side, so that each run stays one contiguous stream
// whose prefetch runs on into the run's next panel; the rest, and a partial last panel, by
// tile<1>.
template <int P, typename Format>
void one_row_panels(const float* x, const uint8_t* packed, int64_t panel_bytes, int64_t p0, int64_t p1,
                    int64_t N, int64_t K, float* out, const float* bias) {
  const int64_t full = std::min(p1, N / kPanel), run = std::max<int64_t>(0, full - p0) / P;
  for (int64_t i = 0; i < run; ++i) {
    const int64_t p = p0 + i;
    tile_one_row<P, Format>(x, packed + p * panel_bytes, run * panel_bytes, K, out + p * kPanel,
                            run * kPanel, bias ? bias + p * kPanel : nullptr);
  }
  for (int64_t p = p0 + P * run; p < p1; ++p) {
    const int64_t n0 = p * kPanel;
    tile<1, Format>(x, K, packed + p * panel_bytes, K, out + n0, N, std::min(kPanel, N - n0),
                    bias ? bias + n0 : nullptr);
  }
}

// acc[MR, 32] += x[MR, kn] · w[kn, 32] for float32 weights w (a widened chunk of a panel),
// acc kept in memory between chunks: each element still sums its k in order with one
// FMA each, so the result is bitwise that of tile() over the whole panel.
template <int MR>
inline void tile_accumulate(const float* x, int64_t ldx, const float* w, int64_t kn, float* acc_buf,
                            bool first) {
  vec acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = first ? zero() : load(acc_buf + m * kPanel + v * kLanes);
  for (int64_t kk = 0; kk < kn; ++kk) {
    vec wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = load(w + kk * kPanel + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const vec xb = set1(x[m * ldx + kk]);
      for (int v = 0; v < kVecs; ++v) acc[m][v] = fma(xb, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) store(acc_buf + m * kPanel + v * kLanes, acc[m][v]);
}

template <int... R>
inline void tile_accumulate_rows(int rows, std::integer_sequence<int, R...>, const float* x,
                                 int64_t ldx, const float* w, int64_t kn, float* acc_buf, bool first) {
  ((rows == R + 1 ? tile_accumulate<R + 1>(x, ldx, w, kn, acc_buf, first) : void()), ...);
}

// Groups [g0, g1) of 32 k of a panel (the last may be short when K is not a multiple of 32,
// for float formats) widened to float32 [k - 32 g0][32] in dst: for panel_rows_chunked, and
// the whole panel for unpack_linear_weight.
template <typename Format>
void widen_groups(const uint8_t* panel, int64_t K, int64_t g0, int64_t g1, float* dst) {
  constexpr int64_t kBytes = kSubBytes<Format>, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(panel + (g + kAhead) * kBytes + line), _MM_HINT_T0);
    const GroupReader<Format> reader = reader_at<Format>(panel, g);
    float* const rows = dst + (g - g0) * kGroup * kPanel;
    for_each_row(reader, std::min(kGroup, K - g * kGroup), [&](int64_t kk, const vec* w) __attribute__((always_inline)) {
      for (int v = 0; v < kVecs; ++v) store(rows + kk * kPanel + v * kLanes, w[v]);
    });
  }
}

// Rows [0, M) (M > kMaxRows) against one panel: a quantized panel is widened kChunkGroups
// groups at a time into a buffer that stays in L1 while every row tile passes over it, so
// each weight is dequantized once per call and read back from L1 (widening the whole panel
// first sent it through L2 and cost as much as the FMAs at 16 rows).
constexpr int64_t kChunkGroups = 4;  // 128 k: 16 KiB of float32 weights

// Float panels take the same path (a float32 chunk is copied: the copy's prefetching made
// 16 to 256 rows 10-15 % faster than reading the chunk where it lies). Running each row tile
// over the whole panel instead read the panel from L2 once per tile, and kept float32 weights
// at 105-146 GFLOP/s from 16 to 256 rows on two Sapphire Rapids-class cores, where the
// chunked Q4_1 panels ran at 270-330 (benchmarks/linear.py; chunked float32, with the 1 MiB
// row chunks below: 125-306).
template <typename Format>
void panel_rows_chunked(const float* x, int64_t M, int64_t K, const uint8_t* panel, float* out,
                        int64_t ldo, int64_t cols, const float* bias) {
  alignas(64) float chunk[kChunkGroups * kGroup * kPanel];
  thread_local std::vector<float> acc_buffer;
  acc_buffer.resize(M * kPanel);
  float* const acc = acc_buffer.data();
  // equal tiles of at most kMaxRows rows, as in packed_linear_impl
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t groups = (K + kGroup - 1) / kGroup;  // a float panel's last may be short
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t g1 = std::min(groups, g0 + kChunkGroups);
    widen_groups<Format>(panel, K, g0, g1, chunk);
    const int64_t kn = std::min(K, g1 * kGroup) - g0 * kGroup;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      const int64_t rows = (M - m) / (tiles - t);
      tile_accumulate_rows(static_cast<int>(rows), std::make_integer_sequence<int, kMaxRows>{},
                           x + m * K + g0 * kGroup, K, chunk, kn, acc + m * kPanel, g0 == 0);
      m += rows;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* o = out + m * ldo;
    const float* a = acc + m * kPanel;
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) o[c] = a[c] + bias[c];
    else
      std::memcpy(o, a, cols * sizeof(float));
  }
}

template <typename Format, int... R>
inline void tile_rows(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx,
                      const uint8_t* panel, int64_t K, float* out, int64_t ldo, int64_t cols,
                      const float* bias) {
  ((rows == R + 1 ? tile<R + 1, Format>(x, ldx, panel, K, out, ldo, cols, bias) : void()), ...);
}
#else
// no SIMD: the same tile, written plainly
constexpr int kMaxRows = 4;
template <typename Format>
void tile_plain(int rows, const float* x, int64_t ldx, const uint8_t* panel, int64_t K, float* out,
                int64_t ldo, int64_t cols, const float* bias) {
  for (int m = 0; m < rows; ++m) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kPanel; ++c) acc[c] += x[m * ldx + k] * Format::at(panel, k, c);
    for (int64_t c = 0; c < cols; ++c) out[m * ldo + c] = acc[c] + (bias ? bias[c] : 0.f);
  }
}
#endif

#if defined(PYSERVE_VEC) && (PYSERVE_VEC == 8 || defined(__AVX512VNNI__))
#define PYSERVE_INT8_DOT 1
// Q4_1 and Q8_0 weights (and Q4_0, Q4_K) against int8 activations, as llama.cpp computes
// them: each row of x is quantized per block of 32 k to int8 with its own scale (sx = max |x|
// / 127), the block's q·qx products are summed exactly in integers, and each block then adds
// d·sx·Σ q·qx (+ m·Σ x for Q4_1). Σ x is the block's exact float sum, so only the rounding of
// x to 8 bits differs from float32. AVX-512 VNNI sums four byte products into int32 in one
// instruction (vpdpbusd, 64 products, four times float32 FMA's 16); AVX2 has vpmaddubsw
// (unsigned × signed bytes, pairs summed into int16) and vpmaddwd (pairs of int16 into int32),
// which the kernels below use so that no int16 sum can saturate.

// A nibble format's 32 k number g of a panel as the int8 kernel reads it: its nibbles (in
// Q4_1's order) and w = d·q + m for the kLanes columns from kLanes·v. Q4_0 and the K-quants
// say so themselves (cpu/linear_kquant.h: m = -8 d, or d = d·sc and m = -dmin·m of the 32
// k's sub-block).
// Q5_0 and Q5_K add a plane of fifth bits (kFifthBits), in the order that puts each lane's
// four at bit 4 of its bytes from one shift (kquant::fifth_bit_position).
template <typename Format>
struct NibbleBlocks {
  static constexpr bool kFifthBits = requires(const uint8_t* p) { Format::int8_fifth_bits(p, 0); };
  static const uint8_t* nibbles(const uint8_t* panel, int64_t g) { return Format::int8_nibbles(panel, g); }
  static const uint8_t* fifth_bits(const uint8_t* panel, int64_t g) {
    if constexpr (kFifthBits) return Format::int8_fifth_bits(panel, g);
    else return nullptr;
  }
  static void scales(const uint8_t* panel, int64_t g, int v, vec& d, vec& m) { Format::int8_scales(panel, g, v, d, m); }
};
template <>
struct NibbleBlocks<Q4_1Format> {
  static constexpr bool kFifthBits = false;
  static const uint8_t* fifth_bits(const uint8_t*, int64_t) { return nullptr; }
  static const uint8_t* nibbles(const uint8_t* panel, int64_t g) { return panel + g * Q4_1Format::kGroupBytes + 128; }
  static void scales(const uint8_t* panel, int64_t g, int v, vec& d, vec& m) {
    const uint8_t* group = panel + g * Q4_1Format::kGroupBytes;
    d = load(reinterpret_cast<const c10::Half*>(group) + v * kLanes);
    m = load(reinterpret_cast<const c10::Half*>(group + 64) + v * kLanes);
  }
};

// a nibble-format int8 tile's step for one block of one row: acc + d·sx·Σ q·qx + m·Σ x, dot
// holding Σ q·qx (int32) and scale_sum the row's (sx, Σ x) for the block
inline vec add_nibble_block(vec acc, ivec dot, vec d, vec mins, const float* scale_sum) {
  acc = fma(kquant::v::to_float(dot), mul(d, set1(scale_sum[0])), acc);
  return fma(mins, set1(scale_sum[1]), acc);
}

#if PYSERVE_VEC == 16  // AVX-512 VNNI
// rows a tile: 12 accumulators + 12 int32 sums + 4 weights + 2 x of 32 zmm (Q5_0 / Q5_K's
// four fifth-bit words spill a few; the row count is Q4's, not tuned for them); Q6_K's tile
// keeps 2 accumulators and 2 sums a row, and 4 high-bit words
template <typename Format>
constexpr int kInt8Rows = std::is_same_v<Format, Q6_KFormat> ? 4 : 6;

// the first `cols` of an int8 tile's 32 columns, plus bias, into out
template <int MR>
inline void store_tile(const vec (&acc)[MR][kVecs], float* out, int64_t ldo, int64_t cols, const float* bias) {
  alignas(64) float row[kPanel];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kVecs; ++v) store(row + v * kLanes, acc[m][v]);
    float* o = out + m * ldo;
    for (int64_t c = 0; c < cols; ++c) o[c] = row[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

// x [M, K] -> q [M, K] int8 and, per row and block, (scale, Σ x)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scale_sum) {
  const int64_t groups = K / kGroup;
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * K + g * kGroup;
        const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        // round to nearest even, the MXCSR default, as torch.round
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * K + g * kGroup), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * K + g * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
        scale_sum[(r * groups + g) * 2] = amax / 127.f;
        scale_sum[(r * groups + g) * 2 + 1] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      }
  });
}

// out[MR, 32] from MR quantized rows and one panel of a nibble format (Q4_1, Q4_0, Q4_K, and
// with their fifth bits Q5_0, Q5_K: q up to 31, whose products vpdpbusd sums in int32 alike)
template <int MR, typename Format>
inline void tile_q4_int8(const int8_t* q, const float* scale_sum, int64_t K, const uint8_t* panel,
                         float* out, int64_t ldo, int64_t cols, const float* bias,
                         const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  using Blocks = NibbleBlocks<Format>;
  constexpr int64_t kBytes = kSubBytes<Format>, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* nibbles = Blocks::nibbles(panel, g);
    for (int64_t line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(panel + (g + kAhead) * kBytes + line), _MM_HINT_T0);
    __m512i dot[MR][2];
    for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    __m512i fifth[2][2];  // [half][k < 16, k >= 16]: each column's word, shifted right by j below
    if constexpr (Blocks::kFifthBits)
      for (int h = 0; h < 2; ++h) {
        fifth[h][1] = _mm512_loadu_si512(Blocks::fifth_bits(panel, g) + h * 64);
        fifth[h][0] = _mm512_slli_epi32(fifth[h][1], 4);
      }
    for (int j = 0; j < 4; ++j) {
      __m512i w[2][2];  // [half][k 4j.. or 16 + 4j..]
      for (int h = 0; h < 2; ++h) {
        const __m512i raw = _mm512_loadu_si512(nibbles + h * 256 + j * 64);
        w[h][0] = _mm512_and_si512(raw, nibble);
        w[h][1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        if constexpr (Blocks::kFifthBits)
          for (int t = 0; t < 2; ++t) {
            w[h][t] = _mm512_or_si512(w[h][t], _mm512_and_si512(fifth[h][t], bit4));
            fifth[h][t] = _mm512_srli_epi32(fifth[h][t], 1);
          }
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = q + m * K + g * kGroup;
        int32_t lo, hi;
        std::memcpy(&lo, xq + 4 * j, 4);
        std::memcpy(&hi, xq + 16 + 4 * j, 4);
        const __m512i xl = _mm512_set1_epi32(lo), xh = _mm512_set1_epi32(hi);
        for (int h = 0; h < 2; ++h) {
          dot[m][h] = _mm512_dpbusd_epi32(dot[m][h], w[h][0], xl);
          dot[m][h] = _mm512_dpbusd_epi32(dot[m][h], w[h][1], xh);
        }
      }
    }
    vec d[kVecs], mins[kVecs];
    for (int h = 0; h < kVecs; ++h) Blocks::scales(panel, g, h, d[h], mins[h]);
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < 2; ++h)
        acc[m][h] = add_nibble_block(acc[m][h], dot[m][h], d[h], mins[h], scale_sum + (m * groups + g) * 2);
  }
  store_tile<MR>(acc, out, ldo, cols, bias);
}

// out[MR, 32] from MR quantized rows and one Q8_0 panel. vpdpbusd multiplies unsigned by
// signed bytes and both x and the weights are signed here, so x goes in offset by 128
// (x + 128, flipping its top bit) and 128 · Σ w comes off again, Σ w from one more vpdpbusd
// against ones per weight vector.
template <int MR>
inline void tile_q8_int8(const int8_t* q, const float* scale_sum, int64_t K, const uint8_t* panel,
                         float* out, int64_t ldo, int64_t cols, const float* bias,
                         const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  constexpr int64_t kBytes = Q8_0Format::kGroupBytes, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = panel + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(group + kAhead * kBytes + line), _MM_HINT_T0);
    __m512i dot[MR][2], wsum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i w[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm512_loadu_si512(group + 64 + h * 512 + j * 64);
        wsum[h] = _mm512_dpbusd_epi32(wsum[h], ones, w[h]);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, q + m * K + g * kGroup + 4 * j, 4);
        const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(four), flip);
        for (int h = 0; h < 2; ++h) dot[m][h] = _mm512_dpbusd_epi32(dot[m][h], xu, w[h]);
      }
    }
    __m512 d[2];
    for (int h = 0; h < 2; ++h) {
      d[h] = load(reinterpret_cast<const c10::Half*>(group) + h * 16);
      wsum[h] = _mm512_slli_epi32(wsum[h], 7);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 sx = _mm512_set1_ps(scale_sum[(m * groups + g) * 2]);
      for (int h = 0; h < 2; ++h) {
        const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m][h], wsum[h]));
        acc[m][h] = _mm512_fmadd_ps(exact, _mm512_mul_ps(d[h], sx), acc[m][h]);
      }
    }
  }
  store_tile<MR>(acc, out, ldo, cols, bias);
}

// out[MR, 32] from MR quantized rows and one Q6_K panel: w = d·sc·(q - 32), q of 6 bits (the
// nibble and two high bits, cpu/linear_kquant.h's q6_high_position) with a scale sc per 16 k.
// Each 16 k's Σ q·qx is summed on its own (k < 16 from the low nibbles, k >= 16 from the high),
// the -32 comes off as 32·Σ qx (block_sums, per 16 k), and each sum then adds d·sc·sx times
// it. The column halves are walked one after the other so that a row's four sums stay two.
template <int MR>
inline void tile_q6_int8(const int8_t* q, const float* scale_sum, const int32_t* block_sums, int64_t K,
                         const uint8_t* panel, float* out, int64_t ldo, int64_t cols, const float* bias,
                         const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  constexpr int64_t kBytes = kSubBytes<Q6_KFormat>, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* nibbles = Q6_KFormat::int8_nibbles(panel, g);
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(nibbles + kAhead * kBytes + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      // [k < 16, k >= 16]: the columns' words, shifted up 4 (for j = 0, 1) and not (j = 2, 3)
      __m512i high[2][2];
      for (int t = 0; t < 2; ++t) {
        high[t][1] = _mm512_loadu_si512(Q6_KFormat::int8_high_bits(panel, g, t) + h * 64);
        high[t][0] = _mm512_slli_epi32(high[t][1], 4);
      }
      __m512i dot[MR][2];
      for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(nibbles + h * 256 + j * 64);
        __m512i w[2] = {_mm512_and_si512(raw, nibble), _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble)};
        for (int t = 0; t < 2; ++t) {
          const __m512i bits = j % 2 == 0 ? high[t][j / 2] : _mm512_srli_epi32(high[t][j / 2], 2);
          w[t] = _mm512_or_si512(w[t], _mm512_and_si512(bits, bits45));
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* xq = q + m * K + g * kGroup;
          int32_t lo, hi;
          std::memcpy(&lo, xq + 4 * j, 4);
          std::memcpy(&hi, xq + 16 + 4 * j, 4);
          dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], w[0], _mm512_set1_epi32(lo));
          dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], w[1], _mm512_set1_epi32(hi));
        }
      }
      const __m512 scale[2] = {Q6_KFormat::int8_scale(panel, g, 0, h), Q6_KFormat::int8_scale(panel, g, 1, h)};
      for (int m = 0; m < MR; ++m) {
        const __m512 sx = _mm512_set1_ps(scale_sum[(m * groups + g) * 2]);
        for (int t = 0; t < 2; ++t) {
          const __m512i offset = _mm512_set1_epi32(32 * block_sums[m * 2 * groups + 2 * g + t]);
          const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m][t], offset));
          acc[m][h] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scale[t], sx), acc[m][h]);
        }
      }
    }
  }
  store_tile<MR>(acc, out, ldo, cols, bias);
}


#else  // AVX2
// Each tile runs over the whole panel once per 8 columns, its rows' int sums and float
// accumulators in registers: 6 rows for the nibble formats (12 of 16 ymm, the weights and
// their mask 3 more), 4 for Q8_0, whose sums take more temporaries (the best of 3 to 6 rows
// in a single-thread benchmark), and 4 for Q5_0 / Q5_K, whose int32 sums beside the int16
// ones and fifth-bit words would not fit 6; 2 for Q6_K, whose rows keep two int32 sums and
// whose four high-bit words stay in registers too.
template <typename Format>
constexpr int kInt8Rows = std::is_same_v<Format, Q6_KFormat>                                      ? 2
                          : std::is_same_v<Format, Q8_0Format> || NibbleBlocks<Format>::kFifthBits ? 4
                                                                                                   : 6;

// x [M, K] -> q [M, K] int8 and, per row and block, (scale, Σ x)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scale_sum) {
  const int64_t groups = K / kGroup;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // vpackssdw and vpacksswb interleave the 128-bit halves; this puts the bytes back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * K + g * kGroup;
        __m256 part[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int v = 0; v < 4; ++v) {
          part[v] = _mm256_loadu_ps(src + 8 * v);
          amax = _mm256_max_ps(amax, _mm256_and_ps(part[v], magnitude));
          sum = _mm256_add_ps(sum, part[v]);
        }
        const float top = reduce_max(amax);
        const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
        __m256i ints[4];  // round to nearest even, the MXCSR default, as torch.round
        for (int v = 0; v < 4; ++v) ints[v] = _mm256_cvtps_epi32(_mm256_mul_ps(part[v], inv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * K + g * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
        scale_sum[(r * groups + g) * 2] = top / 127.f;
        scale_sum[(r * groups + g) * 2 + 1] = reduce_add(sum);
      }
  });
}

// The AVX2 int8 tiles walk their panel once per 8 columns (kVecs passes); the first pass
// reads it from memory, the others from L2, so memory would idle three quarters of the time.
// Instead each (pass, group) step also asks for its share of the next panel's lines, into L2:
// the memory stream then runs through every pass, and the next tile's first pass hits L2
// (a one-row Q6_K layer of 12,288 x 2,048 read 6.3 GB/s without this).
[[gnu::always_inline]] inline void prefetch_next_share(const uint8_t* next, int64_t bytes, int64_t step,
                                                      int64_t steps) {
  if (next == nullptr) return;
  const int64_t lines = bytes / 64, l0 = step * lines / steps, l1 = (step + 1) * lines / steps;
  for (int64_t l = l0; l < l1; ++l) _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
}

// four bytes of x (k .. k + 3 of a row) in every 32-bit lane
inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

template <int MR>
inline void store_columns(const vec (&acc)[MR], float (&result)[MR][kPanel], int v) {
  for (int m = 0; m < MR; ++m) store(result[m] + v * kLanes, acc[m]);
}

template <int MR>
inline void store_result(const float (&result)[MR][kPanel], float* out, int64_t ldo, int64_t cols, const float* bias) {
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < cols; ++c) out[m * ldo + c] = result[m][c] + (bias != nullptr ? bias[c] : 0.f);
}

// out[MR, 32] from MR quantized rows and one panel of a nibble format (Q4_1, Q4_0, Q4_K).
// Per column and 32 k, 8 vpmaddubsw give pair sums of q (0 .. 15) by qx (|qx| <= 127), each
// within ±3,810, so all 8 add up in int16 (±30,480) before one vpmaddwd widens them. With
// fifth bits (Q5_0, Q5_K: q up to 31, pair sums within ±7,874) only 4 fit, so the int16 sums
// are widened after every second block.
// One row of a 4-bit format (Q4_0, Q4_1, Q4_K) in a single pass over the panel: each group's
// 32 k are broadcast once and meet all four 8-column slices, where the tile below walks the
// panel once per slice. Every slice's integer sums and float steps are the tile's, in its
// order: bitwise its result. A decode row of Q4_K read 15.3 GB/s instead of 14.3 (12,288 x
// 2,048), 17.5 instead of 13.9 (1,536 x 2,048) on this 2-core AVX2 machine (2026-12-07).
template <typename Format>
inline void one_row_q4_int8(const int8_t* q, const float* scale_sum, int64_t K, const uint8_t* panel,
                            float* out, int64_t cols, const float* bias) {
  using Blocks = NibbleBlocks<Format>;
  constexpr int64_t kBytes = kSubBytes<Format>, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  vec acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(panel + (g + kAhead) * kBytes + line), _MM_HINT_T0);
    const uint8_t* nibbles = Blocks::nibbles(panel, g);
    const int8_t* xq = q + g * kGroup;
    __m256i dot[kVecs];
    for (int v = 0; v < kVecs; ++v) dot[v] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i x_low = broadcast4(xq + 4 * j), x_high = broadcast4(xq + 16 + 4 * j);
      for (int v = 0; v < kVecs; ++v) {
        const __m256i raw = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(nibbles + (v / 2) * 256 + (v % 2) * 32 + j * 64));
        const __m256i low = _mm256_and_si256(raw, nibble), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        dot[v] = _mm256_add_epi16(dot[v], _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low),
                                                           _mm256_maddubs_epi16(high, x_high)));
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      vec d, mins;
      Blocks::scales(panel, g, v, d, mins);
      acc[v] = add_nibble_block(acc[v], _mm256_madd_epi16(dot[v], ones), d, mins, scale_sum + g * 2);
    }
  }
  alignas(64) float result[1][kPanel];
  for (int v = 0; v < kVecs; ++v) store(result[0] + v * kLanes, acc[v]);
  store_result<1>(result, out, 0, cols, bias);
}

template <int MR, typename Format>
inline void tile_q4_int8(const int8_t* q, const float* scale_sum, int64_t K, const uint8_t* panel,
                         float* out, int64_t ldo, int64_t cols, const float* bias,
                         const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  using Blocks = NibbleBlocks<Format>;
  constexpr int64_t kBytes = kSubBytes<Format>, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), bit4 = _mm256_set1_epi8(16);
  if constexpr (MR == 1 && !Blocks::kFifthBits) {
    one_row_q4_int8<Format>(q, scale_sum, K, panel, out, cols, bias);
    return;
  }
  alignas(64) float result[MR][kPanel];
  for (int v = 0; v < kVecs; ++v) {  // columns 8v .. 8v + 7: half v / 2, bytes 32 (v % 2) ..
    vec acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = zero();
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_next_share(next, next_bytes, v * groups + g, kVecs * groups);
      if (v == 0)
        for (int64_t line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(panel + (g + kAhead) * kBytes + line), _MM_HINT_T0);
      const uint8_t* nibbles = Blocks::nibbles(panel, g) + (v / 2) * 256 + (v % 2) * 32;
      const int8_t* xq = q + g * kGroup;
      __m256i dot[MR], wide[MR];
      for (int m = 0; m < MR; ++m) dot[m] = wide[m] = _mm256_setzero_si256();
      __m256i fifth_low, fifth_high;  // the columns' words, shifted right by j below
      if constexpr (Blocks::kFifthBits) {
        fifth_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Blocks::fifth_bits(panel, g) + v * 32));
        fifth_low = _mm256_slli_epi32(fifth_high, 4);
      }
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + j * 64));
        __m256i low = _mm256_and_si256(raw, nibble), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        if constexpr (Blocks::kFifthBits) {
          low = _mm256_or_si256(low, _mm256_and_si256(fifth_low, bit4));
          high = _mm256_or_si256(high, _mm256_and_si256(fifth_high, bit4));
          fifth_low = _mm256_srli_epi32(fifth_low, 1);
          fifth_high = _mm256_srli_epi32(fifth_high, 1);
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(xq + m * K + 4 * j)),
                                                 _mm256_maddubs_epi16(high, broadcast4(xq + m * K + 16 + 4 * j)));
          dot[m] = _mm256_add_epi16(dot[m], pairs);
          // keeps gcc from hoisting every product of the group ahead of the sums (which
          // spilled them all to the stack)
          __asm__("" : "+x"(dot[m]));
          if constexpr (Blocks::kFifthBits) {
            if (j % 2 == 1) {
              wide[m] = _mm256_add_epi32(wide[m], _mm256_madd_epi16(dot[m], ones));
              dot[m] = _mm256_setzero_si256();
            }
          }
        }
      }
      vec d, mins;
      Blocks::scales(panel, g, v, d, mins);
      for (int m = 0; m < MR; ++m) {
        const __m256i sums = Blocks::kFifthBits ? wide[m] : _mm256_madd_epi16(dot[m], ones);
        acc[m] = add_nibble_block(acc[m], sums, d, mins, scale_sum + (m * groups + g) * 2);
      }
    }
    store_columns<MR>(acc, result, v);
  }
  store_result<MR>(result, out, ldo, cols, bias);
}

// out[MR, 32] from MR quantized rows and one Q8_0 panel. vpmaddubsw wants one operand
// unsigned: it gets |w| (so -128 reads as 128) and qx takes w's sign (vpsignb, which also
// zeroes qx where w is 0), whose product is w·qx. A pair sum reaches ±32,512, so each is
// widened to int32 at once.
template <int MR>
inline void tile_q8_int8(const int8_t* q, const float* scale_sum, int64_t K, const uint8_t* panel,
                         float* out, int64_t ldo, int64_t cols, const float* bias,
                         const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  constexpr int64_t kBytes = Q8_0Format::kGroupBytes, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(64) float result[MR][kPanel];
  for (int v = 0; v < kVecs; ++v) {
    vec acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = zero();
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_next_share(next, next_bytes, v * groups + g, kVecs * groups);
      const uint8_t* group = panel + g * kBytes;
      if (v == 0)
        for (int64_t line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(group + kAhead * kBytes + line), _MM_HINT_T0);
      const uint8_t* weights = group + 64 + (v / 2) * 512 + (v % 2) * 32;
      const int8_t* xq = q + g * kGroup;
      __m256i dot[MR];
      for (int m = 0; m < MR; ++m) dot[m] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + j * 64));
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int m = 0; m < MR; ++m) {
          const __m256i signed_x = _mm256_sign_epi8(broadcast4(xq + m * K + 4 * j), w);
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
        }
      }
      const vec d = load(reinterpret_cast<const c10::Half*>(group) + v * kLanes);
      for (int m = 0; m < MR; ++m)
        acc[m] = fma(_mm256_cvtepi32_ps(dot[m]), mul(d, set1(scale_sum[(m * groups + g) * 2])), acc[m]);
    }
    store_columns<MR>(acc, result, v);
  }
  store_result<MR>(result, out, ldo, cols, bias);
}

// out[MR, 32] from MR quantized rows and one Q6_K panel, as the AVX-512 tile computes it
// (each 16 k's Σ q·qx apart, less 32·Σ qx, times d·sc·sx). A vpmaddubsw pair sum of q (0 .. 63)
// by qx reaches ±16,002, so each is widened to int32 at once.
template <int MR>
inline void tile_q6_int8(const int8_t* q, const float* scale_sum, const int32_t* block_sums, int64_t K,
                         const uint8_t* panel, float* out, int64_t ldo, int64_t cols, const float* bias,
                         const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  constexpr int64_t kBytes = kSubBytes<Q6_KFormat>, kAhead = (kPrefetchBytes + kBytes - 1) / kBytes;
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  alignas(64) float result[MR][kPanel];
  for (int v = 0; v < kVecs; ++v) {  // columns 8v .. 8v + 7: half v / 2, bytes 32 (v % 2) ..
    vec acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = zero();
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_next_share(next, next_bytes, v * groups + g, kVecs * groups);
      const uint8_t* nibbles = Q6_KFormat::int8_nibbles(panel, g);
      if (v == 0)
        for (int64_t line = 0; line < kBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(nibbles + kAhead * kBytes + line), _MM_HINT_T0);
      nibbles += (v / 2) * 256 + (v % 2) * 32;
      const int8_t* xq = q + g * kGroup;
      __m256i high[2][2];  // as the AVX-512 tile's
      for (int t = 0; t < 2; ++t) {
        high[t][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q6_KFormat::int8_high_bits(panel, g, t) + v * 32));
        high[t][0] = _mm256_slli_epi32(high[t][1], 4);
      }
      __m256i dot[MR][2];
      for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + j * 64));
        __m256i w[2] = {_mm256_and_si256(raw, nibble), _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble)};
        for (int t = 0; t < 2; ++t) {
          const __m256i bits = j % 2 == 0 ? high[t][j / 2] : _mm256_srli_epi32(high[t][j / 2], 2);
          w[t] = _mm256_or_si256(w[t], _mm256_and_si256(bits, bits45));
        }
        for (int m = 0; m < MR; ++m)
          for (int t = 0; t < 2; ++t) {
            const __m256i pairs = _mm256_maddubs_epi16(w[t], broadcast4(xq + m * K + 16 * t + 4 * j));
            dot[m][t] = _mm256_add_epi32(dot[m][t], _mm256_madd_epi16(pairs, ones));
          }
      }
      const vec scale[2] = {Q6_KFormat::int8_scale(panel, g, 0, v), Q6_KFormat::int8_scale(panel, g, 1, v)};
      for (int m = 0; m < MR; ++m) {
        const vec sx = set1(scale_sum[(m * groups + g) * 2]);
        for (int t = 0; t < 2; ++t) {
          const __m256i offset = _mm256_set1_epi32(32 * block_sums[m * 2 * groups + 2 * g + t]);
          acc[m] = fma(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[m][t], offset)), mul(scale[t], sx), acc[m]);
        }
      }
    }
    store_columns<MR>(acc, result, v);
  }
  store_result<MR>(result, out, ldo, cols, bias);
}
#endif

// x's int8 sums per row and 16 k: [M, K / 16] (Q6_K's scales cover 16 k)
void block_sums_of(const int8_t* q, int64_t M, int64_t K, int32_t* sums) {
  for (int64_t i = 0; i < M * K / 16; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += q[i * 16 + k];
    sums[i] = sum;
  }
}

template <typename Format, int... R>
inline void tile_int8_rows(int rows, std::integer_sequence<int, R...>, const int8_t* q,
                           const float* scale_sum, const int32_t* block_sums, int64_t K, const uint8_t* panel, float* out,
                           int64_t ldo, int64_t cols, const float* bias, const uint8_t* next = nullptr,
                           int64_t next_bytes = 0) {
  if constexpr (std::is_same_v<Format, Q8_0Format>)
    ((rows == R + 1 ? tile_q8_int8<R + 1>(q, scale_sum, K, panel, out, ldo, cols, bias, next, next_bytes) : void()), ...);
  else if constexpr (std::is_same_v<Format, Q6_KFormat>)
    ((rows == R + 1 ? tile_q6_int8<R + 1>(q, scale_sum, block_sums, K, panel, out, ldo, cols, bias, next, next_bytes)
                    : void()), ...);
  else
    ((rows == R + 1 ? tile_q4_int8<R + 1, Format>(q, scale_sum, K, panel, out, ldo, cols, bias, next, next_bytes)
                    : void()), ...);
}

template <typename Format>
void int8_linear(const float* x, const uint8_t* packed, const float* bias, float* out, int64_t M,
                 int64_t N, int64_t K) {
  const int64_t groups = K / kGroup, panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_bytes = Format::panel_bytes(K);
  // the caller's thread only (at::parallel_for below runs tiles, not this)
  thread_local std::vector<int8_t> q_buffer;
  thread_local std::vector<float> scale_sum_buffer;
  q_buffer.resize(M * K);
  scale_sum_buffer.resize(M * groups * 2);
  // pointers, not the thread_local names, go into the parallel region: a worker thread
  // naming them would get its own, empty, buffers
  int8_t* const q = q_buffer.data();
  float* const scale_sum = scale_sum_buffer.data();
  quantize_rows(x, M, K, q, scale_sum);
  thread_local std::vector<int32_t> block_sums_buffer;
  int32_t* block_sums = nullptr;
  if constexpr (std::is_same_v<Format, Q6_KFormat>) {
    block_sums_buffer.resize(M * K / 16);
    block_sums = block_sums_buffer.data();
    block_sums_of(q, M, K, block_sums);
  }
  // rows in chunks whose int8 x stays in a core's L2 while every panel passes over it
  constexpr int kRows = kInt8Rows<Format>;
  const int64_t chunk = std::max<int64_t>(kRows, (512 * 1024 / K) / kRows * kRows);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel;
        // the first row tile of a panel fetches the next one of this thread's run (see
        // prefetch_next_share); the others find this panel in L2
        const uint8_t* next = p + 1 < p1 ? packed + (p + 1) * panel_bytes : nullptr;
        for (int64_t m = m0; m < m1; m += kRows)
          tile_int8_rows<Format>(static_cast<int>(std::min<int64_t>(kRows, m1 - m)),
                            std::make_integer_sequence<int, kRows>{}, q + m * K,
                            scale_sum + m * groups * 2, block_sums ? block_sums + m * K / 16 : nullptr,
                            K, packed + p * panel_bytes,
                            out + m * N + n0, N, std::min(kPanel, N - n0), bias ? bias + n0 : nullptr,
                            m == m0 ? next : nullptr, panel_bytes);
      }
    });
  }
}
#endif

// Rows [0, M) of x against panels [p0, p1) of a packed weight: out[M, cols of those panels]
// (row stride ldo), bias (if any) of the whole weight's N columns. The body of a parallel
// region: packed_linear_impl's and grouped_linear_impl's.
template <typename Format>
void panels_rows(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t panel_bytes,
                 int64_t p0, int64_t p1, int64_t N, float* out, int64_t ldo, const float* bias) {
#ifdef PYSERVE_VEC
  if constexpr (Format::kQuantized && kRowPanels > 1) {
    if (M == 1) {
      one_row_panels<kRowPanels, Format>(x, packed, panel_bytes, p0, p1, N, K, out, bias);
      return;
    }
  }
#endif
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = packed + p * panel_bytes;
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    const float* b = bias ? bias + n0 : nullptr;
#ifdef PYSERVE_VEC
    if (M > kMaxRows) {
      panel_rows_chunked<Format>(x, M, K, panel, out + n0, ldo, cols, b);
      continue;
    }
#endif
    // equal tiles of at most kMaxRows rows (16 as 8 + 8: a 4-row tile loads a weight
    // vector for every 4 FMAs)
    const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      const int rows = static_cast<int>((M - m) / (tiles - t));
#ifdef PYSERVE_VEC
      tile_rows<Format>(rows, std::make_integer_sequence<int, kMaxRows>{}, x + m * K, K, panel,
                        K, out + m * ldo + n0, ldo, cols, b);
#else
      tile_plain<Format>(rows, x + m * K, K, panel, K, out + m * ldo + n0, ldo, cols, b);
#endif
      m += rows;
    }
  }
}

template <typename Format>
void packed_linear_impl(const float* x, const uint8_t* packed, const float* bias, float* out,
                        int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel, panel_bytes = Format::panel_bytes(K);
  // Rows are taken in chunks whose x (chunk × K float32) stays in a core's L2 while every
  // panel passes over it; within a chunk each panel meets the rows kMaxRows at a time. A
  // panel is widened once per chunk, so chunks are as large as half an L2 of 2 MiB allows
  // (128 rows at K = 1,536 in one chunk: 7 % less time than 256 KiB chunks for Q4_1; float32
  // at 256 rows, SmolLM2's shapes: 306 against 279 GFLOP/s).
  const int64_t x_bytes = 1024 * 1024;
  const int64_t chunk = std::max<int64_t>(kMaxRows, (x_bytes / (K * 4)) / kMaxRows * kMaxRows);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      panels_rows<Format>(x + m0 * K, m1 - m0, K, packed, panel_bytes, p0, p1, N, out + m0 * N, N, bias);
    });
  }
}

// One expert's rows of a grouped linear: x rows [m0, m1) against weight `packed`.
struct GroupedJob {
  int64_t expert, m0, m1;
};

// Splits the jobs' (job, panel) pairs over the threads by cost (a panel's cost: its rows
// plus what reading the panel costs, about kPanelCost rows' worth), each thread calling
// run(job, p0, p1) for its runs of panels. One parallel region for every expert: at decode
// (one row, eight experts) both cores share all the experts' panels.
template <typename Run>
void split_jobs(const std::vector<GroupedJob>& jobs, int64_t panels, Run&& run) {
  constexpr int64_t kPanelCost = 4;
  std::vector<int64_t> cost_before(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j)
    cost_before[j + 1] = cost_before[j] + panels * (jobs[j].m1 - jobs[j].m0 + kPanelCost);
  const int64_t total = cost_before.back();
  if (total == 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), jobs.size() * panels));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // this thread's share of the cost, [c0, c1), in whole panels
      const int64_t c0 = total * t / threads, c1 = total * (t + 1) / threads;
      for (size_t j = 0; j < jobs.size(); ++j) {
        const int64_t per_panel = jobs[j].m1 - jobs[j].m0 + kPanelCost;
        // panel p of job j belongs to the thread whose share holds its first unit of cost
        const int64_t lo = std::max<int64_t>(0, (c0 - cost_before[j] + per_panel - 1) / per_panel);
        const int64_t hi = std::min<int64_t>(panels, std::max<int64_t>(0, (c1 - cost_before[j] + per_panel - 1) / per_panel));
        if (lo < hi) run(jobs[j], lo, hi);
      }
    }
  });
}

template <typename Format>
void grouped_linear_impl(const float* x, const uint8_t* packed, int64_t expert_bytes,
                         const std::vector<GroupedJob>& jobs, const float* bias, float* out,
                         int64_t ldo, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel, panel_bytes = Format::panel_bytes(K);
  split_jobs(jobs, panels, [&](const GroupedJob& job, int64_t p0, int64_t p1) {
    panels_rows<Format>(x + job.m0 * K, job.m1 - job.m0, K, packed + job.expert * expert_bytes,
                        panel_bytes, p0, p1, N, out + job.m0 * ldo, ldo, bias ? bias + job.expert * N : nullptr);
  });
}

#ifdef PYSERVE_INT8_DOT
template <typename Format>
void grouped_int8_impl(const float* x, int64_t R, const uint8_t* packed, int64_t expert_bytes,
                       const std::vector<GroupedJob>& jobs, const float* bias, float* out,
                       int64_t ldo, int64_t N, int64_t K) {
  const int64_t groups = K / kGroup, panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_bytes = Format::panel_bytes(K);
  // every row quantized once, before the region (quantize_rows is a region of its own)
  std::vector<int8_t> q(R * K);
  std::vector<float> scale_sum(R * groups * 2);
  quantize_rows(x, R, K, q.data(), scale_sum.data());
  std::vector<int32_t> block_sums;
  if constexpr (std::is_same_v<Format, Q6_KFormat>) {
    block_sums.resize(R * K / 16);
    block_sums_of(q.data(), R, K, block_sums.data());
  }
  constexpr int kRows = kInt8Rows<Format>;
  split_jobs(jobs, panels, [&](const GroupedJob& job, int64_t p0, int64_t p1) {
    const uint8_t* weight = packed + job.expert * expert_bytes;
    const float* b = bias ? bias + job.expert * N : nullptr;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const uint8_t* next = p + 1 < p1 ? weight + (p + 1) * panel_bytes : nullptr;
      for (int64_t m = job.m0; m < job.m1; m += kRows)
        tile_int8_rows<Format>(static_cast<int>(std::min<int64_t>(kRows, job.m1 - m)),
                               std::make_integer_sequence<int, kRows>{}, q.data() + m * K,
                               scale_sum.data() + m * groups * 2,
                               block_sums.empty() ? nullptr : block_sums.data() + m * K / 16, K,
                               weight + p * panel_bytes, out + m * ldo + n0, ldo,
                               std::min(kPanel, N - n0), b ? b + n0 : nullptr,
                               m == job.m0 ? next : nullptr, panel_bytes);
    }
  });
}
#endif

// A packed weight's format. GGUF block panels stored as int8 mark a layer whose activations
// are quantized to int8 for integer dot products (pack_gguf_weight's int8_activations), for
// the formats that have that kernel (has_int8_kernel); their bytes are those of the uint8
// panels but for Q8_0's, in vpdpbusd's order where the float32 kernels' are k-major.
// kQ8_0: Q8_0 in vpdpbusd's order (int8 activations); kQ8_0Float: k-major, for float32 ones.
enum class Kind { kFloat32, kBFloat16, kQ4_0, kQ4_1, kQ5_0, kQ8_0, kQ8_0Float, kQ4_K, kQ5_K, kQ6_K };

// Calls fn.template operator()<Format>() for the packed weight's format.
template <typename Fn>
void with_format(Kind kind, Fn&& fn) {
  switch (kind) {
    case Kind::kFloat32: fn.template operator()<FloatFormat<float>>(); break;
    case Kind::kBFloat16: fn.template operator()<FloatFormat<c10::BFloat16>>(); break;
    case Kind::kQ4_0: fn.template operator()<Q4_0Format>(); break;
    case Kind::kQ4_1: fn.template operator()<Q4_1Format>(); break;
    case Kind::kQ5_0: fn.template operator()<Q5_0Format>(); break;
    case Kind::kQ8_0: fn.template operator()<Q8_0Format>(); break;
    case Kind::kQ8_0Float: fn.template operator()<Q8_0FloatFormat>(); break;
    case Kind::kQ4_K: fn.template operator()<Q4_KFormat>(); break;
    case Kind::kQ5_K: fn.template operator()<Q5_KFormat>(); break;
    case Kind::kQ6_K: fn.template operator()<Q6_KFormat>(); break;
  }
}

// GGUF's name of each block format
constexpr std::pair<const char*, Kind> kBlockTypes[] = {
    {"Q4_0", Kind::kQ4_0}, {"Q4_1", Kind::kQ4_1}, {"Q5_0", Kind::kQ5_0}, {"Q8_0", Kind::kQ8_0},
    {"Q4_K", Kind::kQ4_K}, {"Q5_K", Kind::kQ5_K}, {"Q6_K", Kind::kQ6_K}};

// the formats with an int8 kernel (cpu/ops.h): the nibble ones (with Q5_0's and Q5_K's
// fifth bits), Q6_K and Q8_0 (in vpdpbusd's order): every quantized one but the k-major Q8_0
template <typename Format>
constexpr bool kHasInt8Kernel = Format::kQuantized && !std::is_same_v<Format, Q8_0FloatFormat>;
bool has_int8_kernel(Kind kind) {
  bool has = false;
  with_format(kind, [&]<typename Format>() { has = kHasInt8Kernel<Format>; });
  return has;
}

Kind kind_of(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(),
              "a packed weight from pack_linear_weight or pack_gguf_weight expected");
  switch (packed.scalar_type()) {
    case at::kFloat: return Kind::kFloat32;
    case at::kBFloat16: return Kind::kBFloat16;
    case at::kByte:
    case at::kChar:
      // each block format's group has its own size
      for (const auto& [name, kind] : kBlockTypes) {
        int64_t bytes = 0;
        with_format(kind, [&]<typename Format>() { bytes = Format::kGroupBytes; });
        if (packed.size(2) == bytes && (packed.scalar_type() == at::kByte || has_int8_kernel(kind)))
          // a uint8 Q8_0 panel is the float32 kernels' k-major one (pack_gguf_weight)
          return kind == Kind::kQ8_0 && packed.scalar_type() == at::kByte ? Kind::kQ8_0Float : kind;
      }
      break;
    default: break;
  }
  TORCH_CHECK(false, "not a packed weight: ", packed.scalar_type(), " ", packed.sizes());
  return Kind::kFloat32;  // not reached
}

int64_t packed_k(Kind kind, const at::Tensor& packed) {
  int64_t k = 0;
  with_format(kind, [&]<typename Format>() {
    k = Format::kQuantized ? packed.size(1) * Format::kSuperK : packed.size(1);
  });
  return k;
}

// Rows `ids` of the packed weight, as float32 [T, K] (an embedding lookup, or the whole
// weight back for BLAS when ids is 0..N-1).
template <typename Format>
void rows_impl(const uint8_t* packed, const int64_t* ids, int64_t T, int64_t K, float* out) {
  const int64_t panel_bytes = Format::panel_bytes(K);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = ids ? ids[t] : t;
      const uint8_t* panel = packed + n / kPanel * panel_bytes;
      for (int64_t k = 0; k < K; ++k) out[t * K + k] = Format::at(panel, k, n % kPanel);
    }
  });
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear_weight: a CPU [N, K] weight expected");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight: weight must be float32 or bfloat16");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  const int64_t elem = w.element_size();
  const auto* src = static_cast<const uint8_t*>(w.data_ptr());
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c)
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(dst + ((p * K + k) * kPanel + c) * elem, src + ((p * kPanel + c) * K + k) * elem, elem);
  });
  return packed;
}

bool int8_dot_supported() {
#ifdef PYSERVE_INT8_DOT
  return true;
#else
  return false;
#endif
}

// GGUF blocks [N, K / kSuperK * kBlockBytes] -> panels [N / 32, K / kSuperK, kGroupBytes]
template <typename Format>
at::Tensor pack_blocks(const at::Tensor& b, int64_t K, const std::string& type) {
  TORCH_CHECK(K > 0 && K % Format::kSuperK == 0, "pack_gguf_weight: K must be a multiple of ",
              Format::kSuperK, " for ", type, ", got ", K);
  const int64_t N = b.size(0), panels = (N + kPanel - 1) / kPanel, groups = K / Format::kSuperK;
  TORCH_CHECK(b.size(1) == groups * Format::kBlockBytes, "pack_gguf_weight: ", type, " rows of ", K,
              " weights take ", groups * Format::kBlockBytes, " bytes, got ", b.size(1));
  at::Tensor packed = at::zeros({panels, groups, Format::kGroupBytes}, b.options());
  const uint8_t* src = b.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c)
        for (int64_t g = 0; g < groups; ++g)
          Format::pack_block(src + (p * kPanel + c) * b.size(1) + g * Format::kBlockBytes,
                             dst + (p * groups + g) * Format::kGroupBytes, c);
  });
  return packed;
}

at::Tensor pack_gguf_weight(const at::Tensor& blocks, int64_t K, const std::string& type,
                            bool int8_activations) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.device().is_cpu(),
              "pack_gguf_weight: uint8 blocks [N, bytes per row] expected");
  const auto* named = std::find_if(std::begin(kBlockTypes), std::end(kBlockTypes),
                                   [&](const auto& entry) { return type == entry.first; });
  TORCH_CHECK(named != std::end(kBlockTypes),
              "pack_gguf_weight: type must be Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K, got ", type);
  const at::Tensor b = blocks.contiguous();
  const bool int8 = int8_activations && has_int8_kernel(named->second);
  // Q8_0 for float32 activations takes its k-major layout (kind_of tells it by the uint8)
  const Kind kind = named->second == Kind::kQ8_0 && !int8 ? Kind::kQ8_0Float : named->second;
  at::Tensor packed;
  with_format(kind, [&]<typename Format>() {
    if constexpr (Format::kQuantized) packed = pack_blocks<Format>(b, K, type);
  });
  return int8 ? packed.view(at::kChar) : packed;
}

at::Tensor packed_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const Kind kind = kind_of(packed);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "packed_rows: ids must be a contiguous int64 vector");
  const int64_t K = packed_k(kind, packed), rows = packed.size(0) * kPanel, T = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "packed_rows: id ", id[t], " outside [0, ", rows, ")");
  at::Tensor out = at::empty({T, K}, packed.options().dtype(at::kFloat));
  with_format(kind, [&]<typename Format>() {
    rows_impl<Format>(static_cast<const uint8_t*>(packed.data_ptr()), id, T, K, out.data_ptr<float>());
  });
  return out;
}

at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t N) {
  const Kind kind = kind_of(packed);
  TORCH_CHECK((N + kPanel - 1) / kPanel == packed.size(0),
              "unpack_linear_weight: N must fit the packed weight's panels");
  const int64_t K = packed_k(kind, packed);
  at::Tensor w = at::empty({N, K}, packed.options().dtype(at::kFloat));
  with_format(kind, [&]<typename Format>() {
    const auto* src = static_cast<const uint8_t*>(packed.data_ptr());
#ifdef PYSERVE_VEC
    // each panel widened with vectors into cache, then copied out row by row
    float* dst = w.data_ptr<float>();
    const int64_t panel_bytes = Format::panel_bytes(K);
    at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> widened(K * kPanel);
      for (int64_t p = p0; p < p1; ++p) {
        widen_groups<Format>(src + p * panel_bytes, K, 0, (K + kGroup - 1) / kGroup, widened.data());
        for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
          float* row = dst + (p * kPanel + c) * K;
          for (int64_t k = 0; k < K; ++k) row[k] = widened[k * kPanel + c];
        }
      }
    });
#else
    rows_impl<Format>(src, nullptr, N, K, w.data_ptr<float>());
#endif
  });
  return w;
}

void packed_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias) {
  const Kind kind = kind_of(packed);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "packed_linear: x [M, K] and out [M, N] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "packed_linear: x and out must be float32");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "packed_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(packed_k(kind, packed) == K, "packed_linear: x has ", K, " columns, the weight ",
              packed_k(kind, packed));
  TORCH_CHECK(out.size(0) == M && (N + kPanel - 1) / kPanel == packed.size(0),
              "packed_linear: out must be [M, N] with N within the packed weight's panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "packed_linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
#ifdef PYSERVE_INT8_DOT
  if (packed.scalar_type() == at::kChar) {  // kind_of let through only has_int8_kernel's
    const auto* weight = static_cast<const uint8_t*>(packed.data_ptr());
    with_format(kind, [&]<typename Format>() {
      if constexpr (kHasInt8Kernel<Format>)
        int8_linear<Format>(x.data_ptr<float>(), weight, b, out.data_ptr<float>(), M, N, K);
    });
    return;
  }
#endif
  with_format(kind, [&]<typename Format>() {
    packed_linear_impl<Format>(x.data_ptr<float>(), static_cast<const uint8_t*>(packed.data_ptr()), b,
                               out.data_ptr<float>(), M, N, K);
  });
}


void grouped_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                    const at::Tensor& offsets, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous(),
              "grouped_linear: packed must be [E, panels, groups, bytes], packed weights stacked");
  const Kind kind = kind_of(packed[0]);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat && x.is_contiguous() && out.stride(1) == 1,
              "grouped_linear: x [R, K] contiguous and out [R, N] (rows may be strided) float32");
  const int64_t E = packed.size(0), R = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(packed_k(kind, packed[0]) == K, "grouped_linear: x has ", K, " columns, the weights ",
              packed_k(kind, packed[0]));
  TORCH_CHECK(out.size(0) == R && (N + kPanel - 1) / kPanel == packed.size(1),
              "grouped_linear: out must be [R, N] with N within the packed weights' panels");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == E + 1 &&
                  offsets.is_contiguous(), "grouped_linear: offsets must be int64 [E + 1]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == R, "grouped_linear: offsets must run from 0 to x's rows");
  std::vector<GroupedJob> jobs;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(off[e + 1] >= off[e], "grouped_linear: offsets must not decrease");
    if (off[e + 1] > off[e]) jobs.push_back({e, off[e], off[e + 1]});
  }
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == E &&
                    bias->size(1) == N && bias->is_contiguous(), "grouped_linear: bias must be float32 [E, N]");
    b = bias->data_ptr<float>();
  }
  if (R == 0 || N == 0) return;
  const auto* weight = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t expert_bytes = packed[0].numel() * packed.element_size();
  const int64_t ldo = out.stride(0);
#ifdef PYSERVE_INT8_DOT
  if (packed.scalar_type() == at::kChar) {
    with_format(kind, [&]<typename Format>() {
      if constexpr (kHasInt8Kernel<Format>)
        grouped_int8_impl<Format>(x.data_ptr<float>(), R, weight, expert_bytes, jobs, b,
                                  out.data_ptr<float>(), ldo, N, K);
    });
    return;
  }
#endif
  with_format(kind, [&]<typename Format>() {
    grouped_linear_impl<Format>(x.data_ptr<float>(), weight, expert_bytes, jobs, b, out.data_ptr<float>(),
                                ldo, N, K);
  });
}

int64_t packed_in_features(const at::Tensor& packed) { return packed_k(kind_of(packed), packed); }

}  // namespace pyserve::cpu
