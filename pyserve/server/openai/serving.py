"""POST /v1/completions and /v1/chat/completions on the async engine, streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator

import orjson

from pathlib import Path

from pyserve.config import ServerConfig
from pyserve.engine.async_engine import AsyncEngine, EngineDeadError
from pyserve.server.errors import APIError, error_body
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.openai.params import (check_unsupported, field, requested_max_tokens,
                                          sampling_params)
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


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, config: ServerConfig):
        self.engine = engine
        self.model_name = model_name
        # every --served-model-name is accepted (and listed by /v1/models); the first is reported
        self.names = engine.core.config.model.served_model_name or (model_name,)
        self.tokenizer = engine.core.tokenizer
        self.max_queued = config.max_num_queued_requests
        self.chat_template = _load_template(config.chat_template)
        self.defaults = engine.core.generation_defaults  # the model's generation_config.json

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
        if model not in (None, "") and model not in self.names:  # "" means the served model, as in vLLM
            raise APIError(404, f"the model '{model}' does not exist", "model")
        return body

    def _truncation(self, body: dict) -> int | None:
        """vLLM's truncate_prompt_tokens: how many last prompt tokens to keep (-1: the model
        length); None keeps them all."""
        k = field(body, "truncate_prompt_tokens", int)
        if k is None:
            return None
        if k < -1 or k == 0:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or positive, got {k}",
                           "truncate_prompt_tokens")
        return self.engine.core.max_model_len if k == -1 else k

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
        add_special = field(body, "add_special_tokens", bool, True)
        keep = self._truncation(body)
        out = []
        for p in prompts:
            if isinstance(p, str):
                text, ids = p, await self._encode(p, add_special)
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                text, ids = None, list(p)
            else:
                raise APIError(400, "'prompt' entries must be strings or lists of token ids", "prompt")
            if keep is not None and len(ids) > keep:
                text, ids = None, ids[-keep:]  # the text no longer matches the ids
            out.append((text, ids))
        return out

    def _messages(self, body: dict) -> list[dict]:
        """The conversation as plain data for the template: text parts joined with newlines (as
        vLLM joins them), tool calls and tool results passed through."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", "messages")
        cleaned = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise APIError(400, f"messages[{i}] needs a role, one of {', '.join(_ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}]: only text content parts "
                                   "({\"type\": \"text\", \"text\": ...}) are supported", "messages")
                content = "\n".join(p["text"] for p in content)
            if content is None:
                content = ""  # e.g. an assistant turn that only calls tools (vLLM: no parts)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}]: content must be a string or a list of text parts",
                               "messages")
            message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    message[key] = m[key]
            if m.get("tool_calls"):
                message["tool_calls"] = _template_tool_calls(m["tool_calls"])
            cleaned.append(message)
        return cleaned

    def _tools(self, body: dict, generating: bool) -> list | None:
        """vLLM's rules without a tool-call parser: tools reach the template only with
        tool_choice "none"; "auto" (the default when tools are given), "required" and a named
        tool need a parser or guided decoding, which pyserve does not have. /tokenize
        (generating False) renders the tools whatever tool_choice says, as vLLM's does."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "'tools' must be a list", "tools")
        if not generating:
            return tools or None
        if not tools:
            if choice not in (None, "none"):
                raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
            return None
        if choice is None or choice == "auto":
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set, which this server does not support; "
                           'send tool_choice "none" to show the tools to the model', "tool_choice")
        if choice != "none":
            raise APIError(400, "tool_choice \"required\" or a named tool needs guided decoding, "
                           "which this server does not support", "tool_choice")
        return tools

    async def _chat_prompt(self, body: dict, generating: bool = True) -> list[int]:
        cleaned = self._messages(body)
        template = field(body, "chat_template", str) or self.chat_template
        kwargs = dict(field(body, "chat_template_kwargs", dict, {}))
        add_generation_prompt = field(body, "add_generation_prompt", bool, True)
        continue_final = field(body, "continue_final_message", bool, False)
        if continue_final and add_generation_prompt:
            raise APIError(400, "Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.", "continue_final_message")
        if continue_final:
            kwargs["continue_final_message"] = True
        tools = self._tools(body, generating)
        if tools is not None:
            kwargs["tools"] = tools
        if body.get("documents") is not None:
            kwargs["documents"] = body["documents"]
        add_special = field(body, "add_special_tokens", bool, False)

        def render() -> list[int]:
            return apply_chat_template(self.tokenizer, cleaned, add_generation_prompt,
                                       chat_template=template, add_special_tokens=add_special,
                                       **kwargs)
        try:
            if sum(len(m["content"]) for m in cleaned) < _OFF_LOOP_CHARS:
                ids = render()
            else:
                ids = await asyncio.get_running_loop().run_in_executor(None, render)
        except Exception as exc:  # template errors are the client's (or the model's) problem
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        keep = self._truncation(body)
        return ids if keep is None else ids[-keep:]

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
        except (ValueError, TypeError, OverflowError) as exc:
            for rid, _ in streams:
                self.engine.discard(rid)
            raise APIError(400, str(exc), _param_of(str(exc))) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        return streams

    async def completions(self, request: Request) -> Response | StreamingResponse:
        body = self._body(request)
        stream = field(body, "stream", bool, False)
        check_unsupported(body, stream)
        logprobs = field(body, "logprobs", int)
        echo = field(body, "echo", bool, False)
        max_tokens = requested_max_tokens(body, chat=False)
        # vLLM: echo with max_tokens 0 scores the prompt alone (one token is generated, unshown)
        echo_only = echo and max_tokens == 0
        params = sampling_params(body, logprobs, stream, chat=False, defaults=self.defaults,
                                 max_tokens=1 if echo_only else max_tokens)
        if echo and logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)  # echoed tokens are scored
        prompts = await self._prompts(body)
        return await self._respond(body, prompts, params, stream, chat=False,
                                   echo=echo, echo_only=echo_only)

    async def chat(self, request: Request) -> Response | StreamingResponse:
        body = self._body(request)
        stream = field(body, "stream", bool, False)
        check_unsupported(body, stream)
        top_logprobs = field(body, "top_logprobs", int)
        if top_logprobs is not None and top_logprobs < 0:
            raise APIError(400, f"top_logprobs must be non-negative, got {top_logprobs}", "top_logprobs")
        wants_logprobs = field(body, "logprobs", bool, False)
        if top_logprobs and not wants_logprobs:
            raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           "top_logprobs")
        params = sampling_params(body, (top_logprobs or 0) if wants_logprobs else None, stream,
                                 chat=True, defaults=self.defaults)
        return await self._respond(body, [(None, await self._chat_prompt(body))], params, stream,
                                   chat=True)

    async def _respond(self, body, prompts, params, stream: bool, chat: bool, echo: bool = False,
                       echo_only: bool = False):
        # everything that can refuse the request is read before any prompt is admitted
        priority = field(body, "priority", int, 0)
        include_usage = continuous = False
        if stream:
            options = field(body, "stream_options", dict)
            if options is not None:  # vLLM (and OpenAI): usage only when asked for
                include_usage = field(options, "include_usage", bool, False)
                continuous = include_usage and field(options, "continuous_usage_stats", bool, False)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        streams = self._start(prompts, params, request_id, priority)
        meta = {"id": request_id, "created": int(time.time()), "model": self.model_name,
                "n": params.n, "prompt_tokens": [len(ids) for _, ids in prompts], "chat": chat,
                "prompt_ids": [ids for _, ids in prompts], "echo_only": echo_only,
                "logprobs": params.logprobs,
                # completions' echo: the prompt text leads each choice's text
                "echo": [text if text is not None else self.tokenizer.decode(ids)
                         for text, ids in prompts] if echo else None}
        if stream:
            return StreamingResponse(200, self._stream(streams, meta, include_usage, continuous))
        try:
            return await self._collect(streams, meta)
        finally:  # the client went away, or a bug: nothing may keep running
            for rid, _ in streams:
                self.engine.discard(rid)

    def _echoed(self, meta, p: int, c, prompt_logprobs) -> tuple[str, dict | None]:
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
        return text, _completion_logprobs(token_ids, positions, self.tokenizer, 0)

    async def _collect(self, streams, meta) -> Response:
        choices, completion_tokens, prompt_logprobs = [], 0, None
        for p, (_, it) in enumerate(streams):
            final = None
            async for final in it:
                pass
            for c in final.outputs:
                # generated tokens, shown or not (echo with max_tokens 0 generates one, as vLLM counts)
                completion_tokens += len(c.token_ids)
                choice = self._choice(meta, p * meta["n"] + c.index, c, final=True)
                if meta["echo"] is not None:
                    choice["text"], choice["logprobs"] = self._echoed(meta, p, c, final.prompt_logprobs)
                if final.prompt_logprobs is not None:
                    shaped = _prompt_logprobs(final.prompt_logprobs, self.tokenizer)
                    if meta["chat"]:
                        prompt_logprobs = shaped  # vLLM: at the top level of a chat response
                    else:
                        choice["prompt_logprobs"] = shaped
                choices.append(choice)
        prompt_tokens = sum(meta["prompt_tokens"])
        response = {"id": meta["id"], "object": "chat.completion" if meta["chat"] else "text_completion",
                    "created": meta["created"], "model": meta["model"], "choices": choices,
                    "usage": _usage(prompt_tokens, completion_tokens)}
        if meta["chat"] and prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs
        return _json(response)

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
        open_streams, started = len(tasks), set()
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
                    yield b"data: " + error_body(500, f"generation failed: {out}") + b"\n\n"
                    break
                if out.prompt_logprobs is not None:
                    prompt_logprobs.setdefault(p, out.prompt_logprobs)
                for c in out.outputs:
                    index = p * meta["n"] + c.index
                    prompt_tokens = meta["prompt_tokens"][p]
                    if meta["chat"] and index not in started:
                        started.add(index)
                        role = {**head, "choices": [{"index": index, "logprobs": None, "finish_reason": None,
                                                     "delta": {"role": "assistant", "content": ""}}]}
                        if continuous_usage:
                            role["usage"] = _usage(prompt_tokens, 0)
                        yield _sse(role)
                    choice = self._choice(meta, index, c, final=False)
                    if meta["echo"] is not None and index not in started:
                        started.add(index)
                        choice["text"], choice["logprobs"] = self._echoed(
                            meta, p, c, prompt_logprobs.get(p))
                    elif meta["echo_only"]:
                        choice["text"], choice["logprobs"] = "", None
                    elif not meta["chat"] and c.logprobs is not None:
                        choice["logprobs"] = _completion_logprobs(
                            c.token_ids, c.logprobs, self.tokenizer, text_offsets.get(index, 0))
                    lp = choice["logprobs"] if not meta["chat"] else None
                    if lp and lp["tokens"]:  # offsets follow the tokens, not the text held back for stop strings
                        text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    generated[index] = generated.get(index, 0) + len(c.token_ids)
                    chunk = {**head, "choices": [choice]}
                    if continuous_usage:
                        chunk["usage"] = _usage(prompt_tokens, generated[index])
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(
                    sum(meta["prompt_tokens"]), sum(generated.values()))})
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for rid, _ in streams:
                self.engine.discard(rid)

    async def tokenize(self, request: Request) -> Response:
        body = self._body(request)
        if "messages" in body:
            tokens = await self._chat_prompt(body, generating=False)
        else:
            prompt = field(body, "prompt", (str,))
            if prompt is None:
                raise APIError(400, "'prompt' (a string) or 'messages' is required", "prompt")
            add_special = field(body, "add_special_tokens", (bool,), True)
            tokens = await self._encode(prompt, add_special)
        strs = ([self.tokenizer.convert_ids_to_tokens(t) for t in tokens]
                if field(body, "return_token_strs", bool, False) else None)
        return _json({"count": len(tokens), "max_model_len": self.engine.core.max_model_len,
                      "tokens": tokens, "token_strs": strs})

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
                  "logprobs": self._logprobs(c, meta["chat"], meta["logprobs"] or 0)}
        if meta["chat"]:
            key = "message" if final else "delta"
            # a whole message lists its tool calls, none here, as vLLM's does ([] rather than
            # absent, which clients read as None)
            choice[key] = ({"role": "assistant", "content": c.text, "tool_calls": []} if final
                           else {"content": c.text})
        else:
            choice["text"] = c.text
        return choice

    def _logprobs(self, c, chat: bool, k: int):
        if c.logprobs is None:
            return None
        if not chat:
            return _completion_logprobs(c.token_ids, c.logprobs, self.tokenizer, 0)
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


def _template_tool_calls(calls) -> list:
    """Tool calls as chat templates expect them (transformers' convention, which vLLM
    follows): each function's `arguments` a dict, parsed from OpenAI's JSON string ({} if it
    is not a JSON object)."""
    if not isinstance(calls, list):
        raise APIError(400, "'tool_calls' must be a list", "messages")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise APIError(400, "each tool call must be an object", "messages")
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = orjson.loads(function["arguments"])
            except orjson.JSONDecodeError:
                arguments = {}
            call = {**call, "function": {**function,
                                         "arguments": arguments if isinstance(arguments, dict) else {}}}
        out.append(call)
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_logprobs(token_ids, positions, tokenizer, text_offset: int) -> dict:
    """The completions logprobs object; positions[i] is None where nothing is scored (the first
    echoed prompt token). text_offset: characters of this choice's text before these tokens."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, position in zip(token_ids, positions):
        if position is None:
            text = tokenizer.decode([token])
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            for t, lp in position.items():
                if lp.decoded_token is None:
                    lp.decoded_token = tokenizer.decode([t])
            text = position[token].decoded_token
            token_logprobs.append(position[token].logprob)
            top_logprobs.append({lp.decoded_token: lp.logprob for lp in position.values()})
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _prompt_logprobs(positions, tokenizer) -> list:
    """vLLM's shape: per prompt position, None or {token id: {logprob, rank, decoded_token}}."""
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": tokenizer.decode([t])}
                                    for t, lp in p.items()} for p in positions]


def _param_of(message: str) -> str | None:
    if "max_tokens" in message or "maximum context length" in message:
        return "max_tokens"
    for name in ("logprobs", "prompt_logprobs", "prompt", "priority", "logit_bias", "seed"):
        if message.startswith(name) or f" {name} " in message:
            return name
    return None
