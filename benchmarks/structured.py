"""What structured outputs cost: decode-step time with and without a JSON schema on every
request, grammar compile times, and the compiled-grammar cache's hit rate.

    python -m benchmarks.structured [--batch-sizes 1,16] [--steps 48] [--model DIR] [...]

Decode steps: one batch of chat prompts, greedy, every request constrained by a JSON schema
that makes the answer a list of 48-64 integers (so it cannot end early), against the same
batch unconstrained with ignore_eos. The median of the steps in which every request decodes
(one token each), after a warm-up batch. The constrained step's extra host work (filling the
bitmask from each matcher, advancing it with the accepted token) and the mask applied in the
sampler are all inside it.

Compile: a set of schemas (tool parameter schemas as agents send them, a few larger ones, a
regex and a choice), each compiled on a fresh compiler, then the p50 / p99 over the set. Cache:
200 requests drawing their schema from the set (Zipf-like: a few schemas most of the time, as
a fleet of agents does) through the engine's compiler; the hit rate is its hits over lookups.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
         "minItems": 48, "maxItems": 64}

TOOL_SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]},
    {"type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
     "required": ["query"]},
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"},
                                      "op": {"enum": ["add", "sub", "mul", "div"]}},
     "required": ["a", "b", "op"]},
    {"type": "object", "properties": {"to": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
                                      "subject": {"type": "string", "maxLength": 80},
                                      "body": {"type": "string"}}, "required": ["to", "subject", "body"]},
    {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                      "append": {"type": "boolean"}}, "required": ["path", "content"]},
    {"type": "object", "properties": {"event": {"type": "object", "properties": {
        "title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
        "attendees": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "start"]}},
     "required": ["event"]},
    {"type": "object", "properties": {"sql": {"type": "string"}, "limit": {"type": "integer",
                                                                         "minimum": 1, "maximum": 1000}},
     "required": ["sql"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}},
        "coupon": {"type": ["string", "null"]}}, "required": ["items"]},
]
LARGER = [
    {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                      for i in range(60)}, "required": [f"field_{i}" for i in range(0, 60, 2)]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string",
                                                                               "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"]}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "age", "address"]}}, "required": ["person"]},
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.splitlines()[0],
                                epilog="Other flags go to the engine, named as `python -m pyserve` names them.")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--steps", type=int, default=48, help="decode steps per batch")
    p.add_argument("--seed", type=int, default=0)
    return p


def decode_steps(core, batch: int, steps: int, constrained: bool) -> list[float]:
    """Durations (s) of the steps in which every request of the batch decoded one token."""
    from pyserve.sampling_params import SamplingParams, StructuredOutputsParams
    from pyserve.tokenizer.tokenizer import apply_chat_template

    prompts = [apply_chat_template(core.tokenizer, [{"role": "user", "content": f"List {48 + i} numbers."}])
               for i in range(batch)]
    spec = StructuredOutputsParams(json=ARRAY) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=not constrained,
                            structured_outputs=spec)
    for i, ids in enumerate(prompts):
        core.add_request(f"s{batch}-{constrained}-{time.monotonic_ns()}-{i}", list(ids), params)
    durations = []
    while core.has_unfinished():
        t = time.perf_counter()
        step = core.schedule()
        if not step.sequences:
            continue
        result = core.run(core.prepare(step))
        core.update(step, result)
        elapsed = time.perf_counter() - t
        decoding = [s for s in step.sequences if s.num_new_tokens == 1 and s.sampling is not None]
        if len(decoding) == batch == len(step.sequences):
            durations.append(elapsed)
    return durations


def grammar_work(core, batch: int, repeats: int = 50) -> tuple[float, float, float]:
    """Median seconds of a step's grammar work for `batch` constrained rows, measured alone (the
    step figures above move with the machine by more than this): filling the bitmask from
    the matchers, applying it to [batch, vocab] logits, advancing each matcher by a token."""
    import torch

    from pyserve.sampling_params import StructuredOutputsParams
    from pyserve.structured.bitmask import apply_bitmask, fill_bitmask

    compiled = core.grammars.compile(StructuredOutputsParams(json=ARRAY))
    matchers = [core.grammars.matcher(compiled) for _ in range(batch)]
    digit = core.tokenizer.encode("7", add_special_tokens=False)[0]
    comma = core.tokenizer.encode(",", add_special_tokens=False)[0]
    for m in matchers:
        m.accept_token(core.tokenizer.encode("[", add_special_tokens=False)[0])
        m.accept_token(digit)
    logits = torch.randn(batch, core.vocab_size)
    fill, apply, accept = [], [], []
    for i in range(repeats):
        t = time.perf_counter()
        bitmask = fill_bitmask(dict(enumerate(matchers)), batch, core.vocab_size)
        fill.append(time.perf_counter() - t)
        rows = logits.clone()
        t = time.perf_counter()
        apply_bitmask(rows, bitmask, list(range(batch)))
        apply.append(time.perf_counter() - t)
        t = time.perf_counter()
        for m in matchers:
            m.accept_token(comma if i % 2 == 0 else digit)
        accept.append(time.perf_counter() - t)
    return statistics.median(fill), statistics.median(apply), statistics.median(accept)


def compile_times(core) -> list[float]:
    from pyserve.sampling_params import StructuredOutputsParams
    from pyserve.structured.compiler import GrammarCompiler

    specs = [StructuredOutputsParams(json=s) for s in TOOL_SCHEMAS + LARGER]
    specs += [StructuredOutputsParams(regex=r"[A-Z]{3}-[0-9]{4}-[a-z]{2,8}"),
              StructuredOutputsParams(choice=["positive", "negative", "neutral"])]
    fresh = GrammarCompiler(core.tokenizer, core.vocab_size, core.eos_token_ids)
    fresh.compile(StructuredOutputsParams(json={"type": "object"}))  # the vocabulary, read once
    times = []
    for spec in specs:
        t = time.perf_counter()
        fresh.compile(spec)
        times.append(time.perf_counter() - t)
    return times


def cache_hit_rate(core, seed: int) -> float:
    from pyserve.sampling_params import StructuredOutputsParams
    from pyserve.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(core.tokenizer, core.vocab_size, core.eos_token_ids)
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(TOOL_SCHEMAS))]
    for _ in range(200):
        schema = rng.choices(TOOL_SCHEMAS, weights)[0]
        compiler.compile(StructuredOutputsParams(json=json.loads(json.dumps(schema))))
    stats = compiler.stats()
    return stats["hits"] / (stats["hits"] + stats["misses"])


def main(argv: list[str] | None = None) -> int:
    args, engine_flags = build_parser().parse_known_args(argv)
    from pyserve.cli import parse_config
    from pyserve.engine.core import EngineCore

    core = EngineCore(parse_config(engine_flags))
    decode_steps(core, 2, 4, True)  # warm-up: kernels, the vocabulary for xgrammar
    print(f"{'batch':>5} {'free step (ms)':>15} {'json step (ms)':>15} {'overhead':>9}")
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        free = statistics.median(decode_steps(core, batch, args.steps, False)) * 1000
        constrained = statistics.median(decode_steps(core, batch, args.steps, True)) * 1000
        fill, apply, accept = (x * 1000 for x in grammar_work(core, batch))
        rows.append((batch, free, constrained))
        print(f"{batch:>5} {free:>15.2f} {constrained:>15.2f} {100 * (constrained / free - 1):>8.1f}%"
              f"   grammar work alone: fill {fill:.3f} + apply {apply:.3f} + accept {accept:.3f} ms"
              f" = {100 * (fill + apply + accept) / free:.1f} % of the free step")
    times = sorted(t * 1000 for t in compile_times(core))
    p50, p99 = statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]
    tool = sorted(t * 1000 for t in compile_times(core)[:len(TOOL_SCHEMAS)])
    print(f"grammar compile over {len(times)} schemas: p50 {p50:.1f} ms, p99 {p99:.1f} ms; "
          f"tool schemas alone p50 {statistics.median(tool):.1f} ms")
    print(f"compiled-grammar cache hit rate, 200 requests over {len(TOOL_SCHEMAS)} tool schemas: "
          f"{100 * cache_hit_rate(core, args.seed):.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
