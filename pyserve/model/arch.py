"""The model shape pyserve needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyserve.errors import ModelLoadError


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # per layer "sliding_attention" or "full_attention"; None: every layer alike (windowed by
    # sliding_window where that is set, as Mistral's)
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (Gemma), else head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores s -> c tanh(s / c)
    final_logit_softcapping: float | None = None  # Gemma 2: logits likewise
    rope_local_theta: float | None = None  # rope base of the sliding layers (Gemma 3; no scaling)
    hidden_activation: str = "silu"
    moe: Any = None  # layers/moe.py's MoeSpec for a mixture of experts (models/moe.py reads it)
    family: Any = None  # what a family's own module reads from config.json (its family_config)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """A hybrid's linear-attention layers (models/qwen3_next.py), which hold a state in the
        state pool instead of a KV cache."""
        return getattr(self.family, "linear_layers", ())

    @property
    def num_kv_layers(self) -> int:
        """The layers that hold a KV cache."""
        return self.num_layers - len(self.linear_layers)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, None where it attends globally."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> "ModelArch":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json names no 'architectures'")
        arch = archs[0]
        cfg = _family_keys(arch, cfg)
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling") or None
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = dict(rope)
            if scaling is not None:
                scaling = dict(scaling)
                scaling.setdefault("rope_type", scaling.get("type", "default"))
                if scaling["rope_type"] == "default":
                    scaling = None
                elif scaling["rope_type"] in ("yarn", "llama3"):
                    fill_original_positions(scaling, cfg)
            for key in ("mlp_bias", "attention_out_bias"):  # biases the layers do not have
                if cfg.get(key):
                    raise ModelLoadError(f"config.json: {key} is not supported yet")
            partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
            if partial not in (None, 1, 1.0) and arch not in _own_partial_rotary():  # their own rope
                raise ModelLoadError(f"config.json: partial_rotary_factor {partial} (rope over part "
                                     "of each head) is not supported yet")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            sliding = cfg.get("sliding_window")
            if arch.startswith(("Qwen", "SmolLM3")) and not cfg.get("use_sliding_window", False):
                sliding = None
            num_layers = int(cfg["num_hidden_layers"])
            layer_types = _layer_types(arch, cfg, num_layers) if sliding else None
            return ModelArch(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", cfg.get(
                    "qkv_bias", arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "SeedOssForCausalLM",
                                         "Glm4ForCausalLM")))),
                qk_norm=(arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Exaone4ForCausalLM")
                         or arch.startswith("Gemma3")),
                sliding_window=int(sliding) if sliding else None,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                layer_types=layer_types,
                query_pre_attn_scalar=_float_or_none(cfg.get("query_pre_attn_scalar")),
                attn_logit_softcapping=_float_or_none(cfg.get("attn_logit_softcapping")),
                final_logit_softcapping=_float_or_none(cfg.get("final_logit_softcapping")),
                rope_local_theta=_float_or_none(cfg.get("rope_local_base_freq")),
                hidden_activation=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
                moe=_moe_spec(arch, cfg, num_layers),
                family=_family_config(arch, cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value for {exc}") from None


def fill_original_positions(scaling: dict, cfg: dict[str, Any]) -> None:
    """The pretraining length a YaRN or Llama 3 scaling extends: its own key, else the
    config's (Phi-3 and others write it there); a YaRN without a factor extends it to
    max_position_embeddings (DeepSeek-V3's rule, transformers')."""
    if scaling.get("original_max_position_embeddings") is None:
        if cfg.get("original_max_position_embeddings") is None:
            raise ModelLoadError(f"config.json: rope scaling '{scaling['rope_type']}' needs "
                                 "original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if scaling["rope_type"] == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = int(cfg["max_position_embeddings"]) / int(scaling["original_max_position_embeddings"])


def _family_keys(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as the shared reader takes it: a family whose checkpoints leave keys out or
    nest them (Gemma's text_config) fills them in by its module's hf_config(architecture, cfg)."""
    from pyserve.model.registry import GEMMA_ARCHITECTURES, HYBRID_ARCHITECTURES

    if architecture in GEMMA_ARCHITECTURES:
        from pyserve.model.models.gemma import hf_config

        return hf_config(architecture, cfg)
    if architecture in HYBRID_ARCHITECTURES:
        from pyserve.model.models.qwen3_next import hf_config

        return hf_config(architecture, cfg)
    return cfg


def _family_config(architecture: str, cfg: dict[str, Any]):
    """models/<family>.py's family_config(cfg), for a family that has one."""
    import importlib

    from pyserve.model.registry import FAMILY_ARCHITECTURES

    if architecture not in FAMILY_ARCHITECTURES:
        return None
    module = importlib.import_module(f"pyserve.model.models.{FAMILY_ARCHITECTURES[architecture][0]}")
    reader = getattr(module, "family_config", None)
    return reader(cfg) if reader is not None else None


def _moe_spec(architecture: str, cfg: dict[str, Any], num_layers: int):
    from pyserve.model.models.moe import moe_spec
    from pyserve.model.registry import HYBRID_ARCHITECTURES, MOE_ARCHITECTURES

    if architecture in HYBRID_ARCHITECTURES:
        from pyserve.model.models import qwen3_next

        return qwen3_next.moe_spec(architecture, cfg, num_layers)
    return moe_spec(architecture, cfg, num_layers) if architecture in MOE_ARCHITECTURES else None


def _own_partial_rotary() -> tuple[str, ...]:
    from pyserve.model.registry import HYBRID_ARCHITECTURES

    return ("Glm4ForCausalLM",) + HYBRID_ARCHITECTURES


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _layer_types(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[str, ...] | None:
    """Which layers slide: the config's list, else the architecture's rule (transformers')."""
    types = cfg.get("layer_types")
    if types is None and arch.startswith("Qwen"):
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is None:
        return None
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"config.json: layer_types must name 'sliding_attention' or "
                             f"'full_attention' for each of the {num_layers} layers")
    return tuple(types)
