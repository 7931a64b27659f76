"""Latency of one batch through the offline engine, as `vllm bench latency` measures it, plus
the latency of each engine step.

    python -m benchmarks.latency [--batch-size 8] [--input-len 32] [--output-len 128]
        [--num-iters-warmup 10] [--num-iters 30] [--output-json FILE] [--seed 0]
        [--python-layers]
        [any `python -m pyserve` model / cache / scheduler flag, e.g. --model DIR]
    python -m pyserve bench latency ...   (the same)

Each iteration sends the same batch of random-token prompts (ids below 10000, as vLLM) with
temperature 1.0 and ignore_eos, so every request produces exactly --output-len tokens, and
times it until the last request finishes. Prefix caching is off unless
--enable-prefix-caching is given (vLLM's choice: the same prompts every iteration would
otherwise be served from the cache after the first).

Per step: the steps until every request has its first token are the prefill (reported as
the batch's time to first token); every later step advances each running request by one token,
so its duration is the per-output-token latency at this batch size (reported in ms).

--python-layers runs every decoder layer through its Python modules instead of the native
stack (model/layers/native.py), the same kernels with the Python between them: what the
stack saves, on one process (no tensor or pipeline parallelism).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency",
                                description=__doc__.splitlines()[0],
                                epilog="Other flags go to the engine, named as `python -m pyserve` "
                                       "names them (see its --help).")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--output-json", help="write the latencies here")
    p.add_argument("--seed", type=int, default=0, help="for the prompts")
    p.add_argument("--python-layers", action="store_true",
                   help="decoder layers in Python, the native stack off")
    return p


def run_batch(core, prompts: list[list[int]], params, ids) -> tuple[float, float, list[float]]:
    """One batch to completion: (seconds, seconds until all have a first token, decode steps)."""
    pending = set()
    start = time.perf_counter()
    for prompt in prompts:
        request_id = f"latency-{next(ids)}"
        core.add_request(request_id, prompt, params)
        pending.add(request_id)
    first_token_s, decode_steps = 0.0, []
    while core.has_unfinished():
        step_start = time.perf_counter()
        outputs = core.step()
        now = time.perf_counter()
        if pending:
            pending -= {o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids}
            first_token_s = now - start
        else:
            decode_steps.append(now - step_start)
    return time.perf_counter() - start, first_token_s, decode_steps


def python_layers(core) -> None:
    """Every decoder layer through its Python forward (the native specs dropped)."""
    runner = getattr(core.executor, "runner", None)
    if runner is None:
        raise SystemExit("--python-layers needs the model in this process (no tensor or pipeline "
                         "parallelism)")
    layers = [m for m in runner.model.modules() if getattr(m, "native", None) is not None]
    for layer in layers:
        layer.native = None
    print(f"{len(layers)} decoder layers in Python")


def summarize(latencies: list[float], first_tokens: list[float], steps: list[float]) -> dict:
    lat, step_ms = np.array(latencies), np.array(steps or [0.0]) * 1000
    return {"avg_latency": float(lat.mean()), "latencies": lat.tolist(),
            "percentiles": dict(zip(PERCENTAGES, np.percentile(lat, PERCENTAGES).tolist())),
            "avg_first_token_latency": float(np.mean(first_tokens)),
            "avg_step_latency_ms": float(step_ms.mean()),
            "step_latency_percentiles_ms": dict(zip(PERCENTAGES,
                                                    np.percentile(step_ms, PERCENTAGES).tolist()))}


def report(r: dict, batch_size: int) -> None:
    print(f"Avg latency: {r['avg_latency']} seconds")
    for pct, value in r["percentiles"].items():
        print(f"{pct}% percentile latency: {value} seconds")
    print(f"Avg time to first token (whole batch): {r['avg_first_token_latency']} seconds")
    print(f"Avg per-step latency (one token for each of {batch_size} requests): "
          f"{r['avg_step_latency_ms']:.2f} ms")
    for pct, value in r["step_latency_percentiles_ms"].items():
        print(f"{pct}% percentile per-step latency: {value:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    args, engine_flags = build_parser().parse_known_args(argv)
    from pyserve.cli import parse_config
    from pyserve.engine.core import EngineCore
    from pyserve.sampling_params import RequestOutputKind, SamplingParams

    # later flags win, so an explicit --enable-prefix-caching turns caching back on
    config = parse_config(["--no-enable-prefix-caching", *engine_flags])
    core = EngineCore(config)
    if args.python_layers:
        python_layers(core)
    if core.max_model_len < args.input_len + args.output_len:
        raise SystemExit(f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds "
                         f"the model length {core.max_model_len}; raise --max-model-len")
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
                            output_kind=RequestOutputKind.DELTA)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, min(10000, core.vocab_size),
                           (args.batch_size, args.input_len)).tolist()
    ids = itertools.count()
    print("Warming up...")
    for _ in range(args.num_iters_warmup):
        run_batch(core, prompts, params, ids)
    latencies, first_tokens, steps = [], [], []
    for _ in range(args.num_iters):
        latency, first_token, decode = run_batch(core, prompts, params, ids)
        latencies.append(latency)
        first_tokens.append(first_token)
        steps += decode
    result = summarize(latencies, first_tokens, steps)
    report(result, args.batch_size)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_id": core.model_name, **result}, f, indent=4)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
