"""When a request is done, checked after each new token (vLLM's rules): EOS unless
ignore_eos, a stop token id, a stop string (the text is cut before it unless
include_stop_str_in_output), max_tokens, or the model length. EOS and stop tokens are not
honoured before min_tokens."""

from __future__ import annotations

from pyserve.engine.request import Request


def check_stop(request: Request, tokenizer, max_model_len: int) -> None:
    params = request.params
    n_out = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if n_out >= params.min_tokens:
        if last in request.eos_token_ids:
            request.finish("stop")
            return
        if last in params.stop_token_ids:
            request.finish("stop", last)
            return
        if params.stop_strings:
            text = tokenizer.decode(request.output_token_ids,
                                    skip_special_tokens=params.skip_special_tokens)
            hits = [(text.find(s), s) for s in params.stop_strings if s in text]
            if hits:
                at, stop = min(hits)
                request.text_end = at + len(stop) if params.include_stop_str_in_output else at
                request.finish("stop", stop)
                return
    if n_out >= request.max_tokens or request.num_tokens >= max_model_len:
        request.finish("length")
