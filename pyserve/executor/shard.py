"""What one tensor-parallel rank loads, and the loading itself: the same on rank 0 and in
every worker process, so that all ranks hold matching shards and KV caches."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pyserve.kv.cache import allocate_kv_caches, bytes_per_block
from pyserve.model.arch import ModelArch
from pyserve.model.errors import ModelLoadError
from pyserve.model.layers.parallel import TPGroup, kv_heads_per_rank
from pyserve.model.loader import load_model
from pyserve.model.runner import ModelRunner

logger = logging.getLogger("pyserve")


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
    # CUDA: num_blocks None -> measured (kv/memory.py) with these; graphs of these decode sizes
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    cuda_graph_sizes: tuple[int, ...] = ()  # empty: eager only
    int8_activations: bool = False  # GGUF Q4_1 / Q8_0 layers quantize their input (--gguf-activations)


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
                       spec.max_model_len, spec.seed, tp, spec.weight_dtype, spec.gguf_path,
                       spec.int8_activations)
    kv_heads = kv_heads_per_rank(spec.arch.num_kv_heads, tp.size)
    num_blocks = spec.num_blocks
    if num_blocks is None:
        num_blocks = _measured_num_blocks(model, spec, tp, device, kv_heads)
    kv_caches = allocate_kv_caches(spec.arch, kv_heads, num_blocks, spec.block_size, spec.dtype, device)
    runner = ModelRunner(model, kv_caches, spec.block_size, device, spec.seed)
    if device.type == "cuda" and spec.cuda_graph_sizes:
        from pyserve.model.cuda_graphs import capture_decode_graphs

        runner.graphs = capture_decode_graphs(model, kv_caches, spec.cuda_graph_sizes,
                                              max_blocks_per_seq(spec), device)
    return runner


def max_blocks_per_seq(spec: ShardSpec) -> int:
    return -(-spec.max_model_len // spec.block_size)


def _measured_num_blocks(model, spec: ShardSpec, tp: TPGroup, device: torch.device, kv_heads: int) -> int:
    """CUDA without --kv-cache-memory: the KV cache gets what the profiling forward leaves
    (kv/memory.py); every rank takes the smallest rank's count, so that all agree."""
    from pyserve.kv import memory

    weights = torch.cuda.memory_allocated(device)
    forward = _profiling_forward(model, spec, device, kv_heads)
    graph_tokens = max(spec.cuda_graph_sizes, default=0)
    profile = memory.measure(device, weights, forward, spec.max_num_batched_tokens, graph_tokens)
    per_block = bytes_per_block(spec.arch, kv_heads, spec.block_size, spec.dtype)
    plan = memory.plan_kv_cache(profile, spec.gpu_memory_utilization, per_block)
    num_blocks = plan.num_blocks
    if tp.size > 1:
        counts = tp.comm.all_gather(torch.tensor([num_blocks], dtype=torch.int64, device=device))
        num_blocks = int(counts.min())
        plan = memory.KVPlan(num_blocks, num_blocks * per_block, per_block)
    logger.info("%s", memory.memory_table(profile, spec.gpu_memory_utilization, plan))
    memory.check_fits(plan, profile, spec.gpu_memory_utilization, spec.block_size, spec.max_model_len)
    return num_blocks


def _profiling_forward(model, spec: ShardSpec, device: torch.device, kv_heads: int):
    """forward(num_tokens): one prefill-shaped forward over num_tokens dummy tokens, spread
    over up to --max-num-seqs sequences as vLLM's profiling run does, with logits for each
    sequence's last token and the sampler's softmax over them; its KV cache is a temporary
    one just large enough, freed afterwards."""
    from pyserve.model.layers.attention import AttentionMetadata

    bs = spec.block_size

    @torch.inference_mode()
    def forward(num_tokens: int) -> None:
        num_seqs = max(1, min(spec.max_num_seqs, num_tokens))
        per_seq = min(-(-num_tokens // num_seqs), spec.max_model_len)
        lengths = [per_seq] * (num_tokens // per_seq) + ([num_tokens % per_seq] if num_tokens % per_seq else [])
        blocks_each = -(-per_seq // bs)
        caches = allocate_kv_caches(spec.arch, kv_heads, blocks_each * len(lengths), bs, spec.dtype, device)
        slots, positions, tables, starts = [], [], [], [0]
        for i, n in enumerate(lengths):
            first_block = i * blocks_each
            positions += range(n)
            slots += [(first_block + p // bs) * bs + p % bs for p in range(n)]
            tables.append(list(range(first_block, first_block + blocks_each)))
            starts.append(starts[-1] + n)
        on = dict(device=device)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, **on),
                                 torch.tensor(tables, dtype=torch.int32, **on),
                                 torch.tensor(starts, dtype=torch.int32, **on),
                                 torch.tensor(lengths, dtype=torch.int32, **on))
        ids = torch.zeros(num_tokens, dtype=torch.int64, **on)
        hidden = model(ids, torch.tensor(positions, dtype=torch.int64, **on), caches, meta)
        last = torch.tensor(starts[1:], dtype=torch.int64, **on) - 1
        logits = model.compute_logits(hidden[last])
        if logits is not None:
            logits.float().softmax(dim=-1).log()
        del caches, hidden, logits

    return forward
