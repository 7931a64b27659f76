"""vLLM's scoring routes for an embedding model: POST /score (and /v1/score) and /rerank (and
/v1/rerank, /v2/rerank, Jina's and Cohere's shape). As vLLM scores with a model that embeds
(rather than a cross-encoder), a pair's score is the cosine similarity of the two texts'
embeddings, each embedded as /v1/embeddings embeds it (the model's pooling, L2-normalised),
in the same batches as generation.

    /score   text_1 (a string or a list), text_2 (a string or a list): one text_1 against
             every text_2, or (two lists of one length) pairwise; data[i].score, in order
    /rerank  query, documents (strings or {"text"} objects), top_n (0 or absent: all),
             return_documents (default true): results sorted by relevance_score, each with
             its index in documents

truncate_prompt_tokens, truncation_side, add_special_tokens, priority and request_id are read
as /v1/embeddings reads them; at most MAX_INPUTS texts a request in all."""

from __future__ import annotations

import time

import orjson
import torch

from pyserve.errors import InvalidRequest
from pyserve.pooling_params import PoolingParams
from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response
from pyserve.server.openai.embeddings import MAX_INPUTS, REFUSED
from pyserve.server.values import brief, field, log_ignored_fields

# read as /v1/embeddings reads them
_SHARED = {"model", "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "priority",
           "request_id", "user"}
_SCORE_FIELDS = _SHARED | {"text_1", "text_2", "encoding_format"}
_RERANK_FIELDS = _SHARED | {"query", "documents", "top_n", "return_documents"}
# a score is a cosine of normalised embeddings: asking for it unnormalised asks for another score
_COSINE_ONLY = ("normalize", "use_activation")


class OpenAIServingScores:
    def __init__(self, embedding):
        """embedding: the server's OpenAIServingEmbedding, whose requests these are."""
        self.embedding = embedding
        self.serving = embedding.serving

    async def score(self, request: Request) -> Response:
        body = _checked(self.serving.parse_body(request), _SCORE_FIELDS)
        if field(body, "encoding_format", str, "float") != "float":
            raise APIError(400, "encoding_format: scores are floats", "encoding_format")
        firsts, seconds = _texts(body, "text_1"), _texts(body, "text_2")
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise APIError(400, f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give "
                           "one text_1, or as many as text_2", "text_1")
        scores, rows = await self._cosines(request, body, firsts, seconds, "score-")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return Response(200, orjson.dumps({
            "id": rows["id"], "object": "list", "created": int(time.time()),
            "model": self.serving.model_name, "data": data, "usage": _usage(rows)}))

    async def rerank(self, request: Request) -> Response:
        body = _checked(self.serving.parse_body(request), _RERANK_FIELDS)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise APIError(400, "query must be a non-empty string", "query")
        documents = _documents(body.get("documents"))
        top_n = field(body, "top_n", int, 0)
        if top_n < 0:
            raise APIError(400, f"top_n must be 0 (all) or more, got {top_n}", "top_n")
        keep_text = field(body, "return_documents", bool, True)
        scores, rows = await self._cosines(request, body, [query], documents, "rerank-")
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    "document": {"text": documents[i]} if keep_text else None} for i in order]
        return Response(200, orjson.dumps({"id": rows["id"], "model": self.serving.model_name,
                                           "usage": _usage(rows), "results": results}))

    async def _cosines(self, request: Request, body: dict, firsts: list[str], seconds: list[str],
                       prefix: str) -> tuple[list[float], dict]:
        """Each first against its second (one first: against every second): cosines of their
        normalised embeddings, and the run's id and prompt tokens."""
        if len(firsts) + len(seconds) > MAX_INPUTS:
            raise APIError(400, f"{len(firsts) + len(seconds)} texts to embed; at most {MAX_INPUTS} "
                           "in one request", "text_2" if prefix == "score-" else "documents")
        try:
            params = PoolingParams("embed", True, None)
        except InvalidRequest as exc:  # a model that cannot embed
            raise APIError(400, exc.message, exc.param) from None
        shared = {name: body[name] for name in _SHARED if name in body}
        rows = await self.embedding._run(request, {**shared, "input": firsts + seconds}, params, prefix)
        vectors = torch.stack([p.float().reshape(-1) for p in rows["pooled"]])
        left, right = vectors[:len(firsts)], vectors[len(firsts):]
        if len(firsts) == 1:
            left = left.expand(len(seconds), -1)
        return (left * right).sum(dim=-1).tolist(), rows


def _checked(body: dict, known: set[str]) -> dict:
    """The body, once what pyserve's pooling routes refuse is refused (by name) and what no
    route reads is logged."""
    for name in REFUSED:
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported by pyserve's pooling routes", name)
    for name in _COSINE_ONLY:
        if body.get(name) not in (None, True):
            raise APIError(400, f"{name}: a score here is the cosine of normalised embeddings", name)
    log_ignored_fields(set(body) - known - set(_COSINE_ONLY))
    return body


def _texts(body: dict, name: str) -> list[str]:
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise APIError(400, f"{name} must be a non-empty string or a non-empty list of them", name)
    return texts


def _documents(value) -> list[str]:
    """Strings, or Cohere's and Jina's {"text": ...} objects."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "documents must be a non-empty list of strings", "documents")
    out = []
    for i, doc in enumerate(value):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str) or not text:
            raise APIError(400, f"documents[{i}] must be a non-empty string (or {{\"text\": ...}}), "
                           f"got {brief(doc)}", "documents")
        out.append(text)
    return out


def _usage(rows: dict) -> dict:
    tokens = rows["prompt_tokens"]
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}
