// CPU implementations of pyserve's tensor ops. Each is also the readable specification of
// its CUDA twin; the Python tests hold both to a plain PyTorch reference.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pyserve::cpu {

// The grain (rows per thread's share) of a row-wise op's at::parallel_for: a few thousand
// elements at least, so that a decode batch's rows (16 of SmolLM2's 384 to 1,536 elements:
// 5-7 us on one core) are split over the cores while one row, whose fork and join would cost
// more than the row, stays on the caller.
inline int64_t rows_grain(int64_t row_elements) {
  constexpr int64_t kElements = 4096;
  return std::max<int64_t>(1, kElements / std::max<int64_t>(1, row_elements));
}

// The KV cache's dtype beside keys and queries of `type`: the same, or, under float32, a
// bfloat16, float16 or float8 e5m2 cache (--kv-cache-dtype), rounded to nearest even as it is
// written (c10's conversions, torch's own) and widened to float32 as attention reads it.
inline bool cache_types_match(at::ScalarType type, at::ScalarType cache) {
  return cache == type || (type == at::kFloat && (cache == at::kBFloat16 || cache == at::kHalf ||
                                                  cache == at::kFloat8_e5m2));
}

// Writes each new token's key/value into its slot of the paged cache.
//   key, value:             [num_tokens, num_kv_heads, head_size]
//   key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size], key's dtype or
//                           one cache_types_match allows
//   slot_mapping:           [num_tokens] int64, slot = block_id * block_size + offset;
//                           a negative slot skips the token (padding).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// Causal attention for a batch that mixes prefill chunks and decode tokens, reading all keys
// and values (including this step's, already cached) through the block tables.
//   out, query:       [num_tokens, num_heads, head_size]; sequence b owns query rows
//                     query_start_loc[b] .. query_start_loc[b+1]
//   block_tables:     [num_seqs, max_blocks_per_seq] int32
//   query_start_loc:  [num_seqs + 1] int32
//   seq_lens:         [num_seqs] int32, context length of each sequence after this step; the
//                     query rows are its last tokens, so row i of a q_len chunk sits at
//                     position seq_len - q_len + i and sees keys 0 ..= that position.
//   window:           > 0: a sliding window, the row at position p sees keys p - window + 1 ..= p
//                     only (Gemma's local layers); <= 0: every key (global attention)
//   softcap:          > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2)
// num_heads must be a multiple of num_kv_heads (grouped-query attention).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t window = 0, double softcap = 0.0);

// Linear layers (csrc/cpu/linear.cpp and linear_kquant.h describe the layouts).
// pack_linear_weight repacks weight [N, K] (float32 or bfloat16) once into panels of 32 output
// columns, zero-padded; pack_gguf_weight does the same for a GGUF tensor's raw blocks [N, K /
// block weights * block bytes] of type Q4_0, Q4_1, Q5_0, Q8_0 (blocks of 32 weights) or Q4_K,
// Q5_K, Q6_K (super-blocks of 256: K a multiple of 256), dequantized in registers bitwise as
// the gguf package dequantizes. packed_linear computes out[M, N] = x[M, K] · weight[N, K]ᵀ (+ bias[N]) from
// either, x, out and bias float32, with float32 accumulation. unpack_linear_weight gives back
// the float32 [N, K] weight (for the GEMM of steps with many rows); packed_rows the float32
// rows ids (an embedding lookup).
// int8_activations: packed_linear then quantizes x to int8 per block of 32 and uses integer
// dot products where the extension has that kernel (int8_dot_supported(): built for AVX2 or
// AVX-512 VNNI): 2 to 3 times the float32 path's speed for SmolLM2's layers at 1 to 2,048
// rows with VNNI, about 2 times with AVX2 (benchmarks/linear.py), at the cost of bitwise
// equality with the float32 model. The packed weight comes back as int8
// to say so, and is otherwise the same (Q8_0's bytes in vpdpbusd's order, where its float32
// panels are k-major). Only the types with that kernel (Q4_0, Q4_1, Q5_0,
// Q8_0, Q4_K, Q5_K) are marked; Q6_K comes back as uint8 and stays exact.
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor pack_gguf_weight(const at::Tensor& blocks, int64_t K, const std::string& type,
                            bool int8_activations = false);
bool int8_dot_supported();
void packed_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias);
at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t N);
at::Tensor packed_rows(const at::Tensor& packed, const at::Tensor& ids);
int64_t packed_in_features(const at::Tensor& packed);  // K of a packed weight

// Grouped linear layers (a mixture of experts' projections): for each expert e, rows
// offsets[e] .. offsets[e + 1] of out[R, N] = those rows of x[R, K] · W_eᵀ (+ bias[e]), W_e =
// packed[e], a stack [E, ...] of packed weights of one format and shape (pack_linear_weight's
// or pack_gguf_weight's, int8 activations included). Every expert's panels are shared out
// over the threads in one parallel region, by rows; each row's result is bitwise what
// packed_linear gives it. out's rows may be strided (a column slice of a wider tensor).
void grouped_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                    const at::Tensor& offsets, const c10::optional<at::Tensor>& bias);

// The experts of a mixture-of-experts block (cpu/moe.cpp): out[T, H] = Σ over each token's k
// choices, in ascending expert order, of topk_weights · down_e(act(gate_e(x), up_e(x))).
// gate_up: one stack of packed [2I, H] weights (gate rows, then up rows) or two stacks of
// [I, H] (gate, up: when their GGUF types differ); down: a stack of packed [H, I]. Biases,
// where the model has them: gate_up_bias [E, 2I], down_bias [E, H]. activation: silu
// (silu(gate) · up) or swigluoai (gpt-oss: gate clamped above at limit, up within ±limit,
// (up + 1) · gate · sigmoid(alpha · gate)).
// Its two steps around the experts' projections, with CUDA twins (csrc/cuda/moe.cu):
// moe_sort_rows gives each (token, choice) pair of topk_ids [T, k] its row in an
// expert-sorted order (row_of [T, k]: experts ascending, tokens in order within one) and the
// experts' row offsets [E + 1]; moe_combine sums out[t] = Σ_c topk_weights[t, c] ·
// y[row_of[t, c]] over t's choices in ascending expert order, from zero, each product
// rounded before its add (transformers' index_add_ of weighted rows).
std::tuple<at::Tensor, at::Tensor> moe_sort_rows(const at::Tensor& topk_ids, int64_t num_experts);
void moe_combine(at::Tensor& out, const at::Tensor& y, const at::Tensor& row_of,
                 const at::Tensor& topk_ids, const at::Tensor& topk_weights);
void fused_moe(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_ids,
               const at::Tensor& topk_weights, const std::vector<at::Tensor>& gate_up,
               const at::Tensor& down, const c10::optional<at::Tensor>& gate_up_bias,
               const c10::optional<at::Tensor>& down_bias, const std::string& activation,
               double alpha, double limit);

// Bidirectional attention over an encoder's packed batch (csrc/cpu/encoder_attention.cpp):
// out[T, H, D] = softmax(q kᵀ · scale) v within each sequence of qkv [T, 3, H, D] (rows
// [3][H][D] contiguous), sequences bounded by query_start_loc [B + 1]; float32.
// encoder_attention_supported(D): this build has a vector path for head size D.
bool encoder_attention_supported(int64_t head_size);
void encoder_attention(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& query_start_loc,
                       double scale);

// Float32 GEMMs as three bfloat16 products on AMX tiles (csrc/cpu/bf16x3.cpp: the split, its
// error and the layout). bf16x3_supported(): built with AMX-BF16 and granted the tile state by
// the kernel. pack_bf16x3_weight packs a float32 weight [N, K] (N, K multiples of 32) once;
// bf16x3_linear returns act(x[M, K] · weight[N, K]ᵀ (+ bias[N])), float32 [M, N], act one of
// none, gelu (erf), gelu_tanh, relu, applied while each block of the output is in L1.
bool bf16x3_supported();
at::Tensor pack_bf16x3_weight(const at::Tensor& weight);
at::Tensor bf16x3_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias, const std::string& activation = "none");

// The fused layer ops, with the contracts of their CUDA twins in csrc/cuda/ops.h:
// rms_norm: out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32;
// fused_add_rms_norm: in place, residual = input + residual, input = rms_norm(residual);
// rotary_embedding: in place on query and key, cos_sin_cache [max_position, rot_dim] =
// cat(cos, sin) in float32, neox (halves) or GPT-J (pairs) style;
// silu_and_mul: out[..., :d] = silu(input[..., :d]) * input[..., d:].
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox);
void silu_and_mul(at::Tensor& out, const at::Tensor& input);

// apply_token_bitmask: structured outputs. logits [S, V] float32 and bitmask [S, ceil(V / 32)]
// int32 (bit k of word w set = token 32w + k allowed, xgrammar's layout) share their rows; in
// each of the given rows, the logits of tokens not allowed become -inf, in place.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);

// sample_tokens (cpu/sampling.cpp): one token a row of logits [S, V] float32 into out [S]
// int64. A greedy row (greedy [S] bool) takes the first index of its maximum (torch.argmax).
// A random row draws from softmax(logits / temperature) restricted by top_k ([S] int64; >= V
// or <= 0: off), top_p ([S] float32; 1: off) and min_p ([S] float32; 0: off), as the
// sampler's PyTorch steps define them, by inverting its CDF at uniforms[r] ([S] float64 in
// [0, 1)).
void sample_tokens(at::Tensor& out, const at::Tensor& logits, const at::Tensor& greedy,
                   const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& top_k,
                   const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                   const std::optional<at::Tensor>& uniforms);

// apply_penalties (cpu/sampling.cpp): in place on logits [S, V] float32, row r's penalties
// ([S] float32 each) over its token histories, ids[offsets[r]:offsets[r + 1]] (int64; seen:
// prompt and output, repeats allowed; output: each repeat counts): repetition on each token
// seen (positive logits divided by it, the others multiplied), then frequency times the
// token's count and presence subtracted per output token; ids outside [0, V) are skipped.
void apply_penalties(at::Tensor& logits, const at::Tensor& presence, const at::Tensor& frequency,
                     const at::Tensor& repetition, const at::Tensor& seen_ids,
                     const at::Tensor& seen_offsets, const at::Tensor& output_ids,
                     const at::Tensor& output_offsets);

// logprob_columns (cpu/sampling.cpp): for logits [R, V] float32 and one target token a row
// (targets [R] int64), without the [R, V] log_softmax: (the target's logprob [R] float32, its
// rank [R] int64, 1 = the most likely, counted as the tokens of greater logprob plus one, the
// k most likely tokens [R, k] int64, likeliest first, equal logits by lower index, and their
// logprobs [R, k] float32). Logprobs are (x - max) - log(sum(exp(x - max))), torch's order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_columns(
    const at::Tensor& logits, const at::Tensor& targets, int64_t k);

}  // namespace pyserve::cpu
