"""POST /v1/embeddings (OpenAI's shapes) and /pooling (vLLM's), on the same engine and batches
as generation: each input is one pooling request (engine/pooling.py).

`input` is a string, a list of strings, a list of token ids or a list of such lists; or, as
vLLM's chat form, `messages` rendered by the chat template (without a generation prompt unless
asked). At most MAX_INPUTS inputs a request, refused before anything is tokenized. Inputs
longer than the model are a 400, unless truncate_prompt_tokens keeps their first (or, with
truncation_side "left", last) tokens: vLLM's pooling side, where generation keeps the last.
encoding_format "base64" is each vector's bytes (embed_dtype, float32 by default, in the
endianness asked for, little-endian by default: what OpenAI's SDK decodes); "bytes" and
"bytes_only" are vLLM's binary answers: the vectors' bytes one after the other as
application/octet-stream, with (bytes) a `metadata` header holding the JSON of where each one
starts and ends, its dtype, endianness and shape, and the usage."""

from __future__ import annotations

import asyncio
import base64
import heapq
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable

import orjson
import torch

from pyserve.engine.async_engine import AsyncEngine, EngineDeadError
from pyserve.errors import InvalidRequest
from pyserve.pooling_params import TASKS, PoolingParams
from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response
from pyserve.server.openai.pooling_window import pool_in_windows
from pyserve.server.request_limits import MAX_PROMPTS
from pyserve.server.values import field, one_of

logger = logging.getLogger("pyserve.requests")

MAX_INPUTS = MAX_PROMPTS  # 2048: OpenAI's cap on inputs in one embeddings request
# values (floats) one response may carry: per-token pooling returns tokens x hidden of them,
# so this bounds a /pooling answer near 400 MB of JSON
MAX_POOLED_VALUES = 2**25
_OFF_LOOP_VALUES = 2**16  # a response with more values than this is encoded off the loop
_OFF_LOOP_CHARS = 20_000  # a batch with more text than this is tokenized off the event loop

# fields each route reads; vLLM's others that pyserve does not implement are refused (400),
# unknown ones logged and ignored, as vLLM ignores them
_FIELDS = {"model", "input", "messages", "encoding_format", "dimensions", "user", "padding",
           "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "priority",
           "request_id", "normalize", "use_activation", "embed_dtype", "endianness",
           "chat_template", "chat_template_kwargs", "add_generation_prompt",
           "continue_final_message"}
_POOLING_FIELDS = _FIELDS | {"task"}
ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")
# vLLM's embed_dtype names (of base64 and bytes answers)
EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ENDIANNESS = ("native", "big", "little")
REFUSED = ("mm_processor_kwargs", "kv_transfer_params", "cache_salt", "prompt_embeds",
            "media_io_kwargs")


class OpenAIServingEmbedding:
    def __init__(self, engine: AsyncEngine, serving):
        """serving: the OpenAIServing whose body parsing, tokenizing and chat template
        these routes share."""
        self.engine = engine
        self.serving = serving

    async def embeddings(self, request: Request) -> Response:
        body = self.serving.parse_body(request)
        task = "embed"
        params, fmt = self._params(body, _FIELDS, task)
        rows = await self._run(request, body, params, "embd-")
        return await self._response(rows, "embedding", "embedding", fmt, _encoding(body))

    async def pooling(self, request: Request) -> Response:
        """vLLM's /pooling: `task` "embed" (the default, the model's pooling task as vLLM
        takes it: the pooled vector, as /v1/embeddings) or "token_embed" (every token's final
        hidden state). dimensions is vLLM's 400 here."""
        body = self.serving.parse_body(request)
        task = field(body, "task", str, "embed")
        if task not in TASKS:  # vLLM's words: the same for a task no model here can do
            raise APIError(400, f"Unsupported task: {task!r}. Supported tasks: {list(TASKS)}", "task")
        if body.get("dimensions") is not None:
            raise APIError(400, "dimensions is currently not supported", "dimensions")
        params, fmt = self._params(body, _POOLING_FIELDS, task)
        rows = await self._run(request, body, params, "pool-")
        return await self._response(rows, "pooling", "data", fmt, _encoding(body))

    # -- request parsing -----------------------------------------------------------------------
    def _params(self, body: dict, known: set[str], task: str) -> tuple[PoolingParams, str]:
        for name in REFUSED:
            if body.get(name) is not None:
                raise APIError(400, f"'{name}' is not supported by pyserve's pooling routes", name)
        unknown = set(body) - known
        if unknown:  # a log line of bounded length, however many names a body holds
            logger.warning("The following fields were present in the request but ignored: %s%s",
                           heapq.nsmallest(20, unknown),
                           f" and {len(unknown) - 20} more" if len(unknown) > 20 else "")
        fmt = field(body, "encoding_format", str, "float")
        one_of("encoding_format", fmt, ENCODING_FORMATS)
        one_of("embed_dtype", field(body, "embed_dtype", str, "float32"), tuple(EMBED_DTYPES))
        one_of("endianness", field(body, "endianness", str, "native"), ENDIANNESS)
        field(body, "user", str)  # accepted, as OpenAI's: it names the end user, nothing more
        # every input is embedded at its own length: padding to a length would change a
        # mean pool, and asking not to pad asks for nothing
        if field(body, "padding", str, "do_not_pad") not in ("do_not_pad", "longest"):
            raise APIError(400, "padding: pyserve embeds each input at its own length (only "
                           "'do_not_pad' or 'longest')", "padding")
        normalize = field(body, "normalize", bool)
        activation = field(body, "use_activation", bool)  # vLLM's newer name for the same
        if normalize is None:
            normalize = activation
        try:
            params = PoolingParams(task, normalize, field(body, "dimensions", int))
        except InvalidRequest as exc:
            raise APIError(400, exc.message, exc.param) from None
        return params, fmt

    async def _inputs(self, body: dict) -> list[tuple[str | None, list[int]]]:
        if body.get("truncation_side") is None:
            # truncate_prompt_tokens keeps an input's first tokens here: vLLM's pooling models
            # cut the end (their tokenizer's truncation_side "right"), as sentence-transformers
            # does; generation keeps the last ones
            body = {**body, "truncation_side": "right"}
        raw = body.get("input")
        if _conversations(raw):  # vLLM's chat forms given as input
            if body.get("messages") is not None:
                raise APIError(400, "give either 'input' or 'messages', not both", "messages")
            body = {**body, "messages": raw, "input": None}
        messages = body.get("messages")
        if messages is not None:
            if body.get("input") is not None:
                raise APIError(400, "give either 'input' or 'messages', not both", "messages")
            # one conversation, or (vLLM's batch form) a list of them: one prompt each
            batch = messages if messages and all(isinstance(m, list) for m in messages) else [messages]
            if len(batch) > MAX_INPUTS:
                raise APIError(400, f"'messages' holds {len(batch)} conversations; at most "
                               f"{MAX_INPUTS} may be embedded in one request", "messages")
            chat = dict(body)
            chat.setdefault("add_generation_prompt", False)  # vLLM's default for embeddings
            return [(None, await self.serving._chat_prompt({**chat, "messages": m}, None))
                    for m in batch]
        if isinstance(raw, str) or (isinstance(raw, list) and raw and _token_list(raw)):
            items = [raw]
        elif isinstance(raw, list) and raw:
            items = raw
        else:
            raise APIError(400, "'input' must be a non-empty string, a list of strings, a list of "
                           "token ids, or a list of token-id lists", "input")
        if len(items) > MAX_INPUTS:  # before any tokenizing
            raise APIError(400, f"'input' holds {len(items)} inputs; at most {MAX_INPUTS} may be "
                           "embedded in one request", "input")
        for item in items:
            if not (isinstance(item, str) or (isinstance(item, list) and _token_list(item))):
                raise APIError(400, "'input' entries must be strings or lists of token ids", "input")
        add_special = field(body, "add_special_tokens", bool, True)
        texts = [item for item in items if isinstance(item, str)]
        encode = lambda: [self.serving.tokenizer.encode(t, add_special_tokens=add_special)  # noqa: E731
                          for t in texts]
        if sum(map(len, texts)) > _OFF_LOOP_CHARS:
            encoded = iter(await asyncio.get_running_loop().run_in_executor(None, encode))
        else:
            encoded = iter(encode())
        out = [(item, next(encoded)) if isinstance(item, str) else (None, list(item))
               for item in items]
        return [self._truncated(body, text, ids) for text, ids in out]

    def _truncated(self, body: dict, text: str | None, ids: list[int]):
        cut = self.serving._truncation(body, None)  # truncate_prompt_tokens, truncation_side
        if cut is None or len(cut(ids)) == len(ids):
            return text, ids
        keep, side = len(cut(ids)), body["truncation_side"]
        if text is not None and field(body, "add_special_tokens", bool, True):
            return None, cut_keeping_specials(self.serving.tokenizer, text, ids, keep, side)
        return None, cut(ids)  # a cut text no longer matches its ids

    # -- running -------------------------------------------------------------------------------
    async def _run(self, request: Request, body: dict, params: PoolingParams, prefix: str,
                   where: Callable[[int], str] = "input[{}]".format) -> dict:
        """where: input i's place in the request (/rerank's "documents[2]"), whose head a
        refusal of that input names."""
        inputs = await self._inputs(body)
        self._check_lengths(inputs, where)
        # a dimensions past the hidden size is admission's 400, which names it: the bound on
        # the values returned must not name input for it first
        width = min(self.engine.hidden_size, params.dimensions or self.engine.hidden_size)
        rows_each = [len(ids) if params.task == "token_embed" else 1 for _, ids in inputs]
        if sum(rows_each) * width > MAX_POOLED_VALUES:
            raise APIError(400, f"the request would return {sum(rows_each) * width} values, more than "
                           f"the {MAX_POOLED_VALUES} one response may hold; send fewer or shorter "
                           "inputs", "input")
        priority = field(body, "priority", int, 0)
        max_queued = self.serving.max_queued
        if max_queued is not None and self.engine.num_waiting() + len(inputs) > max_queued:
            raise APIError(429, f"the server's queue is full ({max_queued} waiting requests); "
                           "retry later", headers=[("retry-after", "1")])
        base, client_id = self.serving._base_id(request, body)
        request_id = prefix + base
        rids = [f"{request_id}-{i}" + (f"-{uuid.uuid4().hex[:8]}" if client_id else "")
                for i in range(len(inputs))]
        try:  # a window at a time: a request sent meanwhile waits behind one window at most
            pooled = await pool_in_windows(self.engine, inputs, rids, params, priority)
        except InvalidRequest as exc:
            raise APIError(400, exc.message, exc.param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        return {"id": request_id, "pooled": pooled,
                "prompt_tokens": sum(len(ids) for _, ids in inputs),
                "longest": max(len(ids) for _, ids in inputs)}

    def _check_lengths(self, inputs: list[tuple[str | None, list[int]]],
                       where: Callable[[int], str]) -> None:
        """Admission's 400 for an input over the model's length, said here, where the input's
        place in the request is known."""
        limit = self.engine.max_model_len
        for i, (_, ids) in enumerate(inputs):
            if len(ids) > limit:
                name = where(i)
                raise APIError(400, f"{name}: this model's maximum context length is {limit} tokens, "
                               f"and {name} holds {len(ids)}; shorten it, or set truncate_prompt_tokens",
                               name.split("[", 1)[0])

    async def _response(self, rows: dict, kind: str, key: str, fmt: str,
                        encoding: tuple[str, str]) -> Response:
        """The JSON body (or vLLM's bytes), encoded off the event loop when it is large
        (thousands of vectors as floats take a second to write). encoding: (embed_dtype,
        endianness) of base64 and bytes."""
        tokens = rows["prompt_tokens"]
        values = sum(p.numel() for p in rows["pooled"])
        if fmt in ("bytes", "bytes_only"):
            rows = {**rows, "model": self.serving.model_name}
            if values < _OFF_LOOP_VALUES:
                return _bytes_response(rows, fmt, encoding)
            return await asyncio.get_running_loop().run_in_executor(
                None, _bytes_response, rows, fmt, encoding)

        def encode() -> bytes:
            data = [{"index": i, "object": kind,
                     key: pooled.tolist() if fmt == "float"
                     else base64.b64encode(_binary(pooled, *encoding)).decode("ascii")}
                    for i, pooled in enumerate(rows["pooled"])]
            return orjson.dumps({
                "id": rows["id"], "object": "list", "created": int(time.time()),
                "model": self.serving.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}})
        if values < _OFF_LOOP_VALUES:
            return Response(200, encode())
        return Response(200, await asyncio.get_running_loop().run_in_executor(None, encode))


def cut_keeping_specials(tokenizer, text: str, ids: list[int], keep: int, side: str) -> list[int]:
    """ids (text's, with the special tokens the tokenizer adds) cut to keep tokens as Hugging
    Face tokenizers truncate: the text's own tokens are cut (their end, or with side "left"
    their start), the special tokens around them stay ([CLS] ... [SEP], an appended EOS that a
    last-token pooling reads)."""
    content = tokenizer.encode(text, add_special_tokens=False)
    extra = len(ids) - len(content)
    head = next((p for p in range(max(extra, -1) + 1) if ids[p:p + len(content)] == content), None)
    room = keep - extra
    if head is None or room <= 0:  # specials not around the text, or no room beside them
        return ids[:keep] if side == "right" else ids[-keep:]
    kept = content[:room] if side == "right" else content[len(content) - room:]
    return ids[:head] + kept + ids[head + len(content):]


def _bytes_response(rows: dict, fmt: str, encoding: tuple[str, str]) -> Response:
    """vLLM's binary answer: the vectors' bytes back to back; with "bytes", a metadata header
    (JSON) says where each starts and ends, its dtype, byte order and shape, and the usage."""
    parts, items, offset = [], [], 0
    for i, pooled in enumerate(rows["pooled"]):
        data = _binary(pooled, *encoding)
        items.append({"index": i, "embed_dtype": encoding[0], "endianness": encoding[1],
                      "start": offset, "end": offset + len(data), "shape": list(pooled.shape)})
        parts.append(data)
        offset += len(data)
    headers = []
    if fmt == "bytes":
        tokens = rows["prompt_tokens"]
        headers.append(("metadata", json.dumps({
            "id": rows["id"], "created": int(time.time()), "model": rows["model"], "data": items,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})))
    return Response(200, b"".join(parts), headers, "application/octet-stream")


def _conversations(raw) -> bool:
    """input given as chat messages (a list of role objects), or a list of such lists."""
    if not isinstance(raw, list) or not raw:
        return False
    first = raw[0][0] if isinstance(raw[0], list) and raw[0] else raw[0]
    return isinstance(first, dict) and "role" in first


def _token_list(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _encoding(body: dict) -> tuple[str, str]:
    """(embed_dtype, endianness) as the request gives them (checked by _params)."""
    return body.get("embed_dtype") or "float32", body.get("endianness") or "native"


def _binary(pooled: torch.Tensor, dtype: str, endianness: str) -> bytes:
    """A vector's bytes as dtype (a name of EMBED_DTYPES) in that byte order."""
    values = pooled.to(EMBED_DTYPES[dtype]).contiguous().reshape(-1)
    raw = values.view(torch.uint8).reshape(-1, values.element_size())
    order = sys.byteorder if endianness == "native" else endianness
    if order != sys.byteorder:
        raw = raw.flip(-1)
    return raw.numpy().tobytes()
