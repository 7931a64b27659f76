// The mixture-of-experts block's experts on the CPU, fused: one call runs every expert a step
// picked, over the packed (quantized or float) weights of cpu/linear.cpp.
//
//   1. the step's (token, choice) pairs are sorted by expert (a counting sort; within an
//      expert, tokens in order) and x's rows gathered in that order;
//   2. grouped_linear runs each expert's gate and up projections over its rows, all experts
//      in one parallel region, so that a decode token's eight experts keep both cores busy
//      and only the picked experts' bytes are read;
//   3. the activation (silu(gate) · up, or gpt-oss's clamped form) and the down projection,
//      grouped the same way;
//   4. each token's output is the sum of its experts' rows times their weights, added in
//      ascending expert order starting from zero: the float32 operations transformers' loop
//      over experts performs (index_add_ of rows · weight), so that the result equals the
//      per-expert reference bitwise (the packed kernels give each row the same result
//      whatever rows it is computed beside).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "cpu/ops.h"

namespace pyserve::cpu {
namespace {

// gpt-oss's activation: gate clamped above at limit, up within ±limit, then
// (up + 1) · gate · sigmoid(alpha · gate), each step rounded to float32 as PyTorch computes it
void clamped_swiglu(const at::Tensor& h, at::Tensor& act, int64_t I, float alpha, float limit) {
  const float* src = h.data_ptr<float>();
  float* dst = act.data_ptr<float>();
  const int64_t R = h.size(0);
  at::parallel_for(0, R, rows_grain(2 * I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const float gate = std::min(src[r * 2 * I + i], limit);
        const float up = std::min(std::max(src[r * 2 * I + I + i], -limit), limit);
        const float scaled = gate * alpha;
        const float sigmoid = 1.f / (1.f + std::exp(-scaled));
        const float glu = gate * sigmoid;
        dst[r * I + i] = (up + 1.f) * glu;
      }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_sort_rows(const at::Tensor& topk_ids, int64_t num_experts) {
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous(),
              "moe_sort_rows: topk_ids must be contiguous int64 [T, k]");
  const int64_t R = topk_ids.numel(), E = num_experts;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  at::Tensor offsets = at::zeros({E + 1}, topk_ids.options());
  at::Tensor rows = at::empty_like(topk_ids);
  int64_t* off = offsets.data_ptr<int64_t>();
  int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "moe: expert id ", ids[i], " is outside 0..", E - 1);
    ++off[ids[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + E);
  for (int64_t i = 0; i < R; ++i) row_of[i] = next[ids[i]]++;
  return {rows, offsets};
}

void moe_combine(at::Tensor& out, const at::Tensor& y, const at::Tensor& row_of,
                 const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 &&
                  y.size(1) == out.size(1), "moe_combine: out [T, H] and y [R, H] contiguous float32");
  TORCH_CHECK(row_of.sizes() == topk_ids.sizes() && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_ids.size(0) == out.size(0) && topk_weights.scalar_type() == at::kFloat &&
                  row_of.is_contiguous() && topk_ids.is_contiguous() && topk_weights.is_contiguous(),
              "moe_combine: row_of, topk_ids and topk_weights must be contiguous [T, k]");
  const int64_t T = out.size(0), H = out.size(1), k = topk_ids.size(1);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const int64_t* rows_of = row_of.data_ptr<int64_t>();
  const float* w = topk_weights.data_ptr<float>();
  const float* rows = y.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, rows_grain(H * k), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> order(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < k; ++c) order[c] = c;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return ids[t * k + a] < ids[t * k + b];
      });
      float* dst = o + t * H;
      std::fill_n(dst, H, 0.f);
      for (int64_t c : order) {
        const float weight = w[t * k + c];
        const float* src = rows + rows_of[t * k + c] * H;
        for (int64_t j = 0; j < H; ++j) {
          const float product = src[j] * weight;
          dst[j] = dst[j] + product;
        }
      }
    }
  });
}

void fused_moe(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_ids,
               const at::Tensor& topk_weights, const std::vector<at::Tensor>& gate_up,
               const at::Tensor& down, const c10::optional<at::Tensor>& gate_up_bias,
               const c10::optional<at::Tensor>& down_bias, const std::string& activation,
               double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "fused_moe: x must be contiguous float32 [T, H]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "fused_moe: out must be contiguous float32 like x");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(), "fused_moe: topk_ids must be contiguous int64 [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(), "fused_moe: topk_weights must be contiguous float32 [T, k]");
  TORCH_CHECK(gate_up.size() == 1 || gate_up.size() == 2,
              "fused_moe: gate_up holds one packed stack (gate rows then up rows) or two (gate, up)");
  TORCH_CHECK(activation == "silu" || activation == "swigluoai",
              "fused_moe: activation must be silu or swigluoai, got ", activation);
  TORCH_CHECK(down.dim() == 4, "fused_moe: down must be a stack of packed weights [E, ...]");
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), E = down.size(0);
  const int64_t R = T * k;
  // the experts' intermediate size: the down projection's inputs
  const int64_t I = packed_in_features(down[0]);
  if (T == 0) return;

  // 1. the (token, choice) pairs by expert
  const auto [rows_of, offsets] = moe_sort_rows(topk_ids, E);
  const int64_t* row_of = rows_of.data_ptr<int64_t>();
  std::vector<int64_t> token_of_row(R);
  for (int64_t i = 0; i < R; ++i) token_of_row[row_of[i]] = i / k;
  const auto options = x.options();
  at::Tensor xs = at::empty({R, H}, options);
  {
    const float* src = x.data_ptr<float>();
    float* dst = xs.data_ptr<float>();
    at::parallel_for(0, R, rows_grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) std::copy_n(src + token_of_row[r] * H, H, dst + r * H);
    });
  }

  // 2. gate and up
  at::Tensor h = at::empty({R, 2 * I}, options);
  if (gate_up.size() == 1) {
    grouped_linear(h, xs, gate_up[0], offsets, gate_up_bias);
  } else {
    for (int half = 0; half < 2; ++half) {
      at::Tensor part = h.narrow(1, half * I, I);
      c10::optional<at::Tensor> bias;
      if (gate_up_bias.has_value() && gate_up_bias->defined())
        bias = gate_up_bias->narrow(1, half * I, I).contiguous();
      grouped_linear(part, xs, gate_up[half], offsets, bias);
    }
  }

  // 3. the activation and down
  at::Tensor act = at::empty({R, I}, options);
  if (activation == "silu")
    silu_and_mul(act, h);
  else
    clamped_swiglu(h, act, I, static_cast<float>(alpha), static_cast<float>(limit));
  at::Tensor y = at::empty({R, H}, options);
  grouped_linear(y, act, down, offsets, down_bias);

  // 4. each token's weighted sum, in ascending expert order
  moe_combine(out, y, rows_of, topk_ids, topk_weights);
}

}  // namespace pyserve::cpu
