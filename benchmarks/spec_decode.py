"""Speculative decoding (n-gram prompt lookup, or a draft model with --draft-model) against
plain decoding, in one run, through the offline engine on the default model (greedy; the
tokens are checked equal on both sides):

- W1-style single streams on three prompt kinds: "copy" (a RAG-style answer that quotes its
  context), "code" (an edit that returns most of the code), "chat" (free text, little to look
  up): milliseconds per output token (the median over the prompts of a request's time over
  its tokens, best of --repeats) and the mean tokens per verified step;
- a W2-shaped batch (16 prompts of 256 random tokens, 128 out, ignore_eos, all at once):
  output tokens per second. With the default disable_by_batch_size (4) such a batch does not
  speculate; --batch-limit sets it (0: no limit) to show what speculating it would cost.

    python -m benchmarks.spec_decode [--max-tokens 128] [--k 4] [--repeats 2] [--batch-limit N]
                                     [--draft-model DIR] [--gguf-activations int8]

--gguf-activations int8 runs both sides in that mode, where a verify step's extra rows cost
little (the integer kernel is far from compute-bound at a few rows); the exact mode's float32
rows each cost about a row's worth of FMAs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

CONTEXT = ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps "
           "each sequence's positions to blocks, so sequences grow without copying, and blocks "
           "whose tokens match are shared between requests through the prefix cache. When the "
           "pool runs out, the request that arrived last is preempted and recomputed later.")
CODE = ("def area(shape, a, b=None):\n    if shape == 'square':\n        return a * a\n"
        "    if shape == 'rectangle':\n        return a * b\n    if shape == 'circle':\n"
        "        return 3.14159 * a * a\n    raise ValueError(shape)\n")
KINDS = {
    "copy": [f"{CONTEXT}\n\nRepeat the text above exactly.",
             f"Context: {CONTEXT}\n\nQuote the sentences about preemption and the block table.",
             f"{CONTEXT}\n\nRewrite the text above word for word, then stop."],
    "code": [f"Rename the function to shape_area and return the whole code:\n\n{CODE}",
             f"Add a docstring to this function and return all of it:\n\n{CODE}",
             f"Replace 3.14159 by math.pi (import math) and return the code:\n\n{CODE}"],
    "chat": ["Write a short story about a lighthouse keeper.",
             "What are three good habits for learning a new language?",
             "Describe a walk through a forest in autumn."],
}


def single_streams(llm, prompts, params, repeats: int):
    """(median ms per output token, token ids per prompt, tokens per verified step)."""
    stats = llm.engine.stats
    start = (stats.spec_drafts, stats.spec_accepted_tokens)
    best, ids = {}, []
    for _ in range(repeats):
        ids = []
        for i, text in enumerate(prompts):
            t0 = time.perf_counter()
            out = llm.chat([{"role": "user", "content": text}], params)[0].outputs[0]
            ms = 1000 * (time.perf_counter() - t0) / max(len(out.token_ids), 1)
            best[i] = min(best.get(i, float("inf")), ms)
            ids.append(out.token_ids)
    drafts, kept = stats.spec_drafts - start[0], stats.spec_accepted_tokens - start[1]
    return statistics.median(best.values()), ids, (1 + kept / drafts) if drafts else 1.0


def batch_throughput(llm, params) -> float:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 10000) for _ in range(256)]} for _ in range(16)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode", description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-limit", type=int, default=None,
                   help="disable_by_batch_size (default: pyserve's, 4; 0: none)")
    p.add_argument("--gguf-activations", choices=("float32", "int8"), default="float32")
    p.add_argument("--draft-model", default=None,
                   help="speculate with this draft model (a directory or .gguf with the default "
                        "model's vocabulary) instead of n-gram lookup")
    args = p.parse_args()
    from pyserve.llm import LLM
    from pyserve.sampling_params import SamplingParams

    if args.draft_model is None:
        method, spec = "ngram", {"method": "ngram", "num_speculative_tokens": args.k,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    else:
        method, spec = "draft", {"method": "draft_model", "model": args.draft_model,
                                 "num_speculative_tokens": args.k}
    if args.batch_limit is not None:
        spec["disable_by_batch_size"] = args.batch_limit or None
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    batch = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    results = {}
    for name, flags in (("plain", {}), (method, {"speculative_config": spec})):
        llm = LLM(None, max_model_len=2048, gguf_activations=args.gguf_activations, **flags)
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=8))
        results[name] = {kind: single_streams(llm, prompts, greedy, args.repeats)
                         for kind, prompts in KINDS.items()}
        results[name]["W2"] = batch_throughput(llm, batch)
        llm.shutdown()
        del llm
    print(f"{'workload':<10} {'plain':>12} {method:>12} {'speedup':>8} {'tokens/step':>12} same tokens")
    for kind in KINDS:
        (a, ids_a, _), (b, ids_b, length) = results["plain"][kind], results[method][kind]
        print(f"{kind + ' TPOT':<10} {a:9.2f} ms {b:9.2f} ms {a / b:7.2f}x {length:12.2f} {ids_a == ids_b}")
    a, b = results["plain"]["W2"], results[method]["W2"]
    print(f"{'W2 tok/s':<10} {a:12.1f} {b:12.1f} {b / a:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
