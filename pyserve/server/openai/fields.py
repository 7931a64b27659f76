"""Every field of vLLM 0.32's completion and chat requests, by what pyserve does with it, so
none is ignored unseen:

- IMPLEMENTED: read somewhere in server/openai/ (params.py, serving.py, messages.py,
  structured.py) with vLLM's meaning; with use_beam_search, the sampling fields beam search
  does not read are a 400 when set off their neutral values (params.beam_search_params);
- NO_EFFECT: fields that change nothing in the output, in vLLM either (`user`, `store`,
  `metadata`, ...): accepted;
- REFUSED_UNLESS_DEFAULT: what pyserve does not implement; a request that sets one to anything
  but its default is a 400 naming it;
- anything else is not a vLLM field: vLLM accepts and ignores it with a warning in its log,
  and so does pyserve (an SDK's newer fields must not break requests), naming the fields.
"""

from __future__ import annotations

from pyserve.server.errors import APIError
from pyserve.server.values import log_ignored_fields

_COMMON = {
    "model", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
    "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens",
    "prompt_logprobs", "logprobs", "max_tokens", "stream", "stream_options", "priority", "request_id",
    "truncate_prompt_tokens", "add_special_tokens", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "best_of", "allowed_token_ids", "bad_words",
    "truncation_side", "return_token_ids", "return_tokens_as_token_ids", "vllm_xargs",
    "use_beam_search", "length_penalty",  # vLLM's beam search (engine/beam_search.py)
    "thinking_token_budget",  # with --reasoning-parser (engine/thinking_budget.py)
}
IMPLEMENTED = {
    "completions": _COMMON | {"prompt", "echo", "suffix"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "add_generation_prompt", "continue_final_message", "documents", "chat_template",
                       "chat_template_kwargs", "parallel_tool_calls", "include_reasoning", "echo",
                       "reasoning_effort", "prompt_token_ids"},
}
NO_EFFECT = {"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
             "prompt_cache_retention",
             # newer vLLM's: a session tag, streaming cadence, and what only its render or
             # expert-routing outputs read
             "session_id", "stream_interval", "routed_experts_prompt_start", "return_token_offsets",
             "return_mm_kwargs"}
# field -> its default: anything else is refused
REFUSED_UNLESS_DEFAULT = {
    "logits_processors": None,
    "cache_salt": None,
    "kv_transfer_params": None, "mm_processor_kwargs": None,
    "prompt_embeds": None, "echo_chat": None, "audio": None,
    "modalities": ["text"], "prediction": None, "functions": None, "function_call": ("none", "auto"),
    "web_search_options": None, "processed_prompt": None,
    "moderation": None,  # no moderation model here
    # newer vLLM's sampling and transfer fields that change the answer
    "repetition_detection": None, "logprob_token_ids": None,
    "return_prompt_text": False, "watermarking": None, "media_io_kwargs": None,
    "ec_transfer_params": None,
}
# why a refused field cannot be honoured, where the field's name does not say it
_WHY = {"logprob_token_ids": "logprobs here are the sampled token's and the top_logprobs most "
                             "likely ones, never those of token ids a request names"}
# per route, vLLM fields of that route pyserve does not implement, or the other route's fields
_ROUTE_REFUSED = {"completions": {"messages": None, "tools": None, "tool_choice": None,
                                  "max_completion_tokens": None},
                  "chat": {"prompt": None, "suffix": None}}


def check_fields(body: dict, route: str) -> None:
    """400 for a field pyserve does not implement; a log line for fields vLLM does not know."""
    for name, default in (REFUSED_UNLESS_DEFAULT | _ROUTE_REFUSED[route]).items():
        # a default is one value, or a tuple of values that change nothing ("none" and "auto"
        # for the legacy function_call, with no `functions` to call)
        if name in body and body[name] is not None and body[name] not in (
                default if isinstance(default, tuple) else (default,)):
            why = f": {_WHY[name]}" if name in _WHY else ""
            raise APIError(400, f"{name} is not supported on this endpoint by this server{why}", name)
    unknown = (set(body) - IMPLEMENTED[route] - NO_EFFECT - set(REFUSED_UNLESS_DEFAULT)
               - set(_ROUTE_REFUSED[route]))
    log_ignored_fields(unknown)
