"""When a request is done, checked after each new token (vLLM's rules): EOS unless
ignore_eos, a stop token id, a stop string (the text is cut before it unless
include_stop_str_in_output), max_tokens, or the model length. EOS, stop tokens and stop
strings are not honoured before min_tokens."""

from __future__ import annotations

from pyserve.engine.request import Request


def append_token(request: Request, token_id: int, max_model_len: int) -> None:
    """Adds a sampled token to the request, its text, and finishes the request if it must. A
    token that stops the request (EOS, a stop token id) stays in its token ids, and its text
    stays out of the output unless include_stop_str_in_output (vLLM's detokenizer: a
    special-token EOS shown with skip_special_tokens false, or a plain-text stop token)."""
    request.append_output(token_id)
    params = request.params
    n_out = len(request.output_token_ids)
    may_stop = n_out >= params.min_tokens
    if may_stop and (token_id in request.eos_token_ids or token_id in params.stop_token_ids):
        if params.include_stop_str_in_output:
            request.detokenizer.add_token(token_id, check_stop=False)
        request.finish("stop", None if token_id in request.eos_token_ids else token_id)
        return
    stop_string = request.detokenizer.add_token(token_id, check_stop=may_stop)
    if may_stop:
        if stop_string is not None:
            request.finish("stop", stop_string)
            return
    if n_out >= request.max_tokens or request.num_tokens >= max_model_len:
        request.finish("length")
