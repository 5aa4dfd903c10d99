"""``jaxkv serve``: an OpenAI-compatible HTTP server with batched (sparse) decoding.

:mod:`jaxkv.serve.protocol` validates requests and shapes responses,
:mod:`jaxkv.serve.engine` batches and decodes them in one thread,
:mod:`jaxkv.serve.app` is the Starlette app uvicorn runs. See docs/serving.md.
Needs the ``serve`` extra (starlette, uvicorn).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

from jaxkv.serve.app import ServeLimits, create_app
from jaxkv.serve.engine import Engine, Method


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT/SIGTERM also drains the engine's queue and, once
    shut down, returns instead of raising the signal again (uvicorn's default)."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        # Requests being decoded end (with an error) a little before uvicorn would cancel
        # their connections. A signal handler must not wait for the engine's lock: a thread does.
        grace = max(0.0, 0.8 * (self.config.timeout_graceful_shutdown or 0.0) - 0.5)
        threading.Thread(target=self._engine.drain, args=(grace,), name="jaxkv-drain").start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(engine: Engine, limits: ServeLimits, *, host: str = "127.0.0.1", port: int = 8000,
        shutdown_grace: float = 10.0) -> None:
    """Serve until SIGINT or SIGTERM, then return.

    On the signal, waiting requests are refused (503) and requests being decoded
    get `shutdown_grace` seconds to finish before they are cancelled.
    """
    log = logging.getLogger("jaxkv.serve")
    if not log.handlers:  # uvicorn configures its own loggers only
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    config = uvicorn.Config(create_app(engine, limits), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=shutdown_grace)
    _Server(config, engine).run()


__all__ = ["Engine", "Method", "ServeLimits", "create_app", "run"]
