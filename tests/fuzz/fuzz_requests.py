"""atheris target: request JSON -> SamplingParams through the real readers of /v1/completions
and /v1/chat/completions (server/openai/serving.py OpenAIServing: params.py, fields.py,
structured.py, messages.py, the chat template on a tiny model's tokenizer).

The fuzzer's bytes become a JSON body (built to reach deep: known field names, values of
every JSON type, near-miss strings like "3", "nan", "1e400"), or are sent raw. Property: the
route either admits the request, with SamplingParams (or BeamSearchParams) whose fields have
the types and bounds the engine relies on, or raises the route's client error, an APIError
with a 4xx status. Anything else escaping is a bug (the server would answer 500).

Now and then a chat body is one of the shapes that held the event loop (issue 68): thousands
of turns, tens of thousands of content parts or tool calls (around the caps of
server/request_limits.py), or a chat_template (the server trusts request templates here)
pieced together from template bombs: huge repetitions, nested loops, doubling strings,
padding widths, big powers. Property: such a request is answered (admitted or refused) within
BOMB_S, the template budget (tokenizer/template_budget.py, its clock shortened here) included.

Only the engine is replaced, by one that stops at admission (add_request): everything that
reads the request runs as it does in the server.

    python -m tests.fuzz.fuzz_requests -runs=100000 -seed=1 CORPUS_DIR [-- --model DIR]
(tests/fuzz/test_atheris.py runs it briefly in CI.)"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import atheris
import orjson

with atheris.instrument_imports(include=["pyserve.server.openai", "pyserve.sampling_params"]):
    from pyserve.server.openai.fields import IMPLEMENTED, NO_EFFECT, REFUSED_UNLESS_DEFAULT
    from pyserve.server.openai.serving import OpenAIServing
    from pyserve.sampling_params import BeamSearchParams, SamplingParams
from pyserve.config import Config
from pyserve.server.errors import APIError
from pyserve.server.http import Request
from pyserve.tokenizer import template_budget

KEYS = sorted(IMPLEMENTED["chat"] | IMPLEMENTED["completions"] | NO_EFFECT
              | set(REFUSED_UNLESS_DEFAULT)) + [
    "role", "content", "type", "text", "tool_calls", "function", "name", "arguments",
    "parameters", "include_usage", "continuous_usage_stats", "json", "regex", "choice",
    "grammar", "json_object", "json_schema", "schema", "enable_thinking", "id"]
STRINGS = ["", "user", "assistant", "system", "tool", "text", "function", "auto", "required",
           "none", "left", "right", "json_object", "json_schema", "text", "3", "-1", "0", "true",
           "false", "nan", "inf", "-inf", "1e400", "1.5", " 7 ", "xgrammar", "a*", "{", "\x00",
           "{\"type\": \"object\"}", "hello world"]


# pieces of chat templates that cost without end, unless the template budget stops them
TEMPLATE_PIECES = ["{{ 'ab ' * N }}", "{% for i in range(N) %}", "{% endfor %}", "{{ x }}",
                   "{% set ns = namespace(s='ab') %}", "{% set ns.s = ns.s ~ ns.s %}",
                   "{% set ns.s = ns.s + ns.s %}", "{{ ns.s }}", "{{ 'x'|center(N) }}",
                   "{{ '%*s'|format(N, 'x') }}", "{{ 'x'.ljust(N) }}", "{{ 7 ** N }}",
                   "{{ [1] * N }}", "{{ range(N)|list|batch(N, 0)|list }}",
                   "{% for m in messages %}{{ m.content }}", "{{ messages|tojson(indent=N) }}",
                   "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ '{:>{}}'.format('x', N) }}"]
SIZES = ["3", "1000", "100000", "10000000", "1000000000"]
BOMB_S = 5.0  # the budget's clock (RENDER_S below) and a shape's parse and walk, on a loaded machine
RENDER_S = 0.5


class Admitted(Exception):
    def __init__(self, params):
        self.params = params


class AdmissionEngine:
    """The engine's interface to OpenAIServing, stopping at add_request."""

    def __init__(self, tokenizer, max_model_len: int = 64):
        self.model_name = "m"
        self.served_model_names = ["m"]
        self.tokenizer = tokenizer
        self.generation_defaults = {}
        self.max_model_len = max_model_len
        self.vocab_size = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 512

    async def compile_grammar(self, spec, timeout_s: float) -> None:
        return None  # xgrammar's own refusals are not this target's subject

    def num_waiting(self) -> int:
        return 0

    def add_request(self, ids, params, request_id, text=None, priority=0):
        raise Admitted(params)

    def discard(self, request_id) -> None:
        pass


def json_value(fdp, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-3, 600)
    if kind == 3:
        return fdp.ConsumeIntInRange(-2**63, 2**63 - 1)
    if kind == 4:
        value = fdp.ConsumeFloat()
        return value if math.isfinite(value) else 1e308
    if kind == 5:
        return STRINGS[fdp.ConsumeIntInRange(0, len(STRINGS) - 1)] if fdp.ConsumeBool() \
            else fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind in (6, 7):
        return [json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return json_object(fdp, depth + 1)


def json_object(fdp, depth: int = 0) -> dict:
    out = {}
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        key = KEYS[fdp.ConsumeIntInRange(0, len(KEYS) - 1)] if fdp.ConsumeIntInRange(0, 7) \
            else fdp.ConsumeUnicodeNoSurrogates(4)
        out[key] = json_value(fdp, depth)
    return out


def bomb_template(fdp) -> str:
    out = []
    for _ in range(fdp.ConsumeIntInRange(1, 6)):
        piece = TEMPLATE_PIECES[fdp.ConsumeIntInRange(0, len(TEMPLATE_PIECES) - 1)]
        out.append(piece.replace("N", SIZES[fdp.ConsumeIntInRange(0, len(SIZES) - 1)]))
    return "".join(out)


def huge_conversation(fdp) -> list[dict]:
    """Many turns of many parts or tool calls: counts around the caps (10,000)."""
    turns = fdp.ConsumeIntInRange(1, 12_000)
    parts = fdp.ConsumeIntInRange(0, 12_000 // turns + 2)
    message = {"role": "user", "content": [{"type": "text", "text": "x"}] * parts}
    if fdp.ConsumeBool():
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        message = {"role": "assistant", "content": "", "tool_calls": [call] * parts}
    return [message] * turns + [{"role": "user", "content": "hi"}]


def bomb(fdp, value: dict) -> None:
    """value made one of issue 68's loop-holding shapes."""
    if fdp.ConsumeBool():
        value["chat_template"] = bomb_template(fdp)
        value.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        value["messages"] = huge_conversation(fdp)


def check_admitted(params) -> None:
    """What the engine relies on of what it is given."""
    if isinstance(params, BeamSearchParams):
        assert isinstance(params.beam_width, int) and 1 <= params.beam_width <= 128, params
        return
    assert isinstance(params, SamplingParams), type(params)
    assert isinstance(params.n, int) and 1 <= params.n <= 128, params.n
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(params, name)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
        assert not math.isnan(value), (name, value)
    assert isinstance(params.top_k, int) and not isinstance(params.top_k, bool), params.top_k
    assert params.max_tokens is None or (isinstance(params.max_tokens, int)
                                         and params.max_tokens >= 1), params.max_tokens
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in params.stop_token_ids)
    assert all(isinstance(s, str) and s for s in params.stop_strings)
    assert all(isinstance(k, int) for k in (params.logit_bias or {})), params.logit_bias
    assert params.seed is None or isinstance(params.seed, int), params.seed


def one_input(data: bytes, serving: OpenAIServing, loop) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    chat = fdp.ConsumeBool()
    if fdp.ConsumeIntInRange(0, 15) == 0:
        body = fdp.ConsumeBytes(fdp.remaining_bytes())  # raw bytes: the JSON parse path
    else:
        value = json_object(fdp)
        if chat and fdp.ConsumeIntInRange(0, 15) == 0:
            bomb(fdp, value)
        elif chat and fdp.ConsumeIntInRange(0, 3):  # mostly a message list to get past
            value.setdefault("messages", [{"role": "user", "content": "hi"}])
        elif not chat and fdp.ConsumeIntInRange(0, 3):
            value.setdefault("prompt", "hi")
        body = orjson.dumps(value)
    route = serving.chat if chat else serving.completions
    started = time.monotonic()
    try:
        loop.run_until_complete(route(Request("POST", "/v1/chat/completions" if chat
                                              else "/v1/completions", {}, body)))
    except Admitted as admitted:
        check_admitted(admitted.params)
    except APIError as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.message)
    else:
        raise AssertionError("the fake engine admits nothing without add_request")
    assert time.monotonic() - started < BOMB_S, f"{time.monotonic() - started:.1f} s for a request"


def make_serving(model: str | None) -> OpenAIServing:
    from pyserve.tokenizer.tokenizer import load_tokenizer

    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
        from make_tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="pyserve-fuzz-")), "llama"))
    config = Config.from_flat(model=model, trust_request_chat_template=True)
    template_budget.RENDER_SECONDS = RENDER_S  # the budget's shape, not its full ten seconds
    return OpenAIServing(AdmissionEngine(load_tokenizer(Path(model))), config.server)


def main() -> None:
    logging.disable(logging.CRITICAL)  # unknown fields log a warning per input
    argv = sys.argv
    model = None
    if "--" in argv:
        ours = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
        if "--model" in ours:
            model = ours[ours.index("--model") + 1]
    serving = make_serving(model)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    atheris.Setup(argv, lambda data: one_input(data, serving, loop))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
