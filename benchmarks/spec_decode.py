"""Speculative decoding (n-gram prompt lookup, or a draft model with --draft-model) against
plain decoding, in one run, through the offline engine on the default model (greedy; the
tokens are checked equal on both sides):

- W1-style single streams on four prompt kinds: "copy" (answers that repeat or quote their
  context, RAG-style), "quote" (prompts asking to quote, which the default model answers in
  its own words instead: little to look up), "code" (an edit that returns most of the code),
  "chat" (free text): TPOT as vLLM defines it (the time after a request's first token over
  the tokens after it; the median over the kind's prompts of each one's best of --repeats),
  the mean tokens per verified step, and the request time per output token with the prefill
  in it;
- a W2-shaped batch (16 prompts of 256 random tokens, 128 out, ignore_eos, all at once):
  output tokens per second, the best of --repeats. With the default disable_by_batch_size
  (4) such a batch does not speculate; --batch-limit sets it (0: no limit) to show what
  speculating it would cost.

Both engines stay up and take turns prompt by prompt (plain, then speculating), so that the
machine's drift touches both sides alike; each kind's per-prompt ratios are printed too.

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
from collections import Counter

CONTEXT = ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps "
           "each sequence's positions to blocks, so sequences grow without copying, and blocks "
           "whose tokens match are shared between requests through the prefix cache. When the "
           "pool runs out, the request that arrived last is preempted and recomputed later.")
CODE = ("def area(shape, a, b=None):\n    if shape == 'square':\n        return a * a\n"
        "    if shape == 'rectangle':\n        return a * b\n    if shape == 'circle':\n"
        "        return 3.14159 * a * a\n    raise ValueError(shape)\n")
RIVER = ("The river rises in the northern hills and flows south for two hundred kilometres before "
         "it reaches the sea. Three towns stand on its banks, and each of them was built around an "
         "old stone bridge. In spring the snowmelt raises the water by several metres, and the "
         "meadows along the lower valley flood for a few weeks every year.")
POLICY = ("Items bought online can be returned within thirty days of delivery. The item must be "
          "unused and in its original packaging, with the receipt or the order number. Refunds go "
          "back to the original payment method within five business days of the item reaching our "
          "warehouse. Shipping costs are refunded only when the item arrived damaged or was not the "
          "item ordered.")
KINDS = {
    # answers that copy their context: the default model repeats the first two word for word
    # and quotes much of the third
    "copy": [f"{CONTEXT}\n\nRepeat the text above exactly.",
             f"{RIVER}\n\nRepeat the text above exactly.",
             f"Document:\n{POLICY}\n\nQuestion: What is the return policy? Answer by quoting the "
             "document exactly."],
    # asked to quote, but the default model (135M) answers in its own words: little to look up
    "quote": [f"Context: {CONTEXT}\n\nQuote the sentences about preemption and the block table.",
              f"{CONTEXT}\n\nRewrite the text above word for word, then stop."],
    "code": [f"Rename the function to shape_area and return the whole code:\n\n{CODE}",
             f"Add a docstring to this function and return all of it:\n\n{CODE}",
             f"Replace 3.14159 by math.pi (import math) and return the code:\n\n{CODE}"],
    "chat": ["Write a short story about a lighthouse keeper.",
             "What are three good habits for learning a new language?",
             "Describe a walk through a forest in autumn."],
}


class Side:
    """One engine of the comparison and what it measured: per kind, each prompt's best ms per
    output token and its token ids; the W2 runs' output tokens per second."""

    def __init__(self, llm):
        self.llm = llm
        self.best: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}  # decode TPOT
        self.best_e2e: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
        self.ids: dict[str, dict[int, list[int]]] = {kind: {} for kind in KINDS}
        # per kind: verified steps, drafts kept, draft tokens proposed, output tokens
        self.counts = {kind: Counter() for kind in KINDS}
        self.batch: list[float] = []

    def stream(self, kind: str, i: int, params) -> None:
        stats = self.llm.engine.stats
        start = (stats.spec_drafts, stats.spec_accepted_tokens, stats.spec_draft_tokens)
        t0 = time.perf_counter()
        result = self.llm.chat([{"role": "user", "content": KINDS[kind][i]}], params)[0]
        e2e = 1000 * (time.perf_counter() - t0)
        out, m = result.outputs[0], result.metrics
        # vLLM's TPOT: the time after the first token over the tokens after it (the prompt's
        # prefill is TTFT's, not TPOT's)
        tpot = 1000 * (m.last_token_time - m.first_token_time) / max(len(out.token_ids) - 1, 1)
        self.best[kind][i] = min(self.best[kind].get(i, float("inf")), tpot)
        self.best_e2e[kind][i] = min(self.best_e2e[kind].get(i, float("inf")),
                                     e2e / max(len(out.token_ids), 1))
        self.ids[kind][i] = out.token_ids
        self.counts[kind].update(steps=stats.spec_drafts - start[0],
                                 kept=stats.spec_accepted_tokens - start[1],
                                 proposed=stats.spec_draft_tokens - start[2],
                                 tokens=len(out.token_ids))

    def tpot(self, kind: str) -> float:
        """the median over the kind's prompts of each one's best TPOT"""
        return statistics.median(self.best[kind].values())

    def e2e_per_token(self, kind: str) -> float:
        """the median over the kind's prompts of each one's best request time per output token
        (prefill included)"""
        return statistics.median(self.best_e2e[kind].values())

    def backoff(self, kind: str) -> str:
        """what the backoff let through: drafts proposed per output token, and the share kept"""
        c = self.counts[kind]
        return (f"{c['proposed'] / max(c['tokens'], 1):.2f} drafts proposed a token, "
                f"{100 * c['kept'] / max(c['proposed'], 1):.0f} % kept")

    def tokens_per_step(self, kind: str) -> float:
        drafts, kept = self.counts[kind]["steps"], self.counts[kind]["kept"]
        return (1 + kept / drafts) if drafts else 1.0


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
                   help="disable_by_batch_size (default: the config's; 0: none)")
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
    # Both engines stay up and take turns, prompt by prompt: this shared machine's speed
    # drifts by tens of percent within minutes, which one engine's whole run and then the
    # other's would read as a difference between them.
    sides = {}
    for name, flags in (("plain", {}), (method, {"speculative_config": spec})):
        llm = LLM(None, max_model_len=2048, gguf_activations=args.gguf_activations, **flags)
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=8))
        sides[name] = Side(llm)
    for _ in range(args.repeats):
        for kind, prompts in KINDS.items():
            for i in range(len(prompts)):
                for side in sides.values():
                    side.stream(kind, i, greedy)
        for side in sides.values():
            side.batch.append(batch_throughput(side.llm, batch))
    a, b = sides["plain"], sides[method]
    print(f"{'workload':<10} {'plain':>12} {method:>12} {'speedup':>8} {'tokens/step':>12} same tokens")
    for kind in KINDS:
        print(f"{kind + ' TPOT':<10} {a.tpot(kind):9.2f} ms {b.tpot(kind):9.2f} ms "
              f"{a.tpot(kind) / b.tpot(kind):7.2f}x {b.tokens_per_step(kind):12.2f} {a.ids[kind] == b.ids[kind]}")
        print("  per prompt: " + ", ".join(f"{a.best[kind][i] / b.best[kind][i]:.2f}x"
                                           for i in range(len(KINDS[kind])))
              + f"; request time per token (prefill in it) {a.e2e_per_token(kind):.2f} -> "
                f"{b.e2e_per_token(kind):.2f} ms, {a.e2e_per_token(kind) / b.e2e_per_token(kind):.2f}x; "
              + b.backoff(kind))
    wa, wb = max(a.batch), max(b.batch)
    print(f"{'W2 tok/s':<10} {wa:12.1f} {wb:12.1f} {wb / wa:7.2f}x   (best of {args.repeats})")
    for side in sides.values():
        side.llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
