// CUDA twins of csrc/cpu/ops.h, same contracts; compiled only when torch has CUDA. The fused
// layer ops follow vLLM's contracts; the PyTorch code in pyserve/model/layers/ is their
// specification.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace pyserve::cuda {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// Same contract as cpu::paged_attention (csrc/cpu/ops.h). Head sizes 64, 128 and 256; float32,
// float16 and bfloat16. The metadata stays on the device (no host synchronisation): the number
// of KV splits is chosen from block_tables' width, an upper bound of the longest context.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t window, double softcap);

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32 (norm.py).
//   input: [..., hidden] contiguous in hidden; out: contiguous, input's shape; weight: [hidden]
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);

// In place: residual = input + residual (rounded to the dtype), input = rms_norm(residual).
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon);

// In place rotary embedding, vLLM's contract. positions: [num_tokens] int64; query:
// [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]; key likewise (or
// none); cos_sin_cache: [max_position, rot_dim] = cat(cos, sin), float32 or query's dtype;
// rot_dim <= head_size. is_neox rotates halves (x[i], x[i + rot_dim/2]), else pairs (x[2i], x[2i+1]).
void rotary_embedding(const at::Tensor& positions, at::Tensor& query,
                      std::optional<at::Tensor> key, int64_t head_size,
                      const at::Tensor& cos_sin_cache, bool is_neox);

// out[..., :d] = silu(input[..., :d]) * input[..., d:], input [..., 2d] (gate | up).
void silu_and_mul(at::Tensor& out, const at::Tensor& input);

// The mixture-of-experts steps of cpu::moe_sort_rows and cpu::moe_combine (csrc/cpu/ops.h),
// same contracts and the same row order; moe_combine in float32, float16 or bfloat16 (float32
// sums, rounded once at the end).
std::tuple<at::Tensor, at::Tensor> moe_sort_rows(const at::Tensor& topk_ids, int64_t num_experts);
void moe_combine(at::Tensor& out, const at::Tensor& y, const at::Tensor& row_of,
                 const at::Tensor& topk_ids, const at::Tensor& topk_weights);

// Queues, on the device's current stream, a write of 1 to `eventfd` once all work queued
// before it has finished.
void notify_when_done(int64_t eventfd, int64_t device);

}  // namespace pyserve::cuda
