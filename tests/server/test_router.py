"""The router's one path parameter: '/v1/responses/{response_id}' matches one last segment of
the normalised path, '/v1/responses/{response_id}/cancel' one segment before a fixed tail;
exact routes win, 405 lists the methods, normalisation holds."""

import json

import pytest
import uvloop

from pyserve.server.http import Request, Response
from pyserve.server.router import Router


def error_response(status, message):
    return Response(status, json.dumps({"error": {"message": message}}).encode())


def make():
    router = Router(error_response)

    async def exact(request):
        return Response(200, b"exact")

    def echo(tag):
        async def handler(request):
            return Response(200, json.dumps({tag: request.path_params}).encode())
        return handler

    router.add("POST", "/v1/responses", exact)
    router.add("GET", "/v1/responses/{response_id}", echo("get"))
    router.add("DELETE", "/v1/responses/{response_id}", echo("delete"))
    router.add("POST", "/v1/responses/{response_id}/cancel", echo("cancel"))
    router.add("GET", "/v1/responses/special", exact)
    return router


def ask(router, method, target):
    response = uvloop.run(router(Request(method, target, {})))
    return response.status, response.body, dict(response.headers)


@pytest.mark.parametrize("target", ["/v1/responses/resp_1", "//v1/responses/resp_1/",
                                    "/v1/responses/resp_%31", "/v1/x/../responses/resp_1?a=b",
                                    "http://host/v1/responses/resp_1"])
def test_the_parameter_is_the_last_segment_however_spelled(target):
    assert ask(make(), "GET", target)[:2] == (200, b'{"get": {"response_id": "resp_1"}}')
    assert ask(make(), "DELETE", target)[:2] == (200, b'{"delete": {"response_id": "resp_1"}}')
    assert ask(make(), "HEAD", target)[0] == 200


@pytest.mark.parametrize("target", ["/v1/responses/resp_1/cancel", "//v1/responses/resp_1/cancel/",
                                    "/v1/responses/resp_%31/%63ancel",
                                    "/v1/x/../responses/resp_1/cancel?a=b"])
def test_a_parameter_before_a_fixed_tail(target):
    assert ask(make(), "POST", target)[:2] == (200, b'{"cancel": {"response_id": "resp_1"}}')
    status, _, headers = ask(make(), "GET", target)
    assert status == 405 and headers["allow"] == "POST"


def test_the_parameter_furthest_right_wins_and_a_tail_must_match_whole():
    router = make()

    async def other(request):
        return Response(200, json.dumps({"other": request.path_params}).encode())

    router.add("POST", "/v1/{kind}/cancel", other)
    assert ask(router, "POST", "/v1/batches/cancel")[:2] == (200, b'{"other": {"kind": "batches"}}')
    # both match; the later parameter's route answers, with its own methods
    status, _, headers = ask(router, "POST", "/v1/responses/cancel")
    assert status == 405 and headers["allow"] == "DELETE, GET, HEAD"
    assert ask(router, "GET", "/v1/responses//cancel")[1] == b'{"get": {"response_id": "cancel"}}'
    assert ask(router, "POST", "/v1/responses/r/cancel")[1] == b'{"cancel": {"response_id": "r"}}'
    for target in ("/v1/responses/r/cancel/x", "/v1/responses/r/cancelx", "/v1/batches/x/cancel"):
        assert ask(router, "POST", target)[0] in (404, 405), target


def test_exact_routes_win_and_other_paths_are_404_or_405():
    router = make()
    assert ask(router, "GET", "/v1/responses/special")[:2] == (200, b"exact")
    assert ask(router, "POST", "/v1/responses/")[:2] == (200, b"exact")  # trailing slash: the exact route
    for target in ("/v1/responses/a/b", "/v1/responses/a%2Fb", "/v1/other/a", "/v1/responsesx",
                   "/v1/responses/a/cancel/b"):
        assert ask(router, "GET", target)[0] == 404, target
    status, _, headers = ask(router, "POST", "/v1/responses/resp_1")
    assert status == 405 and headers["allow"] == "DELETE, GET, HEAD"
    assert ask(router, "GET", "/v1/responses")[0] == 405


def test_the_table_lists_parameter_routes_and_refuses_bad_patterns():
    router = make()
    assert ("GET", "/v1/responses/{response_id}") in router.routes()
    assert ("DELETE", "/v1/responses/{response_id}") in router.routes()
    assert ("POST", "/v1/responses/{response_id}/cancel") in router.routes()
    with pytest.raises(ValueError):
        router.add("GET", "/v1/responses/{other}", None)  # one name per place
    with pytest.raises(ValueError):
        router.add("GET", "/v1/responses/{other}/cancel", None)
    for bad in ("/v1/{a}/{b}", "/v1/{a}/x/{b}", "/v1/{not an id}", "/v1/x{a}/cancel", "/v1/{a}x"):
        with pytest.raises(ValueError):
            router.add("GET", bad, None)
