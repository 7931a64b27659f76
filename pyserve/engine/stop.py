"""When a request is done, checked after each new token (vLLM's rules): EOS unless
ignore_eos, a stop token id, a stop string (the text is cut before it unless
include_stop_str_in_output), max_tokens, or the model length. EOS, stop tokens and stop
strings are not honoured before min_tokens."""

from __future__ import annotations

from pyserve.engine.request import Request


def append_token(request: Request, token_id: int, max_model_len: int) -> None:
    """Adds a sampled token to the request, its text, and finishes the request if it must."""
    request.append_output(token_id)
    params = request.params
    n_out = len(request.output_token_ids)
    may_stop = n_out >= params.min_tokens
    stop_string = request.detokenizer.add_token(token_id, check_stop=may_stop)
    if may_stop:
        if token_id in request.eos_token_ids:
            request.finish("stop")
            return
        if token_id in params.stop_token_ids:
            request.finish("stop", token_id)
            return
        if stop_string is not None:
            request.finish("stop", stop_string)
            return
    if n_out >= request.max_tokens or request.num_tokens >= max_model_len:
        request.finish("length")
