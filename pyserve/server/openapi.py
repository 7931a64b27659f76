"""GET /openapi.json: an OpenAPI 3.1 document of the routes this server serves, as vLLM's
FastAPI app serves one. Written by hand as data (OPERATIONS here, the body schemas in
openapi_schemas.py), not derived from handlers: pyserve's handlers read plain dicts.

The document lists exactly the routes the running server answers: the router's (its
optional routes only where their flags turned them on) and the liveness routes the server
state answers itself (auth.OPEN_PATHS). A route registered without an entry in OPERATIONS
fails the document's build, so the two cannot drift apart (tests/fuzz/test_openapi.py
checks both directions). HEAD, which the router answers on every GET route, is not listed
separately.

Like every route but the liveness ones, /openapi.json needs the API key when --api-key is
set (vLLM's key check guards only /v1 paths, so its /openapi.json is open); the document
then declares the two ways to present the key."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from pyserve.server.auth import OPEN_PATHS
from pyserve.server.http import Request, Response
from pyserve.server.openapi_schemas import component_schemas, ref


@dataclass(frozen=True)
class APIFacts:
    """What the document states about this server beyond its routes."""

    version: str
    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    api_key: bool  # --api-key is set


JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"


def _op(summary: str, tag: str, ok: str | None = None, body: str | None = None,
        stream: bool = False, errors: tuple[int, ...] = (), content: str = JSON,
        anthropic: bool = False, path_param: str | None = None, binary: bool = False) -> dict:
    """One operation: ok names its 200 body's schema (None: any JSON object); errors lists the
    statuses it answers beyond 401 and 503, which are added where they apply. binary: it may
    also answer application/octet-stream (vLLM's bytes encodings of vectors)."""
    schema = ref(ok) if ok else {"type": "object"}
    if content == TEXT:
        schema = {"type": "string"}
    success = {content: {"schema": schema}}
    if binary:
        success["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    if stream:  # server-sent events when the body asks for "stream": true
        success[SSE] = {"schema": {  # each event; its data is one chunk's JSON (or [DONE])
            "type": "object", "required": ["data"],
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}
    operation = {"summary": summary, "tags": [tag],
                 "responses": {"200": {"description": "success", "content": success}},
                 "x-errors": errors, "x-error-schema": "AnthropicError" if anthropic else "Error"}
    if body is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {JSON: {"schema": ref(body)}}}
    if path_param is not None:
        operation["parameters"] = [{"name": path_param, "in": "path", "required": True,
                                    "schema": {"type": "string", "minLength": 1}}]
    return operation


_BODY = (400, 404, 413)  # a malformed body, an unknown model, one over --max-request-body-bytes
_ADMITTED = _BODY + (429,)  # routes that queue work in the engine (--max-num-queued-requests)

OPERATIONS: dict[tuple[str, str], dict] = {
    ("GET", "/health"): _op("Liveness: 200 once the engine runs, 503 while loading, stalled or "
                            "dead", "server", "Health"),
    ("GET", "/ping"): _op("SageMaker's liveness probe", "server"),
    ("GET", "/version"): _op("pyserve's version", "server"),
    ("GET", "/openapi.json"): _op("This document", "server"),
    ("GET", "/metrics"): _op("Prometheus metrics, under vLLM's names", "server", content=TEXT),
    ("GET", "/load"): _op("Requests in flight on the model's routes (--enable-server-load-tracking)",
                          "server"),
    ("GET", "/tokenizer_info"): _op("The tokenizer's configuration "
                                    "(--enable-tokenizer-info-endpoint)", "server", errors=(500,)),
    ("GET", "/debug/books"): _op("The engine's books (--enable-debug-endpoints)", "server"),
    ("GET", "/v1/models"): _op("The served model names", "openai", "ModelList"),
    ("POST", "/v1/completions"): _op("Text completion", "openai", "Completion", "CompletionRequest",
                                     stream=True, errors=_ADMITTED),
    ("POST", "/v1/chat/completions"): _op("Chat completion", "openai", "ChatCompletion",
                                          "ChatCompletionRequest", stream=True, errors=_ADMITTED),
    ("POST", "/v1/embeddings"): _op("Embeddings of texts, token ids or a chat", "openai",
                                    "EmbeddingList", "EmbeddingRequest", errors=_ADMITTED, binary=True),
    ("POST", "/pooling"): _op("vLLM's pooling: per-token hidden states or pooled vectors", "vllm",
                              "PoolingList", "PoolingRequest", errors=_ADMITTED, binary=True),
    **{("POST", path): _op("vLLM's scoring: cosines of text_1's and text_2's embeddings", "vllm",
                           "ScoreList", "ScoreRequest", errors=_ADMITTED)
       for path in ("/score", "/v1/score")},
    **{("POST", path): _op("vLLM's reranking: documents by the cosine of their embeddings with "
                           "the query's", "vllm", "RerankList", "RerankRequest", errors=_ADMITTED)
       for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    ("POST", "/v2/embed"): _op("Cohere's Embed v2 API (vLLM's): texts' embeddings by type", "vllm",
                               "CohereEmbedList", "CohereEmbedRequest", errors=_ADMITTED),
    ("POST", "/tokenize"): _op("A prompt or chat as the model's token ids", "vllm", "Tokenized",
                               "TokenizeRequest", errors=_BODY),
    ("POST", "/detokenize"): _op("Token ids as text", "vllm", "Detokenized", "DetokenizeRequest",
                                 errors=_BODY),
    ("POST", "/invocations"): _op("SageMaker's entry point: a chat, completion or embeddings body",
                                  "vllm", None, "InvocationsRequest", stream=True, errors=_ADMITTED),
    ("POST", "/v1/messages"): _op("Anthropic's Messages API", "anthropic", "AnthropicMessage",
                                  "AnthropicMessagesRequest", stream=True, errors=_ADMITTED,
                                  anthropic=True),
    ("POST", "/v1/messages/count_tokens"): _op("Anthropic's token count of a Messages request",
                                               "anthropic", "AnthropicTokenCount",
                                               "AnthropicCountTokensRequest", errors=_BODY,
                                               anthropic=True),
    ("POST", "/v1/responses/input_tokens"): _op("OpenAI's count of a Responses request's input "
                                                "tokens", "openai", "ResponseInputTokens",
                                                "ResponsesRequest", errors=_BODY),
    ("POST", "/v1/responses"): _op("OpenAI's Responses API", "openai", "Response",
                                   "ResponsesRequest", stream=True, errors=_ADMITTED),
    ("GET", "/v1/responses/{response_id}"): _op("A stored response; ?stream=true&starting_after=N "
                                                "replays a background stream's events", "openai",
                                                "Response", stream=True, errors=(400, 404),
                                                path_param="response_id"),
    ("DELETE", "/v1/responses/{response_id}"): _op("Delete a stored response (a running "
                                                   "background one is cancelled first)", "openai",
                                                   "DeletedResponse", errors=(404,),
                                                   path_param="response_id"),
    ("POST", "/v1/responses/{response_id}/cancel"): _op(
        "Cancel a running background response; 400 for one created without background or "
        "ended otherwise", "openai", "Response", errors=(400, 404), path_param="response_id"),
}

_REASONS = {400: "the request is malformed or asks for what this server refuses",
            401: "missing or invalid API key", 404: "no such model or stored response",
            413: "the body is over --max-request-body-bytes",
            429: "the queue is full (--max-num-queued-requests); retry after Retry-After",
            500: "the server could not produce the answer", 503: "the server is loading, "
            "shutting down or its engine died"}


def _operation(method: str, path: str, facts: APIFacts) -> dict:
    try:
        operation = dict(OPERATIONS[(method, path)])
    except KeyError:
        raise ValueError(f"the route {method} {path} has no entry in server/openapi.py's "
                         "OPERATIONS: describe it there") from None
    errors = set(operation.pop("x-errors"))
    error = ref(operation.pop("x-error-schema"))
    if path not in OPEN_PATHS:  # the liveness routes answer whatever the server's state
        errors.add(503)
        if facts.api_key:
            errors.add(401)
    elif path == "/health":
        errors.add(503)
    responses = dict(operation["responses"])
    for status in sorted(errors):
        responses[str(status)] = {"description": _REASONS[status],
                                  "content": {JSON: {"schema": error}}}
    operation["responses"] = responses
    operation["operationId"] = f"{method.lower()} {path}"
    if path in OPEN_PATHS and facts.api_key:
        operation["security"] = []  # open without the key
    return operation


def openapi_document(routes: list[tuple[str, str]], facts: APIFacts) -> dict:
    """routes: the router's (method, path) pairs; the liveness routes are added here.
    ValueError names a route that OPERATIONS does not describe."""
    served = {(m, p) for m, p in routes if m != "HEAD"} | {("GET", p) for p in OPEN_PATHS}
    paths: dict[str, dict] = {}
    for method, path in sorted(served):
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, facts)
    document = {
        "openapi": "3.1.0",
        "info": {"title": "pyserve", "version": facts.version,
                 "description": "An LLM inference server with OpenAI's, Anthropic's and vLLM's "
                                "APIs. Every GET route answers HEAD too."},
        "paths": paths,
        "components": {"schemas": component_schemas(facts)},
    }
    if facts.api_key:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        document["security"] = [{"bearer": []}, {"apiKeyHeader": []}]  # either one
    return document


def openapi_handler(router, facts: APIFacts):
    """GET /openapi.json. The document is built on the first request, once every route is
    registered, and kept (routes do not change while the server runs)."""
    cached: list[bytes] = []

    async def openapi(request: Request) -> Response:
        if not cached:
            cached.append(orjson.dumps(openapi_document(router.routes(), facts)))
        return Response(200, cached[0])

    return openapi
