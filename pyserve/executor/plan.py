"""Start-up resolution, as one pure function of the configuration: which device, dtype, model
length, EOS ids, step limits, KV-cache size and order, CUDA graph sizes and GGUF handling the
engine runs with, and the shard spec every rank loads. It reads the model's config.json and
generation_config.json (and converts a .gguf once), never its weights, so it is testable
without them; EngineCore builds its executor, KV cache and scheduler from the plan."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pyserve import _native
from pyserve.config import Config, SchedulerConfig
from pyserve.errors import ModelLoadError
from pyserve.executor.shard import (ShardSpec, check_pipeline_parallel, check_tensor_parallel,
                                    largest_stage_layers)
from pyserve.kv.cache import DEFAULT_CPU_KV_CACHE_BYTES, KVLayout
from pyserve.kv.groups import KVGroups, plan_kv_groups, sequence_blocks
from pyserve.arith import cdiv
from pyserve.model.cuda_graphs import capture_sizes
from pyserve.model.layers.linear import BF16GemmRows, bf16_gemm_rows
from pyserve.model.layers.parallel import kv_heads_per_rank
from pyserve.model.loader import resolve_dtype
from pyserve.model.models.bert import EncoderArch
from pyserve.model.registry import HYBRID_ARCHITECTURES, is_encoder
from pyserve.model.sentence_transformers import read_sentence_transformers
from pyserve.model.source import resolve_model
from pyserve.pooling_params import ModelPooler, PoolerConfig

logger = logging.getLogger("pyserve")

CUDA_HEAD_SIZES = (64, 128, 256)  # csrc/cuda/attention.cu's instantiations
# (max_num_seqs, max_num_batched_tokens) by device type, where not given
STEP_LIMITS = {"cpu": (128, 128), "cuda": (256, 2048)}
# an encoder's step budget, where not given (at least its length)
ENCODER_STEP_TOKENS = 2048


@dataclass(frozen=True)
class StatePoolPlan:
    """The state pool of a model with linear-attention layers (kv/state.py): rows for running
    sequences, rows for prefix caching's checkpoints, their bytes, and the checkpoint interval."""

    slots: int = 0
    checkpoints: int = 0
    bytes: int = 0
    interval: int = 0


@dataclass(frozen=True)
class EnginePlan:
    config: Config  # with the step limits filled in
    device: str  # "cpu" or "cuda"
    model_name: str  # the name the API reports
    model_path: Path
    architecture: str
    tokenizer_path: Path
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # config.json's and (unless --generation-config vllm) the generation config's
    block_size: int
    bytes_per_block: int  # on one rank
    num_blocks: int | None  # None: measured on the GPU after loading (kv/memory.py)
    block_order: str  # "resident" or "lru"
    weights: str  # how the weights are held, for the start-up log
    shard: ShardSpec
    pooler: ModelPooler  # how /v1/embeddings pools this model
    is_encoder: bool = False  # an embedding-only model: bidirectional attention, no KV cache
    hidden_size: int = 0
    kv_groups: KVGroups | None = None  # the hybrid KV layout (kv/groups.py); None: one group
    state_pool: StatePoolPlan = StatePoolPlan()  # linear-attention layers' states (kv/state.py)

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of --max-model-len holds at most."""
        return sequence_blocks(self.kv_groups, self.max_model_len, self.block_size,
                               self.config.scheduler.max_num_batched_tokens)


def resolve_device(name: str) -> torch.device:
    """auto: CUDA where torch sees a device and pyserve._C has CUDA kernels, else the CPU."""
    cuda_ready = torch.cuda.is_available() and _native.built_with_cuda()
    if name == "auto":
        return torch.device("cuda" if cuda_ready else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: this torch sees no CUDA device")
    if name == "cuda" and not cuda_ready:
        raise ModelLoadError("--device cuda: this build of pyserve._C has no CUDA kernels (it was "
                             "built without nvcc or against a CPU torch); rebuild it, or use --device cpu")
    return torch.device(name)


def resolve_max_model_len(requested: int | None, arch, allow_long: bool = False) -> int:
    limit = arch.max_position_embeddings
    if requested is not None and requested > limit:
        if not allow_long:
            raise ModelLoadError(f"--max-model-len {requested} exceeds the model's "
                                 f"max_position_embeddings ({limit}); VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                                 "allows it (outputs may degrade past the model's trained length)")
        logger.warning("--max-model-len %d exceeds the model's max_position_embeddings (%d); taken "
                       "as VLLM_ALLOW_LONG_MAX_MODEL_LEN allows: outputs may degrade past the "
                       "model's trained length", requested, limit)
    # sliding windows (Mistral, Qwen2's upper layers, Gemma's local layers) are computed by the
    # attention kernel, so they do not cap the length
    return requested or limit


def resolve_step_limits(scheduler: SchedulerConfig, device: torch.device) -> SchedulerConfig:
    """Fills in --max-num-seqs and --max-num-batched-tokens where they were not given.

    On the CPU a step's time grows with its tokens: a 512-token step takes half a second, and
    every request in it (each running decode too) waits for all of it. Steps of 128 tokens gave
    the same throughput with lower median times to first token (python -m benchmarks.serve,
    W2: 931 against 1,703 ms; W4 with prefix caching: 1,110 against 2,124 ms), and a lone
    2,000-token prompt its first token 2 % later. A GPU step costs about the same at 2,048
    tokens as at 512. The budget is kept at least max_num_seqs, so that every running sequence
    gets its token each step; a given budget below the default sequence count caps that."""
    seqs_default, budget_default = STEP_LIMITS["cuda" if device.type == "cuda" else "cpu"]
    seqs, budget = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    if seqs is None:
        seqs = seqs_default if budget is None else min(seqs_default, budget)
    if budget is None:
        budget = max(budget_default, seqs)
    return dataclasses.replace(scheduler, max_num_seqs=seqs, max_num_batched_tokens=budget)


def _int8_activations(requested: str) -> bool:
    if requested != "int8":
        return False
    if not _native.int8_dot_supported():
        logger.warning("--gguf-activations int8 needs a CPU with AVX2 or AVX-512 VNNI (and an "
                       "extension built on one); using float32 activations")
        return False
    return True


def _bf16_gemm(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype) -> BF16GemmRows | None:
    """--dtype bfloat16 on the CPU: bfloat16 weights, float32 activations, and where the CPU
    multiplies bfloat16 fast (AMX or AVX-512 BF16) the GEMMs of many-row steps (prefill) in
    bfloat16, from the rows this hardware's thresholds say."""
    if device.type != "cpu" or weight_dtype != torch.bfloat16 or dtype != torch.float32:
        return None
    rows = bf16_gemm_rows()
    if rows is None:
        logger.info("--dtype bfloat16: this CPU has neither AMX-BF16 nor AVX-512 BF16, so GEMMs "
                    "stay float32 (bfloat16 weights widened)")
    return rows


def _bf16x3(precision: str, device: torch.device, dtype: torch.dtype,
            weight_dtype: torch.dtype) -> bool:
    """An encoder's float32 GEMMs as three bfloat16 products on AMX tiles (csrc/cpu/bf16x3.cpp),
    where --encoder-matmul-precision is high and the CPU and the build have AMX-BF16."""
    return (precision == "high" and device.type == "cpu" and dtype == torch.float32
            and weight_dtype == torch.float32 and _native.bf16x3_supported())


_KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e5m2,
                    "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e5m2}


def _kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: auto is the activations' dtype; a narrower cache only under float32
    activations on the CPU, whose attention widens each key and value as it reads them (the
    CUDA kernels read caches of the activations' dtype only). Every fp8 is e5m2 there, which
    needs no scales, as in vLLM's CPU backend (which also turns fp8_e4m3 into it)."""
    if name == "auto":
        return dtype
    kv_dtype = _KV_CACHE_DTYPES[name]
    if name == "fp8_e4m3" and device.type == "cpu":
        logger.warning("--kv-cache-dtype fp8_e4m3: the CPU keeps fp8 caches in e5m2 (no scales "
                       "needed), as vLLM's CPU backend does")
    if kv_dtype != dtype and (device.type != "cpu" or dtype != torch.float32):
        raise ModelLoadError(f"--kv-cache-dtype {name}: a cache narrower than the activations "
                             f"({str(dtype).removeprefix('torch.')}) runs on the CPU under "
                             "float32 activations only; use --kv-cache-dtype auto")
    return kv_dtype


def _dtype_name(dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
    name = lambda d: str(d).removeprefix("torch.")
    if weight_dtype == dtype:
        return name(dtype)
    return f"{name(weight_dtype)} weights, {name(dtype)} activations"


def _eos_ids(arch, model_path: Path, generation_config: str) -> tuple[int, ...]:
    """config.json's EOS ids, and the generation config's (vLLM stops on those too) unless
    --generation-config vllm; a folder given there is read instead of the model's."""
    ids = set(arch.eos_token_ids)
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else Path(generation_config)
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            try:
                eos = json.loads(gen_file.read_text()).get("eos_token_id")
            except (OSError, ValueError):
                eos = None
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(i for i in ids if isinstance(i, int)))


def resolve_pooler(requested: PoolerConfig | None, hf_config: dict,
                   sentence_transformers) -> ModelPooler:
    """The model's pooling: --pooler-config's keys over a sentence-transformers directory's
    modules (sentence_transformers: what model/sentence_transformers.py read, or None), over
    vLLM's default for a causal LM made an embedding model: the last token, normalized."""
    kind, normalize = "LAST", True
    if sentence_transformers is not None:
        kind, normalize = sentence_transformers.pooling_type, sentence_transformers.normalize
    if requested is not None:
        kind = requested.pooling_type or kind
        normalize = normalize if requested.normalize is None else requested.normalize
    dims = hf_config.get("matryoshka_dimensions")
    matryoshka = (tuple(int(d) for d in dims) if isinstance(dims, list) and dims
                  else () if hf_config.get("is_matryoshka") else None)
    return ModelPooler(kind, normalize, matryoshka)


def resolve(config: Config) -> EnginePlan:
    device = resolve_device(config.device.device)
    budget_given = config.scheduler.max_num_batched_tokens is not None
    config = dataclasses.replace(config, scheduler=resolve_step_limits(config.scheduler, device))
    source = resolve_model(config.model)
    arch = source.arch
    st = read_sentence_transformers(source.path)
    encoder = is_encoder(arch.architecture)
    max_model_len = resolve_max_model_len(config.model.max_model_len, arch,
                                          config.model.allow_long_max_model_len)
    if encoder:
        config, max_model_len = encoder_limits(config, source.hf_config, st, max_model_len,
                                               budget_given)
    tp = config.parallel.tensor_parallel_size
    if encoder and tp > 1:
        raise ModelLoadError(f"{arch.architecture} is an encoder: pyserve runs it on one rank "
                             "(--tensor-parallel-size 1)")
    check_tensor_parallel(arch, tp)
    pp = config.parallel.pipeline_parallel_size
    if pp > 1:
        check_pipeline_setup(arch, pp, encoder, device, config.parallel.distributed_executor_backend)
    if device.type == "cuda" and arch.head_dim not in CUDA_HEAD_SIZES and not encoder:
        raise ModelLoadError(f"head_dim {arch.head_dim} is not supported on CUDA (the attention "
                             f"kernel has head sizes {', '.join(map(str, CUDA_HEAD_SIZES))}); "
                             "use --device cpu")
    dtype, weight_dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, device)
    block_size, sched = config.cache.block_size, config.scheduler
    kv_dtype = _kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device)
    state_pool = StatePoolPlan()
    if arch.architecture in HYBRID_ARCHITECTURES:
        hybrid_limits(config, arch)
        state_pool = plan_state_pool(config, arch, dtype, device)
    kv_groups = None
    if encoder:  # no KV cache: blocks only bound the tokens one step holds
        per_block = 0
        num_blocks = cdiv(sched.max_num_batched_tokens, block_size) + sched.max_num_seqs
    else:
        kv_groups = hybrid_kv_groups(config, arch, max_model_len)
        # a rank holds its stage's layers: the largest stage's bound the bytes per block
        per_block = KVLayout(largest_stage_layers(arch.num_kv_layers, pp),
                             kv_heads_per_rank(arch.num_kv_heads, tp),
                             arch.head_dim, kv_dtype, kv_groups).bytes_per_block(block_size)
        num_blocks = _cpu_num_blocks(config, device, per_block, max_model_len, sequence_blocks(
            kv_groups, max_model_len, block_size, sched.max_num_batched_tokens), state_pool.bytes)
    graph_sizes = ()
    if device.type == "cuda" and not config.device.enforce_eager and not encoder:
        graph_sizes = capture_sizes(config.device.cuda_graph_sizes, sched.max_num_seqs)
    gguf_kept = source.gguf_path is not None and device.type == "cpu" and dtype == torch.float32
    int8 = gguf_kept and _int8_activations(config.model.gguf_activations)
    bf16_gemm = _bf16_gemm(device, dtype, weight_dtype)
    bf16x3 = encoder and _bf16x3(config.model.encoder_matmul_precision, device, dtype, weight_dtype)
    weights = (f"GGUF weights from {source.gguf_path.name}, "
               f"{'int8' if int8 else 'float32'} activations" if gguf_kept
               else _dtype_name(dtype, weight_dtype))
    if bf16_gemm is not None:
        rows = bf16_gemm.gguf_panels if gguf_kept else bf16_gemm.float_panels
        weights += f"; bfloat16 GEMMs ({bf16_gemm.hardware}) from {rows} rows a step"
        if int8:  # layers with int8-activation panels hold out longer (layers/linear.py)
            weights += (f", {bf16_gemm.int8_panels} on int8 layers" if bf16_gemm.int8_panels
                        else ", none on int8 layers")
    if bf16x3:
        weights += "; GEMMs as three bfloat16 products on AMX (--encoder-matmul-precision high)"
    order = config.cache.kv_block_order
    if order == "auto":
        order = "lru" if device.type == "cuda" else "resident"
    shard = ShardSpec(arch, source.path, config.model.load_format, dtype, device.type,
                      max_model_len, config.model.seed, block_size, num_blocks, tp, weight_dtype,
                      source.gguf_path, config.cache.gpu_memory_utilization,
                      sched.max_num_batched_tokens, sched.max_num_seqs, graph_sizes, int8, encoder,
                      pipeline_parallel_size=pp,
                      pipeline_micro_batches=config.parallel.pipeline_micro_batches,
                      kv_groups=kv_groups, bf16_gemm=bf16_gemm, bf16x3=bf16x3,
                      kv_dtype=None if kv_dtype == dtype else kv_dtype,
                      state_slots=state_pool.slots + state_pool.checkpoints)
    pooler = resolve_pooler(config.model.pooler_config, source.hf_config, st)
    return EnginePlan(config, device.type, source.name, source.path, arch.architecture,
                      source.tokenizer_path, arch.vocab_size, max_model_len,
                      _eos_ids(arch, source.path, config.model.generation_config), block_size,
                      per_block, num_blocks, order, weights, shard, pooler, encoder, arch.hidden_size,
                      kv_groups, state_pool)


def hybrid_kv_groups(config: Config, arch, max_model_len: int) -> KVGroups | None:
    """The hybrid KV layout (kv/groups.py) of a decoder with sliding-window layers whose window
    is shorter than --max-model-len; None (one plain group) otherwise, with
    --disable-hybrid-kv-cache-manager, and where the layout is not built: pipeline stages,
    whose caches hold a share of the layers, and a draft model, which reads the target's
    first table for its own KV cache."""
    spec = config.scheduler.speculative_config
    if (config.cache.disable_hybrid_kv_cache_manager
            or config.parallel.pipeline_parallel_size > 1
            or (spec is not None and spec.method == "draft_model")):
        return None
    groups = plan_kv_groups([arch.layer_window(i) for i in range(arch.num_layers)], max_model_len)
    return groups if groups.frees_windows else None


def resolve_draft(plan: EnginePlan) -> ShardSpec | None:
    """The draft model's shard (speculative method "draft_model"): loaded on rank 0 alone,
    eager, with the target's dtype, block size and block count (its sibling KV cache; the
    count is filled in once the target's is known). None without a draft model."""
    spec = plan.config.scheduler.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    model_cfg = plan.config.model
    source = resolve_model(dataclasses.replace(model_cfg, model=spec.model, tokenizer=None))
    arch = source.arch
    if is_encoder(arch.architecture):
        raise ModelLoadError(f"--speculative-config: the draft model {spec.model} is an encoder "
                             f"({arch.architecture}); it must generate")
    if arch.vocab_size != plan.vocab_size:
        raise ModelLoadError(
            f"--speculative-config: the draft model's vocabulary ({arch.vocab_size} tokens, "
            f"{spec.model}) differs from the target's ({plan.vocab_size}); a draft model must "
            "share the target's tokenizer")
    target = plan.shard
    if target.device == "cuda" and arch.head_dim not in CUDA_HEAD_SIZES:
        raise ModelLoadError(f"--speculative-config: the draft model's head_dim {arch.head_dim} "
                             "is not supported on CUDA")
    gguf_kept = source.gguf_path is not None and target.device == "cpu" and target.dtype == torch.float32
    return dataclasses.replace(
        target, arch=arch, path=source.path, gguf_path=source.gguf_path,
        tensor_parallel_size=1, pipeline_parallel_size=1, cuda_graph_sizes=(), encoder=False,
        int8_activations=target.int8_activations and gguf_kept)


def check_pipeline_setup(arch, pp: int, encoder: bool, device: torch.device,
                         backend: str | None) -> None:
    """Refuses, at start-up, a --pipeline-parallel-size above 1 that cannot run."""
    if encoder:
        raise ModelLoadError(f"{arch.architecture} is an encoder: pyserve runs it on one rank "
                             "(--pipeline-parallel-size 1)")
    if backend == "uni":
        raise ModelLoadError("--distributed-executor-backend uni has no pipeline parallelism; use "
                             "mp (the default) or ray for --pipeline-parallel-size > 1")
    if device.type == "cuda":
        raise ModelLoadError("--pipeline-parallel-size > 1 runs on the CPU only for now (its "
                             "stages hand activations on through host shared memory); use "
                             "--device cpu, or --tensor-parallel-size on CUDA")
    check_pipeline_parallel(arch, pp)


def _cpu_num_blocks(config: Config, device: torch.device, per_block: int,
                    max_model_len: int, need: int, state_bytes: int = 0) -> int | None:
    """The KV cache's blocks from its byte budget (less the state pool's state_bytes); None on
    a GPU without --kv-cache-memory (measured there after loading). need: the blocks one
    sequence of max_model_len holds."""
    if device.type != "cpu" and config.cache.kv_cache_memory is None:
        return None
    block_size = config.cache.block_size
    budget = (config.cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES) - state_bytes
    num_blocks = max(0, budget) // per_block
    if num_blocks < need:
        raise ModelLoadError(
            f"the KV cache ({budget} bytes = {num_blocks} blocks of {block_size} tokens) cannot "
            f"hold one sequence of --max-model-len {max_model_len} ({need} blocks); raise "
            "--kv-cache-memory or lower --max-model-len")
    return num_blocks


def hybrid_limits(config: Config, arch) -> None:
    """A model with linear-attention layers (models/qwen3_next.py) runs on one rank without
    pipeline stages and without speculative decoding (a state cannot be rolled back to the
    last accepted draft yet)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ModelLoadError(f"{arch.architecture}: its linear-attention layers run on one rank; "
                             "serve it with --tensor-parallel-size 1 --pipeline-parallel-size 1")
    if config.scheduler.speculative_config is not None:
        raise ModelLoadError(f"--speculative-config: {arch.architecture} has linear-attention layers, "
                             "whose recurrent state pyserve cannot roll back to the last accepted "
                             "draft token yet; serve it without speculative decoding")


def plan_state_pool(config: Config, arch, dtype: torch.dtype, device: torch.device) -> StatePoolPlan:
    """The state pool (kv/state.py): a row per sequence that may run (--max-num-seqs) and,
    with prefix caching, as many rows for checkpoints, all within half the KV budget
    (--kv-cache-memory, or the CPU's default; a GPU's measured budget is not capped here), so
    that fewer sequences run at once where the states are large. Its bytes come off the KV
    cache's budget. Checkpoints are kept every step budget's worth of blocks
    (--max-num-batched-tokens) and at each prompt's last full block."""
    per_seq = arch.family.state_bytes(dtype)
    caching = config.cache.enable_prefix_caching
    rows_per_seq = 2 if caching else 1
    slots = config.scheduler.max_num_seqs
    budget = config.cache.kv_cache_memory or (DEFAULT_CPU_KV_CACHE_BYTES if device.type == "cpu" else None)
    if budget is not None and slots * rows_per_seq * per_seq > budget // 2:
        slots = max(1, (budget // 2) // (rows_per_seq * per_seq))
    checkpoints = slots if caching else 0
    interval = max(config.cache.block_size, config.scheduler.max_num_batched_tokens
                   // config.cache.block_size * config.cache.block_size)
    plan = StatePoolPlan(slots, checkpoints, (slots + checkpoints) * per_seq, interval)
    logger.info("state pool: %d rows of %d bytes (%.1f MiB) for %d linear-attention layers: %d "
                "running sequences at most, %s", slots + checkpoints, per_seq, plan.bytes / 2**20,
                len(arch.linear_layers), slots,
                f"{checkpoints} prefix-cache checkpoints (every {interval} tokens and at each "
                "prompt's last full block)" if caching else "no checkpoints (prefix caching off)")
    return plan


def encoder_limits(config: Config, hf_config: dict, st, max_model_len: int,
                   budget_given: bool) -> tuple[Config, int]:
    """An encoder attends over its whole input at once, so a step must hold a whole one: the
    length is the model's (less the position offset RoBERTa spends on padding, and at most
    sentence-transformers' max_seq_length), the step budget at least that length, and no
    prefix caching (there is no KV cache to reuse)."""
    length = min(max_model_len, EncoderArch.from_hf_config(hf_config).max_model_len)
    if config.model.max_model_len is None and st is not None and st.max_seq_length:
        length = min(length, st.max_seq_length)
    sched = config.scheduler
    budget = sched.max_num_batched_tokens
    if budget_given and budget < length:
        raise ModelLoadError(f"--max-num-batched-tokens ({budget}) must be at least the "
                             f"encoder's length ({length}): its whole input runs in one step")
    if not budget_given:  # no decode waits on an encoder's steps: large ones batch best
        budget = max(length, ENCODER_STEP_TOKENS)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(sched, max_num_batched_tokens=budget),
        cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
    return config, length
