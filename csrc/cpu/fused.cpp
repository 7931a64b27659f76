// Fused elementwise layer ops on the CPU: one call (and one pass over memory) where PyTorch
// takes several, which matters at decode, where these tensors are a few rows and the time is
// per-op overhead. Same contracts as the CUDA twins (csrc/cuda/ops.h); the PyTorch code in
// pyserve/model/layers/ is their specification. Statistics and products are float32.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu/ops.h"
#include "cpu/vec.h"

namespace pyserve::cpu {
namespace {

template <typename T>
void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  // as norm.py: normalise in float32, round to the dtype, then scale by the weight
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) *
                            static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * inv)));
}

void check_rows(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), op, ": contiguous CPU tensors expected");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_rows(input, "rms_norm");
  check_rows(out, "rms_norm");
  const int64_t n = input.size(-1), rows = input.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "rms_norm", [&] {
    const auto* x = input.data_ptr<scalar_t>();
    const auto* w = weight.data_ptr<scalar_t>();
    auto* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(o + r * n, x + r * n, w, n, epsilon);
    });
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  check_rows(input, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  const int64_t n = input.size(-1), rows = input.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "fused_add_rms_norm", [&] {
    auto* x = input.data_ptr<scalar_t>();
    auto* res = residual.data_ptr<scalar_t>();
    const auto* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; ++i)
          res[r * n + i] = static_cast<scalar_t>(static_cast<float>(x[r * n + i]) +
                                                 static_cast<float>(res[r * n + i]));
        rms_norm_row(x + r * n, res + r * n, w, n, epsilon);
      }
    });
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rotary_embedding: positions must be int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "rotary_embedding: cos_sin_cache must be contiguous float32");
  const int64_t tokens = positions.numel(), rot = cos_sin_cache.size(1), half = rot / 2;
  const auto* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  // [tokens, heads * head_size] or [tokens, heads, head_size]; tokens may be strided (q and
  // k are column slices of the step's qkv projection) but each head must be contiguous
  auto rotate = [&](at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu() && t.stride(-1) == 1 && (t.dim() == 2 || t.stride(1) == head_size),
                "rotary_embedding: each head of a token must be contiguous");
    const int64_t heads = t.numel() / (tokens * head_size), token_stride = t.stride(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rotary_embedding", [&] {
      auto* data = t.data_ptr<scalar_t>();
      at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
        for (int64_t tok = begin; tok < end; ++tok) {
          const float* cos = cache + pos[tok] * rot;
          const float* sin = cos + half;
          for (int64_t h = 0; h < heads; ++h) {
            scalar_t* x = data + tok * token_stride + h * head_size;
            for (int64_t i = 0; i < half; ++i) {
              const int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
              const float x1 = static_cast<float>(x[a]), x2 = static_cast<float>(x[b]);
              // two products, then one sum, each rounded, as the PyTorch reference does
              const float p1 = x1 * cos[i], p2 = x2 * sin[i], p3 = x2 * cos[i], p4 = x1 * sin[i];
              x[a] = static_cast<scalar_t>(p1 - p2);
              x[b] = static_cast<scalar_t>(p3 + p4);
            }
          }
        }
      });
    });
  };
  rotate(query);
  if (key.has_value() && key->defined()) rotate(*key);
}

// The leading columns of one row of silu_and_mul done with vectors; returns how many. float32
// only: a vector exponential (within 2 ulps of std::exp) instead of one libm call per element,
// which took a fifth of a 2,048-token prefill.
template <typename scalar_t>
int64_t silu_and_mul_simd(const scalar_t*, scalar_t*, int64_t) {
  return 0;
}

#ifdef PYSERVE_VEC
template <>
int64_t silu_and_mul_simd<float>(const float* x, float* o, int64_t d) {
  using namespace simd;
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const vec g = load(x + i);
    const vec silu = div(g, add(set1(1.f), exp_clamped(sub(zero(), g))));
    store(o + i, mul(silu, load(x + d + i)));
  }
  return i;
}
#endif

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  check_rows(input, "silu_and_mul");
  check_rows(out, "silu_and_mul");
  const int64_t d = input.size(-1) / 2, rows = input.numel() / (2 * d);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "silu_and_mul", [&] {
    const auto* x = input.data_ptr<scalar_t>();
    auto* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int64_t i = silu_and_mul_simd(x + r * 2 * d, o + r * d, d);
        for (; i < d; ++i) {
          const float g = static_cast<float>(x[r * 2 * d + i]);
          const float silu = static_cast<float>(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
          o[r * d + i] = static_cast<scalar_t>(silu * static_cast<float>(x[r * 2 * d + d + i]));
        }
      }
    });
  });
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: logits must be a contiguous [S, V] float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous [S, W] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "apply_token_bitmask: rows must be int64");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask: the bitmask is narrower than the vocabulary");
  const auto rows_c = rows.contiguous();
  const int64_t* row_ids = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows_c.numel(); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "apply_token_bitmask: row ", row_ids[i], " is out of range");
  }
  float* l = logits.data_ptr<float>();
  const auto* m = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float masked = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows_c.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* out = l + row_ids[i] * vocab;
      const uint32_t* mask = m + row_ids[i] * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = mask[w];
        const int64_t n = std::min<int64_t>(32, vocab - w * 32);
        if (word == 0xFFFFFFFFu) continue;  // all allowed (what most words of a free row are)
        float* o = out + w * 32;
        if (word == 0) {  // none allowed (what most words of a constrained row are)
          std::fill(o, o + n, masked);
          continue;
        }
        for (int64_t k = 0; k < n; ++k) {
          if (!((word >> k) & 1u)) o[k] = masked;
        }
      }
    }
  });
}

}  // namespace pyserve::cpu
