"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from pyserve.errors import InvalidRequest


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text and token ids so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint on what the output may be."""

    json: dict | str | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF, as xgrammar reads it
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest("structured_outputs", "structured_outputs needs exactly one of "
                                 f"{', '.join(self.KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequest("structured_outputs", "choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# extra_args keys pyserve reads: key -> what it does
EXTRA_ARGS = {
    "num_speculative_tokens": "at most this many speculative drafts a step for this request "
                              "(0: none; it never raises the server's --speculative-config)",
}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Accepted as vLLM accepts it; pyserve loads fast tokenizers only, which (as in vLLM's fast
    # incremental detokenizer) join kept special tokens without inserting spaces.
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None  # the sampled token's logprob plus this many top alternatives
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # the output's grammar
    # the most tokens the reasoning (between the reasoning parser's <think> and </think>) may
    # take before </think> is forced; None (or -1, vLLM's "no budget"): unlimited
    thinking_token_budget: int | None = None
    # vLLM's per-request extension arguments (the server's `vllm_xargs`); the keys pyserve
    # reads are EXTRA_ARGS' (any other is refused, never ignored)
    extra_args: dict | None = None
    # vLLM's older name for structured_outputs (one of the two may be given)
    guided_decoding: StructuredOutputsParams | None = None
    # vLLM's fields pyserve does not implement: a value that would change the output is an
    # InvalidRequest naming the field (the server refuses them alike), never ignored
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise InvalidRequest("guided_decoding", "give structured_outputs or guided_decoding "
                                     "(its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.logit_bias:  # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequest("logit_bias", "logit_bias must map token ids to numbers") from None
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise InvalidRequest(name, f"{name} {message}")

        need(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n",
             f"must be at least 1, got {self.n}")
        need(self.best_of is None or self.best_of <= 1 or self.best_of == self.n, "best_of",
             "above n is not supported (vLLM's V1 engine refused it too)")
        # an empty allowed_token_ids is built as in vLLM and refused when a request carries
        # it (LLM.generate, the server's params)
        for name in ("allowed_token_ids", "bad_words", "logits_processors"):
            need(not getattr(self, name), name, "is not supported by this server")
        need(self.truncate_prompt_tokens is None, "truncate_prompt_tokens",
             "is not supported offline: truncate the prompt's token ids before generate()")
        need(self.detokenize is True, "detokenize", "must be True: outputs always carry their text")
        # NaN passes no comparison and infinities pass one-sided ones: refused by name first
        for name in _FLOAT_FIELDS:
            need(_finite(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)}")
        need(all(_finite(b) for b in (self.logit_bias or {}).values()), "logit_bias",
             "values must be finite numbers")
        need(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"must be at least 1, got {self.max_tokens}")
        need(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        need(self.thinking_token_budget is None or (
            isinstance(self.thinking_token_budget, int) and not isinstance(self.thinking_token_budget, bool)
            and self.thinking_token_budget >= 0),
             "thinking_token_budget", f"must be -1 (none) or non-negative, got {self.thinking_token_budget}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        need(all(isinstance(s, str) and s for s in self.stop_strings), "stop",
             "must be a non-empty string or a list of them")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be a list of non-negative token ids")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0.0, "repetition_penalty",
             f"must be positive, got {self.repetition_penalty}")
        need(all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()), "logit_bias",
             "values must be in [-100, 100]")
        # -1: the whole vocabulary, as in vLLM (the engine resolves it against the model)
        need(self.logprobs is None or self.logprobs >= -1, "logprobs",
             f"must be -1 (all) or non-negative, got {self.logprobs}")
        need(self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
             f"must be -1 (all) or non-negative, got {self.prompt_logprobs}")
        need(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args",
             "must be an object")
        for key, value in (self.extra_args or {}).items():
            need(key in EXTRA_ARGS, "extra_args", f"key '{key}' is not supported; pyserve reads "
                 + ", ".join(EXTRA_ARGS))
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                 "extra_args", f"'{key}' must be a non-negative integer, got {value!r}")

    @property
    def max_drafts(self) -> int | None:
        """The request's cap on speculative drafts a step (0: none), or None: the server's."""
        return (self.extra_args or {}).get("num_speculative_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (engine/beam_search.py runs the search). pyserve adds what its
    server forwards: stop strings and stop token ids that end a beam (vLLM's beam search
    ignores both), logprobs (how many top logprobs a response shows per token) and seed (each
    round's draw at a temperature above 0)."""

    beam_width: int
    max_tokens: int | None  # None: up to the model length
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequest("n", f"the beam width (n) must be at least 1, got {self.beam_width}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "length_penalty"):
            if not _finite(getattr(self, name)):
                raise InvalidRequest(name, f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0.0:
            raise InvalidRequest("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop", "stop must be a non-empty string or a list of them")

    @property
    def n(self) -> int:
        """The beams returned: the beam width (vLLM's `n` with use_beam_search)."""
        return self.beam_width
