"""The FastAPI app: thin routes over `serving`, `responses`, `metrics` and `admin`.

Auth: with an API key configured, every /v1 route and /tokenize, /detokenize need `Authorization: Bearer
KEY`; /admin needs the separate admin token; /health, /ready, /metrics and /version are open (probes and
scrapers carry no secrets).
The completion routes check the key before they read the body (within `BodyLimit`), then hand it to
the thread pool (`serving.prepare`); their OpenAPI bodies are declared from the pydantic models.
A request whose client disconnects is aborted: a stream when Starlette cancels it, a non-streaming
request through a watcher on the connection.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from iterserve.server.api import admin
from iterserve.server.api import tokenize as tokenizing
from iterserve.server.api.body_limit import BodyLimit
from iterserve.server.api.errors import APIError, install_error_handlers
from iterserve.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KnobsPatch,
    TokenizeCompletionRequest,
    openapi_body,
    parse_body,
)
from iterserve.server.api.response_counter import ResponseCounter
from iterserve.server.api.responses import chat_body, completion_body, stream_events
from iterserve.server.api.serving import ServerState, collect, prepare_in_pool, start
from iterserve.server.engine.core_client import EngineStepError, EngineStoppedError


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _check_token(request: Request, expected: str | None, what: str) -> None:
    if expected is None:
        return
    given = _bearer(request)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(401, f"a valid {what} is required (Authorization: Bearer ...)", code="invalid_api_key")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="iterserve", version="0.1.0",
                  description="OpenAI-compatible continuous-batching LLM server")
    app.state.iterserve = state
    install_error_handlers(app)
    cutoffs = state.metrics
    on_body_timeout = (lambda: cutoffs.observe_cutoff("body_timeout")) if cutoffs else None
    app.add_middleware(BodyLimit, max_bytes=state.limits.max_request_bytes, timeout=state.limits.body_timeout,
                       on_timeout=on_body_timeout)
    app.add_middleware(ResponseCounter, metrics=state.metrics)  # added last: the outermost

    def api_key(request: Request) -> None:
        _check_token(request, state.api_key, "API key")

    def admin_token(request: Request) -> None:
        if state.admin_token is None:
            raise APIError(401, "the admin API is disabled: start the server with --admin-token",
                           code="admin_disabled")
        _check_token(request, state.admin_token, "admin token")

    @app.get("/health")
    async def health():
        return {"status": "ok"} if state.engine.is_running else _unavailable("the engine is not running")

    @app.get("/ready")
    async def ready():
        if state.draining:
            return _unavailable("draining")
        return {"status": "ready"} if state.engine.is_running else _unavailable("the engine is not running")

    @app.get("/metrics")
    async def metrics():
        body = state.metrics.render(state.draining) if state.metrics else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(api_key)])
    async def models():
        engine = state.engine
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "iterserve",
            "root": state.model_name, "parent": None, "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(api_key)], openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await _run(state, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(api_key)],
              openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await _run(state, request, chat=True)

    @app.post("/tokenize", dependencies=[Depends(api_key)], openapi_extra=openapi_body(TokenizeCompletionRequest))
    async def tokenize(request: Request):
        return await tokenizing.in_pool(state, tokenizing.tokenize, await request.body(),
                                        request.headers.get("content-type"))

    @app.post("/detokenize", dependencies=[Depends(api_key)], openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        return await tokenizing.in_pool(state, tokenizing.detokenize, await request.body(),
                                        request.headers.get("content-type"))

    @app.get("/version")
    async def version():
        return tokenizing.version()

    @app.get("/admin/scheduler", dependencies=[Depends(admin_token)])
    async def get_scheduler():
        return admin.describe(state)

    @app.patch("/admin/scheduler", dependencies=[Depends(admin_token)], openapi_extra=openapi_body(KnobsPatch))
    async def patch_scheduler(request: Request):
        # the body is read here, after the admin token's check: no token, no body read
        patch = parse_body(KnobsPatch, await request.body(), request.headers.get("content-type"))
        return await admin.apply(state, patch)

    @app.post("/admin/reset_prefix_cache", dependencies=[Depends(admin_token)])
    async def reset_prefix_cache():
        return await admin.reset_prefix_cache(state)  # no body is read

    return app


def _unavailable(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


async def _run(state: ServerState, request: Request, chat: bool):
    try:
        body = await request.body()
    except ClientDisconnect:
        return Response(status_code=499)  # gone before its body was in: nothing was started
    job = await prepare_in_pool(state, body, request.headers.get("content-type"), chat)
    try:
        queues = await start(state, job)
    except EngineStoppedError as e:
        raise APIError(503, str(e), code="engine_stopped") from None
    if job.stream:
        return StreamingResponse(stream_events(state, job, queues, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    final = await _until_disconnect(request, collect(state, job, queues))
    if final is None:
        return Response(status_code=499)  # nobody is listening; the choices are aborted
    return (chat_body if chat else completion_body)(state, job, final)


async def _until_disconnect(request: Request, work):
    """Run `work`; if the client disconnects first, cancel it (which aborts its requests) -> None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client went away (or this handler was cancelled)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    try:
        return task.result()
    except EngineStepError as e:
        raise APIError(500, str(e), code="engine_error") from None
    except EngineStoppedError as e:
        raise APIError(503, str(e), code="engine_stopped") from None


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
