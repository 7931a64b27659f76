"""atheris target: request JSON -> SamplingParams through the real readers of /v1/completions
and /v1/chat/completions (server/openai/serving.py OpenAIServing: params.py, fields.py,
structured.py, messages.py, the chat template on a tiny model's tokenizer).

The fuzzer's bytes become a JSON body (built to reach deep: known field names, values of
every JSON type, near-miss strings like "3", "nan", "1e400"), or are sent raw. Property: the
route either admits the request, with SamplingParams (or BeamSearchParams) whose fields have
the types and bounds the engine relies on, or raises the route's client error, an APIError
with a 4xx status. Anything else escaping is a bug (the server would answer 500).

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

KEYS = sorted(IMPLEMENTED["chat"] | IMPLEMENTED["completions"] | NO_EFFECT
              | set(REFUSED_UNLESS_DEFAULT)) + [
    "role", "content", "type", "text", "tool_calls", "function", "name", "arguments",
    "parameters", "include_usage", "continuous_usage_stats", "json", "regex", "choice",
    "grammar", "json_object", "json_schema", "schema", "enable_thinking", "id"]
STRINGS = ["", "user", "assistant", "system", "tool", "text", "function", "auto", "required",
           "none", "left", "right", "json_object", "json_schema", "text", "3", "-1", "0", "true",
           "false", "nan", "inf", "-inf", "1e400", "1.5", " 7 ", "xgrammar", "a*", "{", "\x00",
           "{\"type\": \"object\"}", "hello world"]


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
        if chat and fdp.ConsumeIntInRange(0, 3):  # mostly a message list to get past
            value.setdefault("messages", [{"role": "user", "content": "hi"}])
        elif not chat and fdp.ConsumeIntInRange(0, 3):
            value.setdefault("prompt", "hi")
        body = orjson.dumps(value)
    route = serving.chat if chat else serving.completions
    try:
        loop.run_until_complete(route(Request("POST", "/v1/chat/completions" if chat
                                              else "/v1/completions", {}, body)))
    except Admitted as admitted:
        check_admitted(admitted.params)
    except APIError as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.message)
    else:
        raise AssertionError("the fake engine admits nothing without add_request")


def make_serving(model: str | None) -> OpenAIServing:
    from pyserve.tokenizer.tokenizer import load_tokenizer

    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
        from make_tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="pyserve-fuzz-")), "llama"))
    config = Config.from_flat(model=model)
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
