"""Logprobs in the OpenAI shapes: completions' token lists, chat's content entries,
vLLM's prompt_logprobs, and the scored prompt of completions' echo.

as_ids (vLLM's return_tokens_as_token_ids) names each token "token_id:N" instead of its text,
for tokens that are not valid UTF-8 alone. Logprobs are floored at -9999.0, the number OpenAI
uses for "very unlikely" (JSON has no -inf)."""

from __future__ import annotations

import itertools

_FLOOR = -9999.0


def token_name(token: int, decoded: str | None, tokenizer, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token}"
    return decoded if decoded is not None else tokenizer.decode([token])


def completion_logprobs(token_ids, positions, tokenizer, text_offset: int,
                        as_ids: bool = False) -> dict:
    """The completions logprobs object; positions[i] is None where nothing is scored (the first
    echoed prompt token). text_offset: characters of this choice's text before these tokens."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, position in zip(token_ids, positions):
        if position is None:
            text = token_name(token, None, tokenizer, as_ids)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:  # the engine decoded every logprob token (once)
            text = token_name(token, position[token].decoded_token, tokenizer, as_ids)
            token_logprobs.append(max(position[token].logprob, _FLOOR))
            top_logprobs.append({token_name(t, lp.decoded_token, tokenizer, as_ids):
                                 max(lp.logprob, _FLOOR) for t, lp in position.items()})
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


def choice_logprobs(c, chat: bool, k: int | None, tokenizer, as_ids: bool = False):
    """A choice's logprobs; chat: k top logprobs a token (-1: all the engine returned, the
    whole vocabulary)."""
    if c.logprobs is None:
        return None
    if not chat:
        return completion_logprobs(c.token_ids, c.logprobs, tokenizer, 0, as_ids)
    content = []
    for token, position in zip(c.token_ids, c.logprobs):
        # OpenAI's top_logprobs: the k most likely tokens by rank, whether or not the
        # sampled token is one of them (it may tie with the k-th on rank)
        top = sorted(position.items(), key=lambda item: (item[1].rank, -item[1].logprob))
        top = top if k == -1 else top[:k or 0]
        chosen = position[token]
        names = [token_name(t, lp.decoded_token, tokenizer, as_ids) for t, lp in top]
        # vLLM: the entry's bytes are its text's, even when it is named by its id
        content.append({"token": token_name(token, chosen.decoded_token, tokenizer, as_ids),
                        "logprob": max(chosen.logprob, _FLOOR),
                        "bytes": list(chosen.decoded_token.encode(errors="replace")),
                        "top_logprobs": [{"token": name, "logprob": max(lp.logprob, _FLOOR),
                                          "bytes": list(name.encode(errors="replace"))}
                                         for name, (_, lp) in zip(names, top)]})
    return {"content": content}


def echoed(meta: dict, p: int, c, prompt_logprobs, tokenizer) -> tuple[str, dict | None]:
    """A completions choice with echo: its text and logprobs, the prompt's first. Prompt
    positions keep the prompt token and `logprobs` alternatives (vLLM's cut; -1: all)."""
    prompt_ids = meta["prompt_ids"][p]
    text = meta["echo"][p] + ("" if meta["echo_only"] else c.text)
    if meta["logprobs"] is None:
        return text, None
    keep = None if meta["logprobs"] == -1 else meta["logprobs"] + 1
    positions = [None if lp is None else dict(itertools.islice(lp.items(), keep))
                 for lp in (prompt_logprobs or [None] * len(prompt_ids))]
    token_ids = list(prompt_ids)
    if not meta["echo_only"]:
        positions += c.logprobs or []
        token_ids += c.token_ids
    return text, completion_logprobs(token_ids, positions, tokenizer, 0, meta["as_token_ids"])
