"""POST /v2/embed: Cohere's Embed v2 API, as vLLM serves it, on /v1/embeddings' requests (the
model's pooling, L2-normalised, in the same batches as generation).

    texts             strings, each embedded as /v1/embeddings embeds it (echoed as `texts`)
    inputs            [{"content": [{"type": "text", "text"}]}]: each a user turn rendered by
                      the chat template, as vLLM's chat form of /v1/embeddings; image parts and
                      `images` are a 400 (no vision model here)
    input_type        the model's prompt prefix for it: config.json's task_instructions, else
                      config_sentence_transformers.json's prompts (vLLM's order); Cohere's own
                      names also find an ST prompt of the usual name (search_query -> query;
                      search_document -> document or passage). A model without prompts embeds
                      Cohere's five types as the bare text (the Cohere SDK always sends one;
                      vLLM refuses them); any other type is a 400 naming the ones there are
    output_dimension  /v1/embeddings' dimensions (a Matryoshka model's only)
    embedding_types   float (the default), base64 (little-endian float32), binary / ubinary
                      (one bit a dimension, 1 where the value is >= 0, the first dimension the
                      highest bit; binary's bytes as signed values, byte - 128); int8 and uint8
                      are a 400 (Cohere's calibration is its own)
    truncate          END (the default: the end is cut), START (the start is cut), NONE (an
                      input too long is a 400); to max_tokens when given, else to the model length
    priority          as on every route

The answer: {"id", "embeddings": {type: [...] per requested type}, "texts", "meta":
{"api_version": {"version": "2"}, "billed_units" and "tokens": {"input_tokens"}}}; errors are
the server's usual ones (vLLM's too)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import orjson
import torch

from pyserve.errors import InvalidRequest
from pyserve.pooling_params import PoolingParams
from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response
from pyserve.server.openai.embeddings import MAX_INPUTS, REFUSED
from pyserve.server.values import brief, field, log_ignored_fields, one_of

_FIELDS = {"model", "input_type", "texts", "images", "inputs", "output_dimension", "embedding_types",
           "truncate", "max_tokens", "priority", "request_id"}
EMBEDDING_TYPES = ("float", "base64", "binary", "ubinary")
TRUNCATES = ("END", "START", "NONE")
# the input types Cohere defines; a model without prompts embeds their texts bare
COHERE_INPUT_TYPES = ("search_document", "search_query", "classification", "clustering", "image")
# sentence-transformers' usual prompt names for Cohere's types, tried when no prompt has
# Cohere's own name
_ST_NAMES = {"search_query": ("query",), "search_document": ("document", "passage"),
             "classification": ("classification",), "clustering": ("clustering",)}


def read_prompts(model_path: str) -> dict[str, str] | None:
    """The model's prompt prefixes by input type: config.json's task_instructions, else
    config_sentence_transformers.json's prompts (None where neither names any)."""
    directory = Path(model_path)
    for name, key in (("config.json", "task_instructions"), ("config_sentence_transformers.json", "prompts")):
        try:
            table = json.loads((directory / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):  # no such file (a GGUF file), or not JSON
            continue
        if isinstance(table, dict):
            prompts = {k: v for k, v in table.items() if isinstance(v, str)}
            if prompts:
                return prompts
    return None


class CohereEmbed:
    def __init__(self, embedding, prompts: dict[str, str] | None):
        """embedding: the server's OpenAIServingEmbedding, whose requests these are."""
        self.embedding = embedding
        self.serving = embedding.serving
        self.prompts = prompts

    async def embed(self, request: Request) -> Response:
        body = self.serving.parse_body(request)
        for name in REFUSED:
            if body.get(name) is not None:
                raise APIError(400, f"'{name}' is not supported by pyserve's pooling routes", name)
        log_ignored_fields(set(body) - _FIELDS)
        self.serving.check_model(body.get("model"))
        types = _embedding_types(body.get("embedding_types"))
        truncate = field(body, "truncate", str, "END")
        one_of("truncate", truncate, TRUNCATES)
        limit = field(body, "max_tokens", int)
        if limit is not None and limit < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {limit}", "max_tokens")
        if body.get("images") is not None:
            raise APIError(400, "images: this server embeds text only", "images")
        prefix = self._prefix(field(body, "input_type", str))
        run = {"priority": body.get("priority"), "request_id": body.get("request_id")}
        if truncate != "NONE":  # the end cut keeps the first tokens: truncation_side "right"
            run["truncate_prompt_tokens"] = -1 if limit is None else limit
            run["truncation_side"] = "right" if truncate == "END" else "left"
        texts = None
        if body.get("inputs") is not None:
            if body.get("texts") is not None:
                raise APIError(400, "give either 'texts' or 'inputs', not both", "inputs")
            run["input"] = [[{"role": "user", "content": text}]
                            for text in _input_texts(body["inputs"], prefix)]
        else:
            texts = body.get("texts")
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise APIError(400, "texts must be a non-empty list of strings (or give inputs)", "texts")
            if len(texts) > MAX_INPUTS:
                raise APIError(400, f"texts holds {len(texts)} texts; at most {MAX_INPUTS} may be "
                               "embedded in one request", "texts")
            run["input"] = [prefix + t for t in texts]
        try:
            params = PoolingParams("embed", True, field(body, "output_dimension", int))
        except InvalidRequest as exc:
            raise APIError(400, exc.message, "output_dimension") from None
        try:
            rows = await self.embedding._run(request, {k: v for k, v in run.items() if v is not None},
                                             params, "embd-")
        except APIError as exc:  # name Cohere's field, not the one it became
            names = {"truncate_prompt_tokens": "max_tokens", "dimensions": "output_dimension",
                     "input": "inputs" if texts is None else "texts"}
            if exc.param not in names:
                raise
            raise APIError(exc.status, exc.message, names[exc.param], exc.headers) from None
        if truncate == "NONE" and limit is not None and rows["longest"] > limit:
            raise APIError(400, f"an input of {rows['longest']} tokens is longer than max_tokens="
                           f"{limit} with truncate NONE; set truncate to END or START to cut it",
                           "max_tokens")
        vectors = torch.stack([p.float().reshape(-1) for p in rows["pooled"]])
        embeddings = {kind: _typed(vectors, kind) for kind in types}
        tokens = {"input_tokens": rows["prompt_tokens"]}
        answer = {"id": rows["id"], "embeddings": embeddings, "response_type": "embeddings_by_type",
                  "meta": {"api_version": {"version": "2"}, "billed_units": tokens, "tokens": tokens}}
        if texts is not None:
            answer["texts"] = texts
        return Response(200, orjson.dumps(answer))

    def _prefix(self, input_type: str | None) -> str:
        """The prompt prefix the model gives input_type ("" for none)."""
        if input_type is None:
            return ""
        if self.prompts is None:
            if input_type in COHERE_INPUT_TYPES and input_type != "image":
                return ""
            raise APIError(400, f"Unsupported input_type {brief(input_type)}: this model defines no "
                           f"prompts, so only Cohere's text types ({', '.join(COHERE_INPUT_TYPES[:4])}) "
                           "are read, as the bare text", "input_type")
        for name in (input_type, *_ST_NAMES.get(input_type, ())):
            if name in self.prompts:
                return self.prompts[name]
        raise APIError(400, f"Unsupported input_type {brief(input_type)}. Supported values: "
                       f"{', '.join(sorted(self.prompts))}", "input_type")


def _embedding_types(value) -> list[str]:
    if value is None:
        return ["float"]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise APIError(400, "embedding_types must be a non-empty list of strings", "embedding_types")
    for kind in value:
        if kind not in EMBEDDING_TYPES:
            raise APIError(400, f"embedding_types: {brief(kind)} is not supported; only "
                           f"{', '.join(EMBEDDING_TYPES)}", "embedding_types")
    return list(dict.fromkeys(value))


def _input_texts(inputs, prefix: str) -> list[str]:
    """Each input's text parts (joined with newlines, as chat parts are), prefixed."""
    if not isinstance(inputs, list) or not inputs:
        raise APIError(400, "inputs must be a non-empty list of {\"content\": [...]} objects", "inputs")
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"inputs holds {len(inputs)} inputs; at most {MAX_INPUTS} may be "
                       "embedded in one request", "inputs")
    out = []
    for i, item in enumerate(inputs):
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, list) or not content:
            raise APIError(400, f"inputs[{i}].content must be a non-empty list of parts", "inputs")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"inputs[{i}].content[{j}]: only text parts ({{\"type\": \"text\", "
                               f"\"text\": ...}}) are supported, got {brief(kind)}", "inputs")
            parts.append(part["text"])
        out.append(prefix + "\n".join(parts))  # the prompt once, before the input's text
    return out


def _typed(vectors: torch.Tensor, kind: str):
    """[n, d] float32 vectors as Cohere's embedding type kind."""
    if kind == "float":
        return vectors.tolist()
    if kind == "base64":
        return [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii") for v in vectors]
    if vectors.shape[1] % 8:
        raise APIError(400, f"embedding_types {kind}: the embedding's {vectors.shape[1]} dimensions "
                       "are not a multiple of 8", "embedding_types")
    bits = (vectors >= 0).to(torch.int64).reshape(vectors.shape[0], -1, 8)
    packed = (bits << torch.arange(7, -1, -1)).sum(dim=-1)  # the first dimension the high bit
    return (packed - 128 if kind == "binary" else packed).tolist()
