"""The sampler on the CPU: milliseconds per step for S rows of a V-token vocabulary, pyserve's
native path (pyserve.model.sampler.sample) beside the PyTorch ops it replaced (the ones the
CUDA path runs: dense penalties, sort-based top-k / top-p, exp, float64 cumsum and a search),
in the same run, for the parameter mixes requests send.

    python -m benchmarks.sampler [--rows 1,16] [--vocab 49152] [--threads N] [--repeats 50]

Timings are medians of --repeats calls after a warm-up; --threads sets torch's (and so the
native path's) thread count, default all cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from pyserve.model.sampler import (_apply_penalties_dense, _draw, _uniforms, _weights,
                                   build_metadata, logprob_columns, sample)
from pyserve.sampling_params import SamplingParams
from pyserve.step import SamplingInputs

MIXES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "repetition_penalty 1.1": dict(temperature=0.8, repetition_penalty=1.1),
    "frequency + presence": dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.5),
    "logprobs 5": dict(temperature=0.8, logprobs=5),
}


def torch_ops(logits: torch.Tensor, meta, default: torch.Generator) -> list[int]:
    """The PyTorch steps of sample_on_device (its non-CPU branch), run on the CPU."""
    raw = logits
    if meta.penalties is not None:
        logits = _apply_penalties_dense(logits, meta.penalties)
    chosen = logits.argmax(dim=-1)
    if not meta.all_greedy:
        weights, fallback = _weights(logits, meta)
        chosen = torch.where(meta.greedy, chosen,
                             _draw(weights, _uniforms(meta.generators, default, logits.device), fallback))
    if meta.max_num_logprobs >= 0:
        logprob_columns(raw, chosen, meta.max_num_logprobs)
    return chosen.tolist()


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampler", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'rows':>4}  {'mix':<24} {'native ms':>10} {'torch ms':>9} {'x':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        gen = torch.Generator().manual_seed(rows)
        logits = torch.randn(rows, args.vocab, generator=gen) * 3
        prompt = torch.randint(0, args.vocab, (256,), generator=gen).tolist()
        output = torch.randint(0, args.vocab, (128,), generator=gen).tolist()
        for name, params in MIXES.items():
            inputs = [SamplingInputs(SamplingParams(**params), (2,), len(output), prompt, output)] * rows

            def ours():  # the runner's per-step work: the metadata, then the sampler
                sample(logits, build_metadata(inputs, [None] * rows, args.vocab, logits.device), gen)

            def theirs():
                torch_ops(logits, build_metadata(inputs, [None] * rows, args.vocab, logits.device), gen)

            native, reference = median_ms(ours, args.repeats), median_ms(theirs, args.repeats)
            print(f"{rows:>4}  {name:<24} {native:>10.3f} {reference:>9.3f} {reference / native:>5.1f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
