// The decoder layers on the CPU as one native call a step, built from layer specs: each layer
// is a choice of a norm placement, an attention (its q/k norm, rope, window, softcap) and an
// MLP (dense gated, or a mixture of experts), so that a new architecture made of these pieces
// is a new spec built in Python (pyserve/model/layers/native.py), not new C++.
// Each piece runs the kernels of the Python module it stands for, in the same order on the
// same values, so that the results are bitwise the Python path's, without its 25 to 40 Python
// and pybind11 round trips per layer (about 2 ms of a 10 ms SmolLM2 decode step, 4 ms of a
// 19 ms Gemma 3 270M one).
// For one rank (no tensor parallelism), float32 activations and weights from
// pack_linear_weight or pack_gguf_weight; the Python path serves every other case.
#pragma once

#include <ATen/ATen.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pyserve::cpu {

// One packed weight of a linear layer: the layer's whole weight, or one part of a merged
// layer whose GGUF parts differ in type (q and k in Q5_0, v in Q8_0), each part's output
// columns computed by its own kernel.
struct PackedPart {
  at::Tensor packed;
  int64_t rows;      // output columns
  int64_t max_rows;  // more rows than this: BLAS on the widened weight
};

// A linear layer as apply_linear (pyserve/model/layers/linear.py) runs it: the packed kernel
// up to max_rows rows (packed_max_rows there, by the weight's format), else BLAS on the
// widened weight; a layer of several parts as its _apply_parts, the parts concatenated.
struct PackedLinear {
  std::vector<PackedPart> parts;
  int64_t out_features;
  std::optional<at::Tensor> bias;
  int64_t max_rows;  // more rows than this with a gemm_weight: one bfloat16 GEMM
  // bfloat16 [out_features, K]: above max_rows x is rounded to bfloat16 for one GEMM on it,
  // as layers/linear.py's bf16_linear does (--dtype bfloat16 with AMX or AVX-512 BF16)
  std::optional<at::Tensor> gemm_weight;
  at::Tensor operator()(const at::Tensor& x) const;
  // the same, written into out where one packed kernel computes it all (one part, within its
  // max_rows, no GEMM), out made [rows of x, out_features] first if undefined; else a new
  // tensor, as operator() gives, and out is left as it is
  at::Tensor into(const at::Tensor& x, at::Tensor& out) const;
};

// How q and k are normalised before rotary, as the attention module of each family does.
enum class QkNorm : int64_t {
  kNone = 0,
  kPerHead = 1,            // layers/norm.py's RMSNorm on each head's view (Qwen3)
  kPerHeadContiguous = 2,  // GemmaRMSNorm: each head of a contiguous copy ((1 + w) given)
  kProjection = 3,         // over the whole q and k projections at once (OLMo 2, OLMoE)
};

struct AttentionSpec {
  PackedLinear qkv, o_proj;
  int64_t num_heads, num_kv_heads, head_dim;
  QkNorm qk_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  std::optional<at::Tensor> cos_sin;  // the neox rotary table; none: a layer without rope
  double scale;
  int64_t window;   // 0: global attention
  double softcap;   // 0: none
};

// A gated MLP: act(gate) * up, then down. activation "silu" or "gelu_tanh".
struct DenseMlp {
  PackedLinear gate_up, down;
  std::string activation;
};

// layers/moe.py's SparseMoe on packed experts: a float32 softmax router over router [E, H],
// the top k (renormalised where norm_topk_prob), the experts by fused_moe, and Qwen2-MoE's
// shared expert scaled by sigmoid(shared_gate · x).
struct MoeMlp {
  at::Tensor router;
  int64_t top_k;
  bool norm_topk_prob;
  std::vector<at::Tensor> gate_up;
  at::Tensor down;
  std::optional<DenseMlp> shared_expert;
  std::optional<at::Tensor> shared_gate;  // [1, H]
};

// Where a layer's norms sit:
// - "pre" (Llama): norms = {input, post_attention}; each sublayer's input normalised, the
//   residual add fused into the norm (the stream handed on as (hidden, residual));
// - "sandwich" (Gemma 2/3): norms = {input, post_attention, pre_feedforward,
//   post_feedforward} as (1 + w); each sublayer's input and output normalised, the output
//   added to the stream (handed on as hidden alone).
struct LayerSpec {
  std::string placement;
  std::vector<at::Tensor> norms;
  double eps;
  AttentionSpec attention;
  std::optional<DenseMlp> mlp;
  std::optional<MoeMlp> moe;  // exactly one of mlp and moe
};

// The intermediate tensors of one step's rows, kept for a row count and reused by every layer
// of a stack and by the steps after while the count stays (every decode step of one stream):
// a layer's dozen allocations and views cost about as much as its small kernels at one row.
// Each is made when first written (one a linear layer's fallback never writes is never made)
// and written before it is read, so no value carries over from a step.
struct StepBuffers {
  int64_t tokens = -1, q_size = 0, kv_size = 0, inter2 = 0, hidden_size = 0;
  at::Tensor normed, qkv, q, k, v, attn, attn_rows, out, gate_up, act, down;
  at::Tensor views_of;  // the qkv that q, k and v view: the buffer, or a fallback's own tensor
};

// One layer's step: -> (hidden, residual) as the Python layer returns them (residual
// undefined after a sandwich layer, whose hidden is the stream). hidden and residual are
// updated in place where the Python path does so. The intermediates go to buffers; the
// returned hidden is a buffer where the last kernel wrote it there, a new tensor if
// fresh_output.
std::tuple<at::Tensor, at::Tensor> decoder_layer_forward(
    const LayerSpec& layer, StepBuffers& buffers, bool fresh_output, const at::Tensor& positions,
    at::Tensor hidden, std::optional<at::Tensor> residual, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens);

void check_layer(const LayerSpec& layer);

// A run of layers with their KV caches, called once per step for all of them: one pybind11
// call and one release of the GIL for the whole stack instead of one per layer, so that the
// event loop's thread (HTTP, streaming) cannot hold the model thread up between layers.
// kv_groups[i] says which of the step's KV groups holds layer i's cache: slot_mappings
// [groups, T] and block_tables [groups, num_seqs, max_blocks] hold every group's. Steps of up
// to kBufferedRows rows keep their intermediates in one StepBuffers; one caller at a time.
class DecoderStack {
 public:
  DecoderStack(std::vector<LayerSpec> layers, std::vector<at::Tensor> key_caches,
               std::vector<at::Tensor> value_caches, std::vector<int64_t> kv_groups);

  // -> (hidden, residual) after the last layer, as decoder_layer_forward after each
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::Tensor hidden,
                                             std::optional<at::Tensor> residual,
                                             const at::Tensor& slot_mappings,
                                             const at::Tensor& block_tables,
                                             const at::Tensor& query_start_loc,
                                             const at::Tensor& seq_lens) const;

  // larger steps (long prefill chunks) allocate their own buffers for the call: their kernels
  // dwarf the allocations, and their buffers are not worth keeping between steps
  static constexpr int64_t kBufferedRows = 256;

 private:
  std::vector<LayerSpec> layers_;
  std::vector<at::Tensor> key_caches_, value_caches_;
  std::vector<int64_t> kv_groups_;
  mutable std::mutex mutex_;  // guards buffers_ (the model thread is the only caller)
  mutable StepBuffers buffers_;
};

}  // namespace pyserve::cpu
