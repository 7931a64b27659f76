// One decoder layer on the CPU in a single call: the kernels of the Python layer's forward
// (pyserve/model/models/llama.py's LlamaDecoderLayer, gemma.py's GemmaDecoderLayer), in the
// same order on the same buffers (so the results are bitwise the Python path's), without its
// 25 to 40 Python and pybind11 round trips per layer, which cost about 2 ms of a 10 ms SmolLM2
// decode step and 4 ms of a 19 ms Gemma 3 270M one.
// For one rank (no tensor parallelism), float32 activations and weights from
// pack_linear_weight or pack_gguf_weight; the Python path serves every other case.
#pragma once

#include <ATen/ATen.h>

#include <mutex>
#include <optional>
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

class LlamaLayer {
 public:
  LlamaLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, PackedLinear qkv,
             PackedLinear o_proj, PackedLinear gate_up, PackedLinear down, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, at::Tensor cos_sin, double scale);

  // -> (hidden, residual), as LlamaDecoderLayer.forward returns them; residual None on the
  // first layer. hidden and residual are updated in place where the Python path does so. The
  // intermediates go to buffers (emptied first if they were kept for other rows or sizes); the
  // returned hidden is buffers.down where down's packed kernel wrote it, a new tensor if
  // fresh_output.
  std::tuple<at::Tensor, at::Tensor> forward(StepBuffers& buffers, bool fresh_output,
                                             const at::Tensor& positions, at::Tensor hidden,
                                             std::optional<at::Tensor> residual,
                                             at::Tensor& key_cache, at::Tensor& value_cache,
                                             const at::Tensor& slot_mapping,
                                             const at::Tensor& block_tables,
                                             const at::Tensor& query_start_loc,
                                             const at::Tensor& seq_lens) const;

 private:
  void fit(StepBuffers& buffers, const at::Tensor& hidden) const;

  at::Tensor input_norm_, post_norm_;
  double eps_;
  PackedLinear qkv_, o_proj_, gate_up_, down_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  at::Tensor cos_sin_;
  double scale_;
};

// A run of LlamaLayers with their KV caches, called once per step for all of them: one
// pybind11 call and one release of the GIL for the whole stack instead of one per layer, so
// that the event loop's thread (HTTP, streaming) cannot hold the model thread up between
// layers. The layers share one KV group's slot mapping and tables. Steps of up to
// kBufferedRows rows keep their intermediates in one StepBuffers; one caller at a time.
class LlamaStack {
 public:
  LlamaStack(std::vector<LlamaLayer> layers, std::vector<at::Tensor> key_caches,
             std::vector<at::Tensor> value_caches);

  // -> (hidden, residual) after the last layer, as LlamaLayer::forward after each
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::Tensor hidden,
                                             std::optional<at::Tensor> residual,
                                             const at::Tensor& slot_mapping,
                                             const at::Tensor& block_tables,
                                             const at::Tensor& query_start_loc,
                                             const at::Tensor& seq_lens) const;

  // larger steps (long prefill chunks) allocate their own buffers for the call: their kernels
  // dwarf the allocations, and their buffers are not worth keeping between steps
  static constexpr int64_t kBufferedRows = 256;

 private:
  std::vector<LlamaLayer> layers_;
  std::vector<at::Tensor> key_caches_, value_caches_;
  mutable std::mutex mutex_;  // guards buffers_ (the model thread is the only caller)
  mutable StepBuffers buffers_;
};

// One Gemma 2 / Gemma 3 decoder layer (GemmaDecoderLayer.forward): (1 + w) RMSNorms before
// and after each sublayer (the weights given as 1 + w), optional q/k norms (Gemma 3), a
// sliding window or none, Gemma 2's attention softcap, and a GELU-tanh gated MLP, computed by
// the same ATen ops as the Python path so that it is bitwise the same.
struct GemmaNorms {
  at::Tensor input, post_attention, pre_feedforward, post_feedforward;
  std::optional<at::Tensor> q, k;  // per head, Gemma 3 only
  double eps;
};

class GemmaLayer {
 public:
  GemmaLayer(GemmaNorms norms, PackedLinear qkv, PackedLinear o_proj, PackedLinear gate_up,
             PackedLinear down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
             at::Tensor cos_sin, double scale, int64_t window, double softcap, int64_t kv_group);

  // -> the residual stream after the layer (a new tensor)
  at::Tensor forward(const at::Tensor& positions, const at::Tensor& hidden, at::Tensor& key_cache,
                     at::Tensor& value_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens) const;

  int64_t kv_group() const { return kv_group_; }

 private:
  at::Tensor normed(const at::Tensor& x, const at::Tensor& weight) const;

  GemmaNorms norms_;
  PackedLinear qkv_, o_proj_, gate_up_, down_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  at::Tensor cos_sin_;
  double scale_;
  int64_t window_;  // 0: global attention
  double softcap_;  // 0: none
  int64_t kv_group_;  // which of the hybrid KV layout's groups holds this layer's cache
};

// GemmaLayers with their caches as one call a step (LlamaStack's reason). Local and global
// layers live in different KV groups: slot_mappings [groups, T] and block_tables [groups,
// num_seqs, max_blocks] hold every group's (one group: the step's own, unsqueezed).
class GemmaStack {
 public:
  GemmaStack(std::vector<GemmaLayer> layers, std::vector<at::Tensor> key_caches,
             std::vector<at::Tensor> value_caches);

  at::Tensor forward(const at::Tensor& positions, at::Tensor hidden, const at::Tensor& slot_mappings,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens) const;

 private:
  std::vector<GemmaLayer> layers_;
  std::vector<at::Tensor> key_caches_, value_caches_;
};

}  // namespace pyserve::cpu
