"""POST /v1/completions and /v1/chat/completions on the async engine, streamed or not."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import orjson

from pathlib import Path

from pyserve.config import ServerConfig
from pyserve.engine.async_engine import AsyncEngine, EngineDeadError
from pyserve.server.errors import APIError, error_body
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.openai.params import field, sampling_params
from pyserve.tokenizer.tokenizer import apply_chat_template


def _json(obj) -> Response:
    return Response(200, orjson.dumps(obj))


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# Texts longer than this are tokenized in a worker thread, so one huge prompt cannot stall
# the event loop for every other client.
_OFF_LOOP_CHARS = 20_000


def _load_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, config: ServerConfig):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.core.tokenizer
        self.max_queued = config.max_num_queued_requests
        self.chat_template = _load_template(config.chat_template)

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _OFF_LOOP_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- request parsing -----------------------------------------------------------------------
    def _body(self, request: Request) -> dict:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist", "model")
        return body

    async def _prompts(self, body: dict) -> list[tuple[str | None, list[int]]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise APIError(400, "'prompt' must be a non-empty string, token list, or a list of them",
                           "prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, await self._encode(p)))
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append((None, list(p)))
            else:
                raise APIError(400, "'prompt' entries must be strings or lists of token ids", "prompt")
        return out

    async def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", "messages")
        cleaned = []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise APIError(400, "each message needs a role of system, user or assistant", "messages")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise APIError(400, "only text content parts are supported", "messages")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise APIError(400, "message content must be a string or text parts", "messages")
            cleaned.append({"role": "system" if m["role"] == "developer" else m["role"],
                            "content": content})
        template = field(body, "chat_template", (str,)) or self.chat_template
        kwargs = field(body, "chat_template_kwargs", (dict,), {})
        add_generation_prompt = field(body, "add_generation_prompt", (bool,), True)

        def render() -> list[int]:
            return apply_chat_template(self.tokenizer, cleaned, add_generation_prompt,
                                       chat_template=template, **kwargs)
        try:
            if sum(len(m["content"]) for m in cleaned) < _OFF_LOOP_CHARS:
                return render()
            return await asyncio.get_running_loop().run_in_executor(None, render)
        except Exception as exc:  # template errors are the client's (or the model's) problem
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None

    # -- generation ------------------------------------------------------------------------------
    def _start(self, prompts, params, request_id: str, priority: int) -> list:
        """Admits every prompt before any runs; a refusal aborts what was admitted -> 400."""
        # A request may join the queue while it stays within --max-num-queued-requests.
        if self.max_queued is not None and self.engine.num_waiting() + len(prompts) > self.max_queued:
            raise APIError(429, f"the server's queue is full ({self.max_queued} waiting requests); "
                           "retry later", headers=[("retry-after", "1")])
        streams = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = f"{request_id}-{i}"
                streams.append((rid, self.engine.add_request(ids, params, rid, text, priority)))
        except ValueError as exc:
            for rid, _ in streams:
                self.engine.abort(rid)
            raise APIError(400, str(exc), _param_of(str(exc))) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        return streams

    async def completions(self, request: Request) -> Response | StreamingResponse:
        body = self._body(request)
        stream = field(body, "stream", (bool,), False)
        params = sampling_params(body, field(body, "logprobs", (int,)), stream)
        prompts = await self._prompts(body)
        return await self._respond(body, prompts, params, stream, chat=False)

    async def chat(self, request: Request) -> Response | StreamingResponse:
        body = self._body(request)
        stream = field(body, "stream", (bool,), False)
        logprobs = field(body, "top_logprobs", (int,), 0) if field(body, "logprobs", (bool,)) else None
        params = sampling_params(body, logprobs, stream)
        return await self._respond(body, [(None, await self._chat_prompt(body))], params, stream,
                                   chat=True)

    async def _respond(self, body, prompts, params, stream: bool, chat: bool):
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        streams = self._start(prompts, params, request_id, field(body, "priority", (int,), 0))
        echo = not chat and field(body, "echo", (bool,), False)
        meta = {"id": request_id, "created": int(time.time()), "model": self.model_name,
                "n": params.n, "prompt_tokens": [len(ids) for _, ids in prompts], "chat": chat,
                # completions' echo: the prompt text leads each choice's text
                "echo": [text if text is not None else self.tokenizer.decode(ids)
                         for text, ids in prompts] if echo else None}
        if stream:
            options = field(body, "stream_options", (dict,), {})
            return StreamingResponse(200, self._stream(
                streams, meta, bool(options.get("include_usage")),
                bool(options.get("continuous_usage_stats"))))
        try:
            return await self._collect(streams, meta)
        finally:  # the client went away, or a bug: nothing may keep running
            for rid, _ in streams:
                self.engine.abort(rid)

    async def _collect(self, streams, meta) -> Response:
        choices, completion_tokens = [], 0
        for p, (_, it) in enumerate(streams):
            final = None
            async for final in it:
                pass
            for c in final.outputs:
                completion_tokens += len(c.token_ids)
                choice = self._choice(meta, p * meta["n"] + c.index, c, final=True)
                if meta["echo"] is not None:
                    choice["text"] = meta["echo"][p] + choice["text"]
                if final.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(final.prompt_logprobs, self.tokenizer)
                choices.append(choice)
        prompt_tokens = sum(meta["prompt_tokens"])
        return _json({"id": meta["id"], "object": "chat.completion" if meta["chat"] else "text_completion",
                      "created": meta["created"], "model": meta["model"], "choices": choices,
                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens}})

    async def _stream(self, streams, meta, include_usage: bool,
                      continuous_usage: bool) -> AsyncIterator[bytes]:
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
        completion_tokens, open_streams, started = 0, len(tasks), set()
        try:
            while open_streams:
                p, out = await queue.get()
                if out is None:
                    open_streams -= 1
                    continue
                if isinstance(out, Exception):
                    yield b"data: " + error_body(500, f"generation failed: {out}") + b"\n\n"
                    break
                for c in out.outputs:
                    index = p * meta["n"] + c.index
                    completion_tokens += len(c.token_ids)
                    if meta["chat"] and index not in started:
                        started.add(index)
                        yield _sse({**head, "choices": [{"index": index, "logprobs": None, "finish_reason": None,
                                                         "delta": {"role": "assistant", "content": ""}}]})
                    choice = self._choice(meta, index, c, final=False)
                    if meta["echo"] is not None and index not in started:
                        started.add(index)
                        choice["text"] = meta["echo"][p] + choice["text"]
                    chunk = {**head, "choices": [choice]}
                    if include_usage and continuous_usage:
                        chunk["usage"] = _usage(meta["prompt_tokens"][p], completion_tokens)
                    yield _sse(chunk)
            if include_usage:
                prompt_tokens = sum(meta["prompt_tokens"])
                yield _sse({**head, "choices": [], "usage": {
                    "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}})
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for rid, _ in streams:
                self.engine.abort(rid)

    async def tokenize(self, request: Request) -> Response:
        body = self._body(request)
        if "messages" in body:
            tokens = await self._chat_prompt(body)
        else:
            prompt = field(body, "prompt", (str,))
            if prompt is None:
                raise APIError(400, "'prompt' (a string) or 'messages' is required", "prompt")
            add_special = field(body, "add_special_tokens", (bool,), True)
            tokens = await self._encode(prompt, add_special)
        return _json({"count": len(tokens), "max_model_len": self.engine.core.max_model_len,
                      "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        body = self._body(request)
        tokens = body.get("tokens")
        vocab = self.engine.core.arch.vocab_size
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        return _json({"prompt": self.tokenizer.decode(tokens)})

    def _choice(self, meta, index: int, c, final: bool) -> dict:
        choice = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                  "logprobs": self._logprobs(c, meta["chat"])}
        if meta["chat"]:
            key = "message" if final else "delta"
            choice[key] = {"role": "assistant", "content": c.text} if final else {"content": c.text}
        else:
            choice["text"] = c.text
        return choice

    def _logprobs(self, c, chat: bool):
        if c.logprobs is None:
            return None
        if chat:
            content = []
            for token, position in zip(c.token_ids, c.logprobs):
                top = [{"token": lp.decoded_token, "logprob": lp.logprob,
                        "bytes": list(lp.decoded_token.encode())} for lp in list(position.values())[1:]]
                chosen = position[token]
                content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                                "bytes": list(chosen.decoded_token.encode()), "top_logprobs": top})
            return {"content": content}
        return {"tokens": [p[t].decoded_token for t, p in zip(c.token_ids, c.logprobs)],
                "token_logprobs": [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)],
                "top_logprobs": [{lp.decoded_token: lp.logprob for lp in p.values()} for p in c.logprobs],
                "text_offset": []}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompt_logprobs(positions, tokenizer) -> list:
    """vLLM's shape: per prompt position, None or {token id: {logprob, rank, decoded_token}}."""
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": tokenizer.decode([t])}
                                    for t, lp in p.items()} for p in positions]


def _param_of(message: str) -> str | None:
    if "max_tokens" in message or "maximum context length" in message:
        return "max_tokens"
    for name in ("logprobs", "prompt_logprobs", "prompt"):
        if message.startswith(name) or f" {name} " in message:
            return name
    return None
