// Paged KV-cache writes and paged attention on the CPU.
//
// Attention is computed one (query row, KV head) pair at a time: the row's G = num_heads /
// num_kv_heads query heads walk the sequence's blocks once, each keeping an online softmax
// (running max m, running sum l, unnormalised output acc, all float32) so that no score matrix
// is ever materialised and memory stays O(head_size) per head whatever the context length.
// Head sizes 64, 128 and 256 take a SIMD path (a block's scores for all G heads, their
// exponentials a vector at a time, then the value rows into register accumulators); others
// take the plain loop, which is also the specification of both.
//
// A prefill chunk's rows (more than kRowwiseMaxRows = 17; with AVX-512, blocks of a multiple
// of 16 tokens and G <= 16) go 16 query heads at a time (16 / G rows): the heads are
// transposed once into [D][16], so one key's 16 scores are D FMAs, each broadcasting one
// element of the key, with no horizontal sums, and the online softmax runs on 16 heads at
// once. The one-row path spends a horizontal sum per key and head, which held prefill
// attention to a fifth of the FMA peak.
//
// Sliding windows and softcapping (Gemma 2/3, Mistral): with window > 0 a query at position p
// sees keys (p - window, p], so every path walks keys [begin, end) of its row, begin =
// max(0, end - window), from the block (tile: the 16-key chunk) holding begin, keys below begin
// masked; window <= 0 is global attention. softcap > 0 maps each scaled score s to
// softcap * tanh(s / softcap) before the softmax (the one-row paths only: the tile path is not
// taken then).
//
// Under a float32 query the cache may be narrower (bfloat16, float16, float8 e5m2:
// --kv-cache-dtype): every path widens each key and value to float32 as it loads it and then
// sums exactly as over a float32 cache holding those values.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/ops.h"
#include "cpu/vec.h"

namespace pyserve::cpu {
namespace {

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

template <typename scalar_t>
inline void axpy(float* acc, float p, const scalar_t* v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * static_cast<float>(v[d]);
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(cache.stride(3) == 1, name, " must be contiguous in head_size");
}

template <typename scalar_t, typename cache_t>
void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  cache_t* kc = key_cache.data_ptr<cache_t>();
  cache_t* vc = value_cache.data_ptr<cache_t>();
  // a decode batch's tokens split over the cores (16 of SmolLM2's: 0.4 against 0.5 ms a step
  // over 30 layers, each line written a miss)
  at::parallel_for(0, num_tokens, rows_grain(2 * num_heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* ks = k + t * key.stride(0) + h * key.stride(1);
        const scalar_t* vs = v + t * value.stride(0) + h * value.stride(1);
        cache_t* kd = kc + block * key_cache.stride(0) + h * key_cache.stride(1) +
                       offset * key_cache.stride(2);
        cache_t* vd = vc + block * value_cache.stride(0) + h * value_cache.stride(1) +
                       offset * value_cache.stride(2);
        // a narrower cache rounds to nearest even (c10's conversions)
        for (int64_t d = 0; d < head_size; ++d) {
          kd[d] = static_cast<cache_t>(ks[d]);
          vd[d] = static_cast<cache_t>(vs[d]);
        }
      }
    }
  });
}

#ifdef PYSERVE_VEC
// One work item of the SIMD path: query row t's G heads of one KV head against keys
// [0, num_keys) of its sequence. qf holds the G query heads, scaled, as float32.
template <int D, typename scalar_t>
void attend_simd(const float* qf, int64_t group, const int32_t* table, int64_t key_begin,
                 int64_t num_keys, const scalar_t* k_head, const scalar_t* v_head,
                 int64_t block_stride, int64_t token_stride, int64_t block_size, float softcap,
                 float* scores, float* acc, float* m, float* l) {
  using namespace simd;
  constexpr int NV = D / kLanes;
  const int64_t padded = (block_size + kLanes - 1) / kLanes * kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < group; ++g) {
    m[g] = neg_inf;
    l[g] = 0.f;
    for (int v = 0; v < NV; ++v) store(acc + g * D + v * kLanes, zero());
  }
  for (int64_t first = key_begin / block_size * block_size; first < num_keys; first += block_size) {
    const int64_t block = table[first / block_size];
    const int64_t n = std::min(block_size, num_keys - first);
    const int64_t j0 = std::max<int64_t>(0, key_begin - first);  // keys before it: out of the window
    const scalar_t* kb = k_head + block * block_stride;
    const scalar_t* vb = v_head + block * block_stride;
    // Blocks sit anywhere in the cache, so the hardware prefetcher cannot follow a sequence
    // from one to the next: fetch the next block's row j while this block's row j is used.
    // The first two lines of the block after next as well: its keys' and values' pages then
    // have the hardware's stream prefetcher running on them before the next block's prefetches
    // below reach them (7-10 % more GB/s read over 30 layers' own caches, batches of 16 and
    // 64: benchmarks/attention.py --own-caches)
    if (first + 2 * block_size < num_keys) {
      const int64_t after_next = table[first / block_size + 2];
      for (const scalar_t* head : {k_head, v_head})
        for (int64_t line = 0; line < 128; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(head + after_next * block_stride) + line, _MM_HINT_T1);
    }
    const bool more = first + block_size < num_keys;
    const int64_t next = more ? table[first / block_size + 1] : block;
    const char* k_next = reinterpret_cast<const char*>(k_head + next * block_stride);
    const char* v_next = reinterpret_cast<const char*>(v_head + next * block_stride);
    constexpr int64_t kRowBytes = D * sizeof(scalar_t);
    for (int64_t j = j0; j < n; ++j) {
      if (more)
        for (int64_t line = 0; line < kRowBytes; line += 64)
          _mm_prefetch(k_next + j * token_stride * sizeof(scalar_t) + line, _MM_HINT_T0);
      vec k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load(kb + j * token_stride + v * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qf + g * D;
        vec dot = mul(load(q), k[0]);
        for (int v = 1; v < NV; ++v) dot = fma(load(q + v * kLanes), k[v], dot);
        const float score = reduce_add(dot);
        scores[g * padded + j] = softcap > 0.f ? softcap * std::tanh(score / softcap) : score;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * padded;
      for (int64_t j = 0; j < j0; ++j) s[j] = neg_inf;
      for (int64_t j = n; j < padded; ++j) s[j] = neg_inf;
      vec block_max = load(s);
      for (int64_t c = kLanes; c < padded; c += kLanes) block_max = max(block_max, load(s + c));
      const float new_max = std::max(m[g], reduce_max(block_max));
      const float correction = m[g] == neg_inf ? 0.f : std::exp(m[g] - new_max);
      const vec shift = set1(new_max);
      for (int64_t c = 0; c < padded; c += kLanes) store(s + c, exp_clamped(sub(load(s + c), shift)));
      float sum = 0.f;
      for (int64_t j = j0; j < n; ++j) sum += s[j];  // the masked keys' tiny values left out
      l[g] = l[g] * correction + sum;
      m[g] = new_max;
      vec out[NV];
      const vec corr = set1(correction);
      for (int v = 0; v < NV; ++v) out[v] = mul(load(acc + g * D + v * kLanes), corr);
      for (int64_t j = j0; j < n; ++j) {
        if (more && g == 0)
          for (int64_t line = 0; line < kRowBytes; line += 64)
            _mm_prefetch(v_next + j * token_stride * sizeof(scalar_t) + line, _MM_HINT_T0);
        const vec p = set1(s[j]);
        const scalar_t* vj = vb + j * token_stride;
        for (int v = 0; v < NV; ++v) out[v] = fma(p, load(vj + v * kLanes), out[v]);
      }
      for (int v = 0; v < NV; ++v) store(acc + g * D + v * kLanes, out[v]);
    }
  }
}

template <typename scalar_t>
using attend_fn = void (*)(const float*, int64_t, const int32_t*, int64_t, int64_t, const scalar_t*,
                           const scalar_t*, int64_t, int64_t, int64_t, float, float*, float*,
                           float*, float*);

// The SIMD path for this cache type and head size, or nullptr (then the plain loop runs).
template <typename scalar_t>
attend_fn<scalar_t> simd_attention(int64_t head_size) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return nullptr;
  } else {
    return head_size == 64    ? &attend_simd<64, scalar_t>
           : head_size == 128 ? &attend_simd<128, scalar_t>
           : head_size == 256 ? &attend_simd<256, scalar_t>
                              : nullptr;
  }
}

#if PYSERVE_VEC == 16
constexpr int64_t kChunk = 16;  // keys per chunk, and query heads per tile: one vector each

// Rows [row0, row0 + rows) of one sequence, all G heads of one KV head, rows * G <= 16 query
// heads in all (lane i = row i / G, head i % G): row r sees keys [row_begin[r], row_keys[r]),
// both ascending in r. qf [rows * G][D] holds the query heads, scaled. The heads are
// transposed once into qt [D][16], so the scores of one key for all 16 heads are D FMAs with
// the key's elements broadcast straight from the cache, and the online softmax runs on all
// heads at once; results (unnormalised) go to acc [16][D] with l, as attend_simd's.
template <int D, typename scalar_t>
void attend_tile(const float* qf, int64_t rows, int64_t group, const int64_t* row_begin,
                 const int64_t* row_keys, const int32_t* table, const scalar_t* k_head,
                 const scalar_t* v_head, int64_t block_stride, int64_t token_stride,
                 int64_t block_size, float* qt, float* probs, float* acc, float* l_out) {
  using namespace simd;
  constexpr int NV = D / kLanes;
  // output rows (query head pairs) updated together in the P·V product: 16 accumulators, plus
  // NV value vectors (head size 256: one row at a time)
  constexpr int kPairs = NV <= 8 ? 16 / NV : 1;
  constexpr float kFloor = -1e30f;  // a finite "minus infinity": floor - floor is 0, not NaN
  const int64_t pairs = rows * group, max_keys = row_keys[rows - 1];
  alignas(64) int32_t lane_keys[kChunk], lane_begin[kChunk];
  for (int64_t i = 0; i < kChunk; ++i) {
    lane_keys[i] = i < pairs ? static_cast<int32_t>(row_keys[i / group]) : 0;
    lane_begin[i] = i < pairs ? static_cast<int32_t>(row_begin[i / group]) : 0;
  }
  const __m512i keys_of_lane = _mm512_load_si512(lane_keys);
  const __m512i begin_of_lane = _mm512_load_si512(lane_begin);
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < kChunk; ++i) qt[d * kChunk + i] = i < pairs ? qf[i * D + d] : 0.f;
  for (int64_t i = 0; i < pairs; ++i)
    for (int v = 0; v < NV; ++v) store(acc + i * D + v * kLanes, zero());
  vec m = set1(kFloor), l = zero();
  alignas(64) float corr[kChunk];
  for (int64_t first = row_begin[0] / kChunk * kChunk; first < max_keys; first += kChunk) {
    const int64_t offset = (first % block_size) * token_stride;
    const scalar_t* kb = k_head + table[first / block_size] * block_stride + offset;
    const scalar_t* vb = v_head + table[first / block_size] * block_stride + offset;
    const int64_t n = std::min(kChunk, max_keys - first);
    // scores[j]: key first + j against every head. All kChunk keys of the chunk, n or not: a
    // constant trip count keeps the 16 sums in registers (a loop to n kept them in memory, a
    // load and a store for every FMA), and the chunk lies within one cache block, so the keys
    // past n are readable; their scores are never used. Keys stored densely (token stride D,
    // the cache's own layout) are addressed from one pointer with constant offsets: sixteen
    // strided pointers would not fit the registers. Inlined by force: called out of line, the
    // lambda reached the sums through memory again (a quarter slower).
    vec scores[kChunk];
    auto score_chunk = [&](const auto* keys, auto stride) __attribute__((always_inline)) {
      for (int j = 0; j < kChunk; ++j) scores[j] = zero();
      for (int64_t d = 0; d < D; ++d) {
        const vec q = load(qt + d * kChunk);
        for (int j = 0; j < kChunk; ++j) scores[j] = fma(set1(static_cast<float>(keys[j * stride + d])), q, scores[j]);
      }
    };
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (token_stride == D)
        score_chunk(kb, std::integral_constant<int64_t, D>{});
      else
        score_chunk(kb, token_stride);
    } else {
      // a narrower cache: the chunk's keys widened to float32 once, so that each broadcast
      // above stays one load from memory rather than a scalar conversion per FMA
      alignas(64) float wide[kChunk * D];
      for (int j = 0; j < kChunk; ++j)
        for (int v = 0; v < NV; ++v) store(wide + j * D + v * kLanes, load(kb + j * token_stride + v * kLanes));
      score_chunk(wide, std::integral_constant<int64_t, D>{});
    }
    __mmask16 seen[kChunk];  // lanes whose row sees key first + j
    vec chunk_max = set1(kFloor);
    for (int64_t j = 0; j < n; ++j) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(first + j));
      seen[j] = _mm512_cmpgt_epi32_mask(keys_of_lane, key) & _mm512_cmple_epi32_mask(begin_of_lane, key);
      chunk_max = _mm512_mask_max_ps(chunk_max, seen[j], chunk_max, scores[j]);
    }
    const vec new_m = max(m, chunk_max);
    const vec correction = exp_clamped(sub(m, new_m));
    l = mul(l, correction);
    for (int64_t j = 0; j < n; ++j) {
      const vec p = _mm512_maskz_mov_ps(seen[j], exp_clamped(sub(scores[j], new_m)));
      l = add(l, p);
      store(probs + j * kChunk, p);
    }
    m = new_m;
    store(corr, correction);
    for (int64_t i0 = 0; i0 < pairs; i0 += kPairs) {
      const int64_t block = std::min<int64_t>(kPairs, pairs - i0);
      int64_t longest = 0;
      bool all_see = true;
      for (int64_t i = i0; i < i0 + block; ++i) {
        const int64_t valid = std::min(n, row_keys[i / group] - first);
        all_see = all_see && valid > 0;
        longest = std::max(longest, valid);
      }
      if constexpr (kPairs > 1) {
        if (block == kPairs && all_see) {
          // kPairs rows of the output at once, each value vector loaded once for all of them
          // (one row at a time loads one per FMA, and the loads, not the FMAs, set the pace).
          // A pair whose row stops before key j (or whose window starts after it) has
          // probability 0 there: it adds exactly 0.
          vec out[kPairs][NV];
          for (int p = 0; p < kPairs; ++p) {
            const vec c = set1(corr[i0 + p]);
            for (int v = 0; v < NV; ++v) out[p][v] = mul(load(acc + (i0 + p) * D + v * kLanes), c);
          }
          for (int64_t j = 0; j < longest; ++j) {
            const scalar_t* vj = vb + j * token_stride;
            vec values[NV];
            for (int v = 0; v < NV; ++v) values[v] = load(vj + v * kLanes);
            for (int p = 0; p < kPairs; ++p) {
              const vec prob = set1(probs[j * kChunk + i0 + p]);
              for (int v = 0; v < NV; ++v) out[p][v] = fma(prob, values[v], out[p][v]);
            }
          }
          for (int p = 0; p < kPairs; ++p)
            for (int v = 0; v < NV; ++v) store(acc + (i0 + p) * D + v * kLanes, out[p][v]);
          continue;
        }
      }
      for (int64_t i = i0; i < i0 + block; ++i) {
        const int64_t valid = std::min(n, row_keys[i / group] - first);
        if (valid <= 0) continue;  // this row's causal limit lies before the chunk
        vec out[NV];
        const vec c = set1(corr[i]);
        for (int v = 0; v < NV; ++v) out[v] = mul(load(acc + i * D + v * kLanes), c);
        for (int64_t j = 0; j < valid; ++j) {
          const vec p = set1(probs[j * kChunk + i]);
          const scalar_t* vj = vb + j * token_stride;
          for (int v = 0; v < NV; ++v) out[v] = fma(p, load(vj + v * kLanes), out[v]);
        }
        for (int v = 0; v < NV; ++v) store(acc + i * D + v * kLanes, out[v]);
      }
    }
  }
  store(l_out, l);
}

template <typename scalar_t>
using tile_fn = void (*)(const float*, int64_t, int64_t, const int64_t*, const int64_t*, const int32_t*,
                         const scalar_t*, const scalar_t*, int64_t, int64_t, int64_t, float*,
                         float*, float*, float*);

template <typename scalar_t>
tile_fn<scalar_t> tile_attention(int64_t head_size, int64_t block_size, int64_t group) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return nullptr;
  } else {
    if (block_size % kChunk != 0 || group > kChunk) return nullptr;
    return head_size == 64    ? &attend_tile<64, scalar_t>
           : head_size == 128 ? &attend_tile<128, scalar_t>
           : head_size == 256 ? &attend_tile<256, scalar_t>
                              : nullptr;
  }
}
#endif
#endif

// One work item of the plain path: the same contract as attend_simd, any head size and any
// key/value strides.
template <typename scalar_t>
void attend_plain(const float* qf, int64_t group, int64_t head_size, const int32_t* table,
                  int64_t key_begin, int64_t num_keys, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, int64_t kv_head, float softcap, float* scores,
                  float* acc, float* m, float* l) {
  const int64_t block_size = key_cache.size(2);
  const scalar_t* kc = key_cache.data_ptr<scalar_t>() + kv_head * key_cache.stride(1);
  const scalar_t* vc = value_cache.data_ptr<scalar_t>() + kv_head * value_cache.stride(1);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // A narrower cache's rows (under a float32 query) are widened before the float32 loops, so that
  // the sums run in the order they take over a float32 cache holding the same values.
  std::vector<float> wide(std::is_same_v<scalar_t, float> ? 0 : head_size);
  auto row = [&](const scalar_t* r) {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      return r;
    } else {
      for (int64_t d = 0; d < head_size; ++d) wide[d] = static_cast<float>(r[d]);
      return static_cast<const float*>(wide.data());
    }
  };
  std::fill(acc, acc + group * head_size, 0.f);
  std::fill(m, m + group, neg_inf);
  std::fill(l, l + group, 0.f);
  for (int64_t first = key_begin / block_size * block_size; first < num_keys; first += block_size) {
    const int64_t block = table[first / block_size];
    const int64_t n = std::min(block_size, num_keys - first);
    const int64_t j0 = std::max<int64_t>(0, key_begin - first);
    const scalar_t* kb = kc + block * key_cache.stride(0);
    const scalar_t* vb = vc + block * value_cache.stride(0);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * head_size;
      float* ag = acc + g * head_size;
      float block_max = neg_inf;
      for (int64_t j = j0; j < n; ++j) {
        const float s = dot(qg, row(kb + j * key_cache.stride(2)), head_size);
        scores[j] = softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
        block_max = std::max(block_max, scores[j]);
      }
      const float new_max = std::max(m[g], block_max);
      const float correction = std::exp(m[g] - new_max);
      if (correction != 1.f) {
        l[g] *= correction;
        for (int64_t d = 0; d < head_size; ++d) ag[d] *= correction;
      }
      for (int64_t j = j0; j < n; ++j) {
        const float p = std::exp(scores[j] - new_max);
        l[g] += p;
        axpy(ag, p, row(vb + j * value_cache.stride(2)), head_size);
      }
      m[g] = new_max;
    }
  }
}

// scalar_t: query and output; cache_t: the KV cache, the same or a 16- or 8-bit type under a
// float32 query (--kv-cache-dtype, cache_types_match), widened to float32 as it is loaded
template <typename scalar_t, typename cache_t>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          float scale, int64_t window, float softcap) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t max_blocks = block_tables.size(1);

  // validated once so the kernel can trust the metadata
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && starts[b] >= 0 && starts[b + 1] <= num_tokens, "bad query_start_loc");
    TORCH_CHECK(lens[b] >= q_len, "seq_lens[", b, "] is shorter than its query chunk");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks,
                "block_tables too narrow for seq_lens[", b, "]");
  }

  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
#ifdef PYSERVE_VEC
  const bool same_layout = key_cache.stride(3) == 1 && value_cache.stride(3) == 1 &&
                           key_cache.strides() == value_cache.strides();
  const attend_fn<cache_t> simd_path = same_layout ? simd_attention<cache_t>(head_size) : nullptr;
  const int64_t padded = (block_size + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
#else
  const int64_t padded = block_size;
#endif

  // A sequence's rows go through the tile path only when it has more of them than a
  // speculative verify step carries (1 + at most 16 drafts, config.py's limit): a verify row
  // must compute exactly what the one-row (decode) path computes for it, or a draft could be
  // judged against logits that differ from plain decoding's in the last bits, and under
  // --gguf-activations int8, whose rounding of activations amplifies such bits, by tenths of a
  // logprob. Shorter prefill chunks take the one-row path too; their attention is a small part
  // of their step.
  constexpr int64_t kRowwiseMaxRows = 17;
#if defined(PYSERVE_VEC) && PYSERVE_VEC == 16
  const tile_fn<cache_t> tile_path =
      same_layout && softcap <= 0.f ? tile_attention<cache_t>(head_size, block_size, group) : nullptr;
  const int64_t tile_rows = tile_path != nullptr ? kChunk / group : 1;
#else
  constexpr int64_t tile_rows = 1;
#endif
  // Work items: (sequence, first row, rows, KV head). A chunk's rows go 16 / G to an item
  // when the tile path exists; a decode row, or every row without it, is an item alone.
  // Items are taken largest first from a shared counter: causal rows differ in cost by up to
  // the chunk length, so fixed halves would leave a core idle.
  // An item takes query heads [head0, head0 + heads) of its KV head's group: all G of them,
  // unless the batch has too few items to share evenly among the threads (fewer than two
  // each, and not a multiple of them: a decode row of a model with one KV head, Gemma 3
  // 270M's, or three, SmolLM2's, which went 2 : 1 over two cores), when each one-row item is
  // split into one run of heads per thread. Each run reads the keys and values again, so no
  // more runs than that (Gemma 3 270M at 384 keys, one row: 36 us a layer whole, 24 in two
  // runs, 35 in four single heads on two cores). Each head's scores, softmax and sums are its
  // own, in the same order either way: the split changes no bit of the output.
  struct Item {
    int64_t cost;
    int32_t seq, row0, rows, kv_head, head0, heads;
  };
  std::vector<Item> items;
  bool uneven = false;  // a prefill chunk: rows of unequal cost
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    uneven |= q_len > 1;
    const int64_t step = q_len > kRowwiseMaxRows ? tile_rows : 1;
    for (int64_t r0 = 0; r0 < q_len; r0 += step) {
      const int64_t rows = std::min(step, q_len - r0);
      const int64_t keys = lens[b] - q_len + r0 + rows;
      const int64_t cost = rows * (window > 0 ? std::min(keys, window) : keys);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({cost * group, static_cast<int32_t>(b), static_cast<int32_t>(starts[b] + r0),
                         static_cast<int32_t>(rows), static_cast<int32_t>(h), 0,
                         static_cast<int32_t>(group)});
    }
  }
  const int64_t threads = at::get_num_threads(), num_whole = static_cast<int64_t>(items.size());
  if (group > 1 && num_whole > 0 && num_whole < 2 * threads && num_whole % threads != 0) {
    const int64_t runs = std::min<int64_t>(group, threads);
    std::vector<Item> split;
    for (const Item& item : items) {
      const bool one_row_path = starts[item.seq + 1] - starts[item.seq] <= kRowwiseMaxRows || tile_rows == 1;
      if (!one_row_path) {
        split.push_back(item);
        continue;
      }
      for (int64_t run = 0; run < runs; ++run) {
        const int64_t head0 = group * run / runs, heads = group * (run + 1) / runs - head0;
        split.push_back({item.cost / group * heads, item.seq, item.row0, item.rows, item.kv_head,
                         static_cast<int32_t>(head0), static_cast<int32_t>(heads)});
      }
    }
    items = std::move(split);
  }
  // A decode-only batch keeps its rows in order, split in contiguous halves, each core then
  // reading every KV head of its sequences' blocks: handing the items out one by one measured
  // about 4 % slower per decode step (SmolLM2, batch 16).
  if (uneven)
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};

  // next_item() gives this thread's next item index, or -1 when none is left
  auto work = [&](auto&& next_item) {
    const int64_t pairs = std::max<int64_t>(tile_rows * group, 16);
    std::vector<float> qf(pairs * head_size), acc(pairs * head_size), m(pairs), l(pairs);
    std::vector<float> scores(group * padded);
#if defined(PYSERVE_VEC) && PYSERVE_VEC == 16
    std::vector<float> qt(head_size * kChunk), probs(kChunk * kChunk);
    int64_t row_keys[kChunk], row_begin[kChunk];
#endif
    for (int64_t index = next_item(); index >= 0; index = next_item()) {
      const Item& item = items[index];
      const int64_t b = item.seq, kv_head = item.kv_head, rows = item.rows, heads = item.heads;
      const int64_t first_head = kv_head * group + item.head0;
      const int64_t q_len = starts[b + 1] - starts[b];
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < heads; ++g) {
          const scalar_t* qs = q + (item.row0 + r) * query.stride(0) + (first_head + g) * query.stride(1);
          for (int64_t d = 0; d < head_size; ++d)
            qf[(r * heads + g) * head_size + d] = static_cast<float>(qs[d]) * scale;
        }
      const int32_t* table = tables + b * table_stride;
      const cache_t* k_head = key_cache.data_ptr<cache_t>() + kv_head * key_cache.stride(1);
      const cache_t* v_head = value_cache.data_ptr<cache_t>() + kv_head * value_cache.stride(1);
      // keys row t sees: [begin(its position + 1), its position + 1)
      const int64_t first_keys = lens[b] - q_len + (item.row0 - starts[b]) + 1;
      auto begin = [window](int64_t keys) { return window > 0 ? std::max<int64_t>(0, keys - window) : int64_t{0}; };
#if defined(PYSERVE_VEC) && PYSERVE_VEC == 16
      if (tile_path != nullptr && q_len > kRowwiseMaxRows) {
        for (int64_t r = 0; r < rows; ++r) {
          row_keys[r] = first_keys + r;
          row_begin[r] = begin(first_keys + r);
        }
        tile_path(qf.data(), rows, heads, row_begin, row_keys, table, k_head, v_head, key_cache.stride(0),
                  key_cache.stride(2), block_size, qt.data(), probs.data(), acc.data(), l.data());
      } else
#endif
      {
        for (int64_t r = 0; r < rows; ++r) {
          float* qr = qf.data() + r * heads * head_size;
          float* ar = acc.data() + r * heads * head_size;
#ifdef PYSERVE_VEC
          if (simd_path != nullptr)
            simd_path(qr, heads, table, begin(first_keys + r), first_keys + r, k_head, v_head,
                      key_cache.stride(0), key_cache.stride(2), block_size, softcap, scores.data(),
                      ar, m.data() + r * heads, l.data() + r * heads);
          else
#endif
            attend_plain<cache_t>(qr, heads, head_size, table, begin(first_keys + r),
                                   first_keys + r, key_cache, value_cache, kv_head, softcap,
                                   scores.data(), ar, m.data() + r * heads, l.data() + r * heads);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < heads; ++g) {
          const int64_t i = r * heads + g;
          scalar_t* os = o + (item.row0 + r) * out.stride(0) + (first_head + g) * out.stride(1);
          const float inv = 1.f / l[i];
          for (int64_t d = 0; d < head_size; ++d) os[d] = static_cast<scalar_t>(acc[i * head_size + d] * inv);
        }
    }
  };
  if (uneven) {
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      work([&] { const int64_t i = next++; return i < num_items ? i : int64_t{-1}; });
    });
  } else {
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      work([&, i = begin]() mutable { return i < end ? i++ : int64_t{-1}; });
    });
  }
}

// f(cache_t{}) for a cache narrower than its float32 keys: one of the types cache_types_match
// allows besides float32 itself (checked by the callers)
template <typename F>
void with_narrow_cache(at::ScalarType cache_type, F&& f) {
  if (cache_type == at::kBFloat16)
    f(c10::BFloat16{});
  else if (cache_type == at::kHalf)
    f(c10::Half{});
  else
    f(c10::Float8_e5m2{});
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must both be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value must be contiguous in head_size");
  TORCH_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3),
              "key shape does not match the cache's heads/head_size");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  cache_types_match(key.scalar_type(), key_cache.scalar_type()),
              "key and value must share one dtype, the caches another: the same, or bfloat16, "
              "float16 or float8_e5m2 caches for float32 keys");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be a contiguous int64 tensor with one slot per token");
  const at::ScalarType cache_type = key_cache.scalar_type();
  if (cache_type == key.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
      reshape_and_cache_impl<scalar_t, scalar_t>(key, value, key_cache, value_cache, slot_mapping);
    });
  } else {
    with_narrow_cache(cache_type, [&](auto narrow) {
      reshape_and_cache_impl<float, decltype(narrow)>(key, value, key_cache, value_cache, slot_mapping);
    });
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t window, double softcap) {
  // arguments checked by the dispatcher in bindings.cpp, shared with the CUDA kernel
  const float scale_f = static_cast<float>(scale), softcap_f = static_cast<float>(softcap);
  const at::ScalarType cache_type = key_cache.scalar_type();
  if (cache_type == query.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
      paged_attention_impl<scalar_t, scalar_t>(out, query, key_cache, value_cache, block_tables,
                                               query_start_loc, seq_lens, scale_f, window, softcap_f);
    });
  } else {
    with_narrow_cache(cache_type, [&](auto narrow) {
      paged_attention_impl<float, decltype(narrow)>(out, query, key_cache, value_cache, block_tables,
                                                    query_start_loc, seq_lens, scale_f, window, softcap_f);
    });
  }
}

}  // namespace pyserve::cpu
