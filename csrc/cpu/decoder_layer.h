// One Llama-family decoder layer on the CPU in a single call: the kernels of
// pyserve/model/models/llama.py's LlamaDecoderLayer.forward, in the same order on the same
// buffers (so the results are bitwise the Python path's), without its ~25 Python and pybind11
// round trips per layer, which cost about 2 ms of a 10 ms SmolLM2 decode step.
// For one rank (no tensor parallelism), float32 activations, weights from pack_linear_weight or
// pack_gguf_weight, and no q/k norm; the Python path serves every other case.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace pyserve::cpu {

// A linear layer as apply_linear (pyserve/model/layers/linear.py) runs it: the packed kernel
// up to max_rows rows (packed_max_rows there, by the weight's format), else BLAS on the
// widened weight.
struct PackedLinear {
  at::Tensor packed;
  int64_t out_features;
  std::optional<at::Tensor> bias;
  int64_t max_rows;  // more rows than this: a GEMM (BLAS, or bfloat16 on gemm_weight)
  // bfloat16 [out_features, K]: above max_rows x is rounded to bfloat16 for one GEMM on it,
  // as layers/linear.py's bf16_linear does (--dtype bfloat16 with AMX)
  std::optional<at::Tensor> gemm_weight;
  at::Tensor operator()(const at::Tensor& x) const;
};

class LlamaLayer {
 public:
  LlamaLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, PackedLinear qkv,
             PackedLinear o_proj, PackedLinear gate_up, PackedLinear down, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, at::Tensor cos_sin, double scale);

  // -> (hidden, residual), as LlamaDecoderLayer.forward returns them; residual None on the
  // first layer. hidden and residual are updated in place where the Python path does so.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::Tensor hidden,
                                             std::optional<at::Tensor> residual,
                                             at::Tensor& key_cache, at::Tensor& value_cache,
                                             const at::Tensor& slot_mapping,
                                             const at::Tensor& block_tables,
                                             const at::Tensor& query_start_loc,
                                             const at::Tensor& seq_lens) const;

 private:
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
// layers. The layers share one KV group's slot mapping and tables.
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

 private:
  std::vector<LlamaLayer> layers_;
  std::vector<at::Tensor> key_caches_, value_caches_;
};

}  // namespace pyserve::cpu
