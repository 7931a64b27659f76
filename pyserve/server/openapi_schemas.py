"""The JSON Schemas (2020-12, as OpenAPI 3.1 reads them) of pyserve's request and response
bodies, for /openapi.json (server/openapi.py). Written by hand from what the readers in
server/openai/, server/anthropic/ and sampling_params.py enforce: a body that a schema here
allows is one the route reads (it may still refuse it for what JSON Schema cannot say, e.g.
min_tokens above max_tokens, or a prompt longer than the model), and every bound the readers
check is stated. Types are the canonical ones a client sends; the readers are laxer (vLLM's
pydantic lax mode: "3" for 3), which a schema need not advertise.

Request objects allow properties beyond the listed ones where the route logs and ignores them
(vLLM's habit on completions and chat); /v1/responses refuses unknown fields, and says so."""

from __future__ import annotations

from pyserve.server.anthropic.request import REFUSED as ANTHROPIC_REFUSED
from pyserve.server.openai.cohere_embed import EMBEDDING_TYPES as COHERE_EMBEDDING_TYPES
from pyserve.server.openai.embeddings import EMBED_DTYPES, ENCODING_FORMATS, ENDIANNESS
from pyserve.server.openai.cohere_embed import TRUNCATES as COHERE_TRUNCATES
from pyserve.server.openai.messages import REASONING_EFFORTS
from pyserve.server.openai.responses.translate import INCLUDES as RESPONSES_INCLUDES
from pyserve.server.openai.responses.translate import SUMMARIES
from pyserve.server.request_limits import MAX_N, MAX_STOP, MAX_STOP_CHARS

INT64 = {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1}
BOOL = {"type": "boolean"}
STRING = {"type": "string"}
NUMBER = {"type": "number"}


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: dict, required: tuple[str, ...] = (), extra: bool = True, **more) -> dict:
    schema = {"type": "object", "properties": properties, **more}
    if required:
        schema["required"] = list(required)
    if not extra:
        schema["additionalProperties"] = False
    return schema


def _int(low: int | None = None, high: int | None = None) -> dict:
    schema = {"type": "integer"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return schema


def _number(low: float | None = None, high: float | None = None, above: float | None = None) -> dict:
    schema = {"type": "number"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    if above is not None:
        schema["exclusiveMinimum"] = above
    return schema


_MAX_N, _MAX_STOP = MAX_N, MAX_STOP
_STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                    "maxItems": _MAX_STOP}]}
_TOKEN_IDS = {"type": "array", "items": _int(0), "minItems": 1}


def _sampling(facts) -> dict:
    """params._FIELDS with SamplingParams' bounds; null is each field's default."""
    fields = {
        "n": _int(1, _MAX_N), "temperature": _number(0), "top_p": _number(high=1, above=0),
        "top_k": _int(-1), "min_p": _number(0, 1), "presence_penalty": _number(-2, 2),
        "frequency_penalty": _number(-2, 2), "repetition_penalty": _number(above=0),
        "seed": INT64, "stop": _STOP,
        "stop_token_ids": {"type": "array", "items": _int(0), "maxItems": _MAX_STOP},
        "ignore_eos": BOOL, "min_tokens": _int(0),
        # -1: none; a budget also needs --reasoning-parser (a 400 without it)
        "thinking_token_budget": {"anyOf": [{"const": -1}, _int(0)]},
        "logit_bias": {"type": "object", "propertyNames": {"pattern": r"^\s*[+-]?[0-9]+\s*$"},
                       "additionalProperties": NUMBER},
        "skip_special_tokens": BOOL, "include_stop_str_in_output": BOOL,
        "spaces_between_special_tokens": BOOL, "prompt_logprobs": _int(-1),
        "stream": BOOL,
        "stream_options": obj({"include_usage": BOOL, "continuous_usage_stats": BOOL}),
        "priority": INT64, "request_id": STRING,
        "truncate_prompt_tokens": {"anyOf": [{"const": -1}, _int(1, facts.max_model_len)]},
        "truncation_side": {"enum": ["left", "right"]},
        "add_special_tokens": BOOL, "return_token_ids": BOOL, "return_tokens_as_token_ids": BOOL,
        "use_beam_search": BOOL, "length_penalty": NUMBER,
        "best_of": _int(high=1),  # best_of > 1 is refused
        "user": STRING,
        **_structured(),
    }
    return {name: nullable(schema) for name, schema in fields.items()}


def _structured() -> dict:
    """server/openai/structured.py: at most one constraint per request."""
    return {
        "response_format": {"oneOf": [
            obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            obj({"type": {"const": "json_schema"},
                 "json_schema": obj({"name": STRING, "schema": {"type": "object"}, "strict": BOOL},
                                    ("schema",))}, ("type", "json_schema")),
            obj({"type": {"const": "structural_tag"}}, ("type",))]},
        "structured_outputs": obj({
            "json": {"type": ["object", "string"]}, "regex": STRING,
            "choice": {"type": "array", "items": STRING, "minItems": 1}, "grammar": STRING,
            "json_object": BOOL, "structural_tag": {"type": ["string", "object", "array"]},
            "disable_any_whitespace": BOOL, "disable_additional_properties": BOOL,
            "disable_fallback": BOOL}, extra=False, minProperties=1),
        "guided_json": {"type": ["object", "string"]}, "guided_regex": STRING,
        "guided_choice": {"type": "array", "items": STRING}, "guided_grammar": STRING,
        "structural_tag": {"type": ["string", "object"]},
        "guided_decoding_backend": {"enum": ["", "auto", "xgrammar"]},
    }


def _model(facts) -> dict:
    # "" and null mean the served model, as in vLLM; any other name is a 404
    return nullable({"enum": [*facts.model_names, ""]})


_TEXT_PART = obj({"type": {"const": "text"}, "text": STRING}, ("type", "text"))
_CHAT_MESSAGE = obj({
    "role": {"type": "string", "minLength": 1},
    "content": {"anyOf": [STRING, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "name": STRING, "tool_call_id": STRING,
    "tool_calls": {"type": "array", "items": {"type": "object"}}}, ("role",))
_TOOL = obj({"type": {"const": "function"},
             "function": obj({"name": STRING, "description": STRING,
                              "parameters": {"type": "object"}}, ("name",))}, ("type", "function"))
_TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]},
                          obj({"type": {"const": "function"},
                               "function": obj({"name": STRING}, ("name",))}, ("type", "function"))]}


def _chat_template_fields() -> dict:
    return {"chat_template": nullable(STRING), "chat_template_kwargs": nullable({"type": "object"}),
            "add_generation_prompt": nullable(BOOL), "continue_final_message": nullable(BOOL),
            "documents": nullable({"type": "array", "items": {"type": "object"}})}


def _requests(facts) -> dict:
    sampling = _sampling(facts)
    prompt = {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                        {"type": "array", "minItems": 1,
                         "items": {"anyOf": [STRING, _TOKEN_IDS]}}]}
    completion = obj({"model": _model(facts), "prompt": prompt, **sampling,
                      "max_tokens": nullable(_int(0)), "logprobs": nullable(_int(-1)),
                      "echo": nullable(BOOL)}, ("prompt",))
    chat = obj({"model": _model(facts), "messages": {"type": "array", "items": _CHAT_MESSAGE,
                                                     "minItems": 1},
                **sampling, "max_tokens": nullable(_int(1)),
                "max_completion_tokens": nullable(_int(1)), "logprobs": nullable(BOOL),
                "top_logprobs": nullable(_int(-1)), "echo": nullable(BOOL),
                "tools": nullable({"type": "array", "items": _TOOL}),
                "tool_choice": nullable(_TOOL_CHOICE), "parallel_tool_calls": nullable(BOOL),
                "include_reasoning": nullable(BOOL),
                "reasoning_effort": nullable({"enum": list(REASONING_EFFORTS)}),
                "modalities": nullable({"const": ["text"]}),
                "function_call": nullable({"enum": ["none", "auto"]}),
                **_chat_template_fields()}, ("messages",))
    embedding = _embedding(facts)
    tokenize = {"anyOf": [
        obj({"model": _model(facts), "prompt": STRING, "add_special_tokens": nullable(BOOL),
             "return_token_strs": nullable(BOOL)}, ("prompt",)),
        obj({"model": _model(facts), "messages": chat["properties"]["messages"],
             "tools": nullable({"type": "array", "items": _TOOL}),
             "return_token_strs": nullable(BOOL), "add_special_tokens": nullable(BOOL),
             **_chat_template_fields()}, ("messages",))]}
    detokenize = obj({"model": _model(facts), "tokens": {
        "type": "array", "items": _int(0, facts.vocab_size - 1)}}, ("tokens",))
    return {"CompletionRequest": completion, "ChatCompletionRequest": chat,
            "EmbeddingRequest": embedding,
            "PoolingRequest": {**embedding, "properties": {
                **embedding["properties"], "task": nullable({"enum": ["token_embed", "embed"]})}},
            **_scoring(facts),
            "TokenizeRequest": tokenize, "DetokenizeRequest": detokenize,
            "InvocationsRequest": {"anyOf": [ref("ChatCompletionRequest"), ref("CompletionRequest"),
                                             ref("EmbeddingRequest")]}}


def _scoring(facts) -> dict:
    """server/openai/scores.py: /score's text pairs and /rerank's query and documents."""
    text = {"type": "string", "minLength": 1}
    texts = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}]}
    shared = {"model": _model(facts), "user": nullable(STRING), "add_special_tokens": nullable(BOOL),
              "truncate_prompt_tokens": nullable({"anyOf": [{"const": -1}, _int(1, facts.max_model_len)]}),
              "truncation_side": nullable({"enum": ["left", "right"]}),
              "priority": nullable(INT64), "request_id": nullable(STRING)}
    shared.update({"max_tokens_per_query": nullable(_int(0)), "max_tokens_per_doc": nullable(_int(0)),
                   "padding": nullable({"enum": ["do_not_pad", "longest"]})})
    pairs = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
    return {
        "ScoreRequest": obj({**shared, **{name: texts for pair in pairs for name in pair},
                             "encoding_format": nullable({"const": "float"})},
                            anyOf=[{"required": list(pair)} for pair in pairs]),
        "RerankRequest": obj({**shared, "query": text, "documents": {"anyOf": [text, {
            "type": "array", "minItems": 1, "items": {"anyOf": [text, obj({"text": text}, ("text",))]}}]},
            "top_n": nullable(_int(0)), "return_documents": nullable(BOOL)}, ("query", "documents")),
        # server/openai/cohere_embed.py
        "CohereEmbedRequest": obj({
            "model": _model(facts), "input_type": nullable(STRING), "images": {"type": "null"},
            "texts": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 2048},
            "inputs": {"type": "array", "minItems": 1, "maxItems": 2048, "items": obj({"content": {
                "type": "array", "minItems": 1, "items": obj({"type": {"const": "text"}, "text": STRING},
                                                             ("type", "text"))}}, ("content",))},
            "output_dimension": nullable(_int(1)),
            "embedding_types": nullable({"type": "array", "minItems": 1,
                                         "items": {"enum": list(COHERE_EMBEDDING_TYPES)}}),
            "truncate": nullable({"enum": list(COHERE_TRUNCATES)}), "max_tokens": nullable(_int(1)),
            "priority": nullable(INT64), "request_id": nullable(STRING)},
            # texts or inputs, not both
            oneOf=[{"required": ["texts"], "not": {"required": ["inputs"]}},
                   {"required": ["inputs"], "not": {"required": ["texts"]}}])}


def _embedding(facts) -> dict:
    """server/openai/embeddings.py: `input` or (vLLM's chat form) `messages`, not both."""
    inputs = {"anyOf": [STRING, {"type": "array", "items": STRING, "minItems": 1, "maxItems": 2048},
                        _TOKEN_IDS,
                        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 2048}]}
    return obj({
        "model": _model(facts), "input": inputs,
        "messages": {"type": "array", "items": _CHAT_MESSAGE, "minItems": 1},
        "encoding_format": nullable({"enum": list(ENCODING_FORMATS)}),
        "dimensions": nullable(_int(1)), "user": nullable(STRING),
        "truncate_prompt_tokens": nullable({"anyOf": [{"const": -1}, _int(1, facts.max_model_len)]}),
        "truncation_side": nullable({"enum": ["left", "right"]}),
        "add_special_tokens": nullable(BOOL), "priority": nullable(INT64),
        "request_id": nullable(STRING), "normalize": nullable(BOOL), "use_activation": nullable(BOOL),
        "embed_dtype": nullable({"enum": list(EMBED_DTYPES)}),
        "endianness": nullable({"enum": list(ENDIANNESS)}), **_chat_template_fields()},
        oneOf=[{"required": ["input"]}, {"required": ["messages"]}])


def _anthropic(facts) -> dict:
    """server/anthropic/request.py: text, tool_use and tool_result blocks; max_tokens required."""
    block = {"anyOf": [
        _TEXT_PART,
        obj({"type": {"const": "tool_use"}, "id": STRING, "name": STRING,
             "input": {"type": "object"}}, ("type", "id", "name")),
        obj({"type": {"const": "tool_result"}, "tool_use_id": STRING,
             "content": {"anyOf": [STRING, {"type": "array", "items": _TEXT_PART}]},
             "is_error": BOOL}, ("type", "tool_use_id"))]}
    message = obj({"role": {"enum": ["user", "assistant"]},
                   "content": {"anyOf": [STRING, {"type": "array", "items": block, "minItems": 1}]}},
                  ("role", "content"), extra=False)
    tool = obj({"type": nullable({"const": "custom"}), "name": {"type": "string", "minLength": 1},
                "description": STRING, "input_schema": {"type": "object"}}, ("name", "input_schema"))
    prompt = {
        "model": {"type": "string", "enum": [*facts.model_names, ""]},
        "messages": {"type": "array", "items": message, "minItems": 1},
        "system": {"anyOf": [STRING, {"type": "array", "items": _TEXT_PART}]},
        "tools": {"type": "array", "items": tool},
        "tool_choice": obj({"type": {"enum": ["auto", "any", "tool", "none"]}, "name": STRING,
                            "disable_parallel_tool_use": BOOL}, ("type",)),
        "thinking": obj({"type": {"const": "disabled"}}, ("type",)),
        "metadata": {"type": "object"}, "chat_template_kwargs": {"type": "object"},
        "output_config": obj({
            "format": nullable(obj({"type": {"const": "json_schema"}, "schema": {"type": "object"}},
                                   ("type", "schema"), extra=False)),
            "effort": nullable({"enum": ["low", "medium", "high", "xhigh", "max"]})}, extra=False),
        # what this server cannot honour is a 400 unless null; other unknown fields are ignored
        **{name: {"type": "null"} for name in sorted(ANTHROPIC_REFUSED)}}
    generation = {"max_tokens": _int(1, facts.max_model_len),
                  "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1},
                                     "maxItems": _MAX_STOP},
                  "temperature": _number(0), "top_p": _number(high=1, above=0), "top_k": _int(-1),
                  "stream": BOOL, "service_tier": STRING}
    messages = obj({**prompt, **generation}, ("model", "messages", "max_tokens"))
    # count_tokens counts a prompt: generation fields there are refused
    count = obj({**prompt, **{name: {"type": "null"} for name in generation}}, ("model", "messages"))
    return {"AnthropicMessagesRequest": messages, "AnthropicCountTokensRequest": count}


def _responses(facts) -> dict:
    """server/openai/responses/translate.py: unknown fields are ignored (logged), as on chat."""
    part = obj({"type": {"enum": ["input_text", "output_text"]}, "text": STRING}, ("type", "text"))
    item = {"anyOf": [
        obj({"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
             "content": {"anyOf": [STRING, {"type": "array", "items": part}]}}, ("role", "content")),
        obj({"type": {"const": "function_call"}, "call_id": STRING, "name": STRING,
             "arguments": STRING}, ("type", "call_id", "name", "arguments")),
        obj({"type": {"const": "function_call_output"}, "call_id": STRING, "output": STRING},
            ("type", "call_id", "output")),
        obj({"type": {"const": "reasoning"},
             "summary": {"type": "array", "items": obj({"type": {"const": "summary_text"}, "text": STRING},
                                                       ("type", "text"))},
             "content": nullable({"type": "array", "items": obj(
                 {"type": {"const": "reasoning_text"}, "text": STRING}, ("type", "text"))})},
            ("type",))]}
    function = obj({"type": {"const": "function"}, "name": STRING, "description": nullable(STRING),
                    "parameters": nullable({"type": "object"}), "strict": nullable(BOOL)}, ("type", "name"))
    namespace = obj({"type": {"const": "namespace"}, "name": STRING, "description": nullable(STRING),
                     "tools": {"type": "array", "items": function, "minItems": 1}}, ("type", "name", "tools"))
    tool = {"anyOf": [function, namespace]}
    fmt = {"anyOf": [obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
                     obj({"type": {"const": "json_schema"}, "name": STRING,
                          "schema": {"type": "object"}, "strict": nullable(BOOL)},
                         ("type", "schema"))]}
    summary = {"enum": list(SUMMARIES)}
    sampling = _sampling(facts)
    passed = {k: sampling[k] for k in ("top_k", "repetition_penalty", "seed", "stop", "ignore_eos",
                                       "structured_outputs", "skip_special_tokens",
                                       "include_stop_str_in_output", "logit_bias", "priority",
                                       "request_id")}
    request = obj({
        "model": _model(facts), "input": {"anyOf": [STRING, {"type": "array", "items": item}]},
        "instructions": nullable(STRING), "max_output_tokens": nullable(_int(1)),
        "temperature": sampling["temperature"], "top_p": sampling["top_p"],
        "tools": nullable({"type": "array", "items": tool}),
        "tool_choice": nullable({"anyOf": [{"enum": ["none", "auto", "required"]},
                                           obj({"type": {"const": "function"}, "name": STRING},
                                               ("type", "name"))]}),
        "text": nullable(obj({"format": fmt})), "stream": nullable(BOOL), "store": nullable(BOOL),
        "previous_response_id": nullable(STRING), "parallel_tool_calls": nullable(BOOL),
        "include": nullable({"type": "array", "items": {"enum": list(RESPONSES_INCLUDES)}}),
        **passed, "metadata": nullable({"type": "object"}), "user": nullable(STRING),
        "service_tier": nullable(STRING), "safety_identifier": nullable(STRING),
        "prompt_cache_key": nullable(STRING), "truncation": nullable({"enum": ["auto", "disabled"]}),
        "background": nullable(BOOL), "top_logprobs": nullable(_int(0, 20)),
        "max_tool_calls": nullable(_int(1)),
        "reasoning": nullable(obj({"effort": nullable({"enum": list(REASONING_EFFORTS)}),
                                   "summary": nullable(summary), "generate_summary": nullable(summary),
                                   "context": nullable({"enum": ["auto", "current_turn", "all_turns"]}),
                                   "mode": nullable({"const": "standard"})},
                                  extra=False))},
        ("input",),
        # background needs store (null is true)
        **{"if": {"properties": {"background": {"const": True}}, "required": ["background"]},
           "then": {"properties": {"store": {"not": {"const": False}}}}})
    return {"ResponsesRequest": request}


def _responses_out() -> dict:
    usage = obj({"prompt_tokens": _int(0), "completion_tokens": _int(0), "total_tokens": _int(0)},
                ("prompt_tokens", "completion_tokens", "total_tokens"))
    header = {"id": STRING, "created": _int(0), "model": STRING}
    choice = obj({"index": _int(0), "text": STRING, "finish_reason": nullable(STRING)},
                 ("index", "text", "finish_reason"))
    message = obj({"role": STRING, "content": nullable(STRING),
                   "tool_calls": nullable({"type": "array"})}, ("role", "content"))
    chat_choice = obj({"index": _int(0), "message": message, "finish_reason": nullable(STRING)},
                      ("index", "message", "finish_reason"))
    vector = {"anyOf": [{"type": "array", "items": NUMBER},
                        {"type": "array", "items": {"type": "array", "items": NUMBER}}, STRING]}
    pooled = lambda key: obj({"id": STRING, "object": {"const": "list"}, "created": _int(0),  # noqa: E731
                              "model": STRING, "usage": obj({"prompt_tokens": _int(0)}),
                              "data": {"type": "array", "items": obj(
                                  {"index": _int(0), "object": STRING, key: vector},
                                  ("index", "object", key))}}, ("object", "data", "usage"))
    return {
        "Usage": usage,
        "Completion": obj({**header, "object": {"const": "text_completion"},
                           "choices": {"type": "array", "items": choice}, "usage": ref("Usage")},
                          ("id", "object", "created", "model", "choices", "usage")),
        "ChatCompletion": obj({**header, "object": {"const": "chat.completion"},
                               "choices": {"type": "array", "items": chat_choice},
                               "usage": ref("Usage")},
                              ("id", "object", "created", "model", "choices", "usage")),
        "EmbeddingList": pooled("embedding"), "PoolingList": pooled("data"),
        "ScoreList": obj({"id": STRING, "object": {"const": "list"}, "created": _int(0), "model": STRING,
                          "usage": obj({"prompt_tokens": _int(0)}),
                          "data": {"type": "array", "items": obj(
                              {"index": _int(0), "object": {"const": "score"}, "score": NUMBER},
                              ("index", "object", "score"))}}, ("object", "data", "usage")),
        "RerankList": obj({"id": STRING, "model": STRING, "usage": obj({"total_tokens": _int(0)}),
                           "results": {"type": "array", "items": obj(
                               {"index": _int(0), "relevance_score": NUMBER,
                                "document": nullable(obj({"text": STRING}, ("text",)))},
                               ("index", "relevance_score"))}}, ("results", "usage")),
        "ResponseInputTokens": obj({"object": {"const": "response.input_tokens"}, "input_tokens": _int(0)},
                                   ("object", "input_tokens")),
        "CohereEmbedList": obj({"id": STRING, "embeddings": {"type": "object"},
                                "texts": {"type": "array", "items": STRING},
                                "meta": obj({"api_version": obj({"version": STRING})})},
                               ("id", "embeddings")),
        "Tokenized": obj({"count": _int(0), "max_model_len": _int(1),
                          "tokens": {"type": "array", "items": _int(0)},
                          "token_strs": nullable({"type": "array", "items": STRING})},
                         ("count", "max_model_len", "tokens")),
        "Detokenized": obj({"prompt": STRING}, ("prompt",)),
        "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": obj(
            {"id": STRING, "object": {"const": "model"}, "created": _int(0), "owned_by": STRING,
             "max_model_len": _int(1), "supported_tasks": {"type": "array", "items": STRING}},
            ("id", "object", "created", "owned_by"))}}, ("object", "data")),
        "AnthropicMessage": obj({"id": STRING, "type": {"const": "message"},
                                 "role": {"const": "assistant"}, "model": STRING,
                                 "content": {"type": "array", "items": obj({"type": STRING}, ("type",))},
                                 "stop_reason": nullable(STRING),
                                 "usage": obj({"input_tokens": _int(0), "output_tokens": _int(0)},
                                              ("input_tokens", "output_tokens"))},
                                ("id", "type", "role", "content", "model", "stop_reason", "usage")),
        "AnthropicTokenCount": obj({"input_tokens": _int(0)}, ("input_tokens",)),
        "Response": obj({"id": STRING, "object": {"const": "response"}, "created_at": NUMBER,
                         "model": STRING, "output": {"type": "array"},
                         "status": {"enum": ["queued", "in_progress", "completed", "incomplete",
                                             "failed", "cancelled"]}},
                        ("id", "object", "model", "status", "output")),
        "DeletedResponse": obj({"id": STRING, "object": {"const": "response"},
                                "deleted": {"const": True}}, ("id", "object", "deleted")),
        "Error": obj({"error": obj({"message": STRING, "type": STRING, "param": nullable(STRING),
                                    "code": _int(100, 599)}, ("message", "type", "param", "code"))},
                     ("error",)),
        "AnthropicError": obj({"type": {"const": "error"}, "error": obj(
            {"type": STRING, "message": STRING}, ("type", "message"))}, ("type", "error")),
        "Health": obj({"status": {"enum": ["ok", "loading", "dead", "stalled", "shutting down"]}},
                      ("status",)),
    }


def component_schemas(facts) -> dict:
    """facts: the served model's names, max_model_len and vocab_size (server/openapi.py)."""
    return {**_requests(facts), **_anthropic(facts), **_responses(facts), **_responses_out()}
