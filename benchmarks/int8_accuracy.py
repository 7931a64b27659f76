"""How far --gguf-activations int8 moves the default model from its exact (float32-activation)
output: greedy continuations are generated with float32 activations, then both modes score
those same tokens (prompt logprobs, teacher forcing), so every position is compared on the
same context.

    python -m benchmarks.int8_accuracy [--max-tokens 64]

Prints, over all continuation positions: how often int8's most likely token is the float32
greedy token, the mean and largest |Δ logprob| of that token, and how many tokens each
prompt's own int8 greedy output keeps in common with float32's before they part.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pyserve import LLM, SamplingParams

PROMPTS = [
    "Hello, world!", "The quick brown fox jumps over", "Paris is the capital of", "0 1 2 3",
    "Once upon a time", "The capital of Japan is", "def fibonacci(n):",
    "Explain why the sky is blue in one paragraph.", "List three colors:",
    "The first law of thermodynamics states that",
]


@dataclass
class Agreement:
    positions: int
    top1_agree: int
    mean_abs_delta: float
    max_abs_delta: float
    greedy_common: list[int]  # per prompt: leading tokens int8's greedy output shares

    def describe(self) -> str:
        return (f"{self.positions} positions: int8 top-1 = float32 greedy token at "
                f"{self.top1_agree / self.positions:.1%}; |Δ logprob| of that token mean "
                f"{self.mean_abs_delta:.4f}, max {self.max_abs_delta:.4f}; greedy outputs agree "
                f"for the first {sorted(self.greedy_common)} tokens (of each prompt's "
                f"continuation)")


def measure(model: str | None, prompts: list[str], max_tokens: int, **flags) -> Agreement:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    exact = LLM(model, gguf_activations="float32", **flags)
    reference = exact.generate(prompts, greedy)
    forced = [list(r.prompt_token_ids) + list(r.outputs[0].token_ids) for r in reference]
    exact_scores = exact.generate([{"prompt_token_ids": ids} for ids in forced], scoring)
    del exact
    fast = LLM(model, gguf_activations="int8", **flags)
    fast_greedy = fast.generate(prompts, greedy)
    fast_scores = fast.generate([{"prompt_token_ids": ids} for ids in forced], scoring)
    positions = agree = 0
    deltas = []
    common = []
    for ref, ids, a, b, own in zip(reference, forced, exact_scores, fast_scores, fast_greedy):
        start = len(ref.prompt_token_ids)
        for pos in range(start, len(ids)):
            token = ids[pos]
            exact_lp, fast_lp = a.prompt_logprobs[pos], b.prompt_logprobs[pos]
            positions += 1
            agree += fast_lp[token].rank == 1
            deltas.append(abs(fast_lp[token].logprob - exact_lp[token].logprob))
        theirs = own.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(ref.outputs[0].token_ids, theirs)) if x != y),
                    len(theirs))
        common.append(same)
    return Agreement(positions, agree, sum(deltas) / len(deltas), max(deltas), common)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file; default: the default model")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    print(measure(args.model, PROMPTS, args.max_tokens).describe())


if __name__ == "__main__":
    main()
