"""GET /tokenizer_info: the tokenizer's configuration, only with --enable-tokenizer-info-endpoint.

What vLLM answers (vllm/entrypoints/serve/tokenize/serving.py, TokenizerInfo): transformers'
`init_kwargs` of the tokenizer (what from_pretrained read from tokenizer_config.json and the
files beside it) without `vocab_file` and `merges_file`, special tokens as their text, plus
`tokenizer_class` and, when the server was given --chat-template, that template. Reading
`init_kwargs` needs the transformers tokenizer, which pyserve's tokenizers-only FastTokenizer
loads on first use (a second or more): done once, in a worker thread, then kept."""

from __future__ import annotations

import asyncio
import json

from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response


def _transformers_tokenizer(tokenizer):
    load = getattr(type(tokenizer), "transformers_tokenizer", None)  # FastTokenizer's
    return load(tokenizer) if load is not None else tokenizer


def _plain(value):
    """JSON-ready: an AddedToken (anything with .content) as its text, dict keys as strings."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def tokenizer_info(tokenizer, chat_template: str | None) -> dict:
    hf = _transformers_tokenizer(tokenizer)
    info = dict(getattr(hf, "init_kwargs", None) or {})
    info.pop("vocab_file", None)
    info.pop("merges_file", None)
    info = _plain(info)
    info["tokenizer_class"] = type(hf).__name__
    if chat_template:
        info["chat_template"] = chat_template
    return info


class TokenizerInfo:
    def __init__(self, tokenizer, chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._body: bytes | None = None
        self._lock = asyncio.Lock()  # one load, however many ask at once

    async def __call__(self, request: Request) -> Response:
        async with self._lock:
            if self._body is None:
                try:
                    info = await asyncio.to_thread(tokenizer_info, self.tokenizer,
                                                   self.chat_template)
                except Exception as exc:  # transformers cannot load this tokenizer
                    raise APIError(500, f"Failed to get tokenizer info: {exc}") from None
                # json, not orjson: model_max_length is often 1e30 written as an integer
                self._body = json.dumps(info).encode()
        return Response(200, self._body)
