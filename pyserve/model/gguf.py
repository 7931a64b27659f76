"""GGUF files, read in place.

- gguf_metadata_dir: the file's config.json, tokenizer, chat template and
  generation_config.json in a small Hugging Face style directory (no weights), made once;
- gguf_weights: the file's tensors under Hugging Face names, read from the file itself
  (mmap): the linear, embedding and expert weights the CPU kernels take in their own GGUF
  types, as raw blocks; the rest (norms, small vectors, other types, and every tensor where
  the kernels do not run: CUDA, other dtypes) widened to float32 one tensor at a time with
  the gguf package's own dequantizers. The q/k rows that llama.cpp permutes for its rotary
  layout are put back in Hugging Face order, so the numbers are those transformers computes
  when it loads the GGUF itself;
- convert_gguf: the whole file as a float32 Hugging Face directory (model.safetensors), the
  reference checkpoint the tests and benchmarks compare the in-place weights with.

Each family's GGUF names and keys live here beside the rest (llama, mistral, qwen2, qwen3,
gemma2, gemma3; the mixtures of experts qwen2moe, qwen3moe, olmoe and Mixtral's llama with
experts).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from pyserve.arith import cdiv
from pyserve.errors import ModelLoadError

logger = logging.getLogger("pyserve")
# what a GGUF's metadata directory was made by: a change that alters its contents (rope_freqs
# read into the rope scaling: 2; no weights, the MoE keys: 3) makes earlier ones stale
CONVERSION = 3

# GGUF architecture -> (HF architecture, HF model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    # linear-attention hybrids (models/qwen3_next.py)
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
}
_GEMMA = ("gemma2", "gemma3")
_HYBRID = ("qwen35", "qwen35moe", "qwen3next")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, the stacked experts (layers/moe.py's names for a
    # whole [E, rows, cols] tensor) and Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's four norms per layer: its ffn_norm is the pre-feed-forward norm, and the norm that
# follows attention has a name of its own
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# the hybrids' Gated DeltaNet layers (their attention layers' post_attention_norm follows
# attention; ssm_a holds -exp(A_log), ssm_dt.bias the dt bias, ssm_ba Qwen3-Next's b and a
# merged per key head)
_HYBRID_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _hf_name(gguf_name: str, gguf_arch: str | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor. Only norms' names depend on the architecture,
    so readers of the quantized (2-D) tensors may leave gguf_arch out."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    table = (_GEMMA_LAYER_TENSORS if gguf_arch in _GEMMA
             else _HYBRID_LAYER_TENSORS if gguf_arch in _HYBRID else _LAYER_TENSORS)
    parts = gguf_name.split(".")
    if gguf_arch in _HYBRID and parts[0] == "blk" and len(parts) >= 3:
        if parts[2:] == ["ssm_a"]:
            return f"model.layers.{parts[1]}.linear_attn.A_log"
        if parts[2:] == ["ssm_dt", "bias"]:
            return f"model.layers.{parts[1]}.linear_attn.dt_bias"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in table:
        name = f"model.layers.{parts[1]}.{table[parts[2]]}"
        # a stacked expert tensor has no parameter of its own: the MoE model's loader takes it
        return name if parts[2].endswith("_exps") else f"{name}.{parts[3]}"
    return None


# tensors whose meaning is read elsewhere: rope_freqs into the config's rope scaling
_READ_INTO_CONFIG = {"rope_freqs.weight"}


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (Hugging Face keeps halves)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _config(reader) -> tuple[dict, str]:
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture '{gguf_arch}' is not supported; pyserve converts: "
            + ", ".join(sorted(_ARCHITECTURES)))
    hf_arch, model_type = _ARCHITECTURES[gguf_arch]

    def get(key, default=None):
        return _field(reader, f"{gguf_arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if gguf_arch in ("qwen2", "qwen2moe"):
        cfg["attention_bias"] = True
    # a family's own keys are read by its module (models/<family>.py: gguf_config)
    if gguf_arch in _HYBRID:
        from pyserve.model.models import qwen3_next

        cfg.update(qwen3_next.gguf_config(get, gguf_arch, cfg))
    if int(get("expert_count", 0) or 0) > 0:
        from pyserve.model.models import moe

        cfg.update(moe.gguf_config(get, gguf_arch, cfg, {t.name for t in reader.tensors}))
    factor = get("rope.scaling.factor")
    if gguf_arch in _GEMMA:
        from pyserve.model.models import gemma

        cfg.update(gemma.gguf_config(get, gguf_arch, cfg))
    elif factor is not None and get("rope.scaling.type") in ("llama3", None):
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(factor),
            "low_freq_factor": float(get("rope.scaling.low_freq_factor", 1.0)),
            "high_freq_factor": float(get("rope.scaling.high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 8192)),
        }
    elif factor is not None and get("rope.scaling.type") == "yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor),
                               "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
        for key in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{key}") is not None:
                cfg["rope_scaling"][key] = float(get(f"rope.scaling.yarn_{key}"))
    elif factor is not None and get("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    else:
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            cfg["rope_scaling"] = _scaling_from_rope_freqs(freqs.data, cfg["head_dim"], cfg["rope_theta"])
    return cfg, gguf_arch


def _scaling_from_rope_freqs(data, head_dim: int, theta: float) -> dict | None:
    """The rope scaling of llama.cpp's rope_freqs.weight (its converter writes Llama 3's
    scaling only as this tensor: what each inverse frequency is divided by). Llama 3's
    parameters where some with its low and high frequency factors (1 and 4) give these
    divisors, so that the rope is computed exactly as transformers computes it from the
    original config; else the divisors themselves ("rope_freqs"), as llama.cpp applies them."""
    import numpy as np
    import torch

    from pyserve.model.layers.rotary import _inv_freq, llama3_factors

    factors = np.asarray(data, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ModelLoadError(f"rope_freqs.weight holds {factors.shape[0]} factors; head_dim "
                             f"{head_dim} has {head_dim // 2} frequencies")
    if np.all(factors == 1.0):
        return None
    factor = float(factors.max())
    # original_max_position_embeddings from a frequency between the two bands (its divisor
    # 1 / ((1 - s) / factor + s), s = (old / wavelength - 1) / 3), else the usual powers of two
    candidates = {2 ** k for k in range(4, 21)}
    wavelengths = (2 * np.pi / _inv_freq(head_dim, theta).double()).numpy()
    for divisor, wavelength in zip(factors, wavelengths):
        if 1.0 < divisor < factor:
            s = (1.0 / divisor - 1.0 / factor) / (1.0 - 1.0 / factor)
            candidates.add(round(float(wavelength) * (3.0 * s + 1.0)))
    for old in sorted(candidates):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": old}
        if np.allclose(llama3_factors(head_dim, theta, scaling).numpy(), factors, rtol=1e-5, atol=0):
            return scaling
    return {"rope_type": "rope_freqs", "factors": [float(f) for f in factors]}


def _end_of_turn_ids(reader, gguf_arch: str) -> list[int]:
    """Gemma's chat turns end with <end_of_turn>, which its GGUF does not name as an end of
    generation token (llama.cpp finds it by its text; Hugging Face's generation_config.json
    lists it beside <eos>)."""
    if gguf_arch not in _GEMMA:
        return []
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    for i, index in enumerate(field.data):
        if bytes(field.parts[index]) == b"<end_of_turn>":
            return [i]
    return []


def _merged_groups(num_layers: int) -> list[list[str]]:
    """Checkpoint tensors that share one of our parameters: all kept quantized, or none."""
    groups = []
    for i in range(num_layers):
        groups.append([f"model.layers.{i}.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z")])
        groups.append([f"model.layers.{i}.linear_attn.in_proj_{p}.weight" for p in ("b", "a")])
        groups.append([f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"])
        groups.append([f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up")])
        groups.append([f"model.layers.{i}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")])
        # the experts' gate and up halves are packed together: both blocks, or both float32
        groups.append([f"model.layers.{i}.mlp.experts.{p}_proj" for p in ("gate", "up")])
    return groups


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml type ids the CPU kernel reads
_QUANT_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def tensor_index(path: Path) -> tuple[dict, list[tuple[str, int, tuple[int, ...], int]]]:
    """(the scalar and string metadata (arrays: None), [(name, ggml type, dims, absolute data
    offset)]) read from the header alone: the gguf package's reader also decodes every
    metadata array (the whole vocabulary), which takes seconds."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt):
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values[0] if len(values) == 1 else values

        def string():
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def value(kind):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                elem, count = take("I"), take("Q")
                if elem in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[elem])
                elif elem == 8:  # strings (the vocabulary): skipped, not decoded
                    for _ in range(count):
                        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
                else:
                    for _ in range(count):
                        value(elem)
                return None
            return take(_SCALARS[kind])

        if bytes(buf[:4]) != b"GGUF":
            raise ModelLoadError(f"'{path}' is not a GGUF file")
        pos = 4
        _version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("Q") for _ in range(take("I")))
            infos.append((name, take("I"), dims, take("Q")))
        alignment = int(meta.get("general.alignment") or 32)
        start = cdiv(pos, alignment) * alignment
    return meta, [(n, t, d, start + o) for n, t, d, o in infos]


def gguf_weights(gguf_path: str | Path, arch, tp_size: int = 1, keep_quantized: bool = True,
                 stage=None) -> Iterator[tuple[str, object]]:
    """(Hugging Face name, tensor) for every tensor of the file, read in place (see the
    module's docstring). keep_quantized (the CPU kernels run: CPU, float32 activations): the
    linear, embedding and expert weights in the types the kernels read (Q4_0, Q4_1, Q5_0,
    Q8_0, Q4_K, Q5_K, Q6_K) come as GGUFBlocks / GGUFExperts views of the file, where a merged
    parameter's parts all have such types and a rank's shard splits inputs on whole blocks;
    everything else comes as float32, one tensor at a time. stage: a pipeline stage's layers
    only. Logs how many tensors stay in which type. A tensor pyserve has no place for is a
    ModelLoadError naming it: none is dropped unread."""
    import numpy as np
    import torch

    from pyserve.model.layers.quantized import BLOCK_BYTES, BLOCK_WEIGHTS, GGUFBlocks, GGUFExperts
    from pyserve.model.loader import stage_reads

    meta, index = tensor_index(Path(gguf_path))
    gguf_arch = meta.get("general.architecture")
    # llama.cpp appends a hybrid's multi-token prediction blocks after its layers: not served
    extra = meta.get(f"{gguf_arch}.nextn_predict_layers") or 0
    if extra:
        first = int(meta[f"{gguf_arch}.block_count"]) - int(extra)
        mtp = {n for n, *_ in index if n.startswith("blk.") and int(n.split(".")[1]) >= first}
        logger.info("GGUF: %d tensors of %d multi-token prediction blocks are not used", len(mtp), extra)
        index = [entry for entry in index if entry[0] not in mtp]
    unknown = [n for n, *_ in index if _hf_name(n, gguf_arch) is None and n not in _READ_INTO_CONFIG]
    if unknown:
        raise ModelLoadError(f"GGUF '{gguf_path}' holds tensors pyserve has no place for: "
                             + ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else ""))
    # each tensor read with pread, not viewed through a memory map: the file's pages then stay
    # in the page cache, out of this process's resident memory, which holds only the packed
    # weights (and, while one is packed, its blocks)
    fd = os.open(gguf_path, os.O_RDONLY)

    def read(offset: int, nbytes: int) -> np.ndarray:
        array = np.empty(nbytes, dtype=np.uint8)  # not zeroed: every byte is read into it
        view, done = memoryview(array), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ModelLoadError(f"GGUF '{gguf_path}' ends inside tensor data")
            done += got
        return array

    plus_one_norms = gguf_arch in _GEMMA or gguf_arch in _HYBRID  # norms stored as (1 + w)
    row_parallel = (".self_attn.o_proj.", ".mlp.down_proj.", ".shared_expert.down_proj.")

    def quantizable(name: str, ggml_type: int, dims: tuple[int, ...]) -> bool:
        if not keep_quantized or ggml_type not in _QUANT_TYPES:
            return False
        block = BLOCK_WEIGHTS[_QUANT_TYPES[ggml_type]]
        expert = name.endswith("_proj") and ".experts." in name
        if len(dims) != (3 if expert else 2) or dims[0] % block:
            return False
        split_inputs = name.endswith("experts.down_proj") or any(p in name for p in row_parallel)
        return not split_inputs or (dims[0] % tp_size == 0 and (dims[0] // tp_size) % block == 0)

    kept = {hf: quantizable(hf, t, d) for hf, t, d in
            ((_hf_name(n, gguf_arch), t, d) for n, t, d, _ in index) if hf is not None}
    for group in _merged_groups(arch.num_layers):
        if not all(kept.get(n, True) for n in group):
            for n in group:
                if n in kept:
                    kept[n] = False

    try:
        types_kept, types_widened = Counter(), Counter()
        for tensor_name, ggml_type, dims, offset in index:
            name = _hf_name(tensor_name, gguf_arch)
            if name is None or (stage is not None and not stage_reads(name, stage)):
                continue
            shape = tuple(int(d) for d in reversed(dims))
            heads = None
            if gguf_arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = arch.num_heads if "q_proj" in name else arch.num_kv_heads
            if kept[name]:
                type_ = _QUANT_TYPES[ggml_type]
                row_bytes = shape[-1] // BLOCK_WEIGHTS[type_] * BLOCK_BYTES[type_]
                rows = int(np.prod(shape[:-1]))
                blocks = read(offset, rows * row_bytes).reshape(*shape[:-1], row_bytes)
                if heads is not None:
                    blocks = np.ascontiguousarray(_unpermute_rotary(blocks, heads))
                types_kept[type_] += 1
                if len(shape) == 3:
                    yield name, GGUFExperts(type_, torch.from_numpy(blocks), shape)
                else:
                    yield name, GGUFBlocks(type_, torch.from_numpy(blocks), shape)
                continue
            types_widened[_type_name(ggml_type)] += 1
            yield name, _widened(read, ggml_type, shape, offset, name, plus_one_norms, heads)
    finally:
        os.close(fd)
    logger.info("GGUF tensors kept quantized: %s; loaded as float32: %s",
                _counts(types_kept), _counts(types_widened))


def decode_read_bytes(gguf_path: str | Path) -> tuple[int, int]:
    """(bytes a decode token reads from the file's weights, the file's weight bytes): every
    tensor once, but one row of the token embedding and, of a mixture of experts' stacked
    experts, the share its top-k picks (expert_used_count of expert_count). The numerator
    of a bandwidth roofline."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    meta, index = tensor_index(Path(gguf_path))
    arch = meta.get("general.architecture")
    experts, used = meta.get(f"{arch}.expert_count") or 0, meta.get(f"{arch}.expert_used_count") or 0
    read = total = 0
    for name, ggml_type, dims, _ in index:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        count = 1
        for d in dims:
            count *= int(d)
        nbytes = count // block * size
        total += nbytes
        if name == "token_embd.weight":
            read += nbytes // int(dims[-1])  # one row
        elif "_exps." in name and experts:
            read += nbytes * used // experts
        else:
            read += nbytes
    return read, total


def _widened(read, ggml_type: int, shape: tuple[int, ...], offset: int, name: str, plus_one_norms: bool,
             heads: int | None):
    """One tensor of the file as float32, dequantized by the gguf package."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(ggml_type)
    block, size = GGML_QUANT_SIZES[qtype]
    nbytes = int(np.prod(shape)) // block * size
    raw = read(offset, nbytes)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        raw = raw.view({GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                        GGMLQuantizationType.BF16: np.uint16}[qtype])
        if qtype == GGMLQuantizationType.BF16:
            array = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            array = raw.astype(np.float32)
    else:
        row_bytes = shape[-1] // block * size
        array = dequantize(raw.reshape(-1, row_bytes), qtype).astype(np.float32)
    array = array.reshape(shape)
    if plus_one_norms and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array - 1  # llama.cpp stores (1 + w) norm weights (Gemma, the hybrids) with the 1 added
    if name.endswith("linear_attn.A_log"):  # llama.cpp stores A = -exp(A_log)
        array = np.log(-array.astype(np.float64)).astype(np.float32)
    if name.endswith("shared_expert_gate.weight"):
        array = array.reshape(1, -1)  # llama.cpp keeps Qwen2-MoE's [1, H] gate as a vector
    if heads is not None:
        array = _unpermute_rotary(array, heads)
    return torch.from_numpy(np.ascontiguousarray(array))


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _counts(tally: Counter) -> str:
    return ", ".join(f"{t} {n}" for t, n in sorted(tally.items())) or "none"


def _transformers_names(tensors: dict) -> dict:
    """Stacked experts as transformers 5 holds them: gate_up_proj [E, 2I, H], down_proj."""
    import torch

    out = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_proj"):
            prefix = name[: -len("gate_proj")]
            out[prefix + "gate_up_proj"] = torch.cat([tensor, tensors[prefix + "up_proj"]], dim=1)
        elif not name.endswith("mlp.experts.up_proj"):
            out[name] = tensor
    return out


def gguf_metadata_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """The file's config.json, generation_config.json and tokenizer (with its chat template)
    in out_dir: what a model directory holds besides its weights, which stay in the file."""
    return _write_dir(Path(gguf_path), Path(out_dir), with_weights=False)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """gguf_path as a float32 Hugging Face directory out_dir: the metadata of
    gguf_metadata_dir and every tensor dequantized into model.safetensors (the reference
    checkpoint for tests and benchmarks; serving reads the file in place)."""
    return _write_dir(Path(gguf_path), Path(out_dir), with_weights=True)


def _gguf_tokenizer(gguf_path: Path):
    """The file's tokenizer as transformers reads a GGUF's. transformers loads the tokenizer
    only of the architectures whose weights it loads too (not olmoe, for one); for those the
    same conversion of the file's tokenizer fields is called directly."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, fields, special = get_gguf_tokenizer(str(gguf_path))
    backend, extra = convert_gguf_tokenizer(architecture, fields)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special, **extra)


def _write_dir(gguf_path: Path, out_dir: Path, with_weights: bool) -> Path:
    """Writes into a temporary directory and renames it into place when complete."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from pyserve.model.arch import ModelArch

    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:  # the gguf package raises bare ValueErrors and friends
        raise ModelLoadError(f"'{gguf_path}' is not a readable GGUF file: {exc}") from None
    cfg, gguf_arch = _config(reader)
    end_of_turn = _end_of_turn_ids(reader, gguf_arch)
    del reader  # its memory map and decoded metadata, before the weights are read
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        if with_weights:
            arch = ModelArch.from_hf_config(cfg)
            tensors = _transformers_names(dict(gguf_weights(gguf_path, arch, keep_quantized=False)))
            if gguf_arch in _HYBRID:
                from pyserve.model.models import qwen3_next

                tensors = qwen3_next.reference_tensors(tensors, cfg)
                cfg = {k: v for k, v in cfg.items() if k != qwen3_next.TILED_KEY}
            save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}
        if end_of_turn and cfg["eos_token_id"] is not None:
            generation["eos_token_id"] = [cfg["eos_token_id"], *end_of_turn]
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _gguf_tokenizer(gguf_path).save_pretrained(str(tmp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
