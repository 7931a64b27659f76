"""Streamed completions and chat completions: the engine's outputs for every prompt of a
request, merged as they come, as server-sent events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import orjson

from pyserve.server.errors import error_body
from pyserve.server.openai import objects
from pyserve.server.openai.logprobs import completion_logprobs, echoed
from pyserve.server.strict_json import json_bytes


def sse(obj) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def stream_failed(message: str, sent: int) -> bytes:
    """The end of a stream whose chunks raised (http.StreamingResponse.on_error): an error
    chunk, as an engine failure ends one, and [DONE]."""
    return sse(orjson.loads(error_body(500, message))) + b"data: [DONE]\n\n"


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    """A chunk's running usage (continuous_usage_stats)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def stream_chunks(serving, streams, meta: dict, include_usage: bool,
                        continuous_usage: bool) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response: chunk_dicts' chunks, then [DONE]."""
    chunks = chunk_dicts(serving, streams, meta, include_usage, continuous_usage)
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        await chunks.aclose()


class ChunkStream:
    """chunk_dicts' chunks for another API to translate, with what is known before the first
    of them: the response's id, model and prompt tokens (so that a stream's opening events go
    out at once, not after the prefill). Iterate it (or anext() it) and aclose() it as the
    generator; aclose() also discards the requests when the chunks were never read (a closed
    generator that never started runs no finally)."""

    def __init__(self, chunks: AsyncIterator[dict], meta: dict, discard: Callable[[], None]):
        self._chunks, self._discard = chunks, discard
        self.id, self.model = meta["id"], meta["model"]
        self.prompt_tokens = sum(meta["prompt_tokens"])

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._discard()


async def chunk_dicts(serving, streams, meta: dict, include_usage: bool,
                      continuous_usage: bool) -> AsyncIterator[dict]:
    """A streamed response's chunks as data: per choice a role chunk (chat; with echo, then
    the echoed message), then one chunk per engine output, optional usage; an engine failure
    ends it with {"error": {...}}. A choice's first chunk carries its prompt's token ids
    (return_token_ids: completions in the choice, chat at the chunk's top level).
    However it ends (a client gone, an engine failure) every prompt's request is discarded,
    so nothing keeps running. (Other APIs translate these chunks into their own events.)"""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p, it):
        try:
            async for out in it:
                await queue.put((p, out))
        except Exception as exc:
            await queue.put((p, exc))
        finally:
            await queue.put((p, None))

    tasks = [asyncio.ensure_future(pump(p, it)) for p, (_, it) in enumerate(streams)]
    obj = "chat.completion.chunk" if meta["chat"] else "text_completion"
    head = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"]}
    open_streams, started = len(tasks), set()
    outputs: dict = {}  # chat: each choice's ChoiceOutput (content, reasoning, tool calls)
    generated: dict[int, int] = {}  # tokens generated, per choice
    text_offsets: dict[int, int] = {}  # where a choice's next token starts (completions)
    # a prompt's logprobs ride on the first output of its group, whichever choice that is
    prompt_logprobs: dict[int, list] = {}
    try:
        while open_streams:
            p, out = await queue.get()
            if out is None:
                open_streams -= 1
                continue
            if isinstance(out, Exception):
                yield orjson.loads(error_body(500, f"generation failed: {out}"))
                break
            if out.prompt_logprobs is not None:
                prompt_logprobs.setdefault(p, out.prompt_logprobs)
            meta["cached_tokens"][p] = out.num_cached_tokens
            for c in out.outputs:
                index = p * meta["n"] + c.index
                prompt_tokens = meta["prompt_tokens"][p]
                first = index not in started
                started.add(index)
                if meta["chat"] and first:
                    for opening in objects.chat_opening(meta, head, index, p):
                        if continuous_usage:
                            opening["usage"] = usage_counts(prompt_tokens, 0)
                        yield opening
                    outputs[index] = meta["output"]()
                choice = objects.choice(meta, index, c, False, serving.tokenizer,
                                        output=outputs.get(index))
                if meta["echo"] is not None and first:
                    choice["text"], choice["logprobs"] = echoed(
                        meta, p, c, prompt_logprobs.get(p), serving.tokenizer)
                elif meta["echo_only"]:
                    choice["text"], choice["logprobs"] = "", None
                elif not meta["chat"] and c.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(
                        c.token_ids, c.logprobs, serving.tokenizer, text_offsets.get(index, 0),
                        meta["as_token_ids"])
                if not meta["chat"] and first and meta["return_token_ids"]:
                    choice["prompt_token_ids"] = meta["prompt_ids"][p]
                lp = choice["logprobs"] if not meta["chat"] else None
                if lp and lp["tokens"]:  # offsets follow the tokens, not the text held back for stop strings
                    text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                generated[index] = generated.get(index, 0) + len(c.token_ids)
                if meta["chat"] and not choice["delta"] and choice["finish_reason"] is None \
                        and choice["logprobs"] is None and not meta["return_token_ids"]:
                    continue  # text held back (a marker's start, a call's unfinished list)
                chunk = {**head, "choices": [choice]}
                if continuous_usage:
                    chunk["usage"] = usage_counts(prompt_tokens, generated[index])
                yield chunk
        if include_usage:  # vLLM drops its nulls (prompt_tokens_details without the flag)
            meta["outputs"] = list(outputs.values())  # their reasoning tokens
            usage = serving.usage(sum(meta["prompt_tokens"]), sum(generated.values()), meta)
            yield {**head, "choices": [], "usage": {k: v for k, v in usage.items() if v is not None}}
    finally:
        for t in tasks:
            t.cancel()
        for rid, _ in streams:
            serving.engine.discard(rid)
