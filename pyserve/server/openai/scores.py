"""vLLM's scoring routes for an embedding model: POST /score (and /v1/score) and /rerank (and
/v1/rerank, /v2/rerank, Jina's and Cohere's shape). As vLLM scores with a model that embeds
(rather than a cross-encoder), a pair's score is the cosine similarity of the two texts'
embeddings, each embedded as /v1/embeddings embeds it (the model's pooling, L2-normalised),
in the same batches as generation.

    /score   queries and documents (vLLM's first form), or queries and items, data_1 and
             data_2, text_1 and text_2 (each a string or a list): one query against every
             document, or (two lists of one length) pairwise; data[i].score, in order
    /rerank  query, documents (a string, strings or {"text"} objects), top_n (0 or absent:
             all), return_documents (default true): results sorted by relevance_score, each
             with its index in documents

max_tokens_per_query and max_tokens_per_doc (0: no limit) keep the first that many tokens of
each query's or document's text (counted without the special tokens, which stay around them).
truncate_prompt_tokens, truncation_side, add_special_tokens, priority and request_id are read
as /v1/embeddings reads them; at most MAX_INPUTS texts a request in all. instruction and
chat_template_kwargs feed vLLM's score templates (cross-encoders, LLM rerankers): no template
takes part in a cosine, so they are 400s."""

from __future__ import annotations

import asyncio
import time

import orjson
import torch

from pyserve.errors import InvalidRequest
from pyserve.pooling_params import PoolingParams
from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response
from pyserve.server.openai.embeddings import MAX_INPUTS, REFUSED, cut_keeping_specials
from pyserve.server.values import brief, field, log_ignored_fields

# read as /v1/embeddings reads them
_SHARED = {"model", "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "priority",
           "request_id", "user"}
_LIMITS = {"max_tokens_per_query", "max_tokens_per_doc", "padding"}
# /score's pairs of fields, in the order vLLM tries its request forms
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_SCORE_FIELDS = _SHARED | _LIMITS | {name for pair in SCORE_PAIRS for name in pair} | {"encoding_format"}
_RERANK_FIELDS = _SHARED | _LIMITS | {"query", "documents", "top_n", "return_documents"}
# a score is a cosine of normalised embeddings: asking for it unnormalised asks for another score
_COSINE_ONLY = ("normalize", "use_activation")
# vLLM's inputs to a score template, which a cosine of embeddings has none of
_TEMPLATE_ONLY = ("instruction", "chat_template_kwargs")


class OpenAIServingScores:
    def __init__(self, embedding):
        """embedding: the server's OpenAIServingEmbedding, whose requests these are."""
        self.embedding = embedding
        self.serving = embedding.serving

    async def score(self, request: Request) -> Response:
        body = _checked(self.serving.parse_body(request), _SCORE_FIELDS)
        if field(body, "encoding_format", str, "float") != "float":
            raise APIError(400, "encoding_format: scores are floats", "encoding_format")
        first, second = (next((p for p in SCORE_PAIRS if p[0] in body and p[1] in body), None)
                         or next((p for p in SCORE_PAIRS[::-1] if p[0] in body or p[1] in body),
                                 SCORE_PAIRS[0]))  # a pair half given: name its missing half
        firsts, seconds = _texts(body, first), _texts(body, second)
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise APIError(400, f"{first} holds {len(firsts)} texts and {second} {len(seconds)}: give "
                           f"one of {first}, or as many as {second}", first)
        scores, rows = await self._cosines(request, body, firsts, seconds, "score-", first, second)
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
                       prefix: str, first: str = "query",
                       second: str = "documents") -> tuple[list[float], dict]:
        """Each first against its second (one first: against every second): cosines of their
        normalised embeddings, and the run's id and prompt tokens."""
        if len(firsts) + len(seconds) > MAX_INPUTS:
            raise APIError(400, f"{len(firsts) + len(seconds)} texts to embed; at most {MAX_INPUTS} "
                           "in one request", second)
        firsts = await self._cut(firsts, body, "max_tokens_per_query")
        seconds = await self._cut(seconds, body, "max_tokens_per_doc")
        try:
            params = PoolingParams("embed", True, None)
        except InvalidRequest as exc:  # a model that cannot embed
            raise APIError(400, exc.message, exc.param) from None
        shared = {name: body[name] for name in _SHARED if name in body}

        def where(i: int) -> str:  # the request's name for text i (firsts, then seconds)
            if i >= len(firsts):
                return f"{second}[{i - len(firsts)}]"
            return first if len(firsts) == 1 else f"{first}[{i}]"
        try:
            rows = await self.embedding._run(request, {**shared, "input": firsts + seconds}, params,
                                             prefix, where)
        except APIError as exc:  # another refusal of a text (the KV cache's room): the texts' field
            if exc.param != "input":
                raise
            raise APIError(exc.status, exc.message, second, exc.headers) from None
        vectors = torch.stack([p.float().reshape(-1) for p in rows["pooled"]])
        left, right = vectors[:len(firsts)], vectors[len(firsts):]
        if len(firsts) == 1:
            left = left.expand(len(seconds), -1)
        return (left * right).sum(dim=-1).tolist(), rows

    async def _cut(self, texts: list[str], body: dict, name: str) -> list:
        """The texts, each longer than `name` tokens of its own (0 or absent: no limit) as the
        token ids of its first that many, beside the special tokens the tokenizer adds."""
        limit = field(body, name, int, 0)
        if limit < 0:
            raise APIError(400, f"{name} must be 0 (no limit) or more, got {limit}", name)
        if not limit:
            return texts
        tokenizer = self.serving.tokenizer
        add_special = field(body, "add_special_tokens", bool, True)

        def cut() -> list:
            out = []
            for text in texts:
                ids = tokenizer.encode(text, add_special_tokens=add_special)
                extra = len(ids) - len(tokenizer.encode(text, add_special_tokens=False))
                out.append(text if len(ids) - extra <= limit
                           else cut_keeping_specials(tokenizer, text, ids, limit + extra, "right"))
            return out
        return await asyncio.get_running_loop().run_in_executor(None, cut)


def _checked(body: dict, known: set[str]) -> dict:
    """The body, once what pyserve's pooling routes refuse is refused (by name) and what no
    route reads is logged."""
    for name in REFUSED:
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported by pyserve's pooling routes", name)
    for name in _COSINE_ONLY:
        if body.get(name) not in (None, True):
            raise APIError(400, f"{name}: a score here is the cosine of normalised embeddings", name)
    for name in _TEMPLATE_ONLY:
        if body.get(name) is not None:
            raise APIError(400, f"{name}: a score here is the cosine of two embeddings; no score "
                           "template reads it", name)
    if body.get("padding") not in (None, "do_not_pad", "longest"):
        raise APIError(400, "padding: pyserve embeds each text at its own length (only "
                       "'do_not_pad' or 'longest')", "padding")
    log_ignored_fields(set(body) - known - set(_COSINE_ONLY) - set(_TEMPLATE_ONLY))
    return body


def _texts(body: dict, name: str) -> list[str]:
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise APIError(400, f"{name} must be a non-empty string or a non-empty list of them", name)
    return texts


def _documents(value) -> list[str]:
    """A string, strings, or Cohere's and Jina's {"text": ...} objects."""
    if isinstance(value, str):
        value = [value]
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
