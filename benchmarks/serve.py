"""Online serving benchmark for any OpenAI-compatible server, with `vllm bench serve`'s flags
and output: the same "Serving Benchmark Result" block and the same JSON keys.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --model DIR \\
        --dataset-name random --random-input-len 256 --random-output-len 128 \\
        --num-prompts 64 --max-concurrency 16 --ignore-eos [--save-result]
    python -m pyserve bench serve ...   (the same)

Requests are sampled first (datasets.py), then sent on an arrival schedule: all at once for
--request-rate inf, else gaps drawn from a gamma distribution of shape --burstiness and mean
1 / rate (burstiness 1 = a Poisson process), rescaled so that the last arrival falls at
num_prompts / rate as in vLLM 0.32. --max-concurrency caps the requests in flight; a request
that arrives when the cap is reached waits for a slot. Each request streams; client.py says how
it is timed and metrics.py how the figures follow. As in vLLM 0.32, the random dataset always
sets ignore_eos, and no temperature is sent unless --temperature is given.

Not vLLM's behaviour: --endpoint alone picks the backend (a chat path means openai-chat) and
--backend alone picks the endpoint; the JSON always holds the per-request fields (ttfts, itls,
input_lens, output_lens, latencies, start_times, errors), which vLLM keeps for --save-detailed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime

import aiohttp
import numpy as np

from benchmarks.client import REQUEST_FUNCS, RequestInput, RequestResult, connection_reuse_trace
from benchmarks.datasets import add_dataset_args, load_tokenizer, sample_requests
from benchmarks.metrics import METRICS, calculate_metrics, format_result

CHAT_ENDPOINT, COMPLETIONS_ENDPOINT = "/v1/chat/completions", "/v1/completions"
SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                  "frequency_penalty": float, "presence_penalty": float,
                  "repetition_penalty": float}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve",
                                description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=sorted(REQUEST_FUNCS),
                   help="openai / vllm: completions; openai-chat: chat (default: from --endpoint)")
    p.add_argument("--base-url", help="server URL, instead of --host and --port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", help=f"{COMPLETIONS_ENDPOINT} or {CHAT_ENDPOINT} "
                   "(default: from --backend)")
    p.add_argument("--model", help="model name on the server (default: the server's first)")
    p.add_argument("--served-model-name", help="name to send as `model`, if not --model")
    p.add_argument("--tokenizer", help="local tokenizer directory (default: --model)")
    p.add_argument("--label", help="result file prefix (default: the backend)")
    add_dataset_args(p)
    p.add_argument("--seed", type=int, default=0, help="for the prompts and the arrival times")
    p.add_argument("--input-len", type=int, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, help="sets every dataset's output length")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent before measuring")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated, of ttft, tpot, itl, e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    p.add_argument("--save-result", action="store_true", help="write the JSON result")
    p.add_argument("--save-detailed", action="store_true",
                   help="accepted for vLLM command lines; per-request fields are always saved")
    p.add_argument("--result-dir", help="folder for the JSON result (default: here)")
    p.add_argument("--result-filename", help="default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json")
    p.add_argument("--disable-tqdm", action="store_true", help="accepted; no progress bar is drawn")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into each request")
    for name, kind in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind)
    return p


def arrival_times(num: int, request_rate: float, burstiness: float,
                  rng: np.random.Generator) -> list[float]:
    """Seconds from the start at which each request is sent."""
    if request_rate == float("inf"):
        return [0.0] * num
    if burstiness == float("inf"):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(gaps)
    # the sum of random gaps misses num / rate by a few per cent; rescaling keeps the
    # offered load, and so the throughput, steady from seed to seed (as vLLM 0.32)
    return (times * (num / request_rate) / times[-1]).tolist()


def _resolve_endpoint(args: argparse.Namespace) -> tuple[str, str]:
    backend, endpoint = args.backend, args.endpoint
    if backend is None:
        backend = "openai-chat" if (endpoint or "").endswith("chat/completions") else "openai"
    if endpoint is None:
        endpoint = CHAT_ENDPOINT if backend == "openai-chat" else COMPLETIONS_ENDPOINT
    if (backend == "openai-chat") != endpoint.endswith("chat/completions"):
        raise SystemExit(f"--backend {backend} does not speak to --endpoint {endpoint}: use "
                         f"openai-chat with {CHAT_ENDPOINT}, openai or vllm with {COMPLETIONS_ENDPOINT}")
    return backend, endpoint


def _goodput_slos(pairs: list[str] | None) -> dict[str, float] | None:
    if not pairs:
        return None
    slos = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput {pair}: expected ttft:MS, tpot:MS or e2el:MS")
        slos[key] = float(value)
    return slos


async def first_model(base_url: str, headers: dict) -> tuple[str, str]:
    """(id, root) of the first model the server lists."""
    try:
        async with aiohttp.ClientSession() as session, \
                session.get(base_url + "/v1/models", headers=headers) as response:
            response.raise_for_status()
            entry = (await response.json())["data"][0]
    except (aiohttp.ClientError, OSError, KeyError, IndexError) as exc:
        raise SystemExit(f"cannot list the models at {base_url}/v1/models ({exc}); "
                         "is the server up? or pass --model") from None
    return entry["id"], entry.get("root") or entry["id"]


async def run_requests(inputs: list[RequestInput], request_func, delays: list[float],
                       max_concurrency: int | None,
                       num_warmups: int = 0) -> tuple[list[RequestResult], float]:
    """Sends each input at its delay, at most max_concurrency at once: (records, seconds)."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     trace_configs=[connection_reuse_trace()]) as session:
        gate = asyncio.Semaphore(max_concurrency or len(inputs) or 1)

        async def send(inp: RequestInput, delay: float, start: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            async with gate:
                return await request_func(inp, session)

        if num_warmups:
            print(f"Warming up with {num_warmups} requests...")
            await asyncio.gather(*(send(inputs[0], 0.0, 0.0) for _ in range(num_warmups)))
        start = time.perf_counter()
        records = await asyncio.gather(*(send(i, d, start) for i, d in zip(inputs, delays)))
        return list(records), time.perf_counter() - start


def _apply_general_lengths(args: argparse.Namespace) -> None:
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
        args.prefix_repetition_output_len = args.output_len


def result_path(args: argparse.Namespace, backend: str, model_id: str, date: str) -> str:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (f"{args.label or backend}-{args.request_rate}qps{concurrency}"
                                    f"-{model_id.rstrip('/').split('/')[-1]}-{date}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def _validate(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise SystemExit("--max-concurrency must be greater than 0")
    if args.burstiness <= 0 or args.request_rate <= 0:
        raise SystemExit("--burstiness and --request-rate must be greater than 0")
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be at least 1")
    bad = set(args.percentile_metrics.split(",")) - {key for key, _, _ in METRICS}
    if bad:
        raise SystemExit(f"--percentile-metrics: unknown {', '.join(sorted(bad))}")


@dataclass(frozen=True)
class Target:
    """Where the requests go and what they name."""
    backend: str
    api_url: str
    headers: dict
    model_name: str  # sent as `model`
    model_id: str  # the tokenizer default and the result's model_id


def resolve_target(args: argparse.Namespace) -> Target:
    backend, endpoint = _resolve_endpoint(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {}
    if api_key := os.environ.get("OPENAI_API_KEY"):  # as vLLM's client: the key from the env
        headers["Authorization"] = f"Bearer {api_key}"
    if args.model is None:
        model_name, model_id = asyncio.run(first_model(base_url, headers))
    else:
        model_name, model_id = args.served_model_name or args.model, args.model
    return Target(backend, base_url + endpoint, headers, model_name, model_id)


def build_inputs(args: argparse.Namespace, target: Target, tokenizer) -> list[RequestInput]:
    _apply_general_lengths(args)
    if args.dataset_name == "random":
        args.ignore_eos = True  # vLLM 0.32: random prompts always run to their output length
    sampling = {k: v for k in SAMPLING_FLAGS if (v := getattr(args, k)) is not None}
    return [RequestInput(r.prompt, r.prompt_len, r.expected_output_len, target.model_name,
                         target.api_url, args.ignore_eos, {**sampling, **args.extra_body},
                         target.headers) for r in sample_requests(args, tokenizer)]


def result_json(args: argparse.Namespace, target: Target, metrics: dict,
                records: list[RequestResult], date: str) -> dict:
    rate = args.request_rate if args.request_rate < float("inf") else "inf"
    return {"date": date, "endpoint_type": target.backend, "backend": target.backend,
            "label": args.label, "model_id": target.model_id,
            "tokenizer_id": args.tokenizer or target.model_id, "num_prompts": args.num_prompts,
            "request_rate": rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, **metrics,
            "input_lens": [r.prompt_len for r in records], "ttfts": [r.ttft for r in records],
            "itls": [r.itl for r in records], "latencies": [r.latency for r in records],
            "start_times": [r.start_time for r in records], "errors": [r.error for r in records]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    goodput = _goodput_slos(args.goodput)
    target = resolve_target(args)
    tokenizer = load_tokenizer(args.tokenizer or target.model_id)
    inputs = build_inputs(args, target, tokenizer)
    delays = arrival_times(len(inputs), args.request_rate, args.burstiness,
                           np.random.default_rng(args.seed))
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} "
          f"({'Poisson process' if args.burstiness == 1.0 else 'Gamma distribution'})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    records, duration = asyncio.run(run_requests(inputs, REQUEST_FUNCS[target.backend], delays,
                                                 args.max_concurrency, args.num_warmups))

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    metrics = calculate_metrics(records, duration, count_tokens, percentiles, goodput)
    resends = sum(r.resends for r in records)
    if resends:
        print(f"Requests sent again after the server closed a kept-alive connection: {resends}")
    failed = [r for r in records if not r.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, r in enumerate(failed[:10]):
            print(f"Error {i}: {r.error}")
    print(format_result(metrics, max_concurrency=args.max_concurrency,
                        request_rate=args.request_rate,
                        percentile_metrics=args.percentile_metrics.split(","),
                        percentiles=percentiles))
    if args.save_result:
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = result_path(args, target.backend, target.model_id, date)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result_json(args, target, metrics, records, date), f)
        print(f"Result saved to {path}")
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
