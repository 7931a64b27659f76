"""The completion and chat response objects, field for field as vLLM serialises them: a whole
response is its pydantic model dumped with every field (null where unset), so clients read
`choice.prompt_logprobs`, `response.system_fingerprint` or `choice.stop_reason` without a
KeyError; a stream chunk carries the fields vLLM sets on it (it dumps chunks with
exclude_unset), and the final usage chunk drops its nulls (exclude_none).

Fields pyserve has no value for (service_tier, system_fingerprint, kv_transfer_params, a
message's refusal/annotations/audio/function_call) are always null, as they are in vLLM
without the features behind them.

meta (built per request by OpenAIServing._respond) holds what the shapes need: the request's
id, model and role, whether it is chat, its logprobs k, and its token-id options:
return_token_ids (prompt_token_ids and each choice's token_ids) and as_token_ids
(return_tokens_as_token_ids: logprob tokens named "token_id:N")."""

from __future__ import annotations

from pyserve.server.openai.chat_output import ChoiceOutput, merge_delta
from pyserve.server.openai.logprobs import choice_logprobs

# a chat message's fields before the choice's own (vLLM's ChatMessage, with `reasoning` and
# the older `reasoning_content`, which --reasoning-parser fills)
_MESSAGE = {"content": None, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [], "reasoning": None, "reasoning_content": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None,
          reasoning_tokens: int | None = None) -> dict:
    """cached_tokens: the prompt tokens the prefix cache served, reported with
    --enable-prompt-tokens-details (None without it: prompt_tokens_details is null);
    reasoning_tokens: those of the completion the reasoning parser counted (None without one:
    no completion_tokens_details, as vLLM adds them only with a parser)."""
    details = None if cached_tokens is None else {"cached_tokens": cached_tokens}
    out = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
           "completion_tokens": completion_tokens, "prompt_tokens_details": details}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def response(meta: dict, choices: list, usage_: dict, prompt_logprobs=None) -> dict:
    """A whole response; chat's prompt_logprobs and prompt_token_ids are at its top level."""
    out = {"id": meta["id"], "object": "chat.completion" if meta["chat"] else "text_completion",
           "created": meta["created"], "model": meta["model"], "choices": choices,
           "service_tier": None, "system_fingerprint": None, "usage": usage_}
    if meta["chat"]:
        out["prompt_logprobs"] = prompt_logprobs
        out["prompt_token_ids"] = meta["prompt_ids"][0] if meta["return_token_ids"] else None
    out["kv_transfer_params"] = None
    return out


def choice(meta: dict, index: int, c, final: bool, tokenizer,
           output: ChoiceOutput | None = None) -> dict:
    """A choice of a whole response (final) or of a chunk, from the engine's CompletionOutput
    c. Chat: output shapes the text into content, reasoning and tool calls (per choice; a
    chunk's delta may come out empty)."""
    logprobs = choice_logprobs(c, meta["chat"], meta["logprobs"], tokenizer, meta["as_token_ids"])
    token_ids = list(c.token_ids) if meta["return_token_ids"] else None
    if not meta["chat"]:
        out = {"index": index, "text": c.text, "logprobs": logprobs,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        # the prompt's fields are filled by the caller, once a prompt
        if final:
            return out | {"token_ids": token_ids, "prompt_logprobs": None, "prompt_token_ids": None}
        return out | {"prompt_token_ids": None, "token_ids": token_ids}
    output = output or ChoiceOutput()
    reasoning = output.count(c.token_ids)
    if not output.include_reasoning and any(reasoning):
        # reasoning left out of the answer leaves its tokens out of logprobs and token_ids
        # too, as vLLM hides them (where the parser's markers are one token each)
        if logprobs is not None:
            shown = [e for e, hidden in zip(logprobs["content"], reasoning) if not hidden]
            logprobs = {"content": shown} if shown or final else None
        if token_ids is not None:
            token_ids = [t for t, hidden in zip(token_ids, reasoning) if not hidden]
    if final:
        # a whole message lists its tool calls ([] when none, as vLLM's did until it began
        # dropping an empty list: clients read an absent list as None either way)
        message = {"role": meta["role"], **_MESSAGE, **output.whole(c.text, c.finish_reason)}
        if meta["chat_echo"]:
            message["content"] = meta["chat_echo"] + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": output.finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason, "token_ids": token_ids}
    delta = output.delta(c.text)
    if c.finish_reason is not None:
        merge_delta(delta, output.finish(c.finish_reason))
    out = {"index": index, "delta": delta, "logprobs": logprobs,
           "finish_reason": output.finish_reason(c.finish_reason), "token_ids": token_ids}
    if c.finish_reason is not None:  # vLLM sets it on a choice's last chunk only
        out["stop_reason"] = c.stop_reason
    return out


def chat_opening(meta: dict, head: dict, index: int, p: int) -> list[dict]:
    """A streamed chat choice's first chunks: its role (with the prompt's token ids at the
    top level, null unless return_token_ids), then with echo the echoed last message."""
    role = {**head, "choices": [{"index": index, "delta": {"role": meta["role"], "content": ""},
                                 "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": meta["prompt_ids"][p] if meta["return_token_ids"] else None}
    chunks = [role]
    if meta["chat_echo"]:
        chunks.append({**head, "choices": [{"index": index, "delta": {"content": meta["chat_echo"]},
                                            "logprobs": None, "finish_reason": None}]})
    return chunks
