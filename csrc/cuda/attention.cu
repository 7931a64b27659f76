// Paged attention on the GPU for batches that mix prefill chunks and decode tokens; the same
// contract as the CPU kernel (csrc/cpu/attention.cpp, the readable specification).
//
// Work. A CTA takes one KV head, up to 8 query "slots" that read it and one range of keys (a
// split). A slot is a (query row, query head) pair: the GQA group of one row, or, when groups
// are small and the batch holds prefill chunks, the groups of several adjacent rows of one
// sequence, which then read each K/V row once between them. Groups above 8 heads take several
// CTAs (blockIdx.y). A CTA whose rows cross into the next sequence does one segment after the
// other; rows outside every sequence (padding) are left untouched.
//
// Reads. Four warps take tiles of keys round-robin. Within a warp, TPK lanes hold one key row,
// 16 bytes each (a coalesced, vectorised read of the whole row), so a warp reads 32 / TPK keys
// per step; each lane keeps its slice of the 8 query vectors and of the 8 output accumulators in
// registers. A lane's 8 partial dot products are summed over its TPK lanes by a transposing
// butterfly (8 shuffles instead of 8 * log2(TPK)) that leaves each lane the score of one slot;
// the probabilities are shuffled back to every lane for P.V.
//
// Softmax. Online, in float32 and in base 2 (q is pre-scaled by scale * log2(e)): one running
// max per slot, rescaled once per tile; each warp keeps its own (max, sum, acc) and the CTA
// merges its warps in shared memory. With one split that merge writes the output; with several
// (flash-decoding: a long context at small batch spread over more CTAs than there are rows) it
// writes float32 partials (max, sum, acc) that merge_splits_kernel combines.
//
// Sliding windows (window > 0): a row at position p sees keys (p - window, p] only; keys below a
// slot's window are masked like keys past its position, and a warp skips the tiles that lie
// wholly below the window of the segment's first row (the lowest of its rows). softcap > 0 maps
// each scaled score s to softcap * tanh(s / softcap), here in base 2 (softcap_log2 = softcap *
// log2(e) and the same tanh: c tanh(x / c) keeps its form under a common scale).
//
// Invariants: a key is read only when it is below both the split's end and the table's width
// (block_tables.size(1) * block_size), so bad seq_lens cannot read outside a sequence's table;
// a masked score is -inf and contributes exactly 0, and an all-masked slot yields 0, not NaN.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace pyserve::cuda {
namespace {

constexpr int kSlots = 8;  // query vectors per CTA
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMinKeysPerSplit = 128;  // below this a split costs more than it spreads
constexpr int kMaxSplits = 256;

template <typename T, int D>
struct Layout {
  static constexpr int kVecElems = pyserve::cuda::kVecElems<T>;
  static constexpr int kTpk = D / kVecElems < 32 ? D / kVecElems : 32;  // lanes per key row
  static constexpr int kElems = D / kTpk;        // elements of a row per lane
  static constexpr int kVecs = kElems / kVecElems;  // 16-byte loads per lane per row
  static constexpr int kGroups = 32 / kTpk;      // keys a warp reads per step
  static constexpr int kSteps = 8 / kVecs;       // steps per tile
  static constexpr int kTile = kGroups * kSteps;  // keys per warp per tile
  static constexpr int kDup = kTpk / kSlots;     // lanes of a group holding the same slot's score
  static_assert(kTpk >= kSlots && kElems % kVecElems == 0, "unsupported head size");
};

struct Params {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  float* partial_ml;   // [num_tokens, num_heads, num_splits, 2]: (max, sum); num_splits > 1
  float* partial_acc;  // [num_tokens, num_heads, num_splits, head_size]
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  int64_t cache_stride_block, cache_stride_head;  // in elements; rows are head_size apart
  int num_tokens, num_seqs, num_heads, num_kv_heads;
  int block_size, table_stride, max_keys;  // max_keys = block_tables.size(1) * block_size
  int group, heads_per_cta, head_chunks, rows_per_cta;
  int num_splits, keys_per_split;
  int window;  // <= 0: global attention
  float scale_log2, softcap_log2;  // softcap_log2 <= 0: no softcapping
};

// Sums v[s] over the TPK lanes of a key group for all 8 slots at once. Each exchange hands the
// partner the half of the slots it keeps, so after three exchanges a lane holds one slot (the
// top three bits of its index in the group) summed over 8 lanes; the rest is a plain butterfly.
template <int TPK>
__device__ __forceinline__ float reduce_slots(float (&v)[kSlots], int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool hi = lane & (TPK / 2);
    const float send = hi ? v[i] : v[i + 4], keep = hi ? v[i + 4] : v[i];
    v[i] = keep + __shfl_xor_sync(kFullMask, send, TPK / 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool hi = lane & (TPK / 4);
    const float send = hi ? v[i] : v[i + 2], keep = hi ? v[i + 2] : v[i];
    v[i] = keep + __shfl_xor_sync(kFullMask, send, TPK / 4);
  }
  {
    const bool hi = lane & (TPK / 8);
    const float send = hi ? v[0] : v[1], keep = hi ? v[1] : v[0];
    v[0] = keep + __shfl_xor_sync(kFullMask, send, TPK / 8);
  }
#pragma unroll
  for (int mask = TPK / 16; mask >= 1; mask /= 2) v[0] += __shfl_xor_sync(kFullMask, v[0], mask);
  return v[0];
}

// One segment: rows [row0, row_end) of sequence `seq`, this CTA's heads and split.
template <typename T, int D>
__device__ void attend_segment(const Params& p, float* smem, int seq, int row0, int row_end,
                               int first_head, int heads_here) {
  using L = Layout<T, D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane / L::kTpk, li = lane % L::kTpk;
  const int my_slot = li / L::kDup;
  const int kv_head = first_head / p.group;

  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int rows_here = row_end - row0;
  const int slots_used = rows_here * heads_here;
  // Row r of the chunk sits at position ctx - q_len + r and sees keys 0 ..= that position.
  const int first_limit = p.seq_lens[seq] - q_len + (row0 - q_start) + 1;
  const int my_limit = my_slot < slots_used
                           ? max(0, min(first_limit + my_slot / heads_here, p.max_keys)) : 0;
  const int kv_end = max(0, min(first_limit + rows_here - 1, p.max_keys));
  const int my_begin = p.window > 0 ? max(0, my_limit - p.window) : 0;
  const int seg_begin = p.window > 0 ? max(0, min(first_limit, p.max_keys) - p.window) : 0;
  const int k_begin = blockIdx.z * p.keys_per_split;
  const int k_end = min(kv_end, k_begin + p.keys_per_split);

  float q[kSlots][L::kElems];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (s < slots_used) {
      const T* src = static_cast<const T*>(p.query) + (row0 + s / heads_here) * p.q_stride_token +
                     (first_head + s % heads_here) * p.q_stride_head + li * L::kElems;
#pragma unroll
      for (int v = 0; v < L::kVecs; ++v) unpack<T>(load16(src + v * L::kVecElems), &q[s][v * L::kVecElems]);
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) q[s][e] *= p.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) q[s][e] = 0.f;
    }
  }

  float acc[kSlots][L::kElems];
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
#pragma unroll
    for (int e = 0; e < L::kElems; ++e) acc[s][e] = 0.f;
  float m = -INFINITY, l = 0.f;

  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
  const T* kbase = static_cast<const T*>(p.key_cache) + kv_head * p.cache_stride_head + li * L::kElems;
  const T* vbase = static_cast<const T*>(p.value_cache) + kv_head * p.cache_stride_head + li * L::kElems;

  for (int t0 = k_begin + warp * L::kTile; t0 < k_end; t0 += kWarps * L::kTile) {
    if (t0 + L::kTile <= seg_begin) continue;  // below every row's window (warp-uniform)
    // All of the tile's K and V loads are issued before the first is used.
    uint4 kr[L::kSteps][L::kVecs], vr[L::kSteps][L::kVecs];
#pragma unroll
    for (int st = 0; st < L::kSteps; ++st) {
      const int key = t0 + st * L::kGroups + grp;
      if (key < k_end) {
        const int64_t block = table[key / p.block_size];
        const int64_t off = block * p.cache_stride_block + static_cast<int64_t>(key % p.block_size) * D;
#pragma unroll
        for (int v = 0; v < L::kVecs; ++v) {
          kr[st][v] = load16(kbase + off + v * L::kVecElems);
          vr[st][v] = load16(vbase + off + v * L::kVecElems);
        }
      } else {
#pragma unroll
        for (int v = 0; v < L::kVecs; ++v) kr[st][v] = vr[st][v] = make_uint4(0, 0, 0, 0);
      }
    }

    float score[L::kSteps];
#pragma unroll
    for (int st = 0; st < L::kSteps; ++st) {
      float k[L::kElems];
#pragma unroll
      for (int v = 0; v < L::kVecs; ++v) unpack<T>(kr[st][v], &k[v * L::kVecElems]);
      float dot[kSlots];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        dot[s] = 0.f;
#pragma unroll
        for (int e = 0; e < L::kElems; ++e) dot[s] = fmaf(q[s][e], k[e], dot[s]);
      }
      float sc = reduce_slots<L::kTpk>(dot, lane);
      if (p.softcap_log2 > 0.f) sc = p.softcap_log2 * tanhf(sc / p.softcap_log2);
      const int key = t0 + st * L::kGroups + grp;
      score[st] = key < k_end && key < my_limit && key >= my_begin ? sc : -INFINITY;
    }

    float tile_max = score[0];
#pragma unroll
    for (int st = 1; st < L::kSteps; ++st) tile_max = fmaxf(tile_max, score[st]);
#pragma unroll
    for (int mask = L::kTpk; mask < 32; mask *= 2)
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, mask));
    const float m_new = fmaxf(m, tile_max);
    const float corr = m_new == -INFINITY ? 1.f : exp2f(m - m_new);
    float tile_sum = 0.f;
#pragma unroll
    for (int st = 0; st < L::kSteps; ++st) {
      score[st] = score[st] == -INFINITY ? 0.f : exp2f(score[st] - m_new);
      tile_sum += score[st];
    }
    l = l * corr + tile_sum;
    m = m_new;

    const int src = grp * L::kTpk;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const float c = __shfl_sync(kFullMask, corr, src + s * L::kDup);
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) acc[s][e] *= c;
    }
#pragma unroll
    for (int st = 0; st < L::kSteps; ++st) {
      float v[L::kElems];
#pragma unroll
      for (int i = 0; i < L::kVecs; ++i) unpack<T>(vr[st][i], &v[i * L::kVecElems]);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const float prob = __shfl_sync(kFullMask, score[st], src + s * L::kDup);
#pragma unroll
        for (int e = 0; e < L::kElems; ++e) acc[s][e] = fmaf(prob, v[e], acc[s][e]);
      }
    }
  }

  // The key groups of a warp share their running max: add their sums and accumulators.
#pragma unroll
  for (int mask = L::kTpk; mask < 32; mask *= 2) {
    l += __shfl_xor_sync(kFullMask, l, mask);
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) acc[s][e] += __shfl_xor_sync(kFullMask, acc[s][e], mask);
  }
  float* s_acc = smem;                           // [kWarps][kSlots][D]
  float* s_max = smem + kWarps * kSlots * D;     // [kWarps][kSlots]
  float* s_sum = s_max + kWarps * kSlots;        // [kWarps][kSlots]
  if (grp == 0) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) s_acc[(warp * kSlots + s) * D + li * L::kElems + e] = acc[s][e];
    if (li % L::kDup == 0) {
      s_max[warp * kSlots + my_slot] = m;
      s_sum[warp * kSlots + my_slot] = l;
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < slots_used * D; i += kThreads) {
    const int s = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_max[w * kSlots + s]);
    float sum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = s_max[w * kSlots + s];
      if (mw == -INFINITY) continue;
      const float weight = exp2f(mw - mx);
      sum += s_sum[w * kSlots + s] * weight;
      a += s_acc[(w * kSlots + s) * D + d] * weight;
    }
    const int row = row0 + s / heads_here, head = first_head + s % heads_here;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[row * p.out_stride_token + head * p.out_stride_head + d] =
          static_cast<T>(sum > 0.f ? a / sum : 0.f);
    } else {
      const int64_t idx = (static_cast<int64_t>(row) * p.num_heads + head) * p.num_splits + blockIdx.z;
      p.partial_acc[idx * D + d] = a;
      if (d == 0) {
        p.partial_ml[2 * idx] = mx;
        p.partial_ml[2 * idx + 1] = sum;
      }
    }
  }
  __syncthreads();  // shared memory is reused by the next segment
}

// grid (ceil(num_tokens / rows_per_cta), num_kv_heads * head_chunks, num_splits), kThreads.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const Params p) {
  extern __shared__ float smem[];
  const int kv_head = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int first_head = kv_head * p.group + chunk * kSlots;
  const int heads_here = min(p.heads_per_cta, p.group - chunk * kSlots);
  const int* starts = p.query_start_loc;
  const int row_begin = static_cast<int>(blockIdx.x) * p.rows_per_cta;
  const int row_end = min(row_begin + p.rows_per_cta, p.num_tokens);
  int row = row_begin;
  while (row < row_end) {
    // The sequence owning `row`: the last b with starts[b] <= row.
    int lo = 0, hi = p.num_seqs + 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (starts[mid] <= row) lo = mid + 1;
      else hi = mid;
    }
    const int seq = lo - 1;
    if (seq < 0) {  // rows before the first sequence: padding
      row = starts[0];
      continue;
    }
    if (seq >= p.num_seqs) break;  // rows after the last sequence: padding
    const int seg_end = min(row_end, starts[seq + 1]);
    if (seg_end <= row) break;  // query_start_loc not ascending: nothing sane to do
    attend_segment<T, D>(p, smem, seq, row, seg_end, first_head, heads_here);
    row = seg_end;
  }
}

// grid (num_tokens, num_heads), head_size threads: merges the splits' partials of one row/head.
template <typename T>
__global__ void merge_splits_kernel(const Params p, int head_size) {
  const int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  if (row < p.query_start_loc[0] || row >= p.query_start_loc[p.num_seqs]) return;  // padding
  const int64_t base = (static_cast<int64_t>(row) * p.num_heads + head) * p.num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.partial_ml[2 * (base + s)]);
  float sum = 0.f, a = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float ms = p.partial_ml[2 * (base + s)];
    if (ms == -INFINITY) continue;  // a split past this row's context
    const float weight = exp2f(ms - mx);
    sum += p.partial_ml[2 * (base + s) + 1] * weight;
    a += p.partial_acc[(base + s) * head_size + d] * weight;
  }
  static_cast<T*>(p.out)[row * p.out_stride_token + head * p.out_stride_head + d] =
      static_cast<T>(sum > 0.f ? a / sum : 0.f);
}

int multiprocessor_count(int device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// Splits only when the CTAs without splitting would leave most multiprocessors idle, and
// never below kMinKeysPerSplit keys each. max_keys bounds every context from above without
// reading seq_lens on the host.
void choose_splits(Params& p, int row_ctas, int head_chunks, int tile_keys, int sms) {
  const int64_t ctas = static_cast<int64_t>(row_ctas) * p.num_kv_heads * head_chunks;
  const int64_t target = 2 * static_cast<int64_t>(sms);
  p.num_splits = 1;
  p.keys_per_split = std::max(p.max_keys, 1);
  if (ctas >= target || p.max_keys < 2 * kMinKeysPerSplit) return;
  const int64_t want = std::min<int64_t>({(target + ctas - 1) / ctas,
                                          p.max_keys / kMinKeysPerSplit, kMaxSplits});
  if (want < 2) return;
  const int round = kWarps * tile_keys;  // every warp gets the same number of tiles
  int per_split = static_cast<int>((p.max_keys + want - 1) / want);
  per_split = (per_split + round - 1) / round * round;
  p.keys_per_split = per_split;
  p.num_splits = (p.max_keys + per_split - 1) / per_split;
}

template <typename T, int D>
void launch(Params& p, const at::Tensor& query, int sms, cudaStream_t stream) {
  using L = Layout<T, D>;
  const int row_ctas = (p.num_tokens + p.rows_per_cta - 1) / p.rows_per_cta;
  choose_splits(p, row_ctas, p.head_chunks, L::kTile, sms);
  at::Tensor partials;
  if (p.num_splits > 1) {
    const int64_t n = static_cast<int64_t>(p.num_tokens) * p.num_heads * p.num_splits;
    partials = at::empty({n * (D + 2)}, query.options().dtype(at::kFloat));
    p.partial_ml = partials.data_ptr<float>();
    p.partial_acc = p.partial_ml + 2 * n;
  }
  const dim3 grid(row_ctas, p.num_kv_heads * p.head_chunks, p.num_splits);
  const size_t smem = sizeof(float) * kWarps * kSlots * (D + 2);
  paged_attention_kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_splits > 1) {
    merge_splits_kernel<T><<<dim3(p.num_tokens, p.num_heads), D, 0, stream>>>(p, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

bool aligned16(const at::Tensor& t) {
  const int64_t vec = 16 / t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % vec == 0 &&
         t.stride(1) % vec == 0;
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t window, double softcap) {
  // the common argument checks ran in the dispatcher (bindings.cpp)
  const int64_t head_size = query.size(2);
  TORCH_CHECK(head_size == 64 || head_size == 128 || head_size == 256,
              "the CUDA paged_attention supports head sizes 64, 128 and 256, not ", head_size);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0,
              "caches must be 16-byte aligned");
  const int64_t max_keys = block_tables.size(1) * key_cache.size(2);
  TORCH_CHECK(query.size(0) < (int64_t{1} << 31) && max_keys < (int64_t{1} << 31) &&
                  query.stride(0) * query.size(0) < (int64_t{1} << 40),
              "paged_attention: batch too large");

  const c10::cuda::CUDAGuard guard(query.device());
  const int num_tokens = query.size(0), num_seqs = seq_lens.numel();
  if (num_tokens == 0 || num_seqs == 0) return;
  // A fresh copy is aligned; contiguous() alone would keep a misaligned start.
  const at::Tensor q = aligned16(query) ? query : query.clone(at::MemoryFormat::Contiguous);

  Params p{};
  p.out = out.data_ptr();
  p.query = q.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.cache_stride_block = key_cache.stride(0);
  p.cache_stride_head = key_cache.stride(1);
  p.num_tokens = num_tokens;
  p.num_seqs = num_seqs;
  p.num_heads = query.size(1);
  p.num_kv_heads = key_cache.size(1);
  p.block_size = key_cache.size(2);
  p.table_stride = block_tables.stride(0);
  p.max_keys = static_cast<int>(max_keys);
  p.group = p.num_heads / p.num_kv_heads;
  p.heads_per_cta = std::min(p.group, kSlots);
  p.head_chunks = (p.group + kSlots - 1) / kSlots;
  // Several rows per CTA only pay when rows share a sequence (prefill chunks).
  p.rows_per_cta = p.group < kSlots && num_tokens > 2 * num_seqs ? kSlots / p.group : 1;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.window = static_cast<int>(std::clamp<int64_t>(window, 0, int64_t{1} << 30));
  p.softcap_log2 = softcap > 0 ? static_cast<float>(softcap * 1.4426950408889634) : 0.f;

  const int sms = multiprocessor_count(query.get_device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PYSERVE_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_cuda", [&] {
    switch (head_size) {
      case 64: launch<scalar_t, 64>(p, q, sms, stream); break;
      case 128: launch<scalar_t, 128>(p, q, sms, stream); break;
      default: launch<scalar_t, 256>(p, q, sms, stream); break;
    }
  });
}

}  // namespace pyserve::cuda
