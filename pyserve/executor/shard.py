"""What one tensor-parallel rank loads, and the loading itself: the same on rank 0 and in
every worker process, so that all ranks hold matching shards and KV caches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pyserve.kv.cache import allocate_kv_caches
from pyserve.model.arch import ModelArch
from pyserve.model.errors import ModelLoadError
from pyserve.model.layers.parallel import TPGroup, kv_heads_per_rank
from pyserve.model.loader import load_model
from pyserve.model.runner import ModelRunner


@dataclass(frozen=True)
class ShardSpec:
    """Plain, picklable data: it crosses to each worker process when it is spawned."""

    arch: ModelArch
    path: Path
    load_format: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"; CUDA ranks take device index = rank
    max_model_len: int
    seed: int
    block_size: int
    num_blocks: int
    tensor_parallel_size: int
    weight_dtype: torch.dtype | None = None  # narrower than dtype: bfloat16 weights on the CPU
    gguf_path: Path | None = None  # the GGUF path was converted from: its quantized weights


def check_tensor_parallel(arch: ModelArch, size: int) -> None:
    """Refuses, at start-up, a model whose shapes cannot split over size ranks."""
    if size == 1:
        return
    problems = []
    if arch.num_heads % size:
        problems.append(f"num_attention_heads ({arch.num_heads})")
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        problems.append(f"num_key_value_heads ({arch.num_kv_heads}), which must divide or be a "
                        "multiple of it")
    if arch.intermediate_size % size:
        problems.append(f"intermediate_size ({arch.intermediate_size})")
    if problems:
        raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's "
                             + ", ".join(problems) + "; choose a size that does")


def rank_device(spec: ShardSpec, rank: int) -> torch.device:
    return torch.device("cuda", rank) if spec.device == "cuda" else torch.device(spec.device)


def build_model_runner(spec: ShardSpec, tp: TPGroup) -> ModelRunner:
    device = rank_device(spec, tp.rank)
    model = load_model(spec.arch, spec.path, spec.load_format, spec.dtype, device,
                       spec.max_model_len, spec.seed, tp, spec.weight_dtype, spec.gguf_path)
    kv_caches = allocate_kv_caches(spec.arch, kv_heads_per_rank(spec.arch.num_kv_heads, tp.size),
                                   spec.num_blocks, spec.block_size, spec.dtype, device)
    return ModelRunner(model, kv_caches, spec.block_size, device, spec.seed)
