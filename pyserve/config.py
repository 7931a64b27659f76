"""The one configuration object. Built once at the edge (cli.py, or LLM(...)) and handed down:
each part takes the piece it needs. Nothing below the CLI reads the environment."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pyserve.pooling_params import PoolerConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other names for them (--dtype half, LLM(dtype="float"), LLM(dtype=torch.float16))
DTYPE_ALIASES = {"half": "float16", "float": "float32", "torch.float32": "float32",
                 "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
GGUF_ACTIVATIONS = ("float32", "int8")
MATMUL_PRECISIONS = ("high", "highest")  # torch.set_float32_matmul_precision's names
# vLLM's names (float16 is llama.cpp's default cache type): every fp8 is e5m2 on the CPU, as
# in vLLM's CPU backend; fp8_inc and fp8_ds_mla are not built
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "fp8_e4m3")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic", "qwen3_xml",
                     "qwen3_coder")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def default_download_dir() -> str:
    return str(Path.home() / ".cache" / "pyserve" / "models")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the default model, fetched and converted on first use
    tokenizer: str | None = None  # None: the model's own directory
    # the first is reported; a request may name any (vLLM's --served-model-name A B ...)
    served_model_name: tuple[str, ...] | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: a --max-model-len beyond max_position_embeddings is
    # taken (with a warning: positions past the model's training may degrade outputs)
    allow_long_max_model_len: bool = False
    seed: int = 0
    load_format: str = "auto"
    max_logprobs: int = 20
    download_dir: str = field(default_factory=default_download_dir)
    # GGUF weights kept quantized on the CPU: float32 activations (bitwise the float32 model's
    # output) or int8 ones with integer dot products, as llama.cpp computes them (faster, not
    # bitwise)
    gguf_activations: str = "float32"
    # an encoder's float32 GEMMs: "high" runs them as three bfloat16 products on AMX where
    # the CPU has it (csrc/cpu/bf16x3.cpp; relative error a few 1e-6), "highest" in float32
    encoder_matmul_precision: str = "high"
    # sampling defaults: "auto" (the model's generation_config.json), "vllm" (none), or a folder
    generation_config: str = "auto"
    # vLLM's --override-generation-config: sampling defaults laid over the generation config's
    # (a JSON object of generation_config.json's names, e.g. {"temperature": 0.5})
    override_generation_config: tuple[tuple[str, object], ...] = ()
    # vLLM's --pooler-config: how /v1/embeddings pools, over the model's own choice
    pooler_config: PoolerConfig | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; None: 4 GiB on the CPU, measured on a GPU
    enable_prefix_caching: bool = True
    kv_block_order: str = "auto"  # "resident" on the CPU, "lru" on a GPU (see --kv-block-order)
    # "auto": the activations' dtype; "bfloat16" / "float16" / "fp8*": a 16- or 8-bit cache
    # under float32 activations on the CPU (fewer bytes for attention to read; not bitwise)
    kv_cache_dtype: str = "auto"
    # one block table for every layer, even where sliding-window layers could free blocks
    # (kv/groups.py)
    disable_hybrid_kv_cache_manager: bool = False


# Speculation pays while a step reads weights more than it computes: on the CPU one stream's
# step of 1 + 4 tokens costs about twice a 1-token one, and at a batch of a few streams the
# steps are compute-bound already (benchmarks/spec_decode.py measures both)
DEFAULT_SPEC_BATCH_LIMIT = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: up to num_speculative_tokens proposed a step, by method
    "ngram" (prompt lookup: after the longest recurring suffix of prompt_lookup_min to
    prompt_lookup_max tokens) or "draft_model" (a smaller model with the same vocabulary,
    `model`: a directory or .gguf, run greedily for the proposals)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    # vLLM's defaults: 5 and 5 with neither given, else the one given for the other
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    # vLLM's key: no proposals while more requests than this run (None: at any batch size)
    disable_by_batch_size: int | None = DEFAULT_SPEC_BATCH_LIMIT
    model: str | None = None  # draft_model: the draft's directory or .gguf file

    @staticmethod
    def from_json(value) -> "SpeculativeConfig":
        """ConfigError naming what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"--speculative-config: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        # vLLM: a "model" without a method is a draft model ("draft_model"; older vLLM
        # spelled it "draft")
        method = value.get("method", "draft_model" if value.get("model") else "ngram")
        if method == "draft":
            method = "draft_model"
        if method not in ("ngram", "draft_model"):
            raise ConfigError(f"--speculative-config: method {method!r} is not implemented; "
                              "pyserve speculates with \"ngram\" (prompt lookup) and "
                              "\"draft_model\"")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        if method == "draft_model":
            known -= {"prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unsupported key(s) {', '.join(unknown)} "
                              f"for method {method!r}")
        draft = value.get("model")
        if method == "draft_model" and (not isinstance(draft, str) or not draft):
            raise ConfigError("--speculative-config: method \"draft_model\" needs \"model\", "
                              "the draft model's directory or .gguf file")
        if method == "ngram" and draft is not None:
            raise ConfigError("--speculative-config: \"model\" is for method \"draft_model\"")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            # 16 at most: csrc/cpu/attention.cpp computes verify steps of up to 17 rows row by
            # row, as decode steps are, so that speculation never changes greedy output
            raise ConfigError("--speculative-config: num_speculative_tokens must be 1 to 16")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = SpeculativeConfig.prompt_lookup_min
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ConfigError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        limit = value.get("disable_by_batch_size", DEFAULT_SPEC_BATCH_LIMIT)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError("--speculative-config: disable_by_batch_size must be a positive integer")
        return SpeculativeConfig(method, k, hi, lo, limit, draft)


@dataclass(frozen=True)
class SchedulerConfig:
    # None: per device (engine/core.py's resolve_step_limits), as vLLM sets them per platform:
    # small prefill chunks on the CPU, where a step's time grows with its tokens
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    log_stats_interval: float = 10.0  # seconds between engine summary lines; 0: never
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    # vLLM's --async-scheduling: the next decode step planned while one runs (the async
    # engine, engine/step_chain.py); None: on where it can run, False: off
    async_scheduling: bool | None = None
    # test-only: the model step (1-based) that raises an injected fault; set only from the
    # environment ($PYSERVE_TEST_FAULT_STEP, read by the CLI), never by a flag. None: off
    test_fault_step: int | None = None


EXECUTOR_BACKENDS = ("mp", "uni", "ray")
RAY_COLLECTIVES = ("auto", "gloo")  # --ray-collectives (executor/ray_collectives.py)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # vLLM's -pp: the layers split into this many stages, each on its own TP group (mp backend)
    pipeline_parallel_size: int = 1
    # micro-batches a step is cut into so that stages overlap (at most its sequences); 1: none,
    # each step's stages run one after another (the default: no gain measured yet, see
    # docs/serving.md)
    pipeline_micro_batches: int = 1
    # None: "uni" at size 1, "mp" above it (vLLM's --distributed-executor-backend)
    distributed_executor_backend: str | None = None
    # ray backend: "auto" reduces through shared memory when every rank is on one node, gloo
    # when they span nodes; "gloo" always uses gloo (tests, or a measurement of it)
    ray_collectives: str = "auto"
    # ray backend: CPUs (and torch threads) per rank; None: this node's CPUs shared by the ranks
    ray_cpus_per_rank: int | None = None


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    enforce_eager: bool = False
    # vLLM's --cuda-graph-sizes: None -> 1, 2, 4, 8, 16, ... up to --max-num-seqs; one value
    # N -> that pattern up to N; several -> exactly those decode batch sizes
    cuda_graph_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"  # every interface, as vLLM
    port: int = 8000
    # every key a request may present (vLLM's --api-key takes several); empty: no auth
    api_key: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_num_queued_requests: int | None = None  # None: unbounded; beyond it, 429
    shutdown_timeout: float = 30.0  # seconds SIGTERM lets running requests finish
    chat_template: str | None = None  # a file or an inline Jinja template
    # chat_template_kwargs every request starts from; a request's own win, key by key
    default_chat_template_kwargs: tuple[tuple[str, object], ...] = ()
    # vLLM 0.32: requests are not logged unless --enable-log-requests
    enable_log_requests: bool = False
    max_log_len: int | None = None  # characters of a prompt a request log line shows; None: all
    enable_request_id_headers: bool = False  # echo X-Request-Id in every response
    trust_request_chat_template: bool = False  # a request's own chat_template is a 400 otherwise
    response_role: str = "assistant"  # the role of chat responses when add_generation_prompt
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    # a stream's usage chunk whether or not stream_options.include_usage asks for it
    enable_force_include_usage: bool = False
    # the path prefix a proxy may leave on requests ("/llm": /llm/v1/models is /v1/models)
    root_path: str = ""
    # logprob tokens named "token_id:N" unless a request's return_tokens_as_token_ids says
    return_tokens_as_token_ids: bool = False
    enable_server_load_tracking: bool = False  # GET /load counts requests in flight (else 0)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info exists (else 404)
    # tool_choice "auto": the model decides, and this parser finds its calls in its text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # splits the model's reasoning from its answer
    max_header_bytes: int = 64 * 1024
    max_request_body_bytes: int = 32 * 1024 * 1024
    # the stored Responses (server/openai/responses/store.py) in all, estimated: past it the
    # least recently used go
    max_stored_response_bytes: int = 256 * 1024 * 1024
    keepalive_timeout: float = 5.0
    header_timeout: float = 30.0
    body_timeout: float = 60.0  # seconds from a request's headers to the end of its body
    enable_debug_endpoints: bool = False  # GET /debug/books answers (else 404)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @staticmethod
    def from_flat(**values) -> "Config":
        """Builds a Config from flat keyword names (the CLI's dests, LLM(...)'s kwargs)."""
        if "seed" in values and values["seed"] is None:  # vLLM's LLM(seed=None): unseeded
            values["seed"] = int.from_bytes(os.urandom(7), "little")
        dtype = values.get("dtype")
        if dtype is not None and str(dtype) in DTYPE_ALIASES:
            values["dtype"] = DTYPE_ALIASES[str(dtype)]
        if isinstance(values.get("kv_cache_memory"), str):
            values["kv_cache_memory"] = parse_size(values["kv_cache_memory"])
        keys = values.get("api_key")
        if keys is None or isinstance(keys, str):  # one key from PYSERVE_* or LLM(...)
            values["api_key"] = () if not keys else (keys,)
        else:
            values["api_key"] = tuple(keys)
        for name in ("override_generation_config", "default_chat_template_kwargs"):
            if isinstance(values.get(name), dict):  # a frozen config holds pairs
                values[name] = tuple(sorted(values[name].items()))
        speculative = values.get("speculative_config")
        if isinstance(speculative, (str, dict)):  # JSON from the CLI or PYSERVE_*, a dict from LLM(...)
            values["speculative_config"] = SpeculativeConfig.from_json(speculative)
        pooler = values.get("pooler_config")
        if isinstance(pooler, (str, dict)):  # JSON from the CLI or PYSERVE_*, a dict from LLM(...)
            try:
                values["pooler_config"] = PoolerConfig.from_json(
                    pooler if isinstance(pooler, str) else json.dumps(pooler))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        names = values.get("served_model_name")
        if names is not None:  # a list from the CLI, one string from PYSERVE_* or LLM(...)
            values["served_model_name"] = (names,) if isinstance(names, str) else tuple(names)
        sizes = values.get("cuda_graph_sizes")
        if sizes is not None:  # a list from the CLI or LLM(...), one int from PYSERVE_*
            values["cuda_graph_sizes"] = (sizes,) if isinstance(sizes, int) else tuple(sizes)
        sections = {}
        unknown = set(values)
        for section in dataclasses.fields(Config):
            cls = section.default_factory
            names = {f.name for f in dataclasses.fields(cls)}
            picked = {k: v for k, v in values.items() if k in names}
            unknown -= picked.keys()
            sections[section.name] = cls(**picked)
        if unknown:
            raise TypeError(f"unknown configuration option(s): {', '.join(sorted(unknown))}")
        config = Config(**sections)
        validate(config)
        return config


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the option."""


_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3,
          "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}


def parse_size(text: str | int) -> int:
    """'4GiB', '512MiB', '2G', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number):]
    if not number or unit not in _UNITS:
        raise ValueError(f"'{text}' is not a size (examples: 4GiB, 512MiB, 1000000)")
    value = float(number) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"'{text}' must be positive")
    return int(value)


def validate(config: Config) -> None:
    """Cross-checks that need no weights; raises ConfigError naming the option."""
    def need(ok: bool, option: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{option}: {message}")

    m, c, s = config.model, config.cache, config.scheduler
    need(m.dtype in DTYPES, "--dtype", f"must be one of {', '.join(DTYPES)}")
    need(m.load_format in LOAD_FORMATS, "--load-format", f"must be one of {', '.join(LOAD_FORMATS)}")
    need(m.gguf_activations in GGUF_ACTIVATIONS, "--gguf-activations",
         f"must be one of {', '.join(GGUF_ACTIVATIONS)}")
    need(m.encoder_matmul_precision in MATMUL_PRECISIONS, "--encoder-matmul-precision",
         f"must be one of {', '.join(MATMUL_PRECISIONS)}")
    need(config.device.device in DEVICES, "--device", f"must be one of {', '.join(DEVICES)}")
    need(m.generation_config in ("auto", "vllm") or Path(m.generation_config).is_dir(),
         "--generation-config", f"must be auto, vllm or a folder, got '{m.generation_config}'")
    need(s.scheduling_policy in SCHEDULING_POLICIES, "--scheduling-policy",
         f"must be one of {', '.join(SCHEDULING_POLICIES)}")
    need(m.max_model_len is None or m.max_model_len > 0, "--max-model-len", "must be positive")
    need(m.max_logprobs >= -1, "--max-logprobs", "must be -1 (the vocabulary) or non-negative")
    need(c.block_size in (8, 16, 32, 64, 128), "--block-size", "must be one of 8, 16, 32, 64, 128")
    need(0.0 < c.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization", "must be in (0, 1]")
    need(c.kv_cache_memory is None or c.kv_cache_memory > 0, "--kv-cache-memory", "must be positive")
    need(c.kv_block_order in ("auto", "resident", "lru"), "--kv-block-order",
         "must be auto, resident or lru")
    need(c.kv_cache_dtype in KV_CACHE_DTYPES, "--kv-cache-dtype",
         f"must be one of {', '.join(KV_CACHE_DTYPES)}")
    need(s.max_num_seqs is None or s.max_num_seqs > 0, "--max-num-seqs", "must be positive")
    need(s.max_num_batched_tokens is None or s.max_num_batched_tokens > 0, "--max-num-batched-tokens",
         "must be positive")
    # a step must have room for one token of every running sequence, or some decodes would wait
    need(s.max_num_batched_tokens is None or s.max_num_seqs is None
         or s.max_num_batched_tokens >= s.max_num_seqs, "--max-num-batched-tokens",
         f"must be at least --max-num-seqs ({s.max_num_seqs})")
    sizes = config.device.cuda_graph_sizes
    need(sizes is None or (len(sizes) > 0 and all(isinstance(n, int) and n > 0 for n in sizes)),
         "--cuda-graph-sizes", "must be positive integers")
    need(config.parallel.tensor_parallel_size >= 1, "--tensor-parallel-size", "must be at least 1")
    need(config.parallel.pipeline_parallel_size >= 1, "--pipeline-parallel-size", "must be at least 1")
    need(config.parallel.pipeline_micro_batches >= 1, "--pipeline-micro-batches", "must be at least 1")
    need(config.parallel.distributed_executor_backend in (None, *EXECUTOR_BACKENDS),
         "--distributed-executor-backend", f"must be one of {', '.join(EXECUTOR_BACKENDS)}")
    need(config.parallel.ray_collectives in RAY_COLLECTIVES, "--ray-collectives",
         f"must be one of {', '.join(RAY_COLLECTIVES)}")
    need(config.parallel.ray_cpus_per_rank is None or config.parallel.ray_cpus_per_rank >= 1,
         "--ray-cpus-per-rank", "must be at least 1")
    srv = config.server
    need(0 < srv.port < 65536, "--port", "must be in 1..65535")
    need(not (srv.allow_credentials and "*" in srv.allowed_origins), "--allow-credentials",
         "cannot be combined with --allowed-origins '*'; list the origins")
    need(srv.max_num_queued_requests is None or srv.max_num_queued_requests >= 0,
         "--max-num-queued-requests", "must be non-negative")
    need(srv.shutdown_timeout >= 0, "--shutdown-timeout", "must be non-negative")
    need(srv.tool_call_parser in (None, *TOOL_CALL_PARSERS), "--tool-call-parser",
         f"must be one of {', '.join(TOOL_CALL_PARSERS)}")
    need(not srv.enable_auto_tool_choice or srv.tool_call_parser is not None,
         "--enable-auto-tool-choice", "needs --tool-call-parser to be set")
    need(srv.reasoning_parser in (None, *REASONING_PARSERS), "--reasoning-parser",
         f"must be one of {', '.join(REASONING_PARSERS)}")
    need(srv.max_header_bytes > 0, "--max-header-bytes", "must be positive")
    need(srv.max_request_body_bytes > 0, "--max-request-body-bytes", "must be positive")
    need(srv.max_stored_response_bytes > 0, "--max-stored-response-bytes", "must be positive")
    need(srv.body_timeout > 0, "--body-timeout", "must be positive")
    if m.model is not None and m.load_format != "dummy":
        need(os.path.exists(m.model), "--model", f"'{m.model}' does not exist")
    if m.tokenizer is not None:
        need(os.path.isdir(m.tokenizer), "--tokenizer", f"'{m.tokenizer}' is not a directory")
