"""The HTTP side: a Starlette app speaking the OpenAI API, run by uvicorn.

Handlers validate and tokenize a request, submit it to the :class:`Engine` and
relay its events: as one JSON body, or as server-sent events ending with
``data: [DONE]``. A client that disconnects cancels its request. Every error
is OpenAI's JSON error body with a 4xx/5xx status, never a traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
import typing

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxkv import cache as kvcache
from jaxkv.attention import registry
from jaxkv.serve import protocol
from jaxkv.serve.engine import SHUTTING_DOWN, Engine, Event, Job, Method, Overloaded
from jaxkv.serve.protocol import APIError

log = logging.getLogger("jaxkv.serve")


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What a request may ask for.

    model_name: the id /v1/models lists and requests must name.
    max_context: most tokens of prompt + max_tokens.
    default_max_tokens: max_tokens of a request that gives none (at most what the context leaves).
    method: the attention settings of a request without the ``jaxkv`` field.
    """

    model_name: str
    max_context: int
    default_max_tokens: int = 256
    method: Method = Method()


def _typed(value, annotation, name: str):
    """A JSON value checked against a config field's annotation (int, float, bool, str, tuple of ints)."""
    kinds = typing.get_args(annotation) or (annotation,)
    if value is None and type(None) in kinds:
        return None
    for kind in kinds:
        kind = typing.get_origin(kind) or kind
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if kind is tuple and isinstance(value, list) and all(isinstance(v, int) for v in value):
            return tuple(value)
    raise APIError(400, f"jaxkv: {name} = {value!r} is not a {annotation}", param=f"jaxkv.{name}")


def _config(cls, base, fields: dict, where: str):
    """``base`` (or cls's defaults) with `fields` replaced, each checked against cls's annotations."""
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(fields) - set(hints))
    if unknown:
        raise APIError(400, f"jaxkv.{where}: {cls.__name__} has no field {unknown[0]!r}; fields: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}", param=f"jaxkv.{where}")
    values = {k: _typed(v, hints[k], f"{where}.{k}") for k, v in fields.items()}
    try:
        return dataclasses.replace(base if base is not None else cls(), **values)
    except (ValueError, TypeError) as err:
        raise APIError(400, f"jaxkv.{where}: {err}", param=f"jaxkv.{where}") from None


def resolve_method(extension: protocol.SparseSettings | None, default: Method, model_config) -> Method:
    """The request's attention settings: the server's, with the ``jaxkv`` field's changes."""
    if extension is None:
        return default
    name = extension.method or default.name
    try:
        cls = registry.get(name).config_class if name != "dense" else None
    except ValueError as err:
        raise APIError(400, f"jaxkv.method: {err}", param="jaxkv.method") from None
    if cls is None:
        if extension.settings or extension.cache:
            raise APIError(400, "jaxkv: the dense method takes no settings or cache", param="jaxkv")
        return Method("dense")
    same = name == default.name
    config = _config(cls, default.config if same else None, extension.settings, "settings")
    cache = _config(kvcache.CacheConfig, default.cache if same else None, extension.cache, "cache")
    method = Method(name, config, cache)
    try:
        kvcache.make_backend(model_config, name, config, cache, 1, 1)
    except ValueError as err:
        raise APIError(400, f"jaxkv: {err}", param="jaxkv") from None
    return method


class Server:
    """The request handlers around one Engine."""

    def __init__(self, engine: Engine, limits: ServeLimits):
        self.engine, self.limits = engine, limits

    # ------------------------------------------------------------------ requests

    def _job(self, req, ids: list[int], limit: int | None, emit) -> Job:
        if req.model != self.limits.model_name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves "
                                f"'{self.limits.model_name}'", param="model", code="model_not_found")
        room = self.limits.max_context - len(ids)
        max_tokens = limit if limit is not None else min(self.limits.default_max_tokens, room)
        if len(ids) + max_tokens > self.limits.max_context or room < 1:
            raise APIError(400, f"This model's maximum context length is {self.limits.max_context} tokens. "
                                f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                           param="messages" if isinstance(req, protocol.ChatRequest) else "prompt",
                           code="context_length_exceeded")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        method = resolve_method(req.jaxkv, self.limits.method, self.engine.config)
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        return Job(ids, max_tokens, req.temperature, req.top_p, seed, req.stops, method, emit)

    async def completions(self, request: Request):
        req = protocol.parse(protocol.CompletionRequest, await _json(request))
        ids = self.engine.tokenizer.encode(req.prompt)
        return await self._answer(request, req, ids, req.max_tokens, chat=False)

    async def chat(self, request: Request):
        req = protocol.parse(protocol.ChatRequest, await _json(request))
        messages = [m.model_dump(exclude_none=True, include={"role", "content"}) for m in req.messages]
        ids = self.engine.tokenizer.encode(self.engine.tokenizer.apply_chat_messages(messages))
        return await self._answer(request, req, ids, req.token_limit, chat=True)

    async def _answer(self, request: Request, req, ids: list[int], limit: int | None, *, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = self._job(req, ids, limit, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            self.engine.submit(job)
        except Overloaded as err:
            raise APIError(503, f"The server is overloaded: {err}. Retry later.", type="server_error",
                           code="server_overloaded") from None
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return StreamingResponse(self._stream(job, events, req, rid, len(ids), chat=chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, job, events, req, rid, len(ids), chat=chat)

    async def _whole(self, request: Request, job: Job, events, req, rid, prompt_tokens, *, chat: bool):
        """One JSON body once the request ends; a disconnect meanwhile cancels it."""
        watcher = asyncio.ensure_future(_disconnected(request))
        parts = []
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    job.cancelled.set()
                    return JSONResponse({}, status_code=499)  # nobody is listening
                event = getter.result()
                if event.kind == "error":
                    raise APIError(503 if event.text == SHUTTING_DOWN else 500, event.text, type="server_error")
                if event.kind == "text":
                    parts.append(event.text)
                else:
                    return JSONResponse(protocol.completion_body(
                        rid, req.model, "".join(parts), event.finish_reason,
                        protocol.usage(prompt_tokens, event.completion_tokens), chat=chat))
        finally:
            watcher.cancel()
            job.cancelled.set()  # a no-op once the job has ended

    async def _stream(self, job: Job, events, req, rid, prompt_tokens, *, chat: bool):
        """Server-sent events: one chunk per piece of text, the finish reason, then [DONE].

        Starlette cancels this generator when the client disconnects; the
        ``finally`` then cancels the job, which frees its row at the next chunk.
        """
        def sse(body) -> str:
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                first = protocol.completion_body(rid, req.model, "", None, chat=True, delta=True)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield sse(first)
            while True:
                event = await events.get()
                if event.kind == "text":
                    if event.text:
                        yield sse(protocol.completion_body(rid, req.model, event.text, None, chat=chat, delta=True))
                    continue
                if event.kind == "error":
                    yield sse(APIError(500, event.text, type="server_error").body())
                else:
                    yield sse(protocol.completion_body(rid, req.model, "", event.finish_reason, chat=chat, delta=True))
                    if req.include_usage:
                        tail = protocol.completion_body(rid, req.model, "", None, chat=chat, delta=True)
                        tail["choices"] = []
                        tail["usage"] = protocol.usage(prompt_tokens, event.completion_tokens)
                        yield sse(tail)
                yield "data: [DONE]\n\n"
                return
        finally:
            job.cancelled.set()

    # ------------------------------------------------------------------ the rest

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.limits.model_name, "object": "model", "created": int(time.time()), "owned_by": "jaxkv"}]})

    async def health(self, request: Request):
        engine = self.engine
        return JSONResponse({"status": "ok", "waiting": engine.waiting, "running": engine.running,
                             "batches": engine.batches, "cancelled": engine.cancelled})


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(request: Request, err: APIError):
    return JSONResponse(err.body(), status_code=err.status,
                        headers={"Retry-After": "1"} if err.status == 503 else None)


async def _http_error(request: Request, err: HTTPException):
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                 type=kind).body(), status_code=err.status_code)


async def _server_error(request: Request, err: Exception):
    log.exception("request failed")
    return JSONResponse(APIError(500, f"internal error: {type(err).__name__}", type="server_error").body(),
                        status_code=500)


def create_app(engine: Engine, limits: ServeLimits) -> Starlette:
    """The ASGI app; it starts the engine's thread on startup and stops it on shutdown."""
    server = Server(engine, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            # The engine stops at its next chunk of steps; a long compile in progress is not
            # waited for beyond the timeout (the thread is a daemon: the process exits anyway).
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(engine.stop, timeout=10.0))

    return Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan)
