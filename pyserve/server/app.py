"""`python -m pyserve`: the start-up sequence of the seed, adapted to one event loop.

  1. flags -> Config (cli.py)           2. bind the listening socket (a port clash fails fast)
  3. SIGTERM/SIGINT handlers            4-5. build the engine (model, KV cache, scheduler) in a
                                              worker thread while /health answers 503 "loading"
  6. routes and the API-key check       7. serve on the bound socket   8. gc.freeze()
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import orjson

from pyserve import __version__
from pyserve.config import Config
from pyserve.server.auth import OPEN_PATHS, APIKeyCheck
from pyserve.server.cors import CORS
from pyserve.server.errors import (APIError, as_anthropic_error, error_body, error_response,
                                   is_anthropic_path)
from pyserve.server.fd_limit import raise_open_file_limit
from pyserve.server.http import HTTPLimits, HTTPProtocol, Request, Response
from pyserve.server.load import ServerLoad
from pyserve.server.malloc_trim import MallocTrimmer
from pyserve.server.router import Router, normalize_path, without_root_path

logger = logging.getLogger("pyserve")

# /health turns 503 when work is pending and no step has finished for this long (the longest
# CPU step, a full 2048-token prefill of a 135M model, takes about 5 s on two cores).
STALL_LIMIT_S = 60.0
# a client's X-Request-Id: visible ASCII only, so it can be logged and echoed as a header as is
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
# how long a dead engine's server keeps answering /health with 503 before it exits
ENGINE_DEAD_EXIT_DELAY_S = 1.0


class ServerState:
    """What the connection handler consults: loading, ready (with routes) or stopping."""

    def __init__(self, config: Config):
        self.config = config
        self.router: Router | None = None
        self.phase = "loading"
        self.engine = None
        self.cors = CORS(config.server)
        self.auth = APIKeyCheck(config.server.api_key)
        self.load = ServerLoad(config.server.enable_server_load_tracking)  # GET /load

    async def handle(self, request: Request) -> Response:
        request.target = without_root_path(request.target, self.config.server.root_path)
        if CORS.is_preflight(request):
            response = self.cors.preflight(request)
        else:
            response = await self._route(request)
            self.cors.decorate(request, response)
        if self.config.server.enable_request_id_headers:
            # checked in _route, so nothing the client sent can split a response header
            given = request.headers.get("x-request-id")
            ok = given is not None and REQUEST_ID.fullmatch(given)
            response.headers.append(("x-request-id", given if ok else uuid.uuid4().hex))
        return response

    async def _route(self, request: Request) -> Response:
        response = await self._dispatch(request)
        # Anthropic's clients read its error shape on its routes, whatever refused them
        return as_anthropic_error(response) if is_anthropic_path(normalize_path(request.target)) else response

    async def _dispatch(self, request: Request) -> Response:
        path = normalize_path(request.target)
        if self.auth.enabled and path not in OPEN_PATHS:
            request.api_key_index = self.auth.key_index(request)
            if request.api_key_index is None:  # before routing: unknown paths too, and while loading
                return self.auth.refusal(path)
        given = request.headers.get("x-request-id")
        if given is not None and not REQUEST_ID.fullmatch(given):
            return error_response(400, "the X-Request-Id header must be 1 to 256 visible ASCII "
                                  "characters (no spaces; a repeated header counts as one with "
                                  "', ')")
        if path == "/health":
            return self._health()
        if path == "/ping":
            return Response(200, b"{}")
        if path == "/version":
            return Response(200, orjson.dumps({"version": __version__}))
        if self.phase != "ready":
            return error_response(503, f"the server is {self.phase}")
        try:
            response = await self.load.call(path, self.router, request)
        except APIError as exc:
            response = error_response(exc.status, exc.message, exc.param)
            response.headers.extend(exc.headers)
        if self.config.server.enable_log_requests:
            logger.info("%s %s -> %d", request.method, path, response.status)
        return response

    def _health(self) -> Response:
        if self.phase != "ready":
            return Response(503, orjson.dumps({"status": self.phase}))
        if not self.engine.alive:
            return Response(503, b'{"status": "dead"}')
        if self.engine.stalled(STALL_LIMIT_S):
            return Response(503, b'{"status": "stalled"}')
        return Response(200, b'{"status": "ok"}')


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _build_routes(state: ServerState, engine) -> Router:
    from pyserve.server.openai.serving import OpenAIServing, preparse_json

    serving = OpenAIServing(engine, state.config.server)
    router = Router(error_response, preparse_json)

    # an encoder answers embeddings only; a decoder generates and embeds
    tasks = ["embed", "token_embed"] if engine.is_encoder else ["generate", "embed", "token_embed"]

    async def models(request: Request) -> Response:  # one card per served name, as vLLM
        return Response(200, orjson.dumps({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "pyserve",
            "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len,
            "supported_tasks": tasks} for name in serving.names]}))

    def generation(handler):
        """An encoder model cannot generate: its generation routes answer 400 saying so."""
        if not engine.is_encoder:
            return handler

        async def refuse(request: Request) -> Response:
            raise APIError(400, f"the model '{serving.model_name}' is an embedding model: it "
                           "serves /v1/embeddings and /pooling, not text generation", "model")
        refuse.refuses_generation = True  # /invocations sends such bodies to embeddings
        return refuse

    from pyserve.server.metrics import metrics_handler

    router.add("GET", "/v1/models", models)
    router.add("GET", "/metrics", metrics_handler(engine, engine.model_name))
    from pyserve.server.openai.tokenize import TokenizeRoutes

    tokenize = TokenizeRoutes(serving)
    router.add("POST", "/tokenize", tokenize.tokenize)
    router.add("POST", "/detokenize", tokenize.detokenize)
    router.add("POST", "/v1/completions", generation(serving.completions))
    router.add("POST", "/v1/chat/completions", generation(serving.chat))
    from pyserve.server.openai.embeddings import OpenAIServingEmbedding

    embedding = OpenAIServingEmbedding(engine, serving)
    router.add("POST", "/v1/embeddings", embedding.embeddings)
    router.add("POST", "/pooling", embedding.pooling)
    from pyserve.server.openai.scores import OpenAIServingScores

    scores = OpenAIServingScores(embedding)  # vLLM's scoring routes, on the embeddings
    for path in ("/score", "/v1/score"):
        router.add("POST", path, scores.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add("POST", path, scores.rerank)
    from pyserve.server.openai.cohere_embed import CohereEmbed, read_prompts

    # Cohere's Embed v2, as vLLM serves it; its input types read the model's prompts
    router.add("POST", "/v2/embed", CohereEmbed(embedding, read_prompts(engine.model_path)).embed)
    from pyserve.server.anthropic import AnthropicServing

    anthropic = AnthropicServing(serving)  # Anthropic's Messages API, onto the chat path
    router.add("POST", "/v1/messages", generation(anthropic.messages))
    router.add("POST", "/v1/messages/count_tokens", anthropic.count_tokens)
    from pyserve.server.openai.responses import ResponsesAPI, ResponseStore

    # the server's stored responses
    responses = ResponsesAPI(serving, ResponseStore(max_bytes=state.config.server.max_stored_response_bytes))
    router.add("POST", "/v1/responses", generation(responses.create))
    router.add("POST", "/v1/responses/input_tokens", responses.input_tokens)
    router.add("GET", "/v1/responses/{response_id}", responses.retrieve)
    router.add("DELETE", "/v1/responses/{response_id}", responses.delete)
    router.add("POST", "/v1/responses/{response_id}/cancel", responses.cancel)
    _add_vllm_routes(state, router, serving)
    if state.config.server.enable_debug_endpoints:  # else 404, as any unknown path
        from pyserve.server.debug import books_handler

        router.add("GET", "/debug/books", books_handler(engine))
    from pyserve.server.openapi import APIFacts, openapi_handler

    facts = APIFacts(__version__, tuple(serving.names), engine.max_model_len, engine.vocab_size,
                     bool(state.config.server.api_key))
    router.add("GET", "/openapi.json", openapi_handler(router, facts))  # lists every route above
    return router


def _add_vllm_routes(state: ServerState, router: Router, serving) -> None:
    """vLLM's routes beside the APIs: /load, SageMaker's /invocations and, only when asked
    for as vLLM asks, /tokenizer_info."""
    from pyserve.server.sagemaker import Invocations
    from pyserve.server.tokenizer_info import TokenizerInfo

    router.add("GET", "/load", state.load.handler)
    router.add("POST", "/invocations", Invocations(router))
    if state.config.server.enable_tokenizer_info_endpoint:
        router.add("GET", "/tokenizer_info", TokenizerInfo(serving.tokenizer, serving.chat_template))


def keep_parallel_regions_on_the_model_thread(loop: asyncio.AbstractEventLoop) -> None:
    """Only the model thread opens OpenMP teams (pyserve/executor/threads.py says why): the
    loop's thread (this one; it prepares each step's inputs) and the pool that parses requests
    and renders prompts run their parallel regions serially. The server's loop never runs
    the model, so this holds for the life of the process."""
    from pyserve.engine.async_engine import run_parallel_regions_serially, serial_thread_pool

    run_parallel_regions_serially()
    loop.set_default_executor(serial_thread_pool(None, "pyserve-io"))


async def serve(config: Config) -> int:
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    raise_open_file_limit()  # a connection is a descriptor: thousands of streams need thousands
    step = lambda name, since: logger.info("start-up: %s in %.2fs", name, time.perf_counter() - since)
    try:
        sock = _bind(config.server.host, config.server.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", config.server.host, config.server.port, exc)
        return 1
    step(f"bound {config.server.host}:{config.server.port}", t0)

    stop = asyncio.Event()
    grace = {"s": config.server.shutdown_timeout}

    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGINT or stop.is_set():  # SIGINT, or a second signal: no grace
            grace["s"] = 0.0
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    state = ServerState(config)
    srv = config.server
    limits = HTTPLimits(max_header_bytes=srv.max_header_bytes,
                        max_body_bytes=srv.max_request_body_bytes,
                        header_timeout_s=srv.header_timeout, keepalive_timeout_s=srv.keepalive_timeout,
                        body_timeout_s=srv.body_timeout)
    server = await loop.create_server(
        lambda: HTTPProtocol(state.handle, limits, error_body=lambda s, m: error_body(s, m)), sock=sock)

    t = time.perf_counter()
    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.errors import ModelLoadError

    keep_parallel_regions_on_the_model_thread(loop)

    # Everything that runs the model (loading, warm-up, steps) runs on this one thread.
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="pyserve-model")
    build = loop.run_in_executor(model_thread, AsyncEngine.from_config, config, model_thread)
    done, _ = await asyncio.wait({build, asyncio.ensure_future(stop.wait())},
                                 return_when=asyncio.FIRST_COMPLETED)
    if build not in done:
        logger.info("start-up interrupted")
        server.close()
        return 0
    try:
        engine = build.result()
    except ModelLoadError as exc:
        logger.error("%s", exc)
        server.close()
        return 1
    step("engine built (model, KV cache, scheduler)", t)
    tp = config.parallel.tensor_parallel_size
    logger.info("start-up: executor: %s, tensor-parallel size %d (ranks: %s)", engine.executor_description,
                tp, ", ".join(f"{rank} (pid {pid})" for rank, pid in enumerate(engine.rank_pids)))
    t = time.perf_counter()
    warmup = await engine.warm_up()
    step(f"profiling and warm-up forward over {warmup} tokens", t)
    engine.start()
    engine.last_progress = time.monotonic()
    state.engine = engine
    state.router = _build_routes(state, engine)
    state.phase = "ready"
    gc.freeze()
    trimmer = MallocTrimmer()  # glibc: hand the free pages inside malloc's arenas back
    trimmer.start()
    logger.info("start-up: ready in %.2fs; serving %s on http://%s:%d", time.perf_counter() - t0,
                engine.model_name, config.server.host, config.server.port)

    await asyncio.wait({asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.died.wait())},
                       return_when=asyncio.FIRST_COMPLETED)
    if engine.dead_reason is not None:
        # /health answers 503 "dead" for a moment, so a supervisor polling it sees why we go
        logger.error("the engine died (%s); exiting", engine.dead_reason)
        state.phase = "dead"
        await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
        server.close()
        trimmer.stop()
        await engine.shutdown()
        return 1
    logger.info("shutting down: no new requests; up to %.0fs for running ones", grace["s"])
    state.phase = "shutting down"
    server.close()  # stop accepting connections
    deadline = time.monotonic() + grace["s"]
    while engine.has_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    aborted = engine.abort_all()
    if aborted:
        logger.info("aborted %d requests at shutdown", aborted)
        await asyncio.sleep(0.2)  # let their final events reach the clients
    trimmer.stop()
    await engine.shutdown()
    logger.info("shut down")
    return 0
