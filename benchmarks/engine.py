"""Engine figures in one run, with the default model on this machine:

  1. offline throughput, 64 requests x 256 prompt / 128 output tokens (ignore_eos), next to
     the foundation's batch-16 figure (128 / 128) and transformers' generate at batch 16;
  2. the same 64 requests through the async engine on uvloop, arriving 50 ms apart: the
     fraction of step time the event loop is busy, and how long a new arrival waits before
     it is first scheduled;
  3. prefix caching: 64 requests sharing a 512-token system prompt plus 64 unique tokens,
     16 output tokens, 16 at a time: hit rate and time to first token with caching on vs off.

    python benchmarks/engine.py [--model DIR] [--skip-hf] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from benchmarks.throughput import random_prompts, run_hf, run_pyserve


def async_run(model_dir: str, prompts: list[list[int]], output_len: int, gap_s: float,
              concurrency: int | None, **flags) -> dict:
    import uvloop

    from pyserve.config import Config
    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.engine.core import EngineCore
    from pyserve.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def main():
        core = EngineCore(Config.from_flat(model=model_dir, log_stats_interval=0, **flags))
        engine = AsyncEngine(core)
        gate = asyncio.Semaphore(concurrency or len(prompts))
        ttfts = []

        async def one(i, ids):
            await asyncio.sleep(i * gap_s)
            async with gate:
                start = time.perf_counter()
                first = None
                async for _ in engine.generate(ids, params, f"r{i}"):
                    first = first or time.perf_counter() - start
                ttfts.append(first)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
        await engine.shutdown()
        snap = core.snapshot()
        return {"elapsed_s": elapsed, "output_tok_s": len(prompts) * output_len / elapsed,
                "loop_busy_fraction": engine.loop_busy_fraction,
                "ttft_mean_s": statistics.mean(ttfts), "ttft_median_s": statistics.median(ttfts),
                **snap}

    return uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from pyserve import LLM
    from pyserve.cli import parse_config
    from pyserve.model.default_model import ensure_default_model

    model_dir = args.model or str(ensure_default_model(parse_config([]).model.download_dir))
    results = {}
    llm = LLM(model_dir)
    vocab = llm.engine.vocab_size
    run_pyserve(llm, random_prompts(vocab, 1, 16, 1), 4)
    prompts64 = random_prompts(vocab, 64, 256, 64)
    results["pyserve_64x256x128_tok_s"] = run_pyserve(llm, prompts64, 128)
    results["pyserve_foundation_batch16_128x128_tok_s"] = run_pyserve(
        llm, random_prompts(vocab, 16, 128, 16), 128)
    del llm
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        run_hf(hf, random_prompts(vocab, 1, 16, 1), 4)
        start = time.perf_counter()
        for i in range(0, 64, 16):
            run_hf(hf, prompts64[i:i + 16], 128)
        results["transformers_64x256x128_batch16_tok_s"] = 64 * 128 / (time.perf_counter() - start)
        del hf

    online = async_run(model_dir, prompts64, 128, gap_s=0.05, concurrency=None)
    results["async_loop_busy_fraction"] = online["loop_busy_fraction"]
    results["async_queue_wait_p50_s"] = online["queue_wait_p50_s"]
    results["async_queue_wait_p99_s"] = online["queue_wait_p99_s"]
    results["async_output_tok_s"] = online["output_tok_s"]

    gen = torch.Generator().manual_seed(5)
    system = torch.randint(100, vocab, (512,), generator=gen).tolist()
    shared = [system + torch.randint(100, vocab, (64,), generator=gen).tolist() for _ in range(64)]
    for label, enabled in (("on", True), ("off", False)):
        r = async_run(model_dir, shared, 16, gap_s=0.0, concurrency=16, enable_prefix_caching=enabled)
        results[f"prefix_{label}_hit_rate"] = r["prefix_cache_hit_rate"]
        results[f"prefix_{label}_ttft_mean_s"] = r["ttft_mean_s"]
        results[f"prefix_{label}_ttft_median_s"] = r["ttft_median_s"]
        results[f"prefix_{label}_elapsed_s"] = r["elapsed_s"]

    print(f"\nEngine benchmark, {model_dir}, float32, {torch.get_num_threads()} threads")
    for key, value in results.items():
        print(f"  {key:<48} {value:10.3f}")
    speedup = results["prefix_off_ttft_mean_s"] / results["prefix_on_ttft_mean_s"]
    print(f"  {'prefix caching TTFT speed-up (mean, off / on)':<48} {speedup:10.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
