"""Streaming request functions for OpenAI-compatible servers, timed as `vllm bench serve` times
them, so that our figures and vLLM's client's figures for the same server agree:

- every request streams (`stream: true`) and asks for a final usage chunk
  (`stream_options: {include_usage: true}`);
- TTFT is the time from sending the request to the first SSE event that carries a choice
  (for chat that is the role chunk, which servers send with the first token); each later
  such event adds one inter-token latency (ITL): the gap since the previous one;
- the request's latency ends at its last choice event, not at `[DONE]`, so the trailing usage
  chunk adds nothing;
- `output_tokens` and `prompt_len` are taken from the server's usage chunk when it sends
  one (vLLM 0.32's client does so for both backends); metrics.py counts the output tokens by
  re-encoding the generated text only when a server sends no usage. Not vLLM's behaviour: a
  usage that comes in the same event as a choice (llama.cpp's llama-server puts it in its last
  chunk, beside the finish reason) is read too; vLLM's client skips it and re-encodes the
  text, which undercounts (the re-encoded text merges tokens: 79 for 128 generated, seen).

A request fails when the server answers other than 200, sends no choice at all, sends an
error event mid-stream, or the connection breaks; `error` then says what happened.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # sampling parameters, --extra-body
    headers: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    """One request's record (vLLM's RequestFuncOutput); times in seconds."""
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0  # from the server's usage chunk; 0 when it sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    error: str = ""
    resends: int = 0  # sent again after a kept-alive connection closed under it (_post)


class SSEDecoder:
    """Bytes off the wire -> the `data:` payloads of complete server-sent events."""

    def __init__(self):
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._text.decode(chunk).replace("\r\n", "\n")
        *events, self._buffer = self._buffer.split("\n\n")
        payloads = []
        for event in events:
            # lines starting with ':' are comments (keep-alive pings) and carry no data
            data = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
            if data:
                payloads.append("\n".join(data))
        return payloads


def _completion_text(choice: dict) -> str:
    return choice.get("text") or ""


def _chat_text(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or ""


# A server may close a connection as the client sends on it (llama-server's HTTP library
# does, kept-alive ones above all): a request that provably did not reach it goes again on
# another connection, as browsers resend, and is counted in the report (`resends`): one whose
# body could not be written, on any connection, or one on a connection taken from the pool
# that closed before any response. Any other failure is the server's.
STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
RESENDS = 2


def never_arrived(exc: Exception, reused: bool) -> bool:
    """Whether a request that failed with exc before any response may be sent again."""
    if isinstance(exc, aiohttp.ClientConnectorError):  # no connection was made
        return True
    if isinstance(exc, aiohttp.ClientOSError) and "Can not write request body" in str(exc):
        return True
    return reused and isinstance(exc, STALE_CONNECTION)


def connection_reuse_trace() -> aiohttp.TraceConfig:
    """Marks the request's trace context {"reused": True} when it goes on a pooled connection
    (pass it to the session's trace_configs)."""
    async def reused(session, context, params):
        if isinstance(context.trace_request_ctx, dict):
            context.trace_request_ctx["reused"] = True

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(reused)
    return trace


async def _post(session: aiohttp.ClientSession, inp: RequestInput, payload: dict, result: RequestResult):
    for resend in range(RESENDS + 1):
        attempt = {"reused": False}
        try:
            return await session.post(inp.api_url, json=payload, headers=inp.headers,
                                      trace_request_ctx=attempt)
        except STALE_CONNECTION as exc:
            if resend == RESENDS or not never_arrived(exc, attempt["reused"]):
                raise
            result.resends += 1


async def _stream(session: aiohttp.ClientSession, inp: RequestInput, payload: dict,
                  text_of: Callable[[dict], str]) -> RequestResult:
    result = RequestResult(prompt_len=inp.prompt_len)
    start = last = time.perf_counter()
    result.start_time = start
    pieces: list[str] = []
    try:
        async with await _post(session, inp, payload, result) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                result.error = f"HTTP {response.status} {response.reason}: {body}"
                return result
            decoder = SSEDecoder()
            async for chunk in response.content.iter_any():
                for data in decoder.feed(chunk):
                    if data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if event.get("error"):
                        result.error = f"error event mid-stream: {json.dumps(event['error'])[:300]}"
                        return result
                    if choices := event.get("choices"):
                        now = time.perf_counter()
                        if pieces:
                            result.itl.append(now - last)
                        else:
                            result.ttft = now - start
                        last = now
                        pieces.append(text_of(choices[0]))
                    if usage := event.get("usage"):
                        result.output_tokens = usage.get("completion_tokens") or 0
                        result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.generated_text = "".join(pieces)
    result.latency = last - start
    result.success = bool(pieces)
    if not pieces:
        result.error = "the stream ended without a single choice (no token to time)"
    return result


def _common(payload: dict, inp: RequestInput) -> dict:
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.extra_body)
    return payload


async def request_completions(inp: RequestInput, session: aiohttp.ClientSession) -> RequestResult:
    payload = _common({"model": inp.model, "prompt": inp.prompt, "repetition_penalty": 1.0,
                       "max_tokens": inp.output_len, "stream": True,
                       "stream_options": {"include_usage": True}}, inp)
    return await _stream(session, inp, payload, _completion_text)


async def request_chat(inp: RequestInput, session: aiohttp.ClientSession) -> RequestResult:
    payload = _common({"model": inp.model, "messages": [{"role": "user", "content": inp.prompt}],
                       "max_completion_tokens": inp.output_len, "stream": True,
                       "stream_options": {"include_usage": True}}, inp)
    return await _stream(session, inp, payload, _chat_text)


RequestFunc = Callable[[RequestInput, aiohttp.ClientSession], Awaitable[RequestResult]]

# --backend -> request function; the endpoint path must match (see serve.py)
REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": request_completions,
    "vllm": request_completions,
    "openai-chat": request_chat,
}
