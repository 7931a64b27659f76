"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) for embeddings: the last layer's hidden
states of a packed batch of whole sequences. Post-LN blocks, bidirectional attention within
each sequence, no KV cache. Shapes: T tokens in the batch, B sequences, L the longest one,
H heads, D head size, E hidden size."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _native
from pyserve.errors import ModelLoadError
from pyserve.model.layers.embedding import VocabParallelEmbedding
from pyserve.model.layers.linear import (ColumnParallelLinear, RowParallelLinear,
                                         apply_linear_activation)
from pyserve.model.loader import fill_parameter

ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel")
# masked-LM checkpoints carry the same encoder under a prefix; their head is not read
_MASKED_LM = {"BertForMaskedLM": "BertModel", "RobertaForMaskedLM": "RobertaModel",
              "XLMRobertaForMaskedLM": "XLMRobertaModel"}
_MODEL_TYPES = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}
# hidden_act -> our name of it (layers/linear.py's ACTIVATIONS)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class EncoderArch:
    architecture: str  # one of ENCODER_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str  # a key of _ACTIVATIONS
    pad_token_id: int | None
    # added to the 0-based position of a token: RoBERTa's positions start after padding_idx
    position_offset: int
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position_embeddings - self.position_offset

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> EncoderArch:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type"))
        arch = _MASKED_LM.get(arch, arch)
        if arch not in ENCODER_ARCHITECTURES:
            raise ModelLoadError(f"unsupported encoder architecture '{arch}'; pyserve embeds with: "
                                 + ", ".join(ENCODER_ARCHITECTURES))
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"position_embedding_type '{cfg['position_embedding_type']}' is "
                                 "not supported; pyserve's encoders use absolute positions")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ModelLoadError("this config is a decoder (is_decoder / add_cross_attention); "
                                 "pyserve's encoders are bidirectional")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"hidden_act '{act}' is not supported; use one of "
                                 + ", ".join(_ACTIVATIONS))
        hidden, heads = _read(cfg, "hidden_size", int), _read(cfg, "num_attention_heads", int)
        if heads <= 0 or hidden % heads:
            raise ModelLoadError(f"hidden_size {hidden} is not a multiple of num_attention_heads "
                                 f"{heads}")
        # RoBERTa numbers positions from padding_idx + 1 (transformers' position ids)
        pad = _read(cfg, "pad_token_id", int, None if arch == "BertModel" else _REQUIRED)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (int(eos),)
        return EncoderArch(
            architecture=arch,
            vocab_size=_read(cfg, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_read(cfg, "intermediate_size", int),
            num_layers=_read(cfg, "num_hidden_layers", int),
            num_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=_read(cfg, "max_position_embeddings", int),
            type_vocab_size=_read(cfg, "type_vocab_size", int, 2),
            layer_norm_eps=_read(cfg, "layer_norm_eps", float, 1e-12),
            hidden_act=act,
            pad_token_id=pad,
            position_offset=0 if arch == "BertModel" else pad + 1,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=_read(cfg, "bos_token_id", int, None),
            eos_token_ids=eos_ids,
        )


_REQUIRED = object()


def _read(cfg: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """cfg[key] as kind; default where it is absent or null (None), unless it is required."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"config.json lacks '{key}', which an encoder needs")
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"config.json has a bad value for '{key}': {value!r}") from None


# Longest sequence up to which one padded SDPA call beats a call per sequence: below it the
# calls' overhead dominates, above it the masked kernel's extra work (32 sequences, 12 heads
# of 32, two cores: 1.3 against 2.4 ms at 8 tokens, 3.7 against 4.4 at 32, 10.0 against 8.6
# at 64).
PADDED_MAX_LEN = 32


# The longest sequence for which our kernel takes a step: it saves SDPA's fixed cost per call,
# which dominates short sequences, but does not tile the keys as SDPA's flash kernel does
# (12 heads of 32, two cores: 32 sequences of 22-84 tokens 1.4 against 2.9 ms a layer; 8 of
# 128 1.28 against 1.41; one of 1,024 17.2 against 8.0).
ENCODER_ATTENTION_MAX_LEN = 128


def packed_attention(qkv: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """qkv [T, 3, H, D] of B packed sequences -> [T, H, D], each token attending to every
    token of its own sequence. On the CPU in float32, our kernel (csrc/cpu/encoder_attention.cpp,
    twice SDPA's speed at MiniLM's shapes) where this build has a vector path for D and no
    sequence is longer than ENCODER_ATTENTION_MAX_LEN. Otherwise short sequences go through
    one SDPA call on a padded [B, H, L, D] batch, whose masked keys weigh exactly zero, unless
    padding would more than double the work; else one call per sequence. query_start_loc is
    read on the host: pass a CPU tensor to avoid a device sync."""
    starts = query_start_loc.tolist()
    lens = [end - start for start, end in zip(starts, starts[1:])]
    longest = max(lens)
    if (qkv.device.type == "cpu" and qkv.dtype == torch.float32 and longest <= ENCODER_ATTENTION_MAX_LEN
            and _native.encoder_attention_supported(qkv.shape[3])):
        out = qkv.new_empty(qkv.shape[0], *qkv.shape[2:])
        _native.encoder_attention(out, qkv, query_start_loc, qkv.shape[3] ** -0.5)
        return out
    if (len(lens) == 1 or longest > PADDED_MAX_LEN
            or len(lens) * longest * longest > 2 * sum(n * n for n in lens)):
        out = qkv.new_empty(qkv.shape[0], *qkv.shape[2:])
        for start, end in zip(starts, starts[1:]):
            # [1, H, L, D] each: SDPA's fast CPU kernel takes 4-d inputs, strided ones too
            q, k, v = qkv[start:end, None].permute(2, 1, 3, 0, 4)
            out[start:end] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
        return out
    device = qkv.device
    lens_t = torch.tensor(lens, device=device)
    seq_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
    local = torch.arange(qkv.shape[0], device=device) - query_start_loc.to(device)[seq_ids]
    padded = qkv.new_zeros(len(lens), longest, *qkv.shape[1:])  # [B, L, 3, H, D]
    padded[seq_ids, local] = qkv
    q, k, v = padded.permute(2, 0, 3, 1, 4)  # [B, H, L, D] each
    key_mask = (torch.arange(longest, device=device) < lens_t[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
    return out.transpose(1, 2)[seq_ids, local]


class BertLayer(nn.Module):
    def __init__(self, arch: EncoderArch, dtype: torch.dtype):
        super().__init__()
        e, d, n = arch.hidden_size, arch.head_dim, arch.intermediate_size
        self.num_heads, self.head_dim = arch.num_heads, d
        self.qkv_proj = ColumnParallelLinear(e, [arch.num_heads * d] * 3, True, dtype)
        self.o_proj = RowParallelLinear(arch.num_heads * d, e, True, dtype)
        self.attn_norm = nn.LayerNorm(e, arch.layer_norm_eps, dtype=dtype)
        self.up_proj = ColumnParallelLinear(e, [n], True, dtype)
        self.down_proj = RowParallelLinear(n, e, True, dtype)
        self.mlp_norm = nn.LayerNorm(e, arch.layer_norm_eps, dtype=dtype)
        self.act = _ACTIVATIONS[arch.hidden_act]

    def forward(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(-1, 3, self.num_heads, self.head_dim)
        attn = packed_attention(qkv, query_start_loc).reshape(hidden.shape[0], -1)
        hidden = self.attn_norm(self.o_proj(attn) + hidden)
        x = apply_linear_activation(hidden, self.up_proj, self.act)  # [T, intermediate]
        return self.mlp_norm(self.down_proj(x) + hidden)


class BertEmbeddings(nn.Module):
    def __init__(self, arch: EncoderArch, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype)
        self.position_embeddings = VocabParallelEmbedding(arch.max_position_embeddings,
                                                          arch.hidden_size, dtype)
        # every token is of type 0 (single-segment inputs): only row 0 is read
        self.token_type_embeddings = nn.Embedding(arch.type_vocab_size, arch.hidden_size,
                                                  dtype=dtype).requires_grad_(False)
        self.norm = nn.LayerNorm(arch.hidden_size, arch.layer_norm_eps, dtype=dtype)
        self.position_offset = arch.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        return self.norm(hidden)


# checkpoint name fragment -> ours, first match wins (attention.output before output)
_QKV = {".attention.self.query.": 0, ".attention.self.key.": 1, ".attention.self.value.": 2}
_RENAMES = (
    (".attention.output.dense.", ".o_proj."),
    (".attention.output.LayerNorm.", ".attn_norm."),
    (".intermediate.dense.", ".up_proj."),
    (".output.dense.", ".down_proj."),
    (".output.LayerNorm.", ".mlp_norm."),
    ("embeddings.LayerNorm.", "embeddings.norm."),
)
_SKIPPED = ("pooler.", "cls.", "lm_head.")


def _our_name(name: str) -> tuple[str | None, int | None]:
    """(our parameter name, q/k/v shard id) of a checkpoint tensor; None for one we skip."""
    for prefix in ("bert.", "roberta."):
        name = name.removeprefix(prefix)
    if name.startswith(_SKIPPED) or name.endswith(("position_ids", "token_type_ids")):
        return None, None
    # TF-era checkpoints name LayerNorm's parameters gamma and beta
    if name.endswith(".gamma"):
        name = name[:-len(".gamma")] + ".weight"
    elif name.endswith(".beta"):
        name = name[:-len(".beta")] + ".bias"
    name = name.replace("encoder.layer.", "layers.", 1)
    for fragment, shard in _QKV.items():
        if fragment in name:
            return name.replace(fragment, ".qkv_proj."), shard
    for fragment, ours in _RENAMES:
        if fragment in name:
            return name.replace(fragment, ours), None
    return name, None


class BertEmbeddingModel(nn.Module):
    def __init__(self, arch: EncoderArch, dtype: torch.dtype):
        super().__init__()
        self.arch = arch
        self.embeddings = BertEmbeddings(arch, dtype)
        self.layers = nn.ModuleList(BertLayer(arch, dtype) for _ in range(arch.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                query_start_loc: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (0-based within each sequence) [T]; query_start_loc [B + 1]
        -> the last layer's hidden states [T, E] (transformers' last_hidden_state, unpadded)."""
        hidden = self.embeddings(input_ids, positions)
        for layer in self.layers:
            hidden = layer(hidden, query_start_loc)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (named with or without a bert. / roberta. prefix) into
        place; returns the parameter names filled. A weight may be a tensor or a not-yet-read
        checkpoint slice (narrow() and [...] read it)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target, shard = _our_name(name)
            param = params.get(target) if target is not None else None
            if param is None:
                continue  # heads and buffers the encoder does not use
            fill_parameter(param, tensor, shard)
            loaded.add(target)
        return loaded
