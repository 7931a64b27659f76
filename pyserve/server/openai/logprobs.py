"""Logprobs in the OpenAI shapes: completions' token lists, chat's content entries,
vLLM's prompt_logprobs, and the scored prompt of completions' echo."""

from __future__ import annotations

import itertools


def completion_logprobs(token_ids, positions, tokenizer, text_offset: int) -> dict:
    """The completions logprobs object; positions[i] is None where nothing is scored (the first
    echoed prompt token). text_offset: characters of this choice's text before these tokens."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, position in zip(token_ids, positions):
        if position is None:
            text = tokenizer.decode([token])
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:  # the engine decoded every logprob token (once)
            text = position[token].decoded_token
            token_logprobs.append(position[token].logprob)
            top_logprobs.append({lp.decoded_token: lp.logprob for lp in position.values()})
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def shape_prompt_logprobs(positions) -> list:
    """vLLM's shape: per prompt position, None or {token id: {logprob, rank, decoded_token}}."""
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in p.items()} for p in positions]


def choice_logprobs(c, chat: bool, k: int, tokenizer):
    if c.logprobs is None:
        return None
    if not chat:
        return completion_logprobs(c.token_ids, c.logprobs, tokenizer, 0)
    content = []
    for token, position in zip(c.token_ids, c.logprobs):
        # OpenAI's top_logprobs: the k most likely tokens by rank, whether or not the
        # sampled token is one of them (it may tie with the k-th on rank)
        top = sorted(position.values(), key=lambda lp: (lp.rank, -lp.logprob))[:k]
        chosen = position[token]
        content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()),
                        "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                          "bytes": list(lp.decoded_token.encode())} for lp in top]})
    return {"content": content}


def echoed(meta: dict, p: int, c, prompt_logprobs, tokenizer) -> tuple[str, dict | None]:
    """A completions choice with echo: its text and logprobs, the prompt's first. Prompt
    positions keep the prompt token and `logprobs` alternatives (vLLM's cut)."""
    prompt_ids = meta["prompt_ids"][p]
    text = meta["echo"][p] + ("" if meta["echo_only"] else c.text)
    if meta["logprobs"] is None:
        return text, None
    keep = meta["logprobs"] + 1
    positions = [None if lp is None else dict(itertools.islice(lp.items(), keep))
                 for lp in (prompt_logprobs or [None] * len(prompt_ids))]
    token_ids = list(prompt_ids)
    if not meta["echo_only"]:
        positions += c.logprobs or []
        token_ids += c.token_ids
    return text, completion_logprobs(token_ids, positions, tokenizer, 0)
