// Bidirectional attention for an encoder's packed batch: every token attends to every token of
// its own sequence (no mask, no KV cache), read straight from the QKV projection's output.
//
// One (head, sequence) pair at a time: the sequence's keys of that head are transposed once
// into [D][L] (padded to whole vectors), so one query's scores against a vector of keys are D
// FMAs, each broadcasting one element of the query, with no horizontal sums; then the softmax
// over the row (max, exponentials, sum), then the value rows into D / lanes register
// accumulators, each key's weight broadcast. Encoders' sequences are short (tens to a few
// hundred tokens), so the whole score row fits in L1 and one pass suffices. Head-major
// order splits the pairs evenly over the threads whatever the sequences' lengths (each
// thread takes its heads of every sequence).
//
// It replaced one PyTorch SDPA call per sequence, whose fixed cost dominated at these
// lengths: a MiniLM-shaped step (32 sequences of 22 to 84 tokens, 12 heads of 32) took 2.9 ms
// a layer.
#include "cpu/ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/vec.h"

namespace pyserve::cpu {
namespace {

#ifdef PYSERVE_VEC
using namespace simd;

// R query rows (from i) of one (head, sequence) pair against its transposed keys kt [D][padded]:
// each key vector loaded feeds R FMAs, each value vector R too (R rows' weights at once)
template <int NV, int R>
void attend_rows(const float* qkv, int64_t ld, int64_t H, int64_t start, int64_t L, int64_t padded,
                 int64_t h, int64_t i, float scale, const float* kt, float* s, float* out) {
  constexpr int64_t D = NV * kLanes;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float q[R][D];
  for (int r = 0; r < R; ++r) {
    const float* query = qkv + (start + i + r) * ld + h * D;
    for (int64_t d = 0; d < D; ++d) q[r][d] = query[d] * scale;
  }
  for (int64_t c = 0; c < padded; c += kLanes) {
    vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = zero();
    for (int64_t d = 0; d < D; ++d) {
      const vec k = load(kt + d * padded + c);
      for (int r = 0; r < R; ++r) acc[r] = fma(set1(q[r][d]), k, acc[r]);
    }
    for (int r = 0; r < R; ++r) store(s + r * padded + c, acc[r]);
  }
  float inv[R];
  for (int r = 0; r < R; ++r) {
    float* row = s + r * padded;
    std::fill(row + L, row + padded, kNegInf);
    vec row_max = set1(kNegInf);
    for (int64_t c = 0; c < padded; c += kLanes) row_max = max(row_max, load(row + c));
    const vec shift = set1(reduce_max(row_max));
    vec total = zero();
    for (int64_t c = 0; c < padded; c += kLanes) {
      const vec p = exp_clamped(sub(load(row + c), shift));
      store(row + c, p);
      total = add(total, p);
    }
    // the padding's exponentials are e^-87 (exp_clamped's floor), below float32's resolution
    // of a sum holding the row's largest term, 1; the values below read keys j < L only
    inv[r] = 1.f / reduce_add(total);
  }
  vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = zero();
  for (int64_t j = 0; j < L; ++j) {
    const float* value = qkv + (start + j) * ld + (2 * H + h) * D;
    for (int v = 0; v < NV; ++v) {
      const vec x = load(value + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v] = fma(set1(s[r * padded + j]), x, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + (start + i + r) * H * D + h * D;
    for (int v = 0; v < NV; ++v) store(o + v * kLanes, mul(acc[r][v], set1(inv[r])));
  }
}

// qkv rows: [3][H][D] each (row stride ld); out rows [H][D] (row stride H * D). Rows go
// kRows at a time, as many as keep the value accumulators (kRows * NV vectors) in half the
// vector registers (AVX-512: 32, AVX2: 16). MiniLM's step above: 1.38 ms a layer with 4
// rows of 32 at a time, 1.33 with 8 (against SDPA's 2.9).
template <int NV>
void attend(const float* qkv, int64_t ld, int64_t H, int64_t start, int64_t L, int64_t h,
            float scale, float* out, std::vector<float>& keys_t, std::vector<float>& scores) {
  constexpr int64_t D = NV * kLanes;
  constexpr int kRows = std::max(1, (kLanes == 16 ? 16 : 8) / NV);
  const int64_t padded = (L + kLanes - 1) / kLanes * kLanes;
  keys_t.resize(D * padded);
  scores.resize(kRows * padded);
  float* kt = keys_t.data();
  for (int64_t j = 0; j < L; ++j) {
    const float* key = qkv + (start + j) * ld + (H + h) * D;
    for (int64_t d = 0; d < D; ++d) kt[d * padded + j] = key[d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * padded + L, kt + (d + 1) * padded, 0.f);
  int64_t i = 0;
  for (; i + kRows <= L; i += kRows)
    attend_rows<NV, kRows>(qkv, ld, H, start, L, padded, h, i, scale, kt, scores.data(), out);
  for (; i < L; ++i)
    attend_rows<NV, 1>(qkv, ld, H, start, L, padded, h, i, scale, kt, scores.data(), out);
}

using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          float*, std::vector<float>&, std::vector<float>&);

AttendFn attend_for(int64_t D) {
  switch (D / kLanes * (D % kLanes == 0)) {
    case 1: return attend<1>;
    case 2: return attend<2>;
    case 4: return attend<4>;
    case 8: return attend<8>;
    case 16: return attend<16>;
    default: return nullptr;
  }
}
#endif

}  // namespace

bool encoder_attention_supported(int64_t head_size) {
#ifdef PYSERVE_VEC
  return attend_for(head_size) != nullptr;
#else
  (void)head_size;
  return false;
#endif
}

void encoder_attention(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& query_start_loc,
                       double scale) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu(),
              "encoder_attention: qkv must be a float32 [T, 3, H, D] CPU tensor");
  const int64_t T = qkv.size(0), H = qkv.size(2), D = qkv.size(3);
  TORCH_CHECK(qkv.stride(3) == 1 && qkv.stride(2) == D && qkv.stride(1) == H * D,
              "encoder_attention: each qkv row must hold [3][H][D] contiguously");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() == T * H * D,
              "encoder_attention: out must be a contiguous float32 [T, H, D]");
  TORCH_CHECK(encoder_attention_supported(D), "encoder_attention: head size ", D,
              " has no vector path in this build");
  const at::Tensor bounds = query_start_loc.to(at::kLong).contiguous();
  const int64_t* loc = bounds.data_ptr<int64_t>();
  const int64_t B = bounds.numel() - 1;
  TORCH_CHECK(B >= 1 && loc[0] == 0 && loc[B] == T, "encoder_attention: query_start_loc must run from 0 to T");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(loc[b] <= loc[b + 1], "encoder_attention: query_start_loc must not decrease");
#ifdef PYSERVE_VEC
  const AttendFn fn = attend_for(D);
  const float* src = qkv.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  at::parallel_for(0, H * B, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> keys_t, scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / B, b = i % B;
      if (loc[b + 1] > loc[b])
        fn(src, ld, H, loc[b], loc[b + 1] - loc[b], h, static_cast<float>(scale), dst, keys_t, scores);
    }
  });
#endif
}

}  // namespace pyserve::cpu
