"""POST /v1/completions and /v1/chat/completions on the async engine, streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import time
import uuid

import orjson

from pyserve.config import ServerConfig
from pyserve.engine.async_engine import AsyncEngine, EngineDeadError
from pyserve.errors import InvalidRequest
from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.openai.params import (beam_search_params, check_unsupported, field,
                                          requested_max_tokens, sampling_params)
from pyserve.server.openai import objects
from pyserve.server.openai.chat_output import ChoiceOutput
from pyserve.server.openai.fields import check_fields
from pyserve.server.openai.logprobs import echoed, shape_prompt_logprobs
from pyserve.server.openai.messages import (load_template, template_documents, template_kwargs,
                                            template_messages, tool_mode, with_allowed_tools,
                                            fit_by_dropping_turns)
from pyserve.server.openai.structured import (each_tool_constraint, forced_tool_name,
                                              structured_outputs, tool_call_constraint)
from pyserve.structured.compiler import GrammarError
from pyserve.server.openai.streaming import ChunkStream, chunk_dicts, stream_chunks, stream_failed
from pyserve.server.json_size import check_container_count
from pyserve.server.request_limits import MAX_JSON_DEPTH, MAX_PROMPTS
from pyserve.server.strict_json import json_bytes
from pyserve.server.values import brief, capped, check_nesting, one_of, token_ids
from pyserve.tokenizer.tokenizer import apply_chat_template

logger = logging.getLogger("pyserve.requests")


# Bodies this large are parsed (and their nesting checked) in a worker thread before the
# handler runs: a 30 MB body takes tens of milliseconds, every other stream's wait on the loop.
OFF_LOOP_BODY_BYTES = 256 * 1024


async def preparse_json(request: Request) -> None:
    """The router's prepare hook: a large POST body's JSON object (or its APIError) goes to
    request.json, computed off the event loop; json_object then takes it from there."""
    if request.method != "POST" or len(request.body) < OFF_LOOP_BODY_BYTES:
        return
    request.json = await asyncio.get_running_loop().run_in_executor(None, _parsed_or_error, request)


# A body this large is translated (Anthropic's messages, Responses' items: a walk over every
# block and part in Python) in a worker thread: 10,000 small blocks are tens of milliseconds.
OFF_LOOP_WALK_BYTES = 32 * 1024


async def off_loop_for_large_body(request: Request, work, *args):
    """work(*args), in a worker thread when the request's body is large enough for walking it
    to hold the event loop."""
    if len(request.body) < OFF_LOOP_WALK_BYTES:
        return work(*args)
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(work, *args))


def _parsed_or_error(request: Request):
    try:
        # a large body only (a small one cannot hold enough objects to matter): the count
        # walks what may be a quarter of a million brackets
        check_container_count(request.body)
        return _parse_json_object(request)
    except APIError as exc:
        return exc


def json_object(request: Request) -> dict:
    """A request body that must be one JSON object; else a 400."""
    if isinstance(request.json, APIError):
        raise request.json
    if request.json is not None:
        return request.json
    return _parse_json_object(request)


def _parse_json_object(request: Request) -> dict:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):  # orjson stops at 1024 levels
            raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels "
                           "deep") from None
        number, key = _not_a_json_number(exc), _key_before(exc)
        if number is not None:
            raise APIError(400, f"request body is not valid JSON: {number}"
                           + (f", in '{key}'" if key else ""), key) from None
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    # everything below may recurse over the body (templates, grammars, error messages)
    check_nesting(request.body, body, "the request body", None)
    return body


# JSON has no NaN or infinities; Python's json module (and so many clients) writes them anyway
_NON_JSON_NUMBERS = ("NaN", "Infinity", "-Infinity")
_KEY_BEFORE = re.compile(r'"((?:[^"\\]|\\.){1,64})"\s*:\s*-?\Z')


def _not_a_json_number(exc: orjson.JSONDecodeError) -> str | None:
    """What a body's NaN, Infinity or overflowing number is, said plainly; None for other errors."""
    at = exc.doc[exc.pos - (exc.doc[exc.pos - 1:exc.pos] == "-"):]
    literal = next((t for t in _NON_JSON_NUMBERS if at.startswith(t)), None)
    if literal is not None:
        return f"{literal} is not a JSON number (char {exc.pos}): send a finite number"
    if exc.msg.startswith("number is infinity"):
        return f"a number beyond a double's range (char {exc.pos}): send a finite number"
    return None


def _key_before(exc: orjson.JSONDecodeError) -> str | None:
    """The object key just before the error, when the bad value follows one ("temperature": NaN)."""
    match = _KEY_BEFORE.search(exc.doc[max(0, exc.pos - 80):exc.pos])
    return match.group(1) if match else None


def _json(obj) -> Response:
    return Response(200, json_bytes(obj))


# Texts longer than this are tokenized in a worker thread, so one huge prompt cannot stall
# the event loop for every other client (a millisecond or two of encoding at most on it; the
# tokenizer lets go of Python's lock for longer texts: tokenizer/fast.py).
_OFF_LOOP_CHARS = 4096
# A structured-output grammar that takes longer to compile is refused (a 400); its compile
# finishes in the background and is cached.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
MAX_TOOLS_PROBED = 16  # tools compiled one by one to name the bad one under "required"


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.model_name = engine.model_name
        # every --served-model-name is accepted (and listed by /v1/models); the first is reported
        self.names = engine.served_model_names
        self.tokenizer = engine.tokenizer
        self.max_queued = config.max_num_queued_requests
        self.chat_template = load_template(config.chat_template)
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            logging.getLogger("pyserve").warning(
                "the model carries no chat template: /v1/completions works, chat needs "
                "--chat-template (a file or inline Jinja)")
        self.config = config
        self.defaults = engine.generation_defaults  # the model's generation_config.json

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop_if_long(
            len(text), lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @staticmethod
    async def off_loop_if_long(length: int, work):
        """work() (tokenizing or detokenizing `length` characters or ids): on the loop when
        short, where a thread's hand-off would cost more than the work, else in a worker."""
        if length < _OFF_LOOP_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(None, work)

    # -- request parsing -----------------------------------------------------------------------
    def parse_body(self, request: Request) -> dict:
        """The JSON object of a request (400 if it is not one), its model checked (404)."""
        body = json_object(request)
        self.check_model(body.get("model"))
        return body

    def check_model(self, model) -> None:
        if model not in (None, "") and model not in self.names:  # "" means the served model, as in vLLM
            raise APIError(404, f"the model '{model}' does not exist", "model")

    def _truncation(self, body: dict, max_tokens: int | None):
        """vLLM's truncate_prompt_tokens and truncation_side: a function cutting a prompt's ids
        to the kept ones (the last k, "left", the default; the first k, "right"); -1 keeps
        what fits beside max_tokens. None when the prompt is kept whole."""
        k = field(body, "truncate_prompt_tokens", int)
        side = field(body, "truncation_side", str, "left")
        one_of("truncation_side", side, ("left", "right"))
        if k is None:
            return None
        if k < -1 or k == 0:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or positive, got {k}",
                           "truncate_prompt_tokens")
        room = self.engine.max_model_len - (max_tokens or 0)
        if k > room:  # vLLM's check and words
            raise APIError(400, f"truncate_prompt_tokens={k} cannot be greater than max_model_len "
                           f"- max_tokens = {room}. Please request a smaller truncation size.",
                           "truncate_prompt_tokens")
        keep = room if k == -1 else k
        return (lambda ids: ids[-keep:]) if side == "left" else (lambda ids: ids[:keep])

    async def _prompts(self, body: dict, max_tokens: int | None) -> list[tuple[str | None, list[int]]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompts = [prompt]  # one prompt of ids (token_ids reads every one, off the loop if long)
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise APIError(400, "'prompt' must be a non-empty string, token list, or a list of them",
                           "prompt")
        capped("prompt", prompts, MAX_PROMPTS, "prompts")  # before any is tokenized
        add_special = field(body, "add_special_tokens", bool, True)
        cut = self._truncation(body, max_tokens)
        out = []
        single = prompts[0] is prompt
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                text, ids = p, await self._encode(p, add_special)
            elif isinstance(p, list):
                where = "prompt" if single else f"prompt[{i}]"
                text, ids = None, await self.off_loop_if_long(  # a walk over every id
                    len(p), lambda p=p, where=where: list(token_ids(where, p, self.engine.vocab_size,
                                                                    "prompt")))
            else:
                raise APIError(400, "'prompt' entries must be strings or lists of token ids", "prompt")
            if cut is not None and len(cut(ids)) < len(ids):
                text, ids = None, cut(ids)  # the text no longer matches the ids
            out.append((text, ids))
        return out

    def _template_kwargs(self, body: dict) -> dict:
        """The request's chat_template_kwargs over --default-chat-template-kwargs."""
        return {**dict(self.config.default_chat_template_kwargs), **template_kwargs(body)}

    async def _chat_prompt(self, body: dict, tools: list | None, max_tokens: int | None = None,
                           drop_old_turns: bool = False) -> list[int]:
        """The conversation rendered and tokenized, always off the event loop: reading the
        messages walks every part and tool call, and a template (the model's, or a request's
        own) may loop for as long as its budget lets it (tokenizer/template_budget.py), however
        short the content. drop_old_turns (the Responses API's truncation "auto"): the fewest
        oldest exchanges are dropped for the prompt to leave max_tokens (at least one) of room
        (fit_by_dropping_turns); the last exchange is never cut."""
        kwargs = self._template_kwargs(body)
        own = field(body, "chat_template", str)
        if own is not None and not self.config.trust_request_chat_template:
            raise APIError(400, "Chat template is passed with request, but "
                           "--trust-request-chat-template is not set. Refused request with "
                           "untrusted chat template.", "chat_template")
        template = own or self.chat_template
        add_generation_prompt = field(body, "add_generation_prompt", bool, True)
        continue_final = field(body, "continue_final_message", bool, False)
        if continue_final and add_generation_prompt:
            raise APIError(400, "Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.", "continue_final_message")
        if continue_final:
            kwargs["continue_final_message"] = True
        if tools is not None:
            kwargs["tools"] = tools
        documents = template_documents(body)
        if documents is not None:
            kwargs["documents"] = documents
        add_special = field(body, "add_special_tokens", bool, False)

        def render(messages: list[dict]) -> list[int]:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt,
                                       chat_template=template, add_special_tokens=add_special,
                                       **kwargs)
        if drop_old_turns:  # room for the output asked for (at least one token)
            room = self.engine.max_model_len - max(max_tokens or 1, 1)
            whole = render
            render = lambda messages: fit_by_dropping_turns(  # noqa: E731
                messages, whole, lambda ids: len(ids) <= room)

        def prompt_ids() -> list[int]:
            cleaned = template_messages(body)  # an APIError of its own
            try:
                return render(cleaned)
            except Exception as exc:  # template errors are the client's (or the model's) problem
                raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        ids = await asyncio.get_running_loop().run_in_executor(None, prompt_ids)
        cut = self._truncation(body, max_tokens)
        return ids if cut is None else cut(ids)

    # -- generation ------------------------------------------------------------------------------
    def _start(self, prompts, params, request_id: str, priority: int, client_id: bool) -> list:
        """Admits every prompt before any runs; a refusal aborts what was admitted -> 400.
        client_id: the id's base came from the client, who may reuse it, so the engine's ids
        get a suffix of their own."""
        # A request may join the queue while it stays within --max-num-queued-requests.
        if self.max_queued is not None and self.engine.num_waiting() + len(prompts) > self.max_queued:
            raise APIError(429, f"the server's queue is full ({self.max_queued} waiting requests); "
                           "retry later", headers=[("retry-after", "1")])
        streams = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = f"{request_id}-{i}" + (f"-{uuid.uuid4().hex[:8]}" if client_id else "")
                if self.config.enable_log_requests:
                    self._log_request(rid, text, ids, params)
                streams.append((rid, self.engine.add_request(ids, params, rid, text, priority)))
        except InvalidRequest as exc:
            for rid, _ in streams:
                self.engine.discard(rid)
            raise APIError(400, exc.message, exc.param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        return streams

    def _log_request(self, rid: str, text: str | None, ids: list[int], params) -> None:
        limit = self.config.max_log_len
        logger.info("received request %s: prompt: %r, params: %s, prompt_token_ids: %s", rid,
                    text if limit is None or text is None else text[:limit], params,
                    ids if limit is None else ids[:limit])

    @staticmethod
    def _base_id(request: Request, body: dict) -> tuple[str, bool]:
        """vLLM's: the client's X-Request-Id header (checked by the server), else the body's
        request_id, else a fresh one; and whether the client chose it."""
        given = request.headers.get("x-request-id") or field(body, "request_id", str)
        return (given, True) if given else (uuid.uuid4().hex, False)

    async def completions(self, request: Request) -> Response | StreamingResponse:
        body = self.parse_body(request)
        if body.get("prompt") in (None, "", []) and body.get("prompt_embeds") in (None, []):
            raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.",
                           "prompt")  # vLLM's words, which clients match on
        stream = field(body, "stream", bool, False)
        check_fields(body, "completions")
        check_unsupported(body, stream)
        logprobs = field(body, "logprobs", int)
        echo = field(body, "echo", bool, False)
        max_tokens = requested_max_tokens(body, chat=False)
        # vLLM: echo with max_tokens 0 scores the prompt alone (one token is generated, unshown)
        echo_only = echo and max_tokens == 0
        params = sampling_params(body, logprobs, stream, chat=False, defaults=self.defaults,
                                 max_tokens=1 if echo_only else max_tokens,
                                 vocab_size=self.engine.vocab_size)
        if echo and logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)  # echoed tokens are scored
        params = beam_search_params(body, await self._constrained(body, params))
        prompts = await self._prompts(body, max_tokens)
        return await self._respond(request, body, prompts, params, stream, chat=False,
                                   echo=echo, echo_only=echo_only)

    async def chat(self, request: Request) -> Response | StreamingResponse:
        return await self.chat_result(request, self.parse_body(request), as_data=False)

    async def chat_result(self, request: Request, body: dict, as_data: bool = True,
                          fit_max_tokens: bool = False, drop_old_turns: bool = False,
                          report_cached: bool = False):
        """A chat request's answer. as_data: the response as a dict, or (stream true) an async
        iterator of chunk dicts, which other APIs (Anthropic's, Responses) translate; the
        caller must exhaust or aclose() it. Else the HTTP response. fit_max_tokens: max_tokens
        is capped at the room the prompt leaves in the model length (vLLM's Responses reads
        max_output_tokens so), where chat refuses a request that asks for more. drop_old_turns:
        a conversation too long for the model loses its oldest exchanges (_chat_prompt).
        report_cached: usage names the cached prompt tokens without --enable-prompt-tokens-
        details (vLLM's Responses reports them always)."""
        stream = field(body, "stream", bool, False)
        check_fields(body, "chat")
        check_unsupported(body, stream)
        body = with_allowed_tools(body)
        top_logprobs = field(body, "top_logprobs", int)
        if top_logprobs is not None and top_logprobs < -1:  # -1: the whole vocabulary
            raise APIError(400, "`top_logprobs` must be a positive value or -1.", "top_logprobs")
        wants_logprobs = field(body, "logprobs", bool, False)
        if top_logprobs and not wants_logprobs:
            raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           "top_logprobs")
        params = sampling_params(body, (top_logprobs or 0) if wants_logprobs else None, stream,
                                 chat=True, defaults=self.defaults, vocab_size=self.engine.vocab_size)
        mode, tools = tool_mode(body, True, self.config.enable_auto_tool_choice)
        choice = body.get("tool_choice")
        parallel = field(body, "parallel_tool_calls", bool, True)
        forced = (tool_call_constraint(tools, choice, parallel) if mode in ("required", "named")
                  else None)
        params = beam_search_params(body, await self._constrained(body, params, forced))
        requested = requested_max_tokens(body, chat=True)
        prompt = (self._tokens_in(body) if body.get("prompt_token_ids") is not None else
                  await self._chat_prompt(body, tools, requested, drop_old_turns=drop_old_turns))
        if fit_max_tokens or requested is None:  # vLLM caps a limit the client did not set
            params = self._fitted(params, len(prompt), refuse=fit_max_tokens)
        # vLLM: the response speaks as --response-role after a generation prompt, else it
        # continues the last message's role
        last = body["messages"][-1]
        role = (self.config.response_role if field(body, "add_generation_prompt", bool, True)
                else last["role"])
        # echo: the reply leads with the last message, when it is the reply's own role's
        # (a final assistant message it continues)
        echo = field(body, "echo", bool, False) and last["role"] == role
        echo_text = (template_messages({"messages": [last]})[0]["content"] or None) if echo else None
        name = forced_tool_name(choice) if mode == "named" else None
        thinking = field(self._template_kwargs(body), "enable_thinking", bool, True)
        include_reasoning = field(body, "include_reasoning", bool, True)
        output = lambda: ChoiceOutput(  # noqa: E731 (one per choice)
            mode, name, self._tool_parser(tools) if mode == "auto" else None,
            self._reasoning_parser(thinking), include_reasoning, parallel, self._reasoning_markers,
            calls_end_on_length=not as_data)
        return await self._respond(request, body, [(None, prompt)], params, stream, chat=True,
                                   role=role, output=output, as_data=as_data, chat_echo=echo_text,
                                   report_cached=report_cached)

    def _tokens_in(self, body: dict) -> list[int]:
        """A chat request's own prompt_token_ids (newer vLLM's, for a router that rendered and
        tokenized the conversation already): the prompt as given, not rendered again. The
        messages are still required and read (the response's role and echo come from them)."""
        template_messages(body)
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise APIError(400, "prompt_token_ids must be a non-empty list of token ids",
                           "prompt_token_ids")
        return token_ids("prompt_token_ids", ids, self.engine.vocab_size)

    def _fitted(self, params, prompt_tokens: int, refuse: bool = True):
        """params with max_tokens at most the room a prompt of prompt_tokens leaves (the
        model's generation_config default too: vLLM's get_max_tokens); a prompt with no room
        is the messages' fault (refuse: a 400 here, the route naming its own field for them;
        else admission's)."""
        room = self.engine.max_model_len - prompt_tokens
        if room <= 0 and not refuse:
            return params
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {self.engine.max_model_len} "
                           f"tokens. However, your prompt has {prompt_tokens} tokens. Please shorten "
                           "the prompt.", "messages")
        if getattr(params, "max_tokens", None) is not None and params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        return params

    def _tool_parser(self, tools):
        from pyserve.server.openai.tool_parsers import tool_parser

        return tool_parser(self.config.tool_call_parser, tools)

    def _reasoning_parser(self, enable_thinking: bool):
        if self.config.reasoning_parser is None:
            return None
        from pyserve.server.openai.reasoning import reasoning_parser

        return reasoning_parser(self.config.reasoning_parser, enable_thinking=enable_thinking)

    @functools.cached_property
    def _reasoning_markers(self) -> tuple[int, int] | None:
        """The reasoning parser's start and end markers as token ids, where each is one token
        of this tokenizer (what counting the reasoning's tokens needs); else None."""
        parser = self._reasoning_parser(True)
        if parser is None:
            return None
        ids = [self.tokenizer.encode(marker, add_special_tokens=False)
               for marker in (parser.start, parser.end)]
        return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None

    async def _required_refusal(self, tools: list, message: str) -> str:
        """Why tool_choice "required" cannot be enforced, naming the first tool whose own
        parameters do not compile, where one of the first MAX_TOOLS_PROBED does within one
        compile's time in all (an error path: bounded, not a search over every tool)."""
        deadline = time.monotonic() + GRAMMAR_COMPILE_TIMEOUT_S
        for name, spec in each_tool_constraint(tools[:MAX_TOOLS_PROBED]):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await self.engine.compile_grammar(spec, left)
            except GrammarError as exc:
                return (f"tool_choice \"required\" cannot be enforced: the tool {brief(name)} has "
                        f"parameters that cannot be enforced: {exc.message}")
        return f"tool_choice \"required\" cannot be enforced over these tools' parameters: {message}"

    async def _constrained(self, body: dict, params, forced=None):
        """params with the request's structured-output grammar (or a forced tool call's),
        compiled off the event loop within GRAMMAR_COMPILE_TIMEOUT_S: a grammar that cannot
        be compiled is a 400 naming the field it came from, before anything is admitted."""
        spec, source = structured_outputs(body)
        if forced is not None:
            if spec is not None:
                raise APIError(400, f"{source} cannot be combined with a forced tool call "
                               "(tool_choice \"required\" or a named function)", source)
            spec, source = forced, "tool_choice"
        if spec is None:
            return params
        try:
            await self.engine.compile_grammar(spec, GRAMMAR_COMPILE_TIMEOUT_S)
        except GrammarError as exc:
            message = exc.message
            if forced is not None:  # the grammar is the tools' parameters: say whose
                name = forced_tool_name(body.get("tool_choice"))
                if name is not None:
                    message = (f"the tool {brief(name)}, which tool_choice forces, has parameters "
                               f"that cannot be enforced: {message}")
                else:
                    message = await self._required_refusal(body.get("tools") or [], message)
            raise APIError(400, message, source) from None
        return dataclasses.replace(params, structured_outputs=spec)

    async def _respond(self, request, body, prompts, params, stream: bool, chat: bool,
                       echo: bool = False, echo_only: bool = False, role: str = "assistant",
                       output=ChoiceOutput, as_data: bool = False, chat_echo: str | None = None,
                       report_cached: bool = False):
        # everything that can refuse the request is read before any prompt is admitted
        priority = field(body, "priority", int, 0)
        include_usage = continuous = False
        if stream:
            # vLLM (and OpenAI): usage only when asked for, or always with --enable-force-include-usage
            include_usage = self.config.enable_force_include_usage
            options = field(body, "stream_options", dict)
            if options is not None:
                include_usage = field(options, "include_usage", bool, False) or include_usage
                continuous = include_usage and field(options, "continuous_usage_stats", bool, False)
        return_token_ids = field(body, "return_token_ids", bool, False)
        as_token_ids = field(body, "return_tokens_as_token_ids", bool,
                             self.config.return_tokens_as_token_ids)
        base, client_id = self._base_id(request, body)
        request_id = ("chatcmpl-" if chat else "cmpl-") + base
        streams = self._start(prompts, params, request_id, priority, client_id)
        meta = {"id": request_id, "created": int(time.time()), "model": self.model_name,
                "role": role, "cached_tokens": [0] * len(prompts), "report_cached": report_cached,
                "output": output,  # chat: () -> a choice's ChoiceOutput
                "n": params.n, "prompt_tokens": [len(ids) for _, ids in prompts], "chat": chat,
                "prompt_ids": [ids for _, ids in prompts], "echo_only": echo_only,
                "logprobs": params.logprobs, "return_token_ids": return_token_ids,
                "as_token_ids": as_token_ids, "chat_echo": chat_echo,
                # completions' echo: the prompt text leads each choice's text (vLLM: none
                # with return_token_ids, which carries the prompt's ids instead)
                "echo": [("" if return_token_ids else text if text is not None
                          else self.tokenizer.decode(ids)) for text, ids in prompts] if echo else None}
        if stream:
            if as_data:
                return ChunkStream(chunk_dicts(self, streams, meta, include_usage, continuous), meta,
                                   lambda: [self.engine.discard(rid) for rid, _ in streams])
            return StreamingResponse(200, stream_chunks(self, streams, meta, include_usage, continuous),
                                     on_error=stream_failed)
        try:
            response = await self._collect(streams, meta)
            return response if as_data else _json(response)
        finally:  # the client went away, or a bug: nothing may keep running
            for rid, _ in streams:
                self.engine.discard(rid)

    async def _collect(self, streams, meta) -> dict:
        choices, completion_tokens, prompt_logprobs = [], 0, None
        for p, (_, it) in enumerate(streams):
            final = None
            async for final in it:
                pass
            meta["cached_tokens"][p] = final.num_cached_tokens
            for c in final.outputs:
                # generated tokens, shown or not (echo with max_tokens 0 generates one, as vLLM counts)
                completion_tokens += len(c.token_ids)
                output = meta["output"]() if meta["chat"] else None
                if output is not None:  # kept for the usage (its reasoning tokens)
                    meta.setdefault("outputs", []).append(output)
                choice = objects.choice(meta, p * meta["n"] + c.index, c, True, self.tokenizer,
                                        output=output)
                if meta["echo"] is not None:
                    choice["text"], choice["logprobs"] = echoed(meta, p, c, final.prompt_logprobs,
                                                               self.tokenizer)
                if not meta["chat"] and meta["return_token_ids"]:
                    choice["prompt_token_ids"] = meta["prompt_ids"][p]
                if final.prompt_logprobs is not None:
                    shaped = shape_prompt_logprobs(final.prompt_logprobs)
                    if meta["chat"]:
                        prompt_logprobs = shaped  # vLLM: at the top level of a chat response
                    else:
                        choice["prompt_logprobs"] = shaped
                choices.append(choice)
        prompt_tokens = sum(meta["prompt_tokens"])
        return objects.response(meta, choices, self.usage(prompt_tokens, completion_tokens, meta),
                                prompt_logprobs)

    def usage(self, prompt_tokens: int, completion_tokens: int, meta: dict) -> dict:
        """A response's usage; with --enable-prompt-tokens-details, the prompt tokens the
        prefix cache served (vLLM 0.32 reports them whenever the flag is on, 0 included; over
        several prompts pyserve sums them, where vLLM reports one prompt's)."""
        reported = self.config.enable_prompt_tokens_details or meta.get("report_cached")
        cached = sum(meta["cached_tokens"]) if reported else None
        counted = [o for o in meta.get("outputs", ()) if o.markers is not None]
        reasoning = sum(o.reasoning_tokens for o in counted) if counted else None
        return objects.usage(prompt_tokens, completion_tokens, cached, reasoning)
