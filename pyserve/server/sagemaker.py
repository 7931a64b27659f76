"""POST /invocations: SageMaker's one entry point, handing the body to the route it is written for.

vLLM (vllm/entrypoints/sagemaker/api_router.py) tries its request types in a fixed order and
serves the first the body validates as: chat completions, then completions, then embeddings
(where the server has them), then scores and reranking; no match is a 400 naming the types it
expected. Here the fields each type requires decide, in the same order: `messages` -> chat,
`prompt` -> completions, `input` -> embeddings, a pair of /score's fields (`text_1` and
`text_2`, `queries` and `documents`, ...) -> /score, `query` and `documents` -> /rerank. The
route's own handler then checks the rest of the body, so a malformed chat request gets the
chat route's 400, not a vaguer one."""

from __future__ import annotations

from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.openai.scores import SCORE_PAIRS
from pyserve.server.openai.serving import json_object

# (the fields that pick the route, the route, vLLM's name for its request type)
TARGETS = ((("messages",), "/v1/chat/completions", "ChatCompletionRequest"),
           (("prompt",), "/v1/completions", "CompletionRequest"),
           (("input",), "/v1/embeddings", "EmbeddingCompletionRequest"),
           *((pair, "/score", "ScoreRequest") for pair in SCORE_PAIRS),
           (("query", "documents"), "/rerank", "RerankRequest"))


class Invocations:
    def __init__(self, router):
        self.router = router  # looked up per request: every route is registered by then

    async def __call__(self, request: Request) -> Response | StreamingResponse:
        body = json_object(request)
        served = [(keys, path, name) for keys, path, name in TARGETS
                  if self.router.handler("POST", path) is not None
                  and not getattr(self.router.handler("POST", path), "refuses_generation", False)]
        if ("messages" in body and not any(keys == ("messages",) for keys, _, _ in served)
                and self.router.handler("POST", "/v1/embeddings") is not None):  # an encoder's chat form
            served.insert(0, (("messages",), "/v1/embeddings", "EmbeddingChatRequest"))
        for keys, path, _ in served:
            if all(key in body for key in keys):
                return await self.router.handler("POST", path)(request)
        expected = list(dict.fromkeys(name for _, _, name in served))
        shapes = " or ".join(" and ".join(repr(key) for key in keys) for keys, _, _ in served)
        raise APIError(400, "Cannot find suitable handler for request. Expected one of: "
                       f"{expected} (a body with {shapes})")
