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
  if (!out.defined() || out.size(0) != rows || out.size(1) != out_features)
    out = at::empty({rows, out_features}, x.options());
  packed_linear(out, x.contiguous(), parts[0].packed, bias);
  return out;
}

namespace {

constexpr int64_t kLastDim[] = {-1};

// buffer, made [sizes] like `like` if it is not yet (or was made for other sizes: the MLPs of
// one stack may differ in width, a dense layer's and a shared expert's)
at::Tensor& made(at::Tensor& buffer, at::IntArrayRef sizes, const at::Tensor& like) {
  if (!buffer.defined() || buffer.sizes() != sizes) buffer = at::empty(sizes, like.options());
  return buffer;
}

// layers/norm.py's RMSNorm.forward without a residual: the native norm where x is
// contiguous, its torch ops where it is a view with gaps (q and k heads of a merged qkv)
at::Tensor llama_normed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.is_contiguous()) {
    at::Tensor out = at::empty_like(x);
    rms_norm(out, x, weight, eps);
    return out;
  }
  return weight * (x * at::rsqrt(x.pow(2).mean(kLastDim, /*keepdim=*/true) + eps));
}

// GemmaRMSNorm.forward in float32 (weight given as 1 + w): the native norm of a contiguous copy
at::Tensor contiguous_normed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
  rms_norm(out, input, weight, eps);
  return out;
}

void fit(StepBuffers& b, const AttentionSpec& a, const at::Tensor& hidden) {
  const int64_t T = hidden.size(0), q_size = a.num_heads * a.head_dim, kv_size = a.num_kv_heads * a.head_dim;
  if (b.tokens != T || b.q_size != q_size || b.kv_size != kv_size || b.hidden_size != hidden.size(1))
    b = StepBuffers{T, q_size, kv_size, 0, hidden.size(1)};  // its tensors made as first needed
}

// LlamaAttention.forward (and its Gemma and OLMo variants) on the normalised input x ->
// o_proj's output [T, hidden_size] (the buffer b.out where its packed kernel wrote it)
at::Tensor attention(const AttentionSpec& a, double eps, StepBuffers& b, const at::Tensor& x,
                     const at::Tensor& positions, at::Tensor& key_cache, at::Tensor& value_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
  const int64_t T = x.size(0), q_size = b.q_size, kv_size = b.kv_size;
  const at::Tensor qkv = a.qkv.into(x, b.qkv);
  if (!b.views_of.is_same(qkv)) {  // views of this layer's qkv (none yet: views_of undefined)
    b.views_of = qkv;
    b.q = qkv.narrow(1, 0, q_size).view({T, a.num_heads, a.head_dim});
    b.k = qkv.narrow(1, q_size, kv_size).view({T, a.num_kv_heads, a.head_dim});
    b.v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, a.num_kv_heads, a.head_dim});
  }
  at::Tensor q = b.q, k = b.k, v = b.v;
  switch (a.qk_norm) {
    case QkNorm::kNone:
      break;
    case QkNorm::kPerHead:
      q = llama_normed(q, *a.q_norm, eps);
      k = llama_normed(k, *a.k_norm, eps);
      break;
    case QkNorm::kPerHeadContiguous:
      q = contiguous_normed(q, *a.q_norm, eps);
      k = contiguous_normed(k, *a.k_norm, eps);
      break;
    case QkNorm::kProjection:
      q = llama_normed(qkv.narrow(1, 0, q_size).contiguous(), *a.q_norm, eps).view({T, a.num_heads, a.head_dim});
      k = llama_normed(qkv.narrow(1, q_size, kv_size).contiguous(), *a.k_norm, eps)
              .view({T, a.num_kv_heads, a.head_dim});
      break;
  }
  if (a.cos_sin.has_value()) rotary_embedding(positions, q, k, a.head_dim, *a.cos_sin, /*is_neox=*/true);
  reshape_and_cache(k, v, key_cache, value_cache, slot_mapping);
  at::Tensor& attn = made(b.attn, {T, a.num_heads, a.head_dim}, x);
  paged_attention(attn, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, a.scale,
                  a.window, a.softcap);
  if (!b.attn_rows.defined() || !b.attn_rows.is_alias_of(attn)) b.attn_rows = attn.view({T, q_size});
  return a.o_proj.into(b.attn_rows, b.out);
}

// LlamaMLP.forward: down(act(gate_up(x))); the result in b.down unless fresh_output
at::Tensor dense_mlp(const DenseMlp& m, StepBuffers& b, const at::Tensor& x, bool fresh_output) {
  const at::Tensor gate_up = m.gate_up.into(x, b.gate_up);
  const int64_t d = gate_up.size(1) / 2;
  at::Tensor act;
  if (m.activation == "silu") {
    act = made(b.act, {x.size(0), d}, gate_up);
    silu_and_mul(act, gate_up);
  } else {  // activation.py's gelu_tanh_and_mul, op for op
    act = at::gelu(gate_up.narrow(1, 0, d), "tanh") * gate_up.narrow(1, d, d);
  }
  return fresh_output ? m.down(act) : m.down.into(act, b.down);
}

// SparseMoe.forward on one rank: the router, the experts, the shared expert -> a new tensor
at::Tensor moe_mlp(const MoeMlp& m, StepBuffers& b, const at::Tensor& x) {
  const at::Tensor probs = at::softmax(at::linear(x, m.router), -1, at::kFloat);
  auto [weights, ids] = at::topk(probs, m.top_k, -1);
  if (m.norm_topk_prob) weights = weights / weights.sum(kLastDim, /*keepdim=*/true);
  at::Tensor out = at::empty_like(x);
  fused_moe(out, x.contiguous(), ids, weights.contiguous(), m.gate_up, m.down, c10::nullopt,
            c10::nullopt, "silu", 1.702, 7.0);
  if (m.shared_expert.has_value()) {
    StepBuffers own;  // the shared expert's intermediates are its own: b's may hold x
    out = out + at::sigmoid(at::linear(x, *m.shared_gate)) * dense_mlp(*m.shared_expert, own, x, true);
  }
  return out;
}

at::Tensor mlp(const LayerSpec& l, StepBuffers& b, const at::Tensor& x, bool fresh_output) {
  return l.moe.has_value() ? moe_mlp(*l.moe, b, x) : dense_mlp(*l.mlp, b, x, fresh_output);
}

}  // namespace

void check_layer(const LayerSpec& l) {
  const AttentionSpec& a = l.attention;
  TORCH_CHECK(a.qkv.out_features == (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, "decoder layer: qkv_proj has ",
              a.qkv.out_features, " outputs for ", a.num_heads, " + 2 x ", a.num_kv_heads, " heads of ", a.head_dim);
  TORCH_CHECK(l.mlp.has_value() != l.moe.has_value(), "decoder layer: give exactly one of mlp and moe");
  TORCH_CHECK((a.qk_norm == QkNorm::kNone) == !a.q_norm.has_value() && a.q_norm.has_value() == a.k_norm.has_value(),
              "decoder layer: the q/k norm kind and its weights disagree");
  TORCH_CHECK((l.placement == "pre" && l.norms.size() == 2) || (l.placement == "sandwich" && l.norms.size() == 4),
              "decoder layer: placement 'pre' takes 2 norms, 'sandwich' 4");
  for (const DenseMlp* m : {l.mlp ? &*l.mlp : nullptr,
                            l.moe && l.moe->shared_expert ? &*l.moe->shared_expert : nullptr})
    TORCH_CHECK(m == nullptr || m->activation == "silu" || m->activation == "gelu_tanh",
                "decoder layer: MLP activation '", m ? m->activation : "", "' (silu or gelu_tanh)");
  TORCH_CHECK(!l.moe || l.moe->shared_expert.has_value() == l.moe->shared_gate.has_value(),
              "decoder layer: a shared expert needs its gate");
}

std::tuple<at::Tensor, at::Tensor> decoder_layer_forward(
    const LayerSpec& l, StepBuffers& b, bool fresh_output, const at::Tensor& positions,
    at::Tensor hidden, std::optional<at::Tensor> residual, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "decoder layer: hidden must be contiguous float32 [T, hidden_size]");
  fit(b, l.attention, hidden);
  const int64_t T = hidden.size(0);
  if (l.placement == "sandwich") {  // GemmaDecoderLayer.forward: hidden is the stream
    TORCH_CHECK(!residual.has_value(), "decoder layer: a sandwich-normed layer takes no residual");
    const auto& n = l.norms;
    const at::Tensor attended = attention(l.attention, l.eps, b, contiguous_normed(hidden, n[0], l.eps),
                                          positions, key_cache, value_cache, slot_mapping,
                                          block_tables, query_start_loc, seq_lens);
    const at::Tensor stream = hidden + contiguous_normed(attended, n[1], l.eps);
    const at::Tensor out = mlp(l, b, contiguous_normed(stream, n[2], l.eps), false);
    return {stream + contiguous_normed(out, n[3], l.eps), at::Tensor()};
  }
  // LlamaDecoderLayer.forward
  at::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    fused_add_rms_norm(hidden, res, l.norms[0], l.eps);  // both in place
  } else {
    res = hidden;
    hidden = made(b.normed, {T, b.hidden_size}, res);
    rms_norm(hidden, res, l.norms[0], l.eps);
  }
  at::Tensor out = attention(l.attention, l.eps, b, hidden, positions, key_cache, value_cache,
                             slot_mapping, block_tables, query_start_loc, seq_lens);
  fused_add_rms_norm(out, res, l.norms[1], l.eps);  // out = norm(out + res), res = out + res
  return {mlp(l, b, out, fresh_output), res};
}

DecoderStack::DecoderStack(std::vector<LayerSpec> layers, std::vector<at::Tensor> key_caches,
                           std::vector<at::Tensor> value_caches, std::vector<int64_t> kv_groups)
    : layers_(std::move(layers)), key_caches_(std::move(key_caches)),
      value_caches_(std::move(value_caches)), kv_groups_(std::move(kv_groups)) {
  TORCH_CHECK(!layers_.empty() && key_caches_.size() == layers_.size() &&
                  value_caches_.size() == layers_.size() && kv_groups_.size() == layers_.size(),
              "DecoderStack: ", layers_.size(), " layers, ", key_caches_.size(), " key and ",
              value_caches_.size(), " value caches, ", kv_groups_.size(), " KV groups");
  for (const LayerSpec& l : layers_) {
    check_layer(l);
    TORCH_CHECK(l.placement == layers_[0].placement, "DecoderStack: the layers' norm placements differ");
  }
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(
    const at::Tensor& positions, at::Tensor hidden, std::optional<at::Tensor> residual,
    const at::Tensor& slot_mappings, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
  const bool buffered = hidden.dim() == 2 && hidden.size(0) <= kBufferedRows;
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  StepBuffers own;
  if (buffered) lock.lock();
  StepBuffers& buffers = buffered ? buffers_ : own;
  at::Tensor res;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int64_t group = kv_groups_[i];
    TORCH_CHECK(group < slot_mappings.size(0) && group < block_tables.size(0), "DecoderStack: layer ", i,
                " is in KV group ", group, " but the step has ", block_tables.size(0), " groups' tables");
    at::Tensor key_cache = key_caches_[i], value_cache = value_caches_[i];
    // the last layer's hidden is returned: a new tensor, which the next step cannot overwrite
    const bool last = i + 1 == layers_.size();
    std::tie(hidden, res) = decoder_layer_forward(
        layers_[i], buffers, last, positions, hidden, residual, key_cache, value_cache,
        slot_mappings.select(0, group), block_tables.select(0, group), query_start_loc, seq_lens);
    residual = res.defined() ? std::optional<at::Tensor>(res) : std::nullopt;
  }
  return {hidden, res};
}

}  // namespace pyserve::cpu
