"""OpenAI request fields (plus vLLM's extras) -> SamplingParams, with 400s naming the field."""

from __future__ import annotations

from typing import Any

from pyserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pyserve.server.errors import APIError

_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
           "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
           "spaces_between_special_tokens", "prompt_logprobs")


def field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise APIError(400, f"'{name}' has the wrong type", name)
    return value


# Caps on list-like fields, so one request cannot make the server do unbounded work per token.
MAX_N = 128
MAX_STOP = 64


def _check_caps(body: dict) -> None:
    n = body.get("n")
    if isinstance(n, int) and n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", "n")
    for name in ("stop", "stop_token_ids"):
        value = body.get(name)
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise APIError(400, f"{name} may hold at most {MAX_STOP} entries, got {len(value)}", name)


def sampling_params(body: dict, logprobs: int | None, stream: bool) -> SamplingParams:
    _check_caps(body)
    values = {k: body[k] for k in _FIELDS if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        return SamplingParams(
            **values, max_tokens=max_tokens, logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), name if name in _FIELDS or name in (
            "max_tokens", "logprobs") else None) from None
    except TypeError as exc:
        raise APIError(400, f"invalid sampling parameter: {exc}") from None
