"""OpenAI request fields (plus vLLM's extras) -> SamplingParams, with 400s naming the field.

Each field is read by server/values.py (vLLM's lax types, finite floats, 64-bit ints, no bool
for an int) and held to the caps of server/request_limits.py."""

from __future__ import annotations

from pyserve.errors import InvalidRequest
from pyserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pyserve.server.errors import APIError
from pyserve.server.openai.structured import structured_outputs
from pyserve.server.request_limits import MAX_LOGIT_BIAS, MAX_N, MAX_STOP, MAX_STOP_CHARS
from pyserve.server.values import as_float, as_int, brief, capped, field, is_int_text, token_ids

# SamplingParams fields a request may set, with their JSON types
_FIELDS = {"n": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
           "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
           "seed": int, "stop": (str, list), "stop_token_ids": list, "ignore_eos": bool,
           "min_tokens": int, "logit_bias": dict, "skip_special_tokens": bool,
           "include_stop_str_in_output": bool, "spaces_between_special_tokens": bool,
           "prompt_logprobs": int, "thinking_token_budget": int}

# Fields vLLM answers with a different output that pyserve does not implement: refused, never
# silently ignored. (Structured outputs are read by server/openai/structured.py.)
_UNIMPLEMENTED = ("allowed_token_ids", "bad_words")


def _check_caps(values: dict, vocab_size: int | None) -> None:
    """n, stop and stop_token_ids within request_limits' caps (checked before any entry is
    read); stop_token_ids as token ids, in the vocabulary when its size is known."""
    n = values.get("n")
    if n is not None and n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", "n")
    stop = values.get("stop")
    if isinstance(stop, list):
        capped("stop", stop, MAX_STOP)
    for s in [stop] if isinstance(stop, str) else stop or ():
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"a stop string may be at most {MAX_STOP_CHARS} characters long, "
                           f"got {len(s)}", "stop")
    ids = values.get("stop_token_ids")
    if ids:
        capped("stop_token_ids", ids, MAX_STOP)
        ids = [as_int("stop_token_ids", t) for t in ids]
        values["stop_token_ids"] = (ids if vocab_size is None
                                    else token_ids("stop_token_ids", ids, vocab_size))


def _logit_bias(bias: dict) -> dict[int, float]:
    """vLLM's reading: keys are token ids (JSON keys are strings), values are clamped to
    OpenAI's [-100, 100] (a value must be a finite number); a 400 names the keys that are not
    token ids. (The engine checks the ids against the vocabulary.)"""
    capped("logit_bias", bias, MAX_LOGIT_BIAS)
    bad = [k for k in bias if not is_int_text(str(k))]
    if bad:
        shown = ", ".join(brief(k) for k in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise APIError(400, f"logit_bias keys must be token ids (integers); not token ids: {shown}",
                       "logit_bias")
    out = {}
    for k, v in bias.items():
        token = int(k)
        try:
            value = as_float("logit_bias", v)
        except APIError:
            raise APIError(400, f"logit_bias for token {token} must be a finite number, got "
                           f"{brief(v)}", "logit_bias") from None
        out[token] = min(100.0, max(-100.0, value))
    return out


def check_unsupported(body: dict, stream: bool) -> None:
    """What vLLM refuses, or what would change the output in a way pyserve cannot honour."""
    best_of = field(body, "best_of", int)
    if best_of is not None and best_of > 1:  # vLLM's V1 engine refused it too, before dropping the field
        raise APIError(400, "best_of > 1 is not supported", "best_of")
    if body.get("suffix") is not None:
        raise APIError(400, "suffix is not currently supported", "suffix")
    if body.get("allowed_token_ids") == []:  # allowing nothing must not read as allowing all
        raise APIError(400, "allowed_token_ids is not None and empty!",  # vLLM's words
                       "allowed_token_ids")
    for name in _UNIMPLEMENTED:
        if body.get(name) not in (None, [], {}, ""):  # empty is vLLM's own default: absent
            raise APIError(400, f"{name} is not supported by this server", name)
    if body.get("stream_options") and not stream:  # {} asks for nothing (vLLM's falsy check)
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
                    defaults: dict | None = None, max_tokens: int | None = -1,
                    vocab_size: int | None = None) -> SamplingParams:
    """defaults: the model's generation_config values for fields the request leaves out;
    max_tokens: -1 reads it from the body; vocab_size: the model's, for stop_token_ids."""
    values = {name: field(body, name, kind) for name, kind in _FIELDS.items()}
    values = {k: v for k, v in values.items() if v is not None}
    if values.get("logit_bias"):
        values["logit_bias"] = _logit_bias(values["logit_bias"])
    _check_caps(values, vocab_size)
    field(body, "length_penalty", float)  # read with beam search only, but never a NaN
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
            **values, max_tokens=max_tokens, logprobs=logprobs, extra_args=body.get("vllm_xargs"),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    except InvalidRequest as exc:
        if exc.param == "extra_args":  # the server's name for vLLM's extra_args
            raise APIError(400, "vllm_xargs" + exc.message.removeprefix("extra_args"),
                           "vllm_xargs") from None
        raise APIError(400, exc.message, exc.param) from None
    except TypeError as exc:
        raise APIError(400, f"invalid sampling parameter: {exc}") from None


# Sampling fields vLLM's beam search does not read (it ignores them): a beam-search request that
# sets one off its neutral value is a 400 naming it here, never silently ignored.
_NOT_WITH_BEAMS = {"top_p": (float, (1.0,)), "top_k": (int, (0, -1)), "min_p": (float, (0.0,)),
                   "presence_penalty": (float, (0.0,)), "frequency_penalty": (float, (0.0,)),
                   "repetition_penalty": (float, (1.0,)), "min_tokens": (int, (0,)),
                   "prompt_logprobs": (int, ()), "thinking_token_budget": (int, (-1,))}


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
