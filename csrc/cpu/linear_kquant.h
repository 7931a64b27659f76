// GGUF's Q4_0, Q5_0 and K-quant (Q4_K, Q5_K, Q6_K) blocks as panel formats of the packed linear
// kernel (csrc/cpu/linear.cpp): the same panels of 32 output columns, each GGUF block of one
// output row becoming one column of a group, its integers repacked so that a vector of
// columns at one k comes out of a load, a shift and a mask, and its scales kept as the file
// has them (float16 and 6- or 8-bit integers) and multiplied out in registers.
//
// Nibbles, in every format here, sit as linear.cpp's Q4_1 has them: per 32 k, two halves of 16
// columns, each 4 blocks of 64 bytes; in block j, bytes 4c .. 4c + 3 hold column c's q at
// k = 4j .. 4j + 3 in their low nibbles and at k = 16 + 4j .. in their high (vpdpbusd's order).
// Higher bits sit in one 32-bit word per column and 32 k (16 k for Q6_K's two bits), so one
// shift reads them for a vector of columns, in the nibbles' byte order, so that the int8
// kernel's bytes of k = 4j + b (b = 0 .. 3, a lane's four) get theirs from one shift and mask:
// Q5_0's and Q5_K's fifth bits at fifth_bit_position, Q6_K's two at q6_high_position.
//
// Groups (the unit of a panel's tensor dimension 1) hold 32 k for Q4_0 / Q5_0 and one
// super-block of 256 k for the K-quants, whose d and dmin cover all 256:
//   Q4_0: d[32] f16 | nibbles (512)                                  w = d·(q - 8)
//   Q5_0: d[32] f16 | high bits[32] u32 | nibbles (512)              w = d·(q - 16)
//   Q4_K: d[32], dmin[32] f16 | sc[8][32], m[8][32] u8 | 8 × nibbles w = (d·sc)·q - dmin·m
//   Q5_K: as Q4_K, then high bits[8][32] u32 before the nibbles      w = (d·sc)·q - dmin·m
//   Q6_K: d[32] f16 | sc[16][32] i8 | 8 × nibbles | 2-bit highs[8][2][32] u32  w = (d·sc)·(q - 32)
// Every product in those formulas is exact in float32 (d has 11 significant bits, sc at most
// 8, q at most 6: under 24), so the only rounding is the K-quants' final subtraction, which
// one FMA does exactly as the gguf package's separate product and difference do; the readers
// keep gguf's order of operations where only the sign of a zero would differ. Each format
// dequantizes bitwise as gguf.quants.dequantize.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "cpu/vec.h"

namespace pyserve::cpu::kquant {

inline constexpr int64_t kPanel = 32, kGroup = 32;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// offset of (k, column c)'s byte within 32 k of nibbles, and its nibble's shift
inline int64_t nibble_byte(int64_t k, int64_t c) { return (c / 16) * 256 + ((k % 16) / 4) * 64 + (c % 16) * 4 + k % 4; }
inline int nibble_shift(int64_t k) { return k % kGroup < 16 ? 0 : 4; }
inline int nibble_at(const uint8_t* nibbles, int64_t k, int64_t c) {
  return (nibbles[nibble_byte(k % kGroup, c)] >> nibble_shift(k % kGroup)) & 15;
}
inline void put_nibble(uint8_t* nibbles, int64_t k, int64_t c, int q) {
  uint8_t& dst = nibbles[nibble_byte(k, c)];
  dst = nibble_shift(k) == 0 ? (dst & 0xF0) | q : (dst & 0x0F) | (q << 4);
}
// All 32 k of column c at once (q[k] < 16): its 16 bytes written whole, where 32 calls of
// put_nibble read and wrote each byte twice (packing a model's experts took most of its load)
inline void put_nibble_column(uint8_t* nibbles, int64_t c, const uint8_t* q) {
  for (int64_t k = 0; k < 16; ++k)  // k in the byte's low nibble, k + 16 in its high
    nibbles[nibble_byte(k, c)] = static_cast<uint8_t>(q[k] | (q[k + 16] << 4));
}

// where the fifth bit of k (0 .. 31) sits in a Q5_0 / Q5_K column's word: byte b = k % 4, at
// bit k / 4 of it for k < 16 and 4 + (k - 16) / 4 above. Block j of the nibbles (k = 4j + b and
// 16 + 4j + b) then finds its fifth bits at bit 4 of each byte of (word << 4) >> j and of
// word >> j.
constexpr int fifth_bit_position(int64_t k) {
  return static_cast<int>(8 * (k % 4) + (k < 16 ? k / 4 : 4 + (k - 16) / 4));
}
inline uint32_t fifth_bit_word(const uint8_t* qh_bits) {  // 32 bits, bit i for k = i -> that order
  const uint32_t bits = u32_at(qh_bits);
  uint32_t word = 0;
  for (int i = 0; i < kGroup; ++i) word |= ((bits >> i) & 1u) << fifth_bit_position(i);
  return word;
}

// where the two high bits of k = i (0 .. 15) of a Q6_K column's 16 k sit in its word: byte
// b = i % 4, bits 2 (i / 4) and up. Block j of the nibbles (k = 4j + b) then finds them at bits
// 4, 5 of each byte of (word << 4) >> 2j.
constexpr int q6_high_position(int64_t i) { return static_cast<int>(8 * (i % 4) + 2 * (i / 4)); }

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> sc[8], m[8] (ggml's get_scale_min_k4)
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
    m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

#ifdef PYSERVE_VEC
namespace v {
using namespace simd;
constexpr int kVecs = kPanel / kLanes;
#if PYSERVE_VEC == 16
inline ivec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec iset1(int v) { return _mm512_set1_epi32(v); }
inline ivec iand(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec ior(ivec a, ivec b) { return _mm512_or_si512(a, b); }
inline ivec isub(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
template <int S> ivec srli(ivec a) { return S == 0 ? a : _mm512_srli_epi32(a, S); }
template <int S> ivec slli(ivec a) { return S == 0 ? a : _mm512_slli_epi32(a, S); }
inline vec to_float(ivec a) { return _mm512_cvtepi32_ps(a); }
inline vec u8_float(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec i8_float(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline ivec iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec iset1(int v) { return _mm256_set1_epi32(v); }
inline ivec iand(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec ior(ivec a, ivec b) { return _mm256_or_si256(a, b); }
inline ivec isub(ivec a, ivec b) { return _mm256_sub_epi32(a, b); }
template <int S> ivec srli(ivec a) { return S == 0 ? a : _mm256_srli_epi32(a, S); }
template <int S> ivec slli(ivec a) { return S == 0 ? a : _mm256_slli_epi32(a, S); }
inline vec to_float(ivec a) { return _mm256_cvtepi32_ps(a); }
inline vec u8_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec i8_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
inline vec half_float(const uint8_t* p) { return load(reinterpret_cast<const c10::Half*>(p)); }

// the q (0 .. 15) of columns kLanes·u .. at k = KK of 32 k of nibbles
template <int KK>
inline ivec nibbles(const uint8_t* base, int u) {
  constexpr int kShift = 8 * (KK % 4) + (KK % kGroup < 16 ? 0 : 4);
  const uint8_t* block = base + (KK % 16) / 4 * 64 + (u * kLanes / 16) * 256 + (u * kLanes % 16) * 4;
  return iand(srli<kShift>(iload(block)), iset1(15));
}
// bits B .. B + width - 1 of each column's word, moved to bits 4 .. (the q's high bits)
template <int B, int Mask>
inline ivec high_bits(const uint8_t* words, int u) {
  const ivec w = iload(words + u * kLanes * 4);
  if constexpr (B >= 4) return iand(srli<B - 4>(w), iset1(Mask));
  else return iand(slli<4 - B>(w), iset1(Mask));
}
#if PYSERVE_VEC == 16
// AVX-512 readers look the weight up in a table of floats instead of masking and converting
// its integer: vpermps reads only the low 4 bits of each index lane and vpermt2ps the low 5,
// so an index needs no mask, and a 5-bit one takes its fifth bit with one vpternlogd. 6 vector
// ops a weight vector for Q5_0 where masking, or-ing, subtracting and converting took 9; the
// values are the same floats, so the weights are bitwise the same.
// The q of columns kLanes·u at k = KK in bits 0 .. 3, other nibbles' bits above them.
template <int KK>
inline ivec nibbles_unmasked(const uint8_t* base, int u) {
  constexpr int kShift = 8 * (KK % 4) + (KK % kGroup < 16 ? 0 : 4);
  return srli<kShift>(iload(base + (KK % 16) / 4 * 64 + (u * kLanes / 16) * 256 + (u * kLanes % 16) * 4));
}
// bits 0 .. 3 of nibble, bit 4 of fifth (B: where fifth's word holds it), the rest either's
template <int B>
inline ivec with_fifth_bit(ivec nibble, const uint8_t* words, int u) {
  const ivec w = iload(words + u * kLanes * 4);
  ivec fifth;
  if constexpr (B >= 4) fifth = srli<B - 4>(w);
  else fifth = slli<4 - B>(w);
  // 0xD8: c ? b : a bit by bit, c the mask of bit 4
  return _mm512_ternarylogic_epi32(nibble, fifth, _mm512_set1_epi32(16), 0xD8);
}
// table[index & 15]; (index & 16 ? high : low)[index & 15]
inline vec lookup16(ivec index, vec table) { return _mm512_permutexvar_ps(index, table); }
inline vec lookup32(ivec index, vec low, vec high) { return _mm512_permutex2var_ps(low, index, high); }
// the floats first, first + 1, ..., first + 15
inline vec counting_from(float first) {
  return _mm512_add_ps(_mm512_set1_ps(first),
                       _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
#endif
}  // namespace v
#endif

struct Q4_0Format {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kSuperK = 32, kBlockBytes = 18, kGroupBytes = 64 + 512;
  static int64_t panel_bytes(int64_t K) { return K / kSuperK * kGroupBytes; }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    const uint8_t* g = panel + k / kSuperK * kGroupBytes;
    return half_at(g + 2 * c) * static_cast<float>(nibble_at(g + 64, k, c) - 8);
  }
  static void pack_block(const uint8_t* block, uint8_t* g, int64_t c) {
    std::memcpy(g + 2 * c, block, 2);
    uint8_t q[kGroup];
    for (int64_t j = 0; j < kGroup; ++j) q[j] = j < 16 ? block[2 + j] & 15 : block[2 + j - 16] >> 4;
    put_nibble_column(g + 64, c, q);
  }
#ifdef PYSERVE_VEC
  struct Reader {
    simd::vec d[v::kVecs];
    const uint8_t* q;
    Reader(const uint8_t* group, int = 0) : q(group + 64) {
      for (int u = 0; u < v::kVecs; ++u) d[u] = v::half_float(group + u * v::kLanes * 2);
    }
    // d·(q - 8) as gguf computes it: d·q - 8d in one FMA would give +0 where d < 0 and q = 8
    // make gguf's -0
    template <int KK>
    void row(simd::vec* w) const {
#if PYSERVE_VEC == 16
      const simd::vec centred = v::counting_from(-8.f);  // q - 8 for q = 0 .. 15
      for (int u = 0; u < v::kVecs; ++u) w[u] = simd::mul(d[u], v::lookup16(v::nibbles_unmasked<KK>(q, u), centred));
#else
      for (int u = 0; u < v::kVecs; ++u)
        w[u] = simd::mul(d[u], v::to_float(v::isub(v::nibbles<KK>(q, u), v::iset1(8))));
#endif
    }
  };
#endif
#ifdef PYSERVE_VEC
  // the int8-activation kernel's view of 32 k g: its nibbles, and w = d·q + m
  static const uint8_t* int8_nibbles(const uint8_t* panel, int64_t g) { return panel + g * kGroupBytes + 64; }
  // (of the kLanes columns from kLanes·u)
  static void int8_scales(const uint8_t* panel, int64_t g, int u, simd::vec& d, simd::vec& m) {
    d = v::half_float(panel + g * kGroupBytes + u * v::kLanes * 2);
    m = simd::mul(d, simd::set1(-8.f));
  }
#endif
};

struct Q5_0Format {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kSuperK = 32, kBlockBytes = 22, kGroupBytes = 64 + 128 + 512;
  static int64_t panel_bytes(int64_t K) { return K / kSuperK * kGroupBytes; }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    const uint8_t* g = panel + k / kSuperK * kGroupBytes;
    const int q = nibble_at(g + 192, k, c) | ((u32_at(g + 64 + 4 * c) >> fifth_bit_position(k % kGroup)) & 1) << 4;
    return half_at(g + 2 * c) * static_cast<float>(q - 16);
  }
  static void pack_block(const uint8_t* block, uint8_t* g, int64_t c) {
    std::memcpy(g + 2 * c, block, 2);
    const uint32_t fifth = fifth_bit_word(block + 2);  // the file's bit i: q_i's fifth bit
    std::memcpy(g + 64 + 4 * c, &fifth, 4);
    uint8_t q[kGroup];
    for (int64_t j = 0; j < kGroup; ++j) q[j] = j < 16 ? block[6 + j] & 15 : block[6 + j - 16] >> 4;
    put_nibble_column(g + 192, c, q);
  }
#ifdef PYSERVE_VEC
  struct Reader {
    simd::vec d[v::kVecs];
    const uint8_t *high, *q;
    Reader(const uint8_t* group, int = 0) : high(group + 64), q(group + 192) {
      for (int u = 0; u < v::kVecs; ++u) d[u] = v::half_float(group + u * v::kLanes * 2);
    }
    template <int KK>
    void row(simd::vec* w) const {
#if PYSERVE_VEC == 16
      const simd::vec low = v::counting_from(-16.f), upper = v::counting_from(0.f);  // q - 16
      for (int u = 0; u < v::kVecs; ++u) {
        const auto index = v::with_fifth_bit<fifth_bit_position(KK % kGroup)>(v::nibbles_unmasked<KK>(q, u), high, u);
        w[u] = simd::mul(d[u], v::lookup32(index, low, upper));
      }
#else
      for (int u = 0; u < v::kVecs; ++u) {
        const auto ints = v::ior(v::nibbles<KK>(q, u), v::high_bits<fifth_bit_position(KK % kGroup), 16>(high, u));
        w[u] = simd::mul(d[u], v::to_float(v::isub(ints, v::iset1(16))));
      }
#endif
    }
  };
#endif
#ifdef PYSERVE_VEC
  // the int8 kernel's view of 32 k g: nibbles, fifth bits and w = d·q + m (m = -16 d)
  static const uint8_t* int8_nibbles(const uint8_t* panel, int64_t g) { return panel + g * kGroupBytes + 192; }
  static const uint8_t* int8_fifth_bits(const uint8_t* panel, int64_t g) { return panel + g * kGroupBytes + 64; }
  static void int8_scales(const uint8_t* panel, int64_t g, int u, simd::vec& d, simd::vec& m) {
    d = v::half_float(panel + g * kGroupBytes + u * v::kLanes * 2);
    m = simd::mul(d, simd::set1(-16.f));
  }
#endif
};

// Q4_K and Q5_K: the same super-block but for Q5_K's plane of fifth bits
template <bool kFifthBit>
struct QK45Format {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kSuperK = 256, kBlockBytes = kFifthBit ? 176 : 144;
  static constexpr int64_t kHigh = 640, kNibbles = kFifthBit ? 640 + 8 * 128 : 640;
  static constexpr int64_t kGroupBytes = kNibbles + 8 * 512;
  static int64_t panel_bytes(int64_t K) { return K / kSuperK * kGroupBytes; }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    const uint8_t* g = panel + k / kSuperK * kGroupBytes;
    const int64_t s = k % kSuperK / kGroup;
    int q = nibble_at(g + kNibbles + s * 512, k, c);
    if (kFifthBit) q |= ((u32_at(g + kHigh + s * 128 + 4 * c) >> fifth_bit_position(k % kGroup)) & 1) << 4;
    const float dsc = half_at(g + 2 * c) * static_cast<float>(g[128 + s * 32 + c]);
    const float dm = half_at(g + 64 + 2 * c) * static_cast<float>(g[384 + s * 32 + c]);
    return dsc * static_cast<float>(q) - dm;
  }
  // GGUF: d, dmin (f16), scales[12], [qh[32]: bit s of byte i is the fifth bit of q at 32 s + i],
  // qs[128]: q at 64 j + i (i < 32) in the low nibble of byte 32 j + i, at 64 j + 32 + i in its high
  static void pack_block(const uint8_t* block, uint8_t* g, int64_t c) {
    std::memcpy(g + 2 * c, block, 2);
    std::memcpy(g + 64 + 2 * c, block + 2, 2);
    uint8_t sc[8], m[8];
    k_scales(block + 4, sc, m);
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + (kFifthBit ? 48 : 16);
    for (int s = 0; s < 8; ++s) {
      g[128 + s * 32 + c] = sc[s];
      g[384 + s * 32 + c] = m[s];
      uint32_t high = 0;
      uint8_t q[kGroup];
      for (int i = 0; i < kGroup; ++i) {
        q[i] = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 15;
        if (kFifthBit) high |= static_cast<uint32_t>((qh[i] >> s) & 1) << fifth_bit_position(i);
      }
      put_nibble_column(g + kNibbles + s * 512, c, q);
      if (kFifthBit) std::memcpy(g + kHigh + s * 128 + 4 * c, &high, 4);
    }
  }
#ifdef PYSERVE_VEC
  struct Reader {
    simd::vec dsc[v::kVecs], neg_dm[v::kVecs];
    const uint8_t *high, *q;
    // sub: which 32 k of the super-block
    Reader(const uint8_t* group, int sub) : high(group + kHigh + sub * 128), q(group + kNibbles + sub * 512) {
      for (int u = 0; u < v::kVecs; ++u) {
        dsc[u] = simd::mul(v::half_float(group + u * v::kLanes * 2), v::u8_float(group + 128 + sub * 32 + u * v::kLanes));
        const simd::vec dm = simd::mul(v::half_float(group + 64 + u * v::kLanes * 2),
                                       v::u8_float(group + 384 + sub * 32 + u * v::kLanes));
        neg_dm[u] = simd::mul(dm, simd::set1(-1.f));  // a sign flip, -0 for +0: x + -y is x - y
      }
    }
    template <int KK>
    void row(simd::vec* w) const {
#if PYSERVE_VEC == 16
      const simd::vec low = v::counting_from(0.f), upper = v::counting_from(16.f);
      for (int u = 0; u < v::kVecs; ++u) {
        const auto nibble = v::nibbles_unmasked<KK>(q, u);
        simd::vec qf;
        if constexpr (kFifthBit)
          qf = v::lookup32(v::with_fifth_bit<fifth_bit_position(KK % kGroup)>(nibble, high, u), low, upper);
        else
          qf = v::lookup16(nibble, low);
        w[u] = simd::fma(dsc[u], qf, neg_dm[u]);
      }
#else
      for (int u = 0; u < v::kVecs; ++u) {
        auto ints = v::nibbles<KK>(q, u);
        if constexpr (kFifthBit) ints = v::ior(ints, v::high_bits<fifth_bit_position(KK % kGroup), 16>(high, u));
        w[u] = simd::fma(dsc[u], v::to_float(ints), neg_dm[u]);
      }
#endif
    }
  };
#endif
#ifdef PYSERVE_VEC
  static const uint8_t* int8_nibbles(const uint8_t* panel, int64_t g) {
    return panel + g / 8 * kGroupBytes + kNibbles + g % 8 * 512;
  }
  static const uint8_t* int8_fifth_bits(const uint8_t* panel, int64_t g) requires kFifthBit {
    return panel + g / 8 * kGroupBytes + kHigh + g % 8 * 128;
  }
  static void int8_scales(const uint8_t* panel, int64_t g, int u, simd::vec& d, simd::vec& m) {
    const uint8_t* group = panel + g / 8 * kGroupBytes;
    const int64_t s = g % 8;
    d = simd::mul(v::half_float(group + u * v::kLanes * 2), v::u8_float(group + 128 + s * 32 + u * v::kLanes));
    m = simd::sub(simd::zero(), simd::mul(v::half_float(group + 64 + u * v::kLanes * 2),
                                          v::u8_float(group + 384 + s * 32 + u * v::kLanes)));
  }
#endif
};
using Q4_KFormat = QK45Format<false>;
using Q5_KFormat = QK45Format<true>;

struct Q6_KFormat {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kSuperK = 256, kBlockBytes = 210;
  static constexpr int64_t kNibbles = 64 + 16 * 32, kHigh = kNibbles + 8 * 512, kGroupBytes = kHigh + 8 * 256;
  static int64_t panel_bytes(int64_t K) { return K / kSuperK * kGroupBytes; }
  static float at(const uint8_t* panel, int64_t k, int64_t c) {
    const uint8_t* g = panel + k / kSuperK * kGroupBytes;
    const int64_t s = k % kSuperK / kGroup, i = k % kGroup;
    const uint32_t high = u32_at(g + kHigh + s * 256 + (i / 16) * 128 + 4 * c);
    const int q = nibble_at(g + kNibbles + s * 512, k, c) | ((high >> q6_high_position(i % 16)) & 3) << 4;
    const float ds = half_at(g + 2 * c) * static_cast<float>(static_cast<int8_t>(g[64 + (k % kSuperK / 16) * 32 + c]));
    return ds * static_cast<float>(q - 32);
  }
  // GGUF: ql[128], qh[64], scales[16] (int8, one per 16 k), d (f16). q at 128 h + 64 t + i (i < 64):
  // nibble t of ql[64 h + i]; its bits 4, 5 at 128 h + 32 t + i (i < 32): bits 2t, 2t + 1 of qh[32 h + i]
  static void pack_block(const uint8_t* block, uint8_t* g, int64_t c) {
    std::memcpy(g + 2 * c, block + 208, 2);
    for (int j = 0; j < 16; ++j) g[64 + j * 32 + c] = block[192 + j];
    for (int s = 0; s < 8; ++s) {
      uint32_t high[2] = {0, 0};
      for (int i = 0; i < kGroup; ++i) {
        const int e = 32 * s + i, h = e / 128, r = e % 128;
        put_nibble(g + kNibbles + s * 512, i, c, (block[64 * h + r % 64] >> (4 * (r / 64))) & 15);
        high[i / 16] |= static_cast<uint32_t>((block[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3)
                        << q6_high_position(i % 16);
      }
      std::memcpy(g + kHigh + s * 256 + 4 * c, &high[0], 4);
      std::memcpy(g + kHigh + s * 256 + 128 + 4 * c, &high[1], 4);
    }
  }
#ifdef PYSERVE_VEC
  struct Reader {
    simd::vec ds[2][v::kVecs];  // [k < 16, k >= 16]: the two 16-k scales of these 32 k
    const uint8_t *high, *q;
    Reader(const uint8_t* group, int sub) : high(group + kHigh + sub * 256), q(group + kNibbles + sub * 512) {
      for (int u = 0; u < v::kVecs; ++u) {
        const simd::vec d = v::half_float(group + u * v::kLanes * 2);
        for (int h = 0; h < 2; ++h) ds[h][u] = simd::mul(d, v::i8_float(group + 64 + (2 * sub + h) * 32 + u * v::kLanes));
      }
    }
    template <int KK>
    void row(simd::vec* w) const {
      constexpr int kHalf = KK % kGroup / 16;
      for (int u = 0; u < v::kVecs; ++u) {
        const auto ints = v::ior(v::nibbles<KK>(q, u), v::high_bits<q6_high_position(KK % 16), 0x30>(high + kHalf * 128, u));
        w[u] = simd::mul(ds[kHalf][u], v::to_float(v::isub(ints, v::iset1(32))));
      }
    }
  };
#endif
#ifdef PYSERVE_VEC
  // the int8 kernel's view of 32 k g: its nibbles, its two 16 k's high-bit words (t = 0: k <
  // 16) and, for the kLanes columns from kLanes·u, each 16 k's scale d·sc (w = d·sc·(q - 32))
  static const uint8_t* int8_nibbles(const uint8_t* panel, int64_t g) {
    return panel + g / 8 * kGroupBytes + kNibbles + g % 8 * 512;
  }
  static const uint8_t* int8_high_bits(const uint8_t* panel, int64_t g, int t) {
    return panel + g / 8 * kGroupBytes + kHigh + g % 8 * 256 + t * 128;
  }
  static simd::vec int8_scale(const uint8_t* panel, int64_t g, int t, int u) {
    const uint8_t* group = panel + g / 8 * kGroupBytes;
    return simd::mul(v::half_float(group + u * v::kLanes * 2), v::i8_float(group + 64 + (2 * (g % 8) + t) * 32 + u * v::kLanes));
  }
#endif
};

}  // namespace pyserve::cpu::kquant
