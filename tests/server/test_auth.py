"""The API-key check without sockets: every route in the router's own table is guarded, the
open routes stay open, header forms and path spellings cannot slip past it."""

import orjson
import pytest
import uvloop

from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.core import EngineCore
from pyserve.server.app import ServerState, _build_routes
from pyserve.server.auth import OPEN_PATHS, APIKeyCheck
from pyserve.server.http import Request

KEYS = ("first-key", "second-key-that-is-longer")


@pytest.fixture(scope="module")
def state(tiny_model_factory):
    config = Config.from_flat(model=str(tiny_model_factory("llama")), kv_cache_memory="16MiB",
                              api_key=list(KEYS), enable_tokenizer_info_endpoint=True,
                              enable_debug_endpoints=True)
    core = EngineCore(config)
    state = ServerState(config)
    state.engine = AsyncEngine(core)
    state.router = _build_routes(state, state.engine)
    state.phase = "ready"
    return state


def ask(state, method, target, headers=None, body=b""):
    response = uvloop.run(state.handle(Request(method, target, dict(headers or {}), body)))
    return response


def test_every_route_in_the_table_needs_a_key(state):
    routes = state.router.routes()
    assert ("GET", "/metrics") in routes and ("POST", "/tokenize") in routes  # the walk is real
    assert {("GET", "/load"), ("POST", "/invocations"), ("GET", "/tokenizer_info"),
            ("GET", "/debug/books")} <= set(routes)
    for method, path in routes:
        response = ask(state, method, path)
        assert response.status == 401, (method, path)
        assert ("www-authenticate", "Bearer") in response.headers
        body = orjson.loads(response.body)
        if path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's shape
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        else:
            assert body["error"]["code"] == 401 and body["error"]["type"] == "AuthenticationError"
        assert not any(key in response.body.decode() for key in KEYS)


def test_each_configured_key_opens_every_route(state):
    for key in KEYS:
        for method, path in state.router.routes():
            response = ask(state, method, path, {"authorization": f"Bearer {key}"},
                           body=b"{}" if method == "POST" else b"")
            assert response.status != 401, (key, method, path)


def test_open_paths_and_preflight(state):
    for path in OPEN_PATHS:  # (/health says 503 "dead": this engine's step loop never started)
        assert ask(state, "GET", path).status in (200, 503), path
    preflight = ask(state, "OPTIONS", "/v1/chat/completions",
                    {"origin": "http://app.example", "access-control-request-method": "POST"})
    assert preflight.status == 200
    # OPTIONS without the preflight headers is a request like any other
    assert ask(state, "OPTIONS", "/v1/chat/completions", {"origin": "http://app.example"}).status == 401


@pytest.mark.parametrize("target", [
    "/v1/models", "//v1/models", "/v1/models/", "/v1/%6Dodels", "/./metrics", "/metrics",
    "/tokenize", "/detokenize", "/V1/MODELS", "/v1/Models", "/Metrics", "/health/../metrics",
    "/%2e%2e/metrics", "http://127.0.0.1:8000/v1/models", "HTTP://x/metrics", "*", "/nothing",
    "/v1/nothing", "/v1", "/", "/metrics?key=first-key", "/v1/models?api_key=first-key"])
def test_path_spellings_are_refused_without_a_key(state, target):
    for method in ("GET", "POST", "HEAD", "DELETE"):
        assert ask(state, method, target).status == 401, (method, target)


def test_absolute_form_reaches_the_route_with_a_key(state):
    response = ask(state, "GET", "http://127.0.0.1:8000/v1/models", {"authorization": f"Bearer {KEYS[0]}"})
    assert response.status == 200
    assert orjson.loads(response.body)["data"][0]["id"] == state.engine.model_name


@pytest.mark.parametrize("value,ok", [
    (f"Bearer {KEYS[0]}", True), (f"bearer {KEYS[0]}", True), (f"BEARER {KEYS[1]}", True),
    (f"Bearer  {KEYS[0]}", False), (f"Bearer {KEYS[0]} ", False), (KEYS[0], False),
    (f"Basic {KEYS[0]}", False), ("Bearer ", False), ("Bearer", False), ("", False),
    (f"Bearer {KEYS[0]}x", False), (f"Bearer {KEYS[0][:-1]}", False),
    (f"Bearer {KEYS[0]}, Bearer {KEYS[0]}", False),  # a repeated header, as the parser joins it
    (f"Bearer\t{KEYS[0]}", False), (f"Token {KEYS[0]}", False)])
def test_header_forms(state, value, ok):
    response = ask(state, "GET", "/v1/models", {"authorization": value})
    assert (response.status == 200) is ok, value


@pytest.mark.parametrize("value,ok", [
    (KEYS[0], True), (KEYS[1], True), (f"{KEYS[0]}x", False), (KEYS[0][:-1], False), ("", False),
    (f" {KEYS[0]}", False), (f"Bearer {KEYS[0]}", False), ("wrong-key", False),
    (f"{KEYS[0]}, {KEYS[0]}", False)])  # a repeated header, as the parser joins it
def test_x_api_key_header(state, value, ok):
    response = ask(state, "GET", "/v1/models", {"x-api-key": value})
    assert (response.status == 200) is ok, value


def test_either_header_may_carry_the_key(state):
    assert ask(state, "GET", "/v1/models", {"x-api-key": KEYS[1],
                                            "authorization": "Bearer wrong"}).status == 200
    assert ask(state, "GET", "/v1/models", {"x-api-key": "wrong",
                                            "authorization": f"Bearer {KEYS[0]}"}).status == 200
    assert ask(state, "GET", "/v1/models", {"x-api-key": "wrong",
                                            "authorization": "Bearer wrong"}).status == 401


@pytest.mark.parametrize("target", ["/v1/messages", "/v1/messages/count_tokens", "//v1/messages/",
                                    "/v1/messages/nothing"])
def test_anthropic_paths_refuse_in_anthropic_shape(state, target):
    for headers in ({}, {"x-api-key": "wrong-key"}, {"authorization": "Bearer wrong-key"}):
        response = ask(state, "POST", target, headers, b"{}")
        assert response.status == 401, (target, headers)
        body = orjson.loads(response.body)
        assert body == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": body["error"]["message"]}}
        assert "x-api-key" in body["error"]["message"]
    response = ask(state, "POST", target, {"x-api-key": KEYS[0]}, b"{}")
    assert response.status != 401


def test_no_keys_means_no_check():
    check = APIKeyCheck(())
    assert not check.enabled
    assert not check.allows(Request("GET", "/", {"authorization": "Bearer x"}))


def test_x_request_id_is_checked(state):
    bad = ask(state, "GET", "/v1/models", {"authorization": f"Bearer {KEYS[0]}",
                                           "x-request-id": "a b"})
    assert bad.status == 400 and "X-Request-Id" in orjson.loads(bad.body)["error"]["message"]
    assert ask(state, "GET", "/v1/models", {"authorization": f"Bearer {KEYS[0]}",
                                            "x-request-id": "x" * 257}).status == 400
