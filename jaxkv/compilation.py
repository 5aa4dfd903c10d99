"""Compile once: JAX's persistent compilation cache, length buckets, and compile time kept apart.

- :func:`enable_persistent_cache` points JAX's on-disk cache at the user's cache
  directory, so a second process with the same shapes loads its programs instead
  of compiling them (the CLI and the server turn it on; docs/serving.md).
- :func:`bucket` rounds a cache length up to one of a few sizes, so prompts of
  different lengths share compiled programs.
- :class:`CompileClock` measures the time JAX spends tracing, lowering and
  compiling (or loading compiled programs) while it runs, from JAX's own
  monitoring events, so a caller can report compile time apart from run time.
"""
from __future__ import annotations

import os
import pathlib
import threading
import warnings

import jax
from jax import monitoring

CACHE_DIR_ENV = "JAXKV_COMPILATION_CACHE"  # a directory, or "off" to disable
_DISABLED = ("", "0", "off", "none", "false")

# JAX's monitoring events that span compile work (dispatch.py's names).
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})


def default_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/jaxkv/jax`` (``~/.cache/jaxkv/jax`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxkv" / "jax"


def cache_dir_setting(flag: str | None = None, disable: bool = False) -> pathlib.Path | None:
    """The directory the persistent cache should use: None when disabled.

    Args:
      flag: a directory given on the command line (wins over the environment).
      disable: the command line's "no cache" switch (wins over everything).
    Returns:
      the directory, from the flag, else ``$JAXKV_COMPILATION_CACHE`` (``off``
      disables), else :func:`default_cache_dir`; or None.
    """
    if disable:
        return None
    if flag:
        return pathlib.Path(flag).expanduser()
    env = os.environ.get(CACHE_DIR_ENV)
    if env is not None:
        return None if env.strip().lower() in _DISABLED else pathlib.Path(env).expanduser()
    return default_cache_dir()


def enable_persistent_cache(directory: pathlib.Path | str | None) -> pathlib.Path | None:
    """Turn JAX's persistent compilation cache on in `directory` (None: leave it off).

    Every program is cached, however short its compile: jaxkv's small programs
    (a prefill chunk, a layer's index build) add up to seconds per call.

    Returns:
      the directory in use, or None (also when it cannot be created: a warning says why).
    """
    if directory is None:
        return None
    directory = pathlib.Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # an unusable cache costs compile time, not the command
        warnings.warn(f"JAX compilation cache off: cannot create {directory}: {err.strerror}", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def bucket(n: int, smallest: int = 256) -> int:
    """The smallest bucket ≥ n: ``smallest·2^k`` or ``1.5·smallest·2^k``.

    Two buckets per octave: at most a third of a cache is padding, and a model
    with an 8k window needs at most 10 sizes.

    Args:
      n: a length (tokens), ≥ 0.
      smallest: the smallest bucket.
    """
    size = smallest
    while True:
        if n <= size:
            return size
        if n <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


class CompileClock:
    """Seconds JAX spends compiling (tracing, lowering, XLA or a cache load) in this thread.

    Use as a context manager; ``seconds`` is read while or after it runs. Nested
    compiles (a jit traced inside another's trace) are counted once: the time is
    the union of the compile events' intervals.
    """

    def __init__(self):
        self._spans: list[tuple[float, float]] = []
        self._thread = threading.get_ident()

    def _record(self, event: str, start: float, end: float, **_):
        if event in _COMPILE_EVENTS and threading.get_ident() == self._thread:
            self._spans.append((start, end))

    def __enter__(self) -> "CompileClock":
        monitoring.register_event_time_span_listener(self._record)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_event_time_span_listener(self._record)

    @property
    def seconds(self) -> float:
        total, reach = 0.0, float("-inf")
        for start, end in sorted(self._spans):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total
