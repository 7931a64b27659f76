"""Builds the model and fills its weights: safetensors (one file or a sharded index, read
tensor by tensor through mmap), or random weights for --load-format dummy. A pipeline stage
reads only its own layers' tensors (and the embedding, norm and head it holds)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from pyserve.model.arch import ModelArch
from pyserve.errors import ModelLoadError
from pyserve.model.layers.linear import BF16GemmRows
from pyserve.model.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.registry import is_encoder, model_class

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, checkpoint_dtype: str | None,
                  device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """-> (activation dtype, weight dtype).
    CPU: activations (and the KV cache) are float32, as no AVX2 machine multiplies bfloat16
    fast; bfloat16 means bfloat16 *weights* (linear layers and embeddings), widened in
    registers, which halves the bytes a decode step reads. auto is float32, exact against
    float32 references. CUDA: auto is the checkpoint's half type (bfloat16 for float32 ones),
    for activations and weights alike."""
    if device.type == "cpu":
        if requested == "bfloat16":
            return torch.float32, torch.bfloat16
        dtype = torch.float32 if requested == "auto" else _DTYPES[requested]
        return dtype, dtype
    if requested != "auto":
        return _DTYPES[requested], _DTYPES[requested]
    dtype = torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
    return dtype, dtype


def narrow_weights(model: torch.nn.Module, weight_dtype: torch.dtype) -> None:
    """Stores the linear layers' and embeddings' weights in weight_dtype (after loading them
    at full precision); norms, biases and rotary tables keep the activation dtype, and
    GGUF-quantized weights stay quantized."""
    from pyserve.model.layers.embedding import VocabParallelEmbedding
    from pyserve.model.layers.linear import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            if module.gguf is None:
                module.weight.data = module.weight.data.to(weight_dtype)


def pack_weights(model: torch.nn.Module, int8_activations: bool = False,
                 bf16_gemm: BF16GemmRows | None = None, bf16x3: bool = False) -> None:
    """On the CPU with float32 activations: linear layers and embeddings keep their weights
    in the packed layout of our CPU linear kernel (see layers/linear.py), and the decoder
    layers that can run as one native call are set up to. bf16_gemm: the linear layers (not
    the embedding and LM head, whose steps are few rows) keep a bfloat16 copy for bfloat16
    GEMMs over many rows (layers/linear.py). bf16x3: the linear layers whose shapes allow it
    are packed for bfloat16x3 GEMMs on AMX instead (an encoder's, layers/linear.py)."""
    from pyserve.model.layers.embedding import VocabParallelEmbedding
    from pyserve.model.layers.linear import ColumnParallelLinear, RowParallelLinear, pack_for_cpu

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            if module.gguf is not None or module.weight.dtype in (torch.float32, torch.bfloat16):
                linear = not isinstance(module, VocabParallelEmbedding)
                pack_for_cpu(module, int8_activations, bf16_gemm if linear else None,
                             bf16x3 and linear)
    for module in model.modules():  # a mixture of experts' experts: one stack per projection
        if hasattr(module, "pack_experts"):
            module.pack_experts(int8_activations)
    for module in model.modules():
        if hasattr(module, "make_native"):
            module.make_native()


def fill_parameter(param: torch.nn.Parameter, tensor, shard: int | None = None) -> None:
    """Copies a checkpoint tensor (or a CheckpointSlice) into a parameter, through its
    weight_loader where it has one (this rank's shard; shard: which merged part)."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(tensor[...])
    elif shard is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


class CheckpointSlice:
    """A checkpoint tensor not read yet: each weight loader reads only its rank's rows or
    columns (narrow), or the whole tensor ([...]), so a tensor-parallel rank never
    materialises the full weight. Valid while its file is open."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, index) -> torch.Tensor:
        if index is not Ellipsis:
            raise TypeError("CheckpointSlice reads whole tensors ([...]) or narrow() slices")
        return self._slice[:]


_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")


def stage_reads(name: str, stage: PipelineStage) -> bool:
    """False for a decoder layer's tensor that another pipeline stage loads. (Embedding,
    norm and head tensors a stage lacks are skipped by the model's load_weights, unread.)"""
    match = _LAYER_NUMBER.search(name)
    return match is None or stage.owns_layer(int(match.group(1)))


def iterate_safetensors(files: list[Path], stage: PipelineStage = WHOLE_MODEL
                        ) -> Iterator[tuple[str, CheckpointSlice]]:
    """Lazily: a tensor's bytes are read only when its weight loader reads them."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if stage_reads(name, stage):
                    yield name, CheckpointSlice(f, name)


def _fill_random(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def load_model(arch: ModelArch, path: Path, load_format: str, dtype: torch.dtype,
               device: torch.device, max_positions: int, seed: int,
               tp: TPGroup = SINGLE, weight_dtype: torch.dtype | None = None,
               gguf_path: Path | None = None, int8_activations: bool = False,
               stage: PipelineStage = WHOLE_MODEL,
               bf16_gemm: BF16GemmRows | None = None, bf16x3: bool = False) -> torch.nn.Module:
    """stage: the pipeline stage this process runs (its layers only).
    gguf_path: a GGUF model's file (path holds its metadata): its tensors are read from it in
    place, and on the CPU (float32 activations) its quantized weights stay as they are, read by
    the kernels without widening in memory (model/gguf.py).
    int8_activations: its quantized layers quantize their input to int8 for integer dot products.
    bf16_gemm: steps of many rows run the linear layers as bfloat16 GEMMs (pack_weights).
    bf16x3: the linear layers run as bfloat16x3 GEMMs on AMX (an encoder's; pack_weights)."""
    model = _load(arch, path, load_format, dtype, device, max_positions, seed, tp, gguf_path, stage)
    for module in model.modules():  # what a layer derives from its weights, once
        if hasattr(module, "weights_loaded"):
            module.weights_loaded()
    if weight_dtype is not None and weight_dtype != dtype:
        narrow_weights(model, weight_dtype)
    if device.type == "cpu" and dtype == torch.float32:
        pack_weights(model, int8_activations, bf16_gemm, bf16x3)
    return model


def _load(arch: ModelArch, path: Path, load_format: str, dtype: torch.dtype, device: torch.device,
          max_positions: int, seed: int, tp: TPGroup, gguf_path: Path | None,
          stage: PipelineStage) -> torch.nn.Module:
    cls = model_class(arch.architecture)
    with torch.device(device):
        if is_encoder(arch.architecture):  # its own shape, read from the same config.json
            from pyserve.model.models.bert import EncoderArch

            model = cls(EncoderArch.from_hf_config(json.loads((path / "config.json").read_text())), dtype)
        else:
            model = cls(arch, max_positions, dtype, tp, stage)
    if load_format == "dummy":
        _fill_random(model, seed)
        return model.eval()
    if gguf_path is not None:
        from pyserve.model.gguf import gguf_weights

        keep_quantized = device.type == "cpu" and dtype == torch.float32
        weights = gguf_weights(gguf_path, arch, tp.size, keep_quantized, stage)
    else:
        files = safetensors_files(path)
        if not files:
            raise ModelLoadError(f"no safetensors weights in '{path}'")
        weights = iterate_safetensors(files, stage)
    loaded = model.load_weights(weights)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise ModelLoadError(f"checkpoint in '{path}' lacks {len(missing)} weights, e.g. "
                             + ", ".join(missing[:3]))
    return model.eval()
