// The sampler's last stage on the CPU: one token per row of a step's logits, in one native
// call. The PyTorch sequence it replaces (divide, max, subtract, exp, widen to float64,
// cumulative sum, search, gather, where, and argmax beside them) took 8 ms for 16 rows of
// SmolLM2's 49,152 logits on two cores, each op a pass over memory, and top-k / top-p sorted
// the whole vocabulary (6 ms a row).
//
// Per random row, while the row sits in L2:
//   1. the scaled logits s = x / temperature (IEEE division, bitwise torch's), their maximum
//      and its first index;
//   2. the weights w = exp(s - max) (vec.h's exp_clamped, within 2 ulps of std::exp; exactly 0
//      below e^-87, where float32's exp is at its subnormal end anyway);
//   3. top-k and top-p (top_k_top_p below), then min_p: the most likely token weighs 1, so
//      min_p is the floor itself;
//   4. inverse CDF: the first token whose running float64 sum passes u times the total,
//      found by walking per-block sums and then the one block's weights in order. A token of
//      weight 0 is never chosen (the running sum does not move at it); if rounding leaves
//      the target past the last block, the first maximum (weight 1) is taken.
// A greedy row is the first index of the maximum of its logits, as torch.argmax; NaN counts
// as the maximum there, as it does in torch.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/ops.h"
#include "cpu/vec.h"

namespace pyserve::cpu {
namespace {

constexpr int64_t kBlock = 256;  // tokens per float64 partial sum (a multiple of every lane count)
constexpr float kExpFloor = -87.0f;

struct Max {
  float value;
  int64_t index;
};

// The first index of the maximum of x[0, n); a NaN, where there is one, is the maximum.
Max first_max(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  bool nan = false;
#ifdef PYSERVE_VEC
  using namespace simd;
  vec acc = set1(best);
#if PYSERVE_VEC == 8
  vec unordered = zero();
#endif
  for (; i + kLanes <= n; i += kLanes) {
    const vec v = load(x + i);
    acc = max(acc, v);
#if PYSERVE_VEC == 16
    nan = nan || _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
#else
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
#endif
  }
#if PYSERVE_VEC == 8
  nan = nan || _mm256_movemask_ps(unordered) != 0;
#endif
  best = reduce_max(acc);
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (nan ? std::isnan(x[j]) : x[j] == best) return {x[j], j};
  }
  return {best, 0};  // n == 0 (refused by the caller)
}

// w = exp(s - top), exactly 0 below e^-87 (see the top of the file); w may be s.
void weights(const float* s, float* w, int64_t V, float top) {
  int64_t i = 0;
#ifdef PYSERVE_VEC
  using namespace simd;
  const vec shift = set1(top), floor = set1(kExpFloor);
  for (; i + kLanes <= V; i += kLanes) {
    const vec d = sub(load(s + i), shift);
#if PYSERVE_VEC == 16
    store(w + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ), exp_clamped(d)));
#else
    store(w + i, _mm256_and_ps(exp_clamped(d), _mm256_cmp_ps(d, floor, _CMP_GE_OQ)));
#endif
  }
#endif
  for (; i < V; ++i) {
    const float d = s[i] - top;
    w[i] = d >= kExpFloor ? std::exp(d) : 0.0f;
  }
}

// The float64 sum of w[begin, end), four lanes at a time.
double sum_of(const float* w, int64_t begin, int64_t end) {
  int64_t i = begin;
  double sum = 0.0;
#ifdef PYSERVE_VEC
  __m256d sums[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  for (; i + 8 <= end; i += 8) {
    sums[0] = _mm256_add_pd(sums[0], _mm256_cvtps_pd(_mm_loadu_ps(w + i)));
    sums[1] = _mm256_add_pd(sums[1], _mm256_cvtps_pd(_mm_loadu_ps(w + i + 4)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(sums[0], sums[1]));
  sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < end; ++i) sum += w[i];
  return sum;
}

// Buckets of positive float32 weights, in value order: the float's bits (which order positive
// floats as their values) without their low 17, so a bucket spans 1/64 of an octave; weights
// are at most 1 (the top token's).
constexpr int kBucketShift = 17;
constexpr int64_t kBuckets = (0x3F800000 >> kBucketShift) + 1;

inline int64_t bucket_of(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, 4);
  return bits >> kBucketShift;
}

struct Scratch {
  std::vector<double> mass;
  std::vector<int64_t> count;
  std::vector<std::pair<float, int64_t>> members;
};

// The kept tokens' weights stay, the others become 0. top-k keeps the k most likely tokens;
// top-p then keeps, in order of likelihood, each token whose more likely kept tokens hold less
// than p of the kept mass (so the most likely always stays): _top_k_top_p's sorted rule, found
// without sorting the vocabulary. A histogram over weight buckets finds the one bucket where
// the cut falls; only that bucket's tokens are sorted (likelier first, then lower index: the
// order among equal weights, which a sort leaves open). k >= V and p >= 1 keep everything.
void top_k_top_p(float* w, int64_t V, int64_t k, float p, Scratch& sc) {
  auto cut_bucket = [&](int64_t b, auto keep_member) {
    // drop every token below bucket b, and those of bucket b keep_member refuses
    sc.members.clear();
    for (int64_t i = 0; i < V; ++i) {
      if (w[i] <= 0.0f) continue;
      const int64_t own = bucket_of(w[i]);
      if (own < b) w[i] = 0.0f;
      else if (own == b) sc.members.emplace_back(w[i], i);
    }
    std::sort(sc.members.begin(), sc.members.end(),
              [](const auto& a, const auto& c) { return a.first > c.first || (a.first == c.first && a.second < c.second); });
    for (size_t j = 0; j < sc.members.size(); ++j)
      if (!keep_member(j, sc.members[j].first)) w[sc.members[j].second] = 0.0f;
  };
  if (k > 0 && k < V) {
    sc.count.assign(kBuckets, 0);
    for (int64_t i = 0; i < V; ++i)
      if (w[i] > 0.0f) ++sc.count[bucket_of(w[i])];
    int64_t above = 0;
    for (int64_t b = kBuckets - 1; b >= 0; --b) {
      if (above + sc.count[b] >= k) {
        const int64_t room = k - above;
        cut_bucket(b, [&](size_t j, float) { return static_cast<int64_t>(j) < room; });
        break;
      }
      above += sc.count[b];
    }  // fewer than k tokens of positive weight: all of them stay
  }
  if (p < 1.0f) {
    sc.mass.assign(kBuckets, 0.0);
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      if (w[i] > 0.0f) {
        sc.mass[bucket_of(w[i])] += w[i];
        total += w[i];
      }
    }
    const double target = static_cast<double>(p) * total;
    double before = 0.0;
    for (int64_t b = kBuckets - 1; b >= 0; --b) {
      if (before + sc.mass[b] >= target) {
        double running = before;
        cut_bucket(b, [&](size_t, float weight) {
          const bool keep = running < target;
          running += weight;
          return keep;
        });
        break;
      }
      before += sc.mass[b];
    }
  }
}

// The row's token drawn from its weights w (filtered; the top token weighs 1): the float64
// sums per block, then the walk (see the top of the file). fallback: the top token.
int64_t draw_from(const float* w, int64_t V, double u, int64_t fallback, std::vector<double>& block_sums) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  block_sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    block_sums[b] = sum_of(w, b * kBlock, std::min(V, (b + 1) * kBlock));
    total += block_sums[b];
  }
  const double target = u * total;
  double before = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (before + block_sums[b] <= target) {
      before += block_sums[b];
      continue;
    }
    const int64_t begin = b * kBlock, end = std::min(V, begin + kBlock);
    int64_t last_positive = -1;
    for (int64_t i = begin; i < end; ++i) {
      if (w[i] <= 0.0f) continue;
      before += w[i];
      last_positive = i;
      if (before > target) return i;
    }
    if (last_positive >= 0) return last_positive;  // the block's own sum rounded past target
  }
  return fallback;
}

// Row r: scaled logits s in buf -> its token.
int64_t sample_row(float* s, int64_t V, int64_t k, float p, float min_p, double u, Scratch& sc,
                   std::vector<double>& block_sums) {
  const Max top = first_max(s, V);
  if (std::isnan(top.value) || top.value == -std::numeric_limits<float>::infinity()) return top.index;
  weights(s, s, V, top.value);
  if ((k > 0 && k < V) || p < 1.0f) top_k_top_p(s, V, k, p, sc);
  if (min_p > 0.0f) {
    // min_p is the floor itself: the top token weighs 1
    for (int64_t i = 0; i < V; ++i)
      if (s[i] < min_p) s[i] = 0.0f;
  }
  return draw_from(s, V, u, top.index, block_sums);
}

}  // namespace

void sample_tokens(at::Tensor& out, const at::Tensor& logits, const at::Tensor& greedy,
                   const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& top_k,
                   const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                   const std::optional<at::Tensor>& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "sample_tokens: logits must be a contiguous non-empty [S, V] float32 tensor");
  const int64_t S = logits.size(0), V = logits.size(1);
  auto rows_of = [&](const std::optional<at::Tensor>& t, at::ScalarType type, const char* name) {
    if (!t.has_value()) return static_cast<const void*>(nullptr);
    TORCH_CHECK(t->scalar_type() == type && t->is_contiguous() && t->dim() == 1 && t->size(0) == S,
                "sample_tokens: ", name, " must be a contiguous tensor of one ", c10::toString(type),
                " a row");
    return static_cast<const void*>(t->data_ptr());
  };
  TORCH_CHECK(out.scalar_type() == at::kLong && out.numel() == S && out.is_contiguous(),
              "sample_tokens: out must be [S] int64");
  const auto* greedy_rows = static_cast<const bool*>(rows_of(greedy, at::kBool, "greedy"));
  const auto* temps = static_cast<const float*>(rows_of(temperature, at::kFloat, "temperature"));
  const auto* ks = static_cast<const int64_t*>(rows_of(top_k, at::kLong, "top_k"));
  const auto* ps = static_cast<const float*>(rows_of(top_p, at::kFloat, "top_p"));
  const auto* floors = static_cast<const float*>(rows_of(min_p, at::kFloat, "min_p"));
  const auto* u = static_cast<const double*>(rows_of(uniforms, at::kDouble, "uniforms"));
  for (int64_t r = 0; r < S; ++r) {
    TORCH_CHECK(greedy_rows[r] || (u != nullptr && temps != nullptr && temps[r] > 0.0f),
                "sample_tokens: a random row needs uniforms and a positive temperature");
  }
  const float* x = logits.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(V);
    std::vector<double> block_sums;
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * V;
      if (greedy_rows[r]) {
        tokens[r] = first_max(row, V).index;
        continue;
      }
      const float t = temps[r];
      int64_t i = 0;
#ifdef PYSERVE_VEC
      using namespace simd;
      const vec tv = set1(t);
      for (; i + kLanes <= V; i += kLanes) store(buf.data() + i, div(load(row + i), tv));
#endif
      for (; i < V; ++i) buf[i] = row[i] / t;
      tokens[r] = sample_row(buf.data(), V, ks != nullptr ? ks[r] : V, ps != nullptr ? ps[r] : 1.0f,
                             floors != nullptr ? floors[r] : 0.0f, u[r], scratch, block_sums);
    }
  });
}

void apply_penalties(at::Tensor& logits, const at::Tensor& presence, const at::Tensor& frequency,
                     const at::Tensor& repetition, const at::Tensor& seen_ids,
                     const at::Tensor& seen_offsets, const at::Tensor& output_ids,
                     const at::Tensor& output_offsets) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_penalties: logits must be a contiguous [S, V] float32 tensor");
  const int64_t S = logits.size(0), V = logits.size(1);
  for (const at::Tensor* t : {&presence, &frequency, &repetition})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == S,
                "apply_penalties: each penalty must be [S] float32");
  for (const auto& [ids, offsets] : {std::pair{&seen_ids, &seen_offsets}, std::pair{&output_ids, &output_offsets}}) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->is_contiguous() && offsets->scalar_type() == at::kLong &&
                    offsets->is_contiguous() && offsets->numel() == S + 1,
                "apply_penalties: token ids must be int64 with [S + 1] int64 offsets");
    const int64_t* o = offsets->data_ptr<int64_t>();
    TORCH_CHECK(o[0] == 0 && o[S] == ids->numel(), "apply_penalties: offsets do not cover the ids");
    for (int64_t r = 0; r < S; ++r) TORCH_CHECK(o[r] <= o[r + 1], "apply_penalties: offsets must not decrease");
  }
  float* x = logits.data_ptr<float>();
  const float *pres = presence.data_ptr<float>(), *freq = frequency.data_ptr<float>(),
              *rep = repetition.data_ptr<float>();
  const int64_t *seen = seen_ids.data_ptr<int64_t>(), *seen_o = seen_offsets.data_ptr<int64_t>(),
                *out = output_ids.data_ptr<int64_t>(), *out_o = output_offsets.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> ids;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = x + r * V;
      // the dense form's order, so the results are bitwise its: where(l > 0, l / rep, l * rep)
      // once per token seen, then (l - frequency * count) - presence per output token
      ids.assign(seen + seen_o[r], seen + seen_o[r + 1]);
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      for (const int64_t t : ids) {
        if (t < 0 || t >= V) continue;
        const float l = row[t];
        row[t] = l > 0.0f ? l / rep[r] : l * rep[r];
      }
      ids.assign(out + out_o[r], out + out_o[r + 1]);
      std::sort(ids.begin(), ids.end());
      for (size_t i = 0; i < ids.size();) {
        size_t j = i;
        while (j < ids.size() && ids[j] == ids[i]) ++j;
        const int64_t t = ids[i];
        if (t >= 0 && t < V) row[t] = (row[t] - freq[r] * static_cast<float>(j - i)) - pres[r];
        i = j;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_columns(
    const at::Tensor& logits, const at::Tensor& targets, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logprob_columns: logits must be a contiguous non-empty [R, V] float32 tensor");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.is_contiguous() && targets.numel() == R,
              "logprob_columns: targets must be [R] int64");
  TORCH_CHECK(k >= 0 && k <= V, "logprob_columns: k must be in [0, V]");
  const int64_t* target = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(target[r] >= 0 && target[r] < V, "logprob_columns: target ", target[r], " is out of range");
  at::Tensor picked = at::empty({R}, logits.options());
  at::Tensor ranks = at::empty({R}, targets.options());
  at::Tensor top_ids = at::empty({R, k}, targets.options());
  at::Tensor top_values = at::empty({R, k}, logits.options());
  const float* x = logits.data_ptr<float>();
  float *picked_p = picked.data_ptr<float>(), *top_v = top_values.data_ptr<float>();
  int64_t *ranks_p = ranks.data_ptr<int64_t>(), *top_i = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> best;  // the row's k largest so far, largest first (ties: lower index)
    std::vector<float> buf(V);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * V;
      // log_softmax as torch orders it: (x - max) - log(sum(exp(x - max)))
      const float top = first_max(row, V).value;
      weights(row, buf.data(), V, top);
      const double sum = sum_of(buf.data(), 0, V);
      const float log_sum = static_cast<float>(std::log(sum));
      auto logprob = [&](int64_t j) { return (row[j] - top) - log_sum; };
      const float mine = logprob(target[r]);
      picked_p[r] = mine;
      int64_t above = 0;
      for (int64_t j = 0; j < V; ++j) above += logprob(j) > mine;
      ranks_p[r] = above + 1;
      if (k == 0) continue;
      best.clear();
      for (int64_t j = 0; j < V; ++j) {
        if (static_cast<int64_t>(best.size()) == k && !(row[j] > row[best.back()])) continue;
        auto at = best.begin();
        while (at != best.end() && row[*at] >= row[j]) ++at;
        best.insert(at, j);
        if (static_cast<int64_t>(best.size()) > k) best.pop_back();
      }
      for (int64_t c = 0; c < k; ++c) {
        top_i[r * k + c] = best[c];
        top_v[r * k + c] = logprob(best[c]);
      }
    }
  });
  return {picked, ranks, top_ids, top_values};
}

}  // namespace pyserve::cpu
