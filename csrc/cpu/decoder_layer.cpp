#include "cpu/decoder_layer.h"

#include "cpu/ops.h"

namespace pyserve::cpu {

at::Tensor PackedLinear::operator()(const at::Tensor& x) const {
  if (gemm_weight.has_value() && x.size(0) > max_rows) {
    at::Tensor out = at::linear(x.to(at::kBFloat16), *gemm_weight).to(at::kFloat);
    return bias.has_value() ? out.add_(*bias) : out;
  }
  const at::Tensor input = x.contiguous();
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const PackedPart& part : parts) {
    std::optional<at::Tensor> part_bias;
    if (bias.has_value()) part_bias = bias->narrow(0, start, part.rows);
    if (input.size(0) <= part.max_rows) {
      at::Tensor out = at::empty({input.size(0), part.rows}, input.options());
      packed_linear(out, input, part.packed, part_bias);
      outs.push_back(std::move(out));
    } else {
      outs.push_back(at::linear(input, unpack_linear_weight(part.packed, part.rows), part_bias));
    }
    start += part.rows;
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

at::Tensor PackedLinear::into(const at::Tensor& x, at::Tensor& out) const {
  const int64_t rows = x.size(0);
  if (parts.size() != 1 || rows > parts[0].max_rows || (gemm_weight.has_value() && rows > max_rows))
    return (*this)(x);
  if (!out.defined()) out = at::empty({rows, out_features}, x.options());
  packed_linear(out, x.contiguous(), parts[0].packed, bias);
  return out;
}

LlamaLayer::LlamaLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, PackedLinear qkv,
                       PackedLinear o_proj, PackedLinear gate_up, PackedLinear down,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos_sin,
                       double scale)
    : input_norm_(std::move(input_norm)), post_norm_(std::move(post_norm)), eps_(eps),
      qkv_(std::move(qkv)), o_proj_(std::move(o_proj)), gate_up_(std::move(gate_up)),
      down_(std::move(down)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), cos_sin_(std::move(cos_sin)), scale_(scale) {
  TORCH_CHECK(qkv_.out_features == (num_heads + 2 * num_kv_heads) * head_dim,
              "LlamaLayer: qkv_proj has ", qkv_.out_features, " outputs for ", num_heads, " + 2 x ",
              num_kv_heads, " heads of ", head_dim);
}

void LlamaLayer::fit(StepBuffers& b, const at::Tensor& hidden) const {
  const int64_t T = hidden.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t inter2 = gate_up_.out_features, hidden_size = hidden.size(1);
  if (b.tokens != T || b.q_size != q_size || b.kv_size != kv_size || b.inter2 != inter2 ||
      b.hidden_size != hidden_size)
    b = StepBuffers{T, q_size, kv_size, inter2, hidden_size};  // its tensors made as first needed
}

// buffer, made [sizes] like `like` if it is not yet
static at::Tensor& made(at::Tensor& buffer, at::IntArrayRef sizes, const at::Tensor& like) {
  if (!buffer.defined()) buffer = at::empty(sizes, like.options());
  return buffer;
}

std::tuple<at::Tensor, at::Tensor> LlamaLayer::forward(
    StepBuffers& b, bool fresh_output, const at::Tensor& positions, at::Tensor hidden,
    std::optional<at::Tensor> residual, at::Tensor& key_cache, at::Tensor& value_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "LlamaLayer: hidden must be contiguous float32 [T, hidden_size]");
  fit(b, hidden);
  const int64_t T = hidden.size(0), q_size = b.q_size, kv_size = b.kv_size;
  at::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    fused_add_rms_norm(hidden, res, input_norm_, eps_);  // both in place
  } else {
    res = hidden;
    hidden = made(b.normed, {T, b.hidden_size}, res);
    rms_norm(hidden, res, input_norm_, eps_);
  }
  const at::Tensor qkv = qkv_.into(hidden, b.qkv);
  if (!b.views_of.is_same(qkv)) {  // views of this layer's qkv (none yet: views_of undefined)
    b.views_of = qkv;
    b.q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
    b.k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads_, head_dim_});
    b.v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads_, head_dim_});
  }
  rotary_embedding(positions, b.q, b.k, head_dim_, cos_sin_, /*is_neox=*/true);
  reshape_and_cache(b.k, b.v, key_cache, value_cache, slot_mapping);
  at::Tensor& attn = made(b.attn, {T, num_heads_, head_dim_}, hidden);
  paged_attention(attn, b.q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale_);
  if (!b.attn_rows.defined()) b.attn_rows = attn.view({T, q_size});
  at::Tensor out = o_proj_.into(b.attn_rows, b.out);
  fused_add_rms_norm(out, res, post_norm_, eps_);  // out = norm(out + res), res = out + res
  const at::Tensor gate_up = gate_up_.into(out, b.gate_up);
  at::Tensor& act = made(b.act, {T, b.inter2 / 2}, gate_up);
  silu_and_mul(act, gate_up);
  if (fresh_output) return {down_(act), res};
  return {down_.into(act, b.down), res};
}

LlamaStack::LlamaStack(std::vector<LlamaLayer> layers, std::vector<at::Tensor> key_caches,
                       std::vector<at::Tensor> value_caches)
    : layers_(std::move(layers)), key_caches_(std::move(key_caches)), value_caches_(std::move(value_caches)) {
  TORCH_CHECK(!layers_.empty() && key_caches_.size() == layers_.size() && value_caches_.size() == layers_.size(),
              "LlamaStack: ", layers_.size(), " layers, ", key_caches_.size(), " key and ",
              value_caches_.size(), " value caches");
}

std::tuple<at::Tensor, at::Tensor> LlamaStack::forward(
    const at::Tensor& positions, at::Tensor hidden, std::optional<at::Tensor> residual,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
  const bool buffered = hidden.dim() == 2 && hidden.size(0) <= kBufferedRows;
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  StepBuffers own;
  if (buffered) lock.lock();
  StepBuffers& buffers = buffered ? buffers_ : own;
  at::Tensor res;
  for (size_t i = 0; i < layers_.size(); ++i) {
    at::Tensor key_cache = key_caches_[i], value_cache = value_caches_[i];
    // the last layer's hidden is returned: a new tensor, which the next step cannot overwrite
    const bool last = i + 1 == layers_.size();
    std::tie(hidden, res) = layers_[i].forward(buffers, last, positions, hidden, residual,
                                               key_cache, value_cache, slot_mapping, block_tables,
                                               query_start_loc, seq_lens);
    residual = res;
  }
  return {hidden, res};
}

GemmaLayer::GemmaLayer(GemmaNorms norms, PackedLinear qkv, PackedLinear o_proj,
                       PackedLinear gate_up, PackedLinear down, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, at::Tensor cos_sin, double scale,
                       int64_t window, double softcap, int64_t kv_group)
    : norms_(std::move(norms)), qkv_(std::move(qkv)), o_proj_(std::move(o_proj)),
      gate_up_(std::move(gate_up)), down_(std::move(down)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), cos_sin_(std::move(cos_sin)),
      scale_(scale), window_(window), softcap_(softcap), kv_group_(kv_group) {
  TORCH_CHECK(qkv_.out_features == (num_heads + 2 * num_kv_heads) * head_dim,
              "GemmaLayer: qkv_proj has ", qkv_.out_features, " outputs for ", num_heads, " + 2 x ",
              num_kv_heads, " heads of ", head_dim);
  TORCH_CHECK(norms_.q.has_value() == norms_.k.has_value(), "GemmaLayer: a q norm without a k norm");
}

at::Tensor GemmaLayer::normed(const at::Tensor& x, const at::Tensor& weight) const {
  // GemmaRMSNorm.forward in float32: the native norm of the contiguous rows
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
  rms_norm(out, input, weight, norms_.eps);
  return out;
}

at::Tensor GemmaLayer::forward(const at::Tensor& positions, const at::Tensor& hidden,
                               at::Tensor& key_cache, at::Tensor& value_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "GemmaLayer: hidden must be contiguous float32 [T, hidden_size]");
  const int64_t T = hidden.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const at::Tensor qkv = qkv_(normed(hidden, norms_.input));
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads_, head_dim_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads_, head_dim_});
  if (norms_.q.has_value()) {
    q = normed(q, *norms_.q);
    k = normed(k, *norms_.k);
  }
  rotary_embedding(positions, q, k, head_dim_, cos_sin_, /*is_neox=*/true);
  reshape_and_cache(k, v, key_cache, value_cache, slot_mapping);
  at::Tensor attn = at::empty_like(q);
  paged_attention(attn, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale_,
                  window_, softcap_);
  const at::Tensor residual = hidden + normed(o_proj_(attn.view({T, q_size})), norms_.post_attention);
  const at::Tensor gate_up = gate_up_(normed(residual, norms_.pre_feedforward));
  const int64_t d = gate_up.size(1) / 2;
  // activation.py's gelu_tanh_and_mul, op for op
  const at::Tensor act = at::gelu(gate_up.narrow(1, 0, d), "tanh") * gate_up.narrow(1, d, d);
  return residual + normed(down_(act), norms_.post_feedforward);
}

GemmaStack::GemmaStack(std::vector<GemmaLayer> layers, std::vector<at::Tensor> key_caches,
                       std::vector<at::Tensor> value_caches)
    : layers_(std::move(layers)), key_caches_(std::move(key_caches)), value_caches_(std::move(value_caches)) {
  TORCH_CHECK(!layers_.empty() && key_caches_.size() == layers_.size() && value_caches_.size() == layers_.size(),
              "GemmaStack: ", layers_.size(), " layers, ", key_caches_.size(), " key and ",
              value_caches_.size(), " value caches");
}

at::Tensor GemmaStack::forward(const at::Tensor& positions, at::Tensor hidden,
                               const at::Tensor& slot_mappings, const at::Tensor& block_tables,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int64_t group = layers_[i].kv_group();
    TORCH_CHECK(group < slot_mappings.size(0) && group < block_tables.size(0), "GemmaStack: layer ", i,
                " is in KV group ", group, " but the step has ", block_tables.size(0), " groups' tables");
    at::Tensor key_cache = key_caches_[i], value_cache = value_caches_[i];
    hidden = layers_[i].forward(positions, hidden, key_cache, value_cache, slot_mappings.select(0, group),
                                block_tables.select(0, group), query_start_loc, seq_lens);
  }
  return hidden;
}

}  // namespace pyserve::cpu
