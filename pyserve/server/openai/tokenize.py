"""vLLM's POST /tokenize and /detokenize: a prompt (or a chat, rendered as the chat route
renders it, tools included) as the model's token ids, and ids back as text."""

from __future__ import annotations

import orjson

from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response
from pyserve.server.openai.messages import tool_mode, with_allowed_tools
from pyserve.server.openai.params import field


class TokenizeRoutes:
    def __init__(self, serving):
        """serving: the server's OpenAIServing, whose tokenizer and chat rendering these use."""
        self.serving = serving

    async def tokenize(self, request: Request) -> Response:
        body = self.serving.parse_body(request)
        if "messages" in body:
            body = with_allowed_tools(body)  # the tools the chat route would render
            tokens = await self.serving._chat_prompt(body, tool_mode(body, False, False)[1])
        else:
            prompt = field(body, "prompt", (str,))
            if prompt is None:
                raise APIError(400, "'prompt' (a string) or 'messages' is required", "prompt")
            add_special = field(body, "add_special_tokens", (bool,), True)
            tokens = await self.serving._encode(prompt, add_special)
        strs = None
        if field(body, "return_token_strs", bool, False):
            strs = await self.serving.off_loop_if_long(
                len(tokens), lambda: [self.serving.tokenizer.convert_ids_to_tokens(t) for t in tokens])
        return Response(200, orjson.dumps({"count": len(tokens), "tokens": tokens, "token_strs": strs,
                                           "max_model_len": self.serving.engine.max_model_len}))

    async def detokenize(self, request: Request) -> Response:
        body = self.serving.parse_body(request)
        tokens = body.get("tokens")
        vocab = self.serving.engine.vocab_size
        if not isinstance(tokens, list):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")

        def text() -> str:  # a check and a decode in proportion to the list: off the loop when long
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
                raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
            return self.serving.tokenizer.decode(tokens)
        return Response(200, orjson.dumps({"prompt": await self.serving.off_loop_if_long(len(tokens), text)}))
