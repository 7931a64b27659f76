"""GET /openapi.json against the router's own table: every served route is in the document and
nothing else is, the document is valid OpenAPI 3.1 (the 3.1 meta-schema, each body schema a
valid 2020-12 schema, schemathesis loading it), its body schemas agree with what the readers
accept and refuse, and it is behind the API key like every other route."""

import jsonschema
import orjson
import pytest
import schemathesis
import uvloop
from schemathesis.specs.openapi.definitions import OPENAPI_31

from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.core import EngineCore
from pyserve.server.app import ServerState, _build_routes
from pyserve.server.auth import OPEN_PATHS
from pyserve.server.http import Request
from pyserve.server.openapi import OPERATIONS, APIFacts, openapi_document

KEY = "fuzz-key"
OPTIONAL = {("GET", "/tokenizer_info"), ("GET", "/debug/books")}  # served only when asked for


def make_state(model: str, **flags) -> ServerState:
    config = Config.from_flat(model=model, kv_cache_memory="16MiB", **flags)
    state = ServerState(config)
    state.engine = AsyncEngine(EngineCore(config))
    state.router = _build_routes(state, state.engine)
    state.phase = "ready"
    return state


@pytest.fixture(scope="module")
def full(tiny_model_factory):
    """Every optional route on, behind a key."""
    return make_state(str(tiny_model_factory("llama")), api_key=[KEY],
                      enable_tokenizer_info_endpoint=True, enable_debug_endpoints=True)


@pytest.fixture(scope="module")
def plain(tiny_model_factory):
    return make_state(str(tiny_model_factory("llama")))


def ask(state, target, headers=None):
    return uvloop.run(state.handle(Request("GET", target, dict(headers or {}))))


def fetch(state, key=None) -> dict:
    response = ask(state, "/openapi.json", {"authorization": f"Bearer {key}"} if key else {})
    assert response.status == 200 and response.content_type == "application/json"
    return orjson.loads(response.body)


def operations(document) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item}


@pytest.mark.parametrize("which", ["full", "plain"])
def test_the_document_lists_exactly_the_served_routes(which, request):
    state = request.getfixturevalue(which)
    routes = state.router.routes()
    listed = operations(fetch(state, KEY if which == "full" else None))
    served = {r for r in routes if r[0] != "HEAD"} | {("GET", p) for p in OPEN_PATHS}
    assert listed == served
    # HEAD is answered on exactly the GET routes (the document says so once, in its info)
    assert {p for m, p in routes if m == "HEAD"} == {p for m, p in routes if m == "GET"}
    # the liveness routes really are answered without the router (a 404 would mean they moved)
    for path in OPEN_PATHS:
        assert ask(state, path).status in (200, 503), path
    if which == "full":  # every description in the table is of a route some server serves
        assert set(OPERATIONS) == listed
    else:
        assert listed == set(OPERATIONS) - OPTIONAL


def test_a_route_without_a_description_fails_the_build():
    facts = APIFacts("0", ("m",), 512, 512, False)
    with pytest.raises(ValueError, match="POST /v1/new_route"):
        openapi_document([("POST", "/v1/new_route")], facts)


@pytest.mark.parametrize("which", ["full", "plain"])
def test_the_document_is_valid_openapi_3_1(which, request):
    state = request.getfixturevalue(which)
    document = fetch(state, KEY if which == "full" else None)
    assert document["openapi"] == "3.1.0"
    jsonschema.Draft202012Validator(OPENAPI_31).validate(document)
    for name, schema in document["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    loaded = schemathesis.openapi.from_dict(document)
    ops = [result.ok() for result in loaded.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} == operations(document)
    assert ("securitySchemes" in document["components"]) == (which == "full")


def test_openapi_json_needs_the_key_when_one_is_set(full, plain):
    refused = ask(full, "/openapi.json")
    assert refused.status == 401 and ("www-authenticate", "Bearer") in refused.headers
    assert ask(full, "/openapi.json", {"x-api-key": KEY}).status == 200
    assert ask(plain, "/openapi.json").status == 200


def body_schema(document, path) -> jsonschema.Draft202012Validator:
    """A validator of path's POST body (its $refs resolve against the document's components)."""
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


ACCEPTED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                             "temperature": 0, "n": 2, "stop": ["."]},
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1, "seed": 7},
    "/v1/embeddings": {"input": ["a", "b"], "encoding_format": "base64"},
    "/pooling": {"input": "a", "task": "embed"},
    "/score": {"text_1": "a", "text_2": ["b", "c"]},
    "/v1/rerank": {"query": "a", "documents": ["b", {"text": "c"}], "top_n": 1},
    "/tokenize": {"prompt": "hello", "return_token_strs": True},
    "/detokenize": {"tokens": [1, 2, 511]},
    "/v1/messages": {"model": "", "max_tokens": 2,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}
REFUSED = [  # each one a body the route answers with a 400, the bound stated in the schema
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 65}),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}),
    ("/v1/completions", {"prompt": "x", "thinking_token_budget": -2}),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}),
    ("/score", {"text_1": "a", "text_2": []}),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}),
    ("/detokenize", {"tokens": [512]}),
    ("/v1/messages", {"model": "", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "high", "summary": "brief"}}),
    ("/v1/responses", {"input": "hi", "truncation": "middle"}),
    ("/v1/responses", {"input": "hi", "top_logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "reasoning_effort": "extreme"}),
    ("/v1/messages", {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                      "mcp_servers": [{"name": "x"}]}),
    ("/v1/messages/count_tokens", {"model": "", "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "hi"}]}),
]


def test_body_schemas_agree_with_the_readers(tiny_model_factory):
    state = make_state(str(tiny_model_factory("llama")))  # its own: its engine is shut down here
    document = fetch(state)

    async def answer(path, body):
        response = await state.handle(Request("POST", path, {}, orjson.dumps(body)))
        return response.status, response.body

    async def main():
        state.engine.start()
        try:
            accepted = {path: await answer(path, body) for path, body in ACCEPTED.items()}
            refused = [(path, body, (await answer(path, body))[0]) for path, body in REFUSED]
        finally:
            await state.engine.shutdown()
        return accepted, refused

    accepted, refused = uvloop.run(main())
    for path, body in ACCEPTED.items():
        body_schema(document, path).validate(body)
        assert accepted[path][0] == 200, (path, accepted[path])
    for path, body, status in refused:
        assert not body_schema(document, path).is_valid(body), (path, body)
        assert status == 400, (path, body, status)
