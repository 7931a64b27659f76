// Paged KV-cache writes and paged attention on the CPU.
//
// Attention is computed one (query row, KV head) pair at a time: the row's G = num_heads /
// num_kv_heads query heads walk the sequence's blocks once, each keeping an online softmax
// (running max m, running sum l, unnormalised output acc, all float32) so that no score matrix
// is ever materialised and memory stays O(head_size) per head whatever the context length.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/ops.h"

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

template <typename scalar_t>
void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  scalar_t* kc = key_cache.data_ptr<scalar_t>();
  scalar_t* vc = value_cache.data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* ks = k + t * key.stride(0) + h * key.stride(1);
        const scalar_t* vs = v + t * value.stride(0) + h * value.stride(1);
        scalar_t* kd = kc + block * key_cache.stride(0) + h * key_cache.stride(1) +
                       offset * key_cache.stride(2);
        scalar_t* vd = vc + block * value_cache.stride(0) + h * value_cache.stride(1) +
                       offset * value_cache.stride(2);
        std::copy(ks, ks + head_size, kd);
        std::copy(vs, vs + head_size, vd);
      }
    }
  });
}

template <typename scalar_t>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          float scale) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t max_blocks = block_tables.size(1);

  // Which sequence owns each query row; validated once so the kernel can trust it.
  std::vector<int32_t> row_seq(num_tokens, -1);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && starts[b + 1] <= num_tokens, "bad query_start_loc");
    TORCH_CHECK(lens[b] >= q_len, "seq_lens[", b, "] is shorter than its query chunk");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks,
                "block_tables too narrow for seq_lens[", b, "]");
    for (int64_t t = starts[b]; t < starts[b + 1]; ++t) row_seq[t] = static_cast<int32_t>(b);
  }

  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_size), acc(group * head_size), m(group), l(group);
    std::vector<float> scores(block_size);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t t = work / num_kv_heads, kv_head = work % num_kv_heads;
      const int32_t b = row_seq[t];
      if (b < 0) continue;  // a row no sequence claims (padding) is left untouched
      const int64_t q_len = starts[b + 1] - starts[b];
      const int64_t num_keys = lens[b] - q_len + (t - starts[b]) + 1;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qs = q + t * query.stride(0) + (kv_head * group + g) * query.stride(1);
        for (int64_t d = 0; d < head_size; ++d)
          qf[g * head_size + d] = static_cast<float>(qs[d]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = tables + b * table_stride;
      for (int64_t first = 0; first < num_keys; first += block_size) {
        const int64_t block = table[first / block_size];
        const int64_t n = std::min(block_size, num_keys - first);
        const scalar_t* kb = kc + block * key_cache.stride(0) + kv_head * key_cache.stride(1);
        const scalar_t* vb = vc + block * value_cache.stride(0) + kv_head * value_cache.stride(1);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_size;
          float* ag = acc.data() + g * head_size;
          float block_max = neg_inf;
          for (int64_t j = 0; j < n; ++j) {
            scores[j] = dot(qg, kb + j * key_cache.stride(2), head_size);
            block_max = std::max(block_max, scores[j]);
          }
          const float new_max = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_max);
          if (correction != 1.f) {
            l[g] *= correction;
            for (int64_t d = 0; d < head_size; ++d) ag[d] *= correction;
          }
          for (int64_t j = 0; j < n; ++j) {
            const float p = std::exp(scores[j] - new_max);
            l[g] += p;
            axpy(ag, p, vb + j * value_cache.stride(2), head_size);
          }
          m[g] = new_max;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* os = o + t * out.stride(0) + (kv_head * group + g) * out.stride(1);
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < head_size; ++d)
          os[d] = static_cast<scalar_t>(acc[g * head_size + d] * inv);
      }
    }
  });
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
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key, value and caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be a contiguous int64 tensor with one slot per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
    reshape_and_cache_impl<scalar_t>(key, value, key_cache, value_cache, slot_mapping);
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  // arguments checked by the dispatcher in bindings.cpp, shared with the CUDA kernel
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                   seq_lens, static_cast<float>(scale));
  });
}

}  // namespace pyserve::cpu
