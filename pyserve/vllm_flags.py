"""`vllm serve`'s flags, by what pyserve does with each, so a vLLM command line works after
changing only the command name, or fails at once with the reason.

- HONOURED: flags pyserve's own parser (cli.py) defines under vLLM's name and meaning, with
  where the value lands (an attribute path of cli.ServeArgs; None: what pyserve always does).
- FOREIGN: flags with no use here. Each is accepted silently for the values that mean what
  pyserve does anyway (`--cpu-offload-gb 0`), and otherwise either accepted with a
  one-line warning (`warn`: nothing a client would notice changes) or refused with exit 2
  (`refuse`: pyserve would serve something other than what was asked for).

A flag in neither table is refused as not supported (refuse_unknown), never with argparse's
bare "unrecognized arguments". vLLM's conventions for writing flags and values are here too:
--snake_case spellings, human-readable integers (4k, 8G)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

HONOURED: dict[str, str | None] = {
    "--model": "config.model.model",
    "--tokenizer": "config.model.tokenizer",
    "--served-model-name": "config.model.served_model_name",
    "--dtype": "config.model.dtype",
    "--max-model-len": "config.model.max_model_len",
    "--seed": "config.model.seed",
    "--load-format": "config.model.load_format",
    "--generation-config": "config.model.generation_config",
    "--override-generation-config": "config.model.override_generation_config",
    "--max-logprobs": "config.model.max_logprobs",
    "--pooler-config": "config.model.pooler_config",
    "--speculative-config": "config.scheduler.speculative_config",
    "--download-dir": "config.model.download_dir",
    "--block-size": "config.cache.block_size",
    "--gpu-memory-utilization": "config.cache.gpu_memory_utilization",
    "--kv-cache-memory-bytes": "config.cache.kv_cache_memory",
    "--enable-prefix-caching": "config.cache.enable_prefix_caching",
    "--disable-hybrid-kv-cache-manager": "config.cache.disable_hybrid_kv_cache_manager",
    "--kv-cache-dtype": "config.cache.kv_cache_dtype",
    "--max-num-seqs": "config.scheduler.max_num_seqs",
    "--max-num-batched-tokens": "config.scheduler.max_num_batched_tokens",
    "--scheduling-policy": "config.scheduler.scheduling_policy",
    "--disable-log-stats": "config.scheduler.log_stats_interval",
    "--tensor-parallel-size": "config.parallel.tensor_parallel_size",
    "--pipeline-parallel-size": "config.parallel.pipeline_parallel_size",
    "--distributed-executor-backend": "config.parallel.distributed_executor_backend",
    "--device": "config.device.device",
    "--enforce-eager": "config.device.enforce_eager",
    "--cuda-graph-sizes": "config.device.cuda_graph_sizes",
    "--host": "config.server.host",
    "--port": "config.server.port",
    "--api-key": "config.server.api_key",
    "--allowed-origins": "config.server.allowed_origins",
    "--allowed-methods": "config.server.allowed_methods",
    "--allowed-headers": "config.server.allowed_headers",
    "--allow-credentials": "config.server.allow_credentials",
    "--chat-template": "config.server.chat_template",
    "--default-chat-template-kwargs": "config.server.default_chat_template_kwargs",
    "--enable-log-requests": "config.server.enable_log_requests",
    "--disable-log-requests": None,  # vLLM's old flag: not logging requests is the default
    "--max-log-len": "config.server.max_log_len",
    "--enable-request-id-headers": "config.server.enable_request_id_headers",
    "--trust-request-chat-template": "config.server.trust_request_chat_template",
    "--response-role": "config.server.response_role",
    "--enable-auto-tool-choice": "config.server.enable_auto_tool_choice",
    "--tool-call-parser": "config.server.tool_call_parser",
    "--reasoning-parser": "config.server.reasoning_parser",
    "--enable-prompt-tokens-details": "config.server.enable_prompt_tokens_details",
    "--enable-force-include-usage": "config.server.enable_force_include_usage",
    "--root-path": "config.server.root_path",
    "--return-tokens-as-token-ids": "config.server.return_tokens_as_token_ids",
    "--enable-server-load-tracking": "config.server.enable_server_load_tracking",
    "--enable-tokenizer-info-endpoint": "config.server.enable_tokenizer_info_endpoint",
    "--log-level": "log_level",
}


@dataclass(frozen=True)
class ForeignFlag:
    names: tuple[str, ...]  # vLLM's spellings; the first is the one messages name
    reason: str  # why it is ignored or refused, a verb phrase whose subject is pyserve
    refuse: bool = False  # values outside `fine` exit 2 (else: a warning)
    action: str = "store"  # "store" (one value), "many" (one or more), "switch", "bool" (--x/--no-x)
    type: type = str
    fine: tuple = ()  # values that mean what pyserve does anyway: accepted silently

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def _no_media(text: str) -> str:
    """--limit-mm-per-prompt's JSON -> "none" when every modality's limit is 0 (what a
    text-only server allows anyway); anything else stays as given, and is refused."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, dict) and all(limit in (0, {"count": 0}) for limit in value.values()):
        return "none"
    return text


# --structured-outputs-config's reasoning_parser, carried to --reasoning-parser (cli.py)
REASONING_PARSER_MARK = "xgrammar, reasoning parser "


def _structured_outputs_config(text: str) -> str:
    """--structured-outputs-config's JSON -> "xgrammar" when it asks for what pyserve does
    (backend auto or xgrammar, whitespace and additional properties as the schema allows,
    grammars from the end of the reasoning on); with vLLM's reasoning_parser key, that parser
    after REASONING_PARSER_MARK. Anything else stays as given, and is refused."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if (isinstance(value, dict) and value.get("backend") in (None, "auto", "xgrammar")
            and not value.get("disable_any_whitespace") and not value.get("disable_additional_properties")
            and not value.get("enable_in_reasoning")):
        parser = value.get("reasoning_parser")
        return "xgrammar" if not parser else REASONING_PARSER_MARK + str(parser)
    return text


_HUB_ONLY = "reads it only to fetch a model given as a Hugging Face id (org/name), not for a local path"
_NO_TLS = "serves plain HTTP; put a TLS-terminating proxy in front of it"
_NO_LORA = "serves no LoRA adapters"
_NO_MM = "serves text-only models"

FOREIGN: tuple[ForeignFlag, ...] = (
    # accepted for what pyserve always does
    ForeignFlag(("--enable-chunked-prefill",), "always splits long prompts into chunks of "
                "--max-num-batched-tokens, which changes no output", action="bool", fine=(True,)),
    ForeignFlag(("--disable-sliding-window",), "runs sliding-window attention and does not cap "
                "--max-model-len at the window (within the window outputs are the same); pass "
                "--max-model-len to cap it", action="switch"),
    ForeignFlag(("--disable-frontend-multiprocessing",), "always runs its API server and engine "
                "in one process", action="switch", fine=(True,)),
    ForeignFlag(("--preemption-mode",), "preempts by recomputation only", refuse=True,
                fine=("recompute",)),
    ForeignFlag(("--task",), "serves generation and embeddings from one model (no classify, "
                "score or reward)", refuse=True, fine=("auto", "generate", "embed", "embedding")),
    ForeignFlag(("--runner",), "serves generation and embeddings from one model (a decoder), or "
                "embeddings (an encoder)", refuse=True, fine=("auto", "generate", "pooling")),
    ForeignFlag(("--convert",), "pools a decoder for /v1/embeddings without converting it (no "
                "classify or reward heads)", refuse=True, fine=("auto", "none", "embed")),
    ForeignFlag(("--tokenizer-mode",), "reads Hugging Face tokenizers (tokenizer.json) only",
                refuse=True, fine=("auto", "hf", "slow")),
    ForeignFlag(("--quantization", "-q"), "runs unquantized weights and GGUF files only (pass the "
                ".gguf as the model: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K stay quantized)",
                refuse=True, fine=("gguf",)),
    ForeignFlag(("--data-parallel-size", "-dp"), "runs one engine per server; start one server "
                "per replica behind a load balancer", refuse=True, type=int, fine=(1,)),
    ForeignFlag(("--api-server-count",), "runs one API server process", refuse=True, type=int,
                fine=(1,)),
    ForeignFlag(("--cpu-offload-gb",), "keeps all weights on the device it runs on", refuse=True,
                type=float, fine=(0.0,)),
    # accepted with a warning: nothing a client would notice changes
    ForeignFlag(("--trust-remote-code",), "runs no code from model repositories: its own model "
                "code serves each supported architecture", action="switch"),
    ForeignFlag(("--revision",), _HUB_ONLY), ForeignFlag(("--hf-token",), _HUB_ONLY),
    ForeignFlag(("--code-revision",), "runs no code from model repositories"),
    ForeignFlag(("--tokenizer-revision",), "reads the tokenizer of the model's own revision"),
    ForeignFlag(("--swap-space",), "preempts by recomputation and keeps no CPU swap space",
                type=float),
    ForeignFlag(("--disable-custom-all-reduce",), "has its own collectives (shared memory on the "
                "CPU, NCCL on CUDA) and no custom all-reduce to turn off", action="switch"),
    ForeignFlag(("--max-seq-len-to-capture",), "captures CUDA graphs of decode steps only "
                "(--cuda-graph-sizes); longer steps run eagerly anyway", type=int),
    ForeignFlag(("--compilation-config", "-O"), "does not use torch.compile (decode steps replay "
                "CUDA graphs; --enforce-eager turns them off)"),
    ForeignFlag(("--enable-expert-parallel", "-ep"), "splits each expert's intermediate size across "
                "the tensor-parallel ranks (vLLM's default) rather than placing whole experts on ranks",
                action="switch"),
    ForeignFlag(("--max-parallel-loading-workers",), "loads weights in one pass", type=int),
    ForeignFlag(("--disable-fastapi-docs",), "serves no /docs or /redoc; its /openapi.json "
                "(behind the API key) stays", action="switch"),
    ForeignFlag(("--max-cudagraph-capture-size",), "captures the decode sizes of "
                "--cuda-graph-sizes", type=int),
    ForeignFlag(("--prefix-caching-hash-algo",), "hashes prefix-cache blocks its own way"),
    ForeignFlag(("--long-prefill-token-threshold",), "splits long prompts by "
                "--max-num-batched-tokens only", type=int),
    ForeignFlag(("--max-num-partial-prefills",), "splits long prompts by --max-num-batched-tokens "
                "only", type=int),
    ForeignFlag(("--max-long-partial-prefills",), "splits long prompts by --max-num-batched-tokens "
                "only", type=int),
    ForeignFlag(("--log-config-file",), "configures its own logging (--log-level)"),
    ForeignFlag(("--uvicorn-log-level",), "has no uvicorn (its HTTP server logs no access lines; "
                "--log-level sets pyserve's own level)", type=str.lower,
                fine=("critical", "error", "warning", "info", "debug", "trace")),
    ForeignFlag(("--disable-uvicorn-access-log",), "has no access log (requests are logged only "
                "with --enable-log-requests)", action="switch"),
    ForeignFlag(("--enable-log-outputs",), "logs requests, not their outputs", action="switch"),
    ForeignFlag(("--otlp-traces-endpoint",), "exports no OpenTelemetry traces"),
    ForeignFlag(("--performance-mode",), "keeps its own measured scheduling defaults "
                "(--max-num-seqs, --max-num-batched-tokens set them)", fine=("balanced",)),
    ForeignFlag(("--optimization-level",), "does not use torch.compile (decode steps replay CUDA "
                "graphs; --enforce-eager turns them off)", type=int),
    ForeignFlag(("--stream-interval",), "streams each step's new tokens as they come (the text is "
                "the same, in more chunks)", type=int, fine=(1,)),
    ForeignFlag(("--attention-backend",), "picks its own attention kernels (the outputs are the "
                "same)"),
    ForeignFlag(("--model-impl",), "runs its own model code for each supported architecture",
                refuse=True, fine=("auto", "vllm")),
    # refused: pyserve would serve something other than what was asked for
    ForeignFlag(("--ssl-keyfile",), _NO_TLS, refuse=True),
    ForeignFlag(("--ssl-certfile",), _NO_TLS, refuse=True),
    ForeignFlag(("--ssl-ca-certs",), _NO_TLS, refuse=True),
    ForeignFlag(("--enable-lora",), _NO_LORA, refuse=True, action="switch"),
    ForeignFlag(("--lora-modules",), _NO_LORA, refuse=True, action="many"),
    ForeignFlag(("--max-loras",), _NO_LORA, refuse=True, type=int),
    ForeignFlag(("--max-lora-rank",), _NO_LORA, refuse=True, type=int),
    ForeignFlag(("--limit-mm-per-prompt",), _NO_MM, refuse=True, type=_no_media, fine=("none",)),
    ForeignFlag(("--language-model-only",), _NO_MM, action="switch", fine=(True,)),
    ForeignFlag(("--mm-processor-kwargs",), _NO_MM, refuse=True),
    ForeignFlag(("--hf-overrides",), "reads a model's config.json as it is", refuse=True),
    ForeignFlag(("--enable-sleep-mode",), "has no sleep mode", refuse=True, action="switch"),
    ForeignFlag(("--middleware",), "takes no ASGI middleware (it has its own HTTP server)",
                refuse=True, action="many"),
    ForeignFlag(("--guided-decoding-backend",), "compiles every grammar with xgrammar",
                refuse=True, fine=("auto", "xgrammar")),
    ForeignFlag(("--structured-outputs-config",), "compiles every grammar with xgrammar, its "
                "one structured-output backend, whitespace and additional properties as each "
                "request's schema allows", refuse=True, type=_structured_outputs_config,
                fine=("xgrammar",)),
    ForeignFlag(("--chat-template-content-format",), "hands the template each message's text "
                "parts joined into one string (vLLM's \"string\" format)", refuse=True,
                fine=("auto", "string")),
    ForeignFlag(("--uds",), "listens on TCP only (--host, --port)", refuse=True),
    ForeignFlag(("--tool-parser-plugin",), "loads no tool-parser plugins (--tool-call-parser names "
                "a built-in parser)", refuse=True),
)


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every FOREIGN flag to parser in one help group; each defaults to None (not given)."""
    g = parser.add_argument_group(
        "vLLM flags pyserve has no use for",
        "accepted where they mean what pyserve does anyway, else warned about or refused")
    for flag in FOREIGN:
        kwargs = dict(dest=flag.dest, default=None, help=f"{_verdict(flag)}: pyserve {flag.reason}")
        if flag.action == "switch":
            kwargs["action"] = "store_true"
        elif flag.action == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=flag.type, metavar="VALUE")
            if flag.action == "many":
                kwargs["nargs"] = "+"
        g.add_argument(*flag.names, **kwargs)


def _verdict(flag: ForeignFlag) -> str:
    otherwise = "refused" if flag.refuse else "ignored"
    if flag.action == "switch":
        return "accepted" if flag.fine else otherwise
    if flag.action == "bool":
        return f"accepted; --no-{flag.names[0][2:]} {otherwise}" if flag.fine else otherwise
    if flag.fine:
        return f"{', '.join(map(str, flag.fine))}: accepted; other values {otherwise}"
    return otherwise


def check_foreign(args: dict) -> list[str]:
    """Pops every FOREIGN dest from args; returns the warnings to log. Raises ValueError with
    the sentence to print (exit 2) for the first refused one."""
    warnings = []
    for flag in FOREIGN:
        value = args.pop(flag.dest)
        if value is None:
            continue
        if value in flag.fine:
            continue
        if flag.action in ("switch", "bool"):
            shown = flag.names[0]
        else:
            shown = f"{flag.names[0]} {' '.join(value) if isinstance(value, list) else value}"
        if flag.action == "bool" and value is False:
            shown = "--no-" + flag.names[0][2:]
        if flag.refuse:
            raise ValueError(f"pyserve does not support {shown}: it {flag.reason}")
        warnings.append(f"{shown} is ignored: pyserve {flag.reason}")
    return warnings


def foreign_names() -> list[str]:
    return [name for flag in FOREIGN for name in flag.names]


# -- vLLM's command-line conventions ---------------------------------------------------------

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's human-readable integers: 25600, 25.6k (decimal: k m g t), 25K (binary: K M G T)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        value = int(text)
    elif match[2] in _DECIMAL:
        value = int(float(match[1]) * _DECIMAL[match[2]])
    elif "." in match[1]:
        raise argparse.ArgumentTypeError(f"{text}: a binary suffix ({match[2]}) takes a whole "
                                         f"number; did you mean {match[1]}{match[2].lower()}?")
    else:
        value = int(match[1]) * _BINARY[match[2]]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def human_readable_int_or_auto(text: str) -> int | None:
    """vLLM's --max-model-len: a human-readable integer, or -1 / auto (here: the model's)."""
    if text.strip() in ("-1", "auto"):
        return None
    return human_readable_int(text)


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """--max_model_len=8 -> --max-model-len=8, as vLLM's parser takes flags."""
    out = []
    for arg in argv:
        if arg == "--":
            out.extend(argv[len(out):])
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def config_file_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """vLLM's --config FILE: (the YAML file's keys as flags, the command line without
    --config FILE). max_model_len: 4096 -> --max-model-len 4096; true -> the switch, false ->
    --no-switch; lists -> several values; mappings -> JSON. The caller parses them apart, as
    defaults the command line overrides. Raises ValueError saying what is wrong with the file."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            break
    else:
        return [], argv
    path = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
    rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
    if not path:
        raise ValueError("--config needs a YAML file")
    import yaml  # transformers' dependency

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flag names to values")
    flags = []
    for key, value in values.items():
        name = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if value is True:
            flags.append(name)
        elif value is False:
            flags.append("--no-" + name[2:])
        elif isinstance(value, list):
            flags += [name, *map(str, value)]
        elif isinstance(value, dict):
            flags += [name, json.dumps(value)]
        else:
            flags += [name, str(value)]
    return flags, rest


def refuse_unknown(parser: argparse.ArgumentParser, extras: Sequence[str]) -> None:
    """Exits 2 on the first argument the parser did not take, saying what it is."""
    if not extras:
        return
    flags = [e for e in extras if e.startswith("-") and not _is_number(e)]
    if flags:
        parser.error(f"pyserve does not support {flags[0].partition('=')[0]} (`{parser.prog} "
                     "--help` lists the flags it takes)")
    parser.error(f"unexpected argument '{extras[0]}'")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
