"""The OpenAI-compatible HTTP front on FastAPI + uvicorn: /v1/completions,
/v1/chat/completions (JSON or Server-Sent Events), /v1/models, /health, /metrics.

Handlers validate the body, hand its request (one per prompt of a /v1/completions body whose
`prompt` is a list of them, as OpenAI's batch) to the engine thread and drain their queue
(server/streams.py); they never touch the engine. A client that disconnects has its requests
aborted (the engine frees their KV blocks at the next step). SIGTERM: uvicorn stops accepting, in-flight requests get
GRACE_SECONDS to finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import startup
from ..errors import ConfigError, PromptError, TrtgraphError
from ..formats import openai as oa
from ..inputs import JSONProblem, loads_json, short
from ..runtime.serving.requests import Request as ParsedRequest, Result, parse_request
from .engine_thread import Aborted, EngineThread
from .metrics import CONTENT_TYPE, Metrics
from .streams import Group, events

DRAIN_SECONDS = 5.0  # after SIGTERM, how long in-flight requests may run before they are aborted
GRACE_SECONDS = 10.0  # then uvicorn closes whatever connection is still open
DISCONNECT_POLL_SECONDS = 0.5  # non-streaming requests: how often to look for a gone client
WHERE = "request body"  # how errors name the request
MAX_BODY_BYTES = 32 << 20  # far above any body the limits of a capture can serve


class OpenAIError(Exception):
    """An HTTP error answered with OpenAI's error JSON (formats/openai.py's error_object)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None, body: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = body or oa.error_object(message, param, error_type, code)


def _not_served(model: str, model_name: str) -> OpenAIError:
    return OpenAIError(404, f"model {short(model)} is not served here; this server serves {model_name!r} "
                            f"(GET /v1/models).", "model", code="model_not_found")


def _model_object(model_name: str) -> dict:
    return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "trtgraph"}


def bad_request(message: str) -> OpenAIError:
    return OpenAIError(400, message)


def create_app(thread: EngineThread, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app over an engine thread (started by the caller; stopped when the app shuts down)."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(thread.stop, GRACE_SECONDS)

    app = FastAPI(title="trtgraph", lifespan=lifespan)
    app.state.thread = thread

    @app.exception_handler(OpenAIError)
    async def openai_error(request, exc: OpenAIError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):  # an unknown path, a wrong method: OpenAI's shape too
        return JSONResponse(oa.error_object(f"{request.method} {request.url.path}: {exc.detail}."),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")  # HTTP header bytes, as latin-1 text
        scheme, _, key = given.partition(" ")  # the scheme is case-insensitive (RFC 9110)
        if not (scheme.lower() == "bearer" and secrets.compare_digest(key.encode("latin-1"), api_key.encode())):
            raise OpenAIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`.",
                              error_type="authentication_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": 'Bearer realm="trtgraph"'})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if thread.ready.is_set():
            return {"status": "ok"}
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(thread.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [_model_object(model_name)]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str):
        if model != model_name:
            raise _not_served(model, model_name)
        return _model_object(model_name)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        return await _respond(request, thread, model_name, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request):
        return await _respond(request, thread, model_name, chat=True)

    return app


async def _respond(request: Request, thread: EngineThread, model_name: str, chat: bool):
    if not thread.ready.is_set():
        raise OpenAIError(503, "the engine is still loading; retry when GET /health answers 200.",
                          error_type="server_error", code="loading")
    body = await _body(request)
    if not isinstance(body.get("model", model_name), str):
        raise OpenAIError(400, f"`model` must be a string, the served model's name ({model_name!r}, GET /v1/models); "
                               f"got {short(body['model'])}.", "model")
    if body.get("model", model_name) != model_name:
        raise _not_served(body["model"], model_name)
    shapes = oa.Response(chat, model_name, token_bytes=getattr(thread.engine.tokenizer, "token_bytes", None))
    fields = oa.body_fields(body, chat)  # what a refusal by the context names
    bodies = _bodies(body, chat, thread.max_waiting)
    try:  # off the event loop, as the parse: a prompt of millions of ids is seconds of checks
        reqs, refused = await asyncio.to_thread(_translate, bodies, chat, shapes.id, thread.engine)
    except PromptError as exc:
        raise OpenAIError(400, str(exc), body=oa.error_from_exception(exc)) from None
    if refused is not None:  # the prompt's refusal admission would give, counted as the engine counts it
        thread.metrics.finished(refused)
        raise OpenAIError(400, refused.error, body=oa.error_from_result(refused, False, fields))
    stream, include_usage = oa.stream_mode(body)
    group = Group(reqs)
    queue = thread.submit(*reqs)
    if queue is None:
        thread.metrics.requests.labels("rejected").inc()
        raise OpenAIError(429, f"more than {thread.max_waiting} requests are waiting (--max-waiting); "
                               f"retry later.", error_type="rate_limit_error", code="too_many_waiting_requests")

    def abort() -> None:
        for rid in group.ids:
            thread.abort(rid)

    try:
        item = await _next(queue, request, abort)
        _raise_if_refused(item, fields)
        if stream:
            return StreamingResponse(events(item, queue, shapes, include_usage, group,
                                            lambda it: getattr(_refusal(it, fields), "body", None), abort),
                                     media_type="text/event-stream")
        while not group.take(item):
            item = await _next(queue, request, abort)
            _raise_if_refused(item, fields)
    except BaseException:  # refused, the client gone, cancelled: no request of the body runs on for nobody
        abort()
        raise
    return shapes.full(group.result())


def _bodies(body: dict, chat: bool, most: int) -> list[tuple[dict, str]]:
    """A body as (the body of each of its prompts, where errors name it): several for a
    /v1/completions body whose `prompt` is a list of prompts (OpenAI's batch), else itself."""
    prompts = None if chat else body.get("prompt")
    if not (isinstance(prompts, list) and len(prompts) > 1 and all(isinstance(p, (str, list)) for p in prompts)):
        return [(body, WHERE)]  # one prompt (or none: refused as one)
    if len(prompts) > most:
        raise OpenAIError(400, f"`prompt` holds {len(prompts)} prompts; this server takes at most {most} in one "
                               f"request (--max-waiting): split them.", "prompt")
    # each as a one-prompt list: `[["a"]]` is refused as it would be alone, not read as "a"
    return [({**body, "prompt": [p]}, f"{WHERE} (prompt {i})") for i, p in enumerate(prompts)]


def _translate(bodies: list[tuple[dict, str]], chat: bool, rid: str, engine) -> tuple[list[ParsedRequest],
                                                                                          Result | None]:
    """Bodies -> (their requests, each prompt rendered and encoded and fitted to the context —
    a chat without a max gets what the context leaves, as OpenAI and vLLM have it — or the first
    refusal admission would give one: Admission.prepare, Admission.fit). Raises PromptError for
    a bad body. Several bodies (one per prompt) get ids rid-0, rid-1, ..., their shared fields
    checked first, once, as the body's."""
    if len(bodies) > 1:
        parse_request(oa.completion_request({**bodies[0][0], "prompt": [0]}, rid, WHERE, allow_stream=True), WHERE,
                      engine.vocab_size)
    reqs = []
    for i, (body, where) in enumerate(bodies):
        native = (oa.chat_request if chat else oa.completion_request)(
            body, rid if len(bodies) == 1 else f"{rid}-{i}", where, allow_stream=True)
        req = oa.model_temperature(parse_request(native, where, engine.vocab_size), engine.generation)
        req, refused = engine.admission.prepare(req)
        if refused is None:
            req, refused = engine.admission.fit(req)
        if refused is not None:
            if len(bodies) > 1:
                refused.error = f"prompt {i}: {refused.error}"
            return [], refused
        reqs.append(req)
    return reqs, None


async def _body(request: Request) -> dict:
    """The JSON object of a request, read as strictly as a prompts file (no NaN or Infinity,
    bounded depth and size)."""
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > MAX_BODY_BYTES:
                raise OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes.",
                                  code="request_too_large")
    except ClientDisconnect:  # gone before its whole body came: nothing to serve, nobody to answer
        raise OpenAIError(499, "the client disconnected.") from None
    try:  # in a worker thread: a 30 MB body is seconds of parsing, and every stream would wait for it
        body = await asyncio.to_thread(loads_json, data.decode("utf-8"), allow_nonfinite=False, unique_keys=True)
    except (JSONProblem, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object.")
    return body


async def _next(queue: asyncio.Queue, request: Request, abort: Callable[[], None]):
    """The response's next output; aborts its requests if the client went away meanwhile. The
    client is looked at every DISCONNECT_POLL_SECONDS also while outputs keep coming (a
    non-streamed request gets one per step: looking only when none came for that long never looked)."""
    state = request.state
    while True:
        if time.monotonic() >= getattr(state, "disconnect_poll_at", 0.0):
            state.disconnect_poll_at = time.monotonic() + DISCONNECT_POLL_SECONDS
            if await request.is_disconnected():
                abort()
                raise OpenAIError(499, "the client disconnected.")
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            continue


def _refusal(item, fields: tuple[str, str]) -> OpenAIError | None:
    """The error an output stands for (an abort, a refusal), or None."""
    if isinstance(item, Aborted):
        return OpenAIError(503, f"request aborted: {item.reason}.", error_type="server_error", code="aborted")
    if isinstance(item, PromptError):
        return OpenAIError(400, str(item), body=oa.error_from_exception(item))
    if isinstance(item, TrtgraphError):
        return OpenAIError(500, str(item), error_type="server_error")
    if item.finished and item.finish_reason == "error":  # no recorded key can serve it: run's message
        return OpenAIError(400, item.result.error, body=oa.error_from_result(item.result, False, fields))
    return None


def _raise_if_refused(item, fields: tuple[str, str]) -> None:
    error = _refusal(item, fields)
    if error is not None:
        raise error


def served_name(source, model: str | None = None) -> str:
    """The name the model is served as: a Hub checkpoint's repository id (as vLLM serves it; also
    where `model` says it has moved, the same files by their sha256), a checkpoint directory's
    name (`model`: where it has moved since capture), or "trtgraph-synthetic"."""
    if source.hub is not None:
        return source.hub
    path = model or source.path
    name = os.path.basename(os.path.abspath(path)) if path else ""  # (`--model .` is the directory's name)
    return name or "trtgraph-synthetic"


def build_server(manifest, host: str, port: int, max_waiting: int, api_key: str | None,
                 log_level: str = "info", model: str | None = None) -> tuple[uvicorn.Server, EngineThread]:
    """The uvicorn server and its engine thread (not started: the thread loads the engine
    when started, and GET /health answers 503 until then)."""
    from ..artifacts import load_manifest
    from ..runtime.serving.engine import Engine

    manifest_obj = load_manifest(manifest)
    if manifest_obj.parallel.get("tensor_parallel_size", 1) != 1:
        raise ConfigError(f"{manifest}: `trtgraph serve` serves single-process manifests; this one was captured "
                          f"with tensor_parallel_size {manifest_obj.parallel['tensor_parallel_size']}.")
    model_name = served_name(manifest_obj.app_config().model, model)

    def load() -> Engine:
        engine = Engine(manifest_obj, model=model)
        startup.freeze_heap(engine.executor.device)  # one engine for the process's life
        return engine

    thread = EngineThread(load, Metrics(), max_waiting)  # read once
    config = uvicorn.Config(create_app(thread, model_name, api_key), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACE_SECONDS, lifespan="on")
    server = _Server(config, thread)
    thread.on_failure = lambda: setattr(server, "should_exit", True)
    return server, thread


class _Server(uvicorn.Server):
    """uvicorn's server; on SIGTERM/SIGINT it also starts the clock on in-flight requests:
    DRAIN_SECONDS to finish, then they end with an abort event (and their streams with
    [DONE]) instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, thread: EngineThread):
        super().__init__(config)
        self._drain = threading.Timer(DRAIN_SECONDS, thread.abort_all, ["the server is shutting down"])
        self._drain.daemon = True

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if not self._drain.is_alive() and not self._drain.finished.is_set():
            self._drain.start()


def serve(manifest, host: str, port: int, max_waiting: int, api_key: str | None, model: str | None = None) -> None:
    """Bind, load the engine in its thread, serve until SIGTERM or SIGINT. Raises the
    engine's load error (a TrtgraphError) if loading fails."""
    server, thread = build_server(manifest, host, port, max_waiting, api_key, model=model)
    # uvicorn handles SIGTERM/SIGINT itself and re-raises the signal once it has shut down;
    # by then every request is finished or aborted, so that re-raise should just return.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    thread.start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits 1 when it cannot bind; say why, exit 2
        if server.started:
            raise
    if thread.failed is not None:
        raise thread.failed
    if not server.started:
        raise ConfigError(f"cannot listen on {host}:{port} (in use, or not an address of this machine); "
                          f"pick another --host/--port.")
