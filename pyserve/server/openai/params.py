"""OpenAI request fields (plus vLLM's extras) -> SamplingParams, with 400s naming the field.

Types are read as vLLM's pydantic models read them in lax mode: an integral float or a string
of digits is an int, "true"/"false" is a bool, and ints are floats; anything else is a 400."""

from __future__ import annotations

import re
from typing import Any

from pyserve.errors import InvalidRequest
from pyserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pyserve.server.errors import APIError
from pyserve.server.openai.structured import structured_outputs

_INT64 = (-2**63, 2**63 - 1)
_INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")
_TRUE, _FALSE = ("true", "t", "yes", "y", "on", "1"), ("false", "f", "no", "n", "off", "0")

# SamplingParams fields a request may set, with their JSON types
_FIELDS = {"n": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
           "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
           "seed": int, "stop": (str, list), "stop_token_ids": list, "ignore_eos": bool,
           "min_tokens": int, "logit_bias": dict, "skip_special_tokens": bool,
           "include_stop_str_in_output": bool, "spaces_between_special_tokens": bool,
           "prompt_logprobs": int}

# Fields vLLM answers with a different output that pyserve does not implement: refused, never
# silently ignored. (Structured outputs are read by server/openai/structured.py.)
_UNIMPLEMENTED = ("allowed_token_ids", "bad_words")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, float) and abs(value) >= 2**63:
        # the JSON parser reads an integer beyond 64 bits as a float (-2**63 - 1 rounds to
        # -2**63): an integer's range cannot be trusted through it
        raise APIError(400, f"'{name}' is out of the 64-bit integer range", name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and _INT_TEXT.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {value!r}", name)
    if not _INT64[0] <= value <= _INT64[1]:
        raise APIError(400, f"'{name}' is out of the 64-bit integer range", name)
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number, got {value!r}", name)
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {value!r}", name)
    return value


def field(body: dict, name: str, kinds, default: Any = None) -> Any:
    """body[name] read as kinds (a type or a tuple of types); absent or null gives default."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if kinds == (int,):
        return _as_int(name, value)
    if kinds == (float,):
        return _as_float(name, value)
    if kinds == (bool,):
        return _as_bool(name, value)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise APIError(400, f"'{name}' has the wrong type", name)
    return value


# Caps on list-like fields, so one request cannot make the server do unbounded work per token.
MAX_N = 128
MAX_STOP = 64


def _check_caps(values: dict) -> None:
    n = values.get("n")
    if n is not None and n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", "n")
    for name in ("stop", "stop_token_ids"):
        value = values.get(name)
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise APIError(400, f"{name} may hold at most {MAX_STOP} entries, got {len(value)}", name)
    if values.get("stop_token_ids"):
        values["stop_token_ids"] = [_as_int("stop_token_ids", t) for t in values["stop_token_ids"]]


def _logit_bias(bias: dict) -> dict[int, float]:
    """vLLM's reading: keys are token ids (JSON keys are strings), values are clamped to
    OpenAI's [-100, 100]; a 400 names every key that is not a token id."""
    bad = [k for k in bias if not _INT_TEXT.fullmatch(str(k))]
    if bad:
        raise APIError(400, "logit_bias keys must be token ids (integers); not token ids: "
                       + ", ".join(repr(k) for k in bad), "logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            if isinstance(v, bool):
                raise ValueError
            value = float(v)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias for token {int(k)} must be a number, got {v!r}",
                           "logit_bias") from None
        out[int(k)] = min(100.0, max(-100.0, value))
    return out


def check_unsupported(body: dict, stream: bool) -> None:
    """What vLLM refuses, or what would change the output in a way pyserve cannot honour."""
    best_of = field(body, "best_of", int)
    if best_of is not None and best_of > 1:  # vLLM's V1 engine refused it too, before dropping the field
        raise APIError(400, "best_of > 1 is not supported", "best_of")
    if body.get("suffix") is not None:
        raise APIError(400, "suffix is not currently supported", "suffix")
    for name in _UNIMPLEMENTED:
        if body.get(name) not in (None, [], {}, ""):  # empty is vLLM's own default: absent
            raise APIError(400, f"{name} is not supported by this server", name)
    if body.get("stream_options") is not None and not stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    prompt_logprobs = field(body, "prompt_logprobs", int)
    if stream and prompt_logprobs is not None and prompt_logprobs != 0:
        raise APIError(400, "prompt_logprobs are not available when stream is enabled",
                       "prompt_logprobs")


def requested_max_tokens(body: dict, chat: bool) -> int | None:
    """Chat: max_completion_tokens, else max_tokens, else None (the model's max_new_tokens or
    the model length). Completions: max_tokens, 16 when absent or null (OpenAI's and vLLM's)."""
    if chat:
        value = field(body, "max_completion_tokens", int)
        return value if value is not None else field(body, "max_tokens", int)
    return field(body, "max_tokens", int, 16)


def sampling_params(body: dict, logprobs: int | None, stream: bool, chat: bool,
                    defaults: dict | None = None, max_tokens: int | None = -1) -> SamplingParams:
    """defaults: the model's generation_config values for fields the request leaves out;
    max_tokens: -1 reads it from the body."""
    values = {name: field(body, name, kind) for name, kind in _FIELDS.items()}
    values = {k: v for k, v in values.items() if v is not None}
    if values.get("logit_bias"):
        values["logit_bias"] = _logit_bias(values["logit_bias"])
    _check_caps(values)
    if max_tokens == -1:
        max_tokens = requested_max_tokens(body, chat)
    defaults = dict(defaults or {})
    fallback = defaults.pop("max_tokens", None)  # generation_config's max_new_tokens, as vLLM:
    if max_tokens is None:  # only where the request sets no limit
        max_tokens = fallback
    for name, value in defaults.items():
        values.setdefault(name, value)
    try:
        return SamplingParams(
            **values, max_tokens=max_tokens, logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    except InvalidRequest as exc:
        raise APIError(400, exc.message, exc.param) from None
    except TypeError as exc:
        raise APIError(400, f"invalid sampling parameter: {exc}") from None


# Sampling fields vLLM's beam search does not read (it ignores them): a beam-search request that
# sets one off its neutral value is a 400 naming it here, never silently ignored.
_NOT_WITH_BEAMS = {"top_p": (float, (1.0,)), "top_k": (int, (0, -1)), "min_p": (float, (0.0,)),
                   "presence_penalty": (float, (0.0,)), "frequency_penalty": (float, (0.0,)),
                   "repetition_penalty": (float, (1.0,)), "min_tokens": (int, (0,)),
                   "prompt_logprobs": (int, ())}


def beam_search_params(body: dict, params: SamplingParams) -> SamplingParams | BeamSearchParams:
    """With use_beam_search: vLLM's BeamSearchParams from the request's fields (n is the beam
    width; temperature as sampling resolves it, the model's default included); else params."""
    if not field(body, "use_beam_search", bool, False):
        return params
    for name, (kind, neutral) in _NOT_WITH_BEAMS.items():
        value = field(body, name, kind)
        if value is not None and value not in neutral:
            raise APIError(400, f"{name} is not supported with beam search", name)
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported with beam search", "logit_bias")
    if params.structured_outputs is not None:
        raise APIError(400, "structured outputs are not supported with beam search",
                       structured_outputs(body)[1] or "tool_choice")
    try:
        return BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
            temperature=params.temperature, length_penalty=field(body, "length_penalty", float, 1.0),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
            stop_token_ids=tuple(params.stop_token_ids), logprobs=params.logprobs, seed=params.seed)
    except InvalidRequest as exc:
        raise APIError(400, exc.message, exc.param) from None
