"""Next-token choice from a step's logits: greedy (argmax) or random with temperature,
top-k, top-p and min-p, each request drawing from its own seeded generator when it has one."""

from __future__ import annotations

import torch

from pyserve.engine.request import Request


def _mask_unreached_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Below min_tokens, EOS and stop tokens cannot be chosen (vLLM's rule)."""
    for row, r in enumerate(requests):
        if len(r.output_token_ids) < r.params.min_tokens:
            banned = [t for t in (*r.eos_token_ids, *r.params.stop_token_ids) if t < logits.shape[1]]
            if banned:
                logits[row, banned] = float("-inf")


def _filtered_probs(logits: torch.Tensor, r: Request) -> torch.Tensor:
    p = r.params
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator) -> list[int]:
    """logits: [len(requests), vocab] float32 -> one token id per request."""
    _mask_unreached_min_tokens(logits, requests)
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, r in enumerate(requests):
        if r.params.greedy:
            out.append(greedy[row])
            continue
        probs = _filtered_probs(logits[row], r)
        token = torch.multinomial(probs, 1, generator=r.generator or generator)
        out.append(int(token))
    return out
