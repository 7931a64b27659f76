"""Speculative decoding (n-gram prompt lookup) against plain decoding: one greedy stream at a
time, on prompts whose answers repeat their context (the case prompt lookup is for: editing,
quoting, summarising with the source's words), through the offline engine on the default
model; the same prompts and the same tokens on both sides (the output is checked equal).

    python -m benchmarks.speculative [--max-tokens 128] [--k 4] [--repeats 2]

Prints, per side, the milliseconds per output token (a request's whole time over its tokens,
the best of --repeats passes) and, with speculation, the drafts' acceptance rate and mean
tokens per step."""

from __future__ import annotations

import argparse
import sys
import time

PASSAGE = ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps "
           "each sequence's positions to blocks, so sequences grow without copying, and blocks "
           "whose tokens match are shared between requests through the prefix cache.")
PROMPTS = [
    [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}],
    [{"role": "user", "content": "Fix the typo and return the code:\n\ndef add(a, b):\n    retrun a + b\n\n"
                                 "def sub(a, b):\n    return a - b\n"}],
    [{"role": "user", "content": f"{PASSAGE}\n\nQuote the sentence about the block table."}],
]


def run(llm, params, repeats: int) -> tuple[float, list]:
    """(best ms per output token over the prompts, the outputs' token ids)."""
    best, ids = float("inf"), None
    for _ in range(repeats):
        t0, tokens, ids = time.perf_counter(), 0, []
        for messages in PROMPTS:
            out = llm.chat(messages, params)[0].outputs[0]
            tokens += len(out.token_ids)
            ids.append(out.token_ids)
        best = min(best, 1000 * (time.perf_counter() - t0) / tokens)
    return best, ids


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    from pyserve.llm import LLM
    from pyserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    plain = LLM(None, max_model_len=2048)
    run(plain, SamplingParams(temperature=0, max_tokens=8), 1)  # warm-up
    plain_ms, plain_ids = run(plain, params, args.repeats)
    plain.shutdown()
    del plain
    fast = LLM(None, max_model_len=2048, speculative_config=spec)
    run(fast, SamplingParams(temperature=0, max_tokens=8), 1)
    stats = fast.engine.stats
    start = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    spec_ms, spec_ids = run(fast, params, args.repeats)
    drafts, proposed, kept = (now - then for now, then in zip(
        (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens), start))
    print(f"plain:       {plain_ms:6.2f} ms per output token")
    print(f"speculative: {spec_ms:6.2f} ms per output token ({plain_ms / spec_ms:.2f}x), "
          f"{kept} of {proposed} draft tokens accepted ({100 * kept / max(proposed, 1):.0f}%), "
          f"{1 + kept / max(drafts, 1):.2f} tokens per verified step; same tokens: "
          f"{spec_ids == plain_ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
