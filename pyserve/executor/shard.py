"""What one rank loads, and the loading itself: the same on rank 0 and in every worker
process, so that all ranks hold matching shards and KV caches. Under pipeline parallelism a
rank loads its stage's layers only, and holds KV caches for those layers only."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pyserve.executor.allocator import keep_freed_memory
from pyserve.kv.cache import KVLayout, allocate_kv_caches
from pyserve.kv.groups import KVGroups, sequence_blocks
from pyserve.arith import cdiv
from pyserve.model.arch import ModelArch
from pyserve.errors import ModelLoadError
from pyserve.model.layers.linear import BF16GemmRows
from pyserve.model.layers.parallel import (WHOLE_MODEL, PipelineStage, TPGroup, kv_heads_per_rank,
                                            pipeline_stage, stage_layer_counts)
from pyserve.model.loader import load_model
from pyserve.model.runner import ModelRunner
from pyserve.step import dummy_lengths, dummy_step

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
    gguf_path: Path | None = None  # a GGUF model's file: its weights, read in place
    # CUDA: num_blocks None -> measured (kv/memory.py) with these; graphs of these decode sizes
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    cuda_graph_sizes: tuple[int, ...] = ()  # empty: eager only
    int8_activations: bool = False  # GGUF Q4_1 / Q8_0 layers quantize their input (--gguf-activations)
    encoder: bool = False  # an encoder (BERT): no KV cache; num_blocks only bounds a step's tokens
    pipeline_parallel_size: int = 1  # stages; world size tensor_parallel_size * this
    pipeline_micro_batches: int = 1  # at most this many per step, so that stages overlap
    kv_groups: KVGroups | None = None  # the hybrid KV layout (kv/groups.py); None: one group
    # steps of many rows: bfloat16 GEMMs from these rows (--dtype bfloat16, AMX or AVX-512 BF16)
    bf16_gemm: BF16GemmRows | None = None
    bf16x3: bool = False  # an encoder's float32 GEMMs as bfloat16x3 on AMX (--encoder-matmul-precision)
    kv_dtype: torch.dtype | None = None  # the KV cache's (--kv-cache-dtype); None: dtype
    state_slots: int = 0  # linear-attention layers: the state pool's slots (executor/plan.py)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


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


def check_pipeline_parallel(arch: ModelArch, size: int) -> None:
    """Refuses, at start-up, more pipeline stages than the model has layers to give them."""
    if size == 1:
        return
    counts = stage_layer_counts(arch.num_layers, size)
    if min(counts) == 0:
        raise ModelLoadError(
            f"--pipeline-parallel-size {size} leaves a stage with no layers: the model has "
            f"{arch.num_layers} decoder layers (split {counts}); use at most {arch.num_layers} stages")


def rank_device(spec: ShardSpec, rank: int) -> torch.device:
    return torch.device("cuda", rank) if spec.device == "cuda" else torch.device(spec.device)


def build_model_runner(spec: ShardSpec, tp: TPGroup, stage: PipelineStage = WHOLE_MODEL,
                       links=None) -> ModelRunner:
    """links: a pipeline stage's StageLinks (executor/pipeline.py); None for the whole model."""
    keep_freed_memory()  # this process runs a model's steps (executor/allocator.py)
    device = rank_device(spec, tp.rank)
    model = load_model(spec.arch, spec.path, spec.load_format, spec.dtype, device,
                       spec.max_model_len, spec.seed, tp, spec.weight_dtype, spec.gguf_path,
                       spec.int8_activations, stage, spec.bf16_gemm, spec.bf16x3)
    capturable = getattr(model, "graph_capturable", True)  # a family's word on CUDA graphs
    if spec.state_slots:  # linear-attention layers: their state pool, before the KV cache
        model.allocate_state(spec.state_slots, spec.dtype, device)
    if links is not None:
        from pyserve.executor.pipeline_stage import PipelineStageModel

        model = PipelineStageModel(model, stage, links, spec.dtype, spec.pipeline_micro_batches)
    if spec.encoder:
        runner = ModelRunner(model, [], spec.block_size, device, spec.seed)
        runner.num_blocks = spec.num_blocks
        return runner
    layout = kv_layout(spec, tp.size, stage)
    num_blocks = spec.num_blocks
    if num_blocks is None:
        num_blocks = _measured_num_blocks(model, spec, tp, device, layout)
    kv_caches = allocate_kv_caches(layout, num_blocks, spec.block_size, device)
    runner = ModelRunner(model, kv_caches, spec.block_size, device, spec.seed, num_blocks)
    if device.type == "cuda" and spec.cuda_graph_sizes and not capturable:
        logger.info("CUDA graphs: off for %s, whose forward depends on the step's data (as "
                    "--enforce-eager)", spec.arch.architecture)
    elif device.type == "cuda" and spec.cuda_graph_sizes:
        from pyserve.model.cuda_graphs import capture_decode_graphs

        runner.graphs = capture_decode_graphs(model, kv_caches, spec.cuda_graph_sizes,
                                              max_blocks_per_seq(spec), device)
    return runner


def build_stage_runner(spec: ShardSpec, links) -> ModelRunner:
    """A pipeline stage's rank: its stage's layers, reducing over the stage's TP communicator
    (links: its StageLinks, executor/pipeline.py; any backend's)."""
    stage = pipeline_stage(spec.arch.num_layers, spec.pipeline_parallel_size, links.stage)
    tp = TPGroup(links.tp_rank, spec.tensor_parallel_size, links.tp_comm)
    return build_model_runner(spec, tp, stage, links)


def kv_layout(spec: ShardSpec, tp_size: int, stage: PipelineStage = WHOLE_MODEL) -> KVLayout:
    """One rank's KV caches: its stage's layers, its share of the KV heads."""
    arch = spec.arch
    layers = sum(stage.owns_layer(i) and i not in arch.linear_layers for i in range(arch.num_layers))
    return KVLayout(layers, kv_heads_per_rank(arch.num_kv_heads, tp_size), arch.head_dim,
                    spec.cache_dtype, spec.kv_groups)


def largest_stage_layers(num_layers: int, pp_size: int) -> int:
    """The layers of the stage with the most: its KV cache bounds a rank's bytes per block."""
    return max(stage_layer_counts(num_layers, pp_size))


def max_blocks_per_seq(spec: ShardSpec) -> int:
    return cdiv(spec.max_model_len, spec.block_size)


def _measured_num_blocks(model, spec: ShardSpec, tp: TPGroup, device: torch.device,
                         layout: KVLayout) -> int:
    """CUDA without --kv-cache-memory: the KV cache gets what the profiling forward leaves
    (kv/memory.py); every rank takes the smallest rank's count, so that all agree."""
    from pyserve.kv import memory

    weights = torch.cuda.memory_allocated(device)
    forward = _profiling_forward(model, spec, tp, device, layout)
    graph_tokens = max(spec.cuda_graph_sizes, default=0)
    profile = memory.measure(device, weights, forward, spec.max_num_batched_tokens, graph_tokens)
    per_block = layout.bytes_per_block(spec.block_size)
    plan = memory.plan_kv_cache(profile, spec.gpu_memory_utilization, per_block)
    num_blocks = plan.num_blocks
    if tp.size > 1:
        counts = tp.comm.all_gather(torch.tensor([num_blocks], dtype=torch.int64, device=device))
        num_blocks = int(counts.min())
        plan = memory.KVPlan(num_blocks, num_blocks * per_block, per_block)
    logger.info("%s", memory.memory_table(profile, spec.gpu_memory_utilization, plan))
    need = sequence_blocks(spec.kv_groups, spec.max_model_len, spec.block_size,
                           spec.max_num_batched_tokens)
    memory.check_fits(plan, profile, spec.gpu_memory_utilization, spec.block_size, spec.max_model_len,
                      need)
    return num_blocks


def _profiling_forward(model, spec: ShardSpec, tp: TPGroup, device: torch.device, layout: KVLayout):
    """forward(num_tokens): the dummy step (pyserve/step.py) over num_tokens tokens, run by a
    runner on a temporary KV cache just large enough (freed afterwards), with the sampler's
    work on each sequence's last token on rank 0."""
    bs = spec.block_size

    def forward(num_tokens: int) -> None:
        lengths = dummy_lengths(num_tokens, spec.max_num_seqs, spec.max_model_len)
        blocks_each = cdiv(max(lengths), bs)
        caches = allocate_kv_caches(layout, blocks_each * len(lengths), bs, device)
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(lengths))]
        runner = ModelRunner(model, caches, bs, device, spec.seed)
        # every KV group on the same blocks: what a dummy forward writes is never read
        others = layout.kv_groups.num_groups - 1
        prepared = runner.prepare(dummy_step(lengths, tables, group_tables=[[t] * others for t in tables]))
        if tp.rank == 0:
            runner.run(prepared)
        else:  # only rank 0 samples
            runner.execute_model(prepared.inputs)
        del caches, runner, prepared

    return forward
