"""The OpenAI API's request and response bodies, as far as jaxkv serves them.

Requests are validated by pydantic models: a field the server does not know,
or a value it cannot honour (``n`` ≠ 1, ``logprobs``, a penalty ≠ 0), is an
error that names the field, answered with HTTP 400 and OpenAI's error body.
The ``jaxkv`` field is this server's extension: per-request sparse settings.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered as OpenAI's error body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SparseSettings(BaseModel):
    """The ``jaxkv`` extension field: which attention method decodes this request.

    method: dense or a sparse method (default: the server's).
    settings: fields of that method's config, e.g. ``{"top_k": 512}`` for ParisKV.
    cache: fields of ``jaxkv.cache.CacheConfig`` (sink, local, buffer, dense_threshold, offload).
    """

    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    cache: dict[str, Any] = Field(default_factory=dict)


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    user: str | None = None
    # Accepted at their no-op values only.
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    logprobs: Literal[False, None] = None
    jaxkv: SparseSettings | None = None

    @pydantic.field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @pydantic.field_validator("stream_options")
    @classmethod
    def _only_include_usage(cls, options):
        if options is not None and set(options) - {"include_usage"}:
            raise ValueError(f"stream_options: unknown keys {sorted(set(options) - {'include_usage'})}")
        return options

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str
    echo: Literal[False] = False
    best_of: Literal[1, None] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(model: type[BaseModel], body: Any):
    """A validated request, or APIError 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"] if first["type"] != "extra_forbidden" else "this server does not support this field"
        raise APIError(400, f"{where}: {message}" if where else message, param=where) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None = None, *,
                    chat: bool, delta: bool = False) -> dict:
    """One response (or one streamed chunk when `delta`) in the shape of the endpoint."""
    if chat:
        message = ({"content": text} if delta else {"role": "assistant", "content": text})
        choice = {"index": 0, "delta" if delta else "message": message, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk" if delta else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
