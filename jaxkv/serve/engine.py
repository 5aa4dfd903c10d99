"""The batching engine: one thread that prefills and decodes every request, batch by batch.

Requests wait in a bounded queue. The engine takes the oldest one and, with it,
up to ``max_batch - 1`` more that can share its batch: the same attention
settings, the same cache bucket (:func:`jaxkv.generate.capacity_for`) and, for a
sparse method, the same side of the dense-fallback threshold. Each prompt is
prefilled alone (as generate() prefills it), the batch is padded to a power of
two with idle rows, and decoding runs in chunks of ``chunk_steps`` steps
(:meth:`jaxkv.generate.Decoding.advance`); after each chunk every request's new
text goes to its client, and rows whose client left or whose stop string
appeared are cancelled. Requests that arrive meanwhile wait for the next batch
(no joining at step boundaries: the four-region cache advances every row of a
batch at every step, so a row cannot idle in a running batch).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import models
from jaxkv import cache as kvcache
from jaxkv.attention import registry
from jaxkv.generate import PAD, Prefilled, capacity_for, prefill_prompts, start_decoding

log = logging.getLogger("jaxkv.serve")
SHUTTING_DOWN = "the server is shutting down"


@dataclasses.dataclass(frozen=True)
class Method:
    """A request's attention settings (hashable: requests with equal ones may share a batch)."""

    name: str = "dense"
    config: Any = None  # the method's config dataclass (None: its defaults)
    cache: kvcache.CacheConfig | None = None

    def dense_threshold(self) -> int:
        """Contexts shorter than this are attended exactly by a sparse method (0 for dense)."""
        if self.name == "dense":
            return 0
        mcfg = self.config if self.config is not None else registry.get(self.name).config_class()
        return (self.cache or kvcache.CacheConfig()).resolve(mcfg).dense_threshold


@dataclasses.dataclass
class Event:
    """What the engine tells a request's handler: new text, the end, or an error."""

    kind: str  # "text" | "end" | "error"
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclasses.dataclass(eq=False)
class Job:
    """One request as the engine runs it. ``emit`` must be safe to call from the engine thread."""

    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stops: list[str]
    method: Method
    emit: Callable[[Event], None]
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    # Requests of one lane share batches and answer as they would alone: (method, cache capacity,
    # whether a sparse method starts above its dense-fallback threshold).
    lane: tuple = dataclasses.field(init=False)

    def __post_init__(self):
        sparse_side = len(self.ids) >= self.method.dense_threshold()
        self.lane = (self.method, capacity_for(len(self.ids), self.max_tokens), sparse_side)


class Overloaded(Exception):
    """The queue is full: the request is refused, not queued."""


class TextStream:
    """A row's tokens as text, released as it becomes final.

    Text that could still become a stop string, or that ends inside a UTF-8
    character, is held back until the next tokens decide it.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self._tokenizer, self._stops = tokenizer, stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self._sent = 0

    def push(self, tokens: list[int]) -> tuple[str, bool]:
        """Add tokens; returns (text now final, whether a stop string was reached)."""
        self.tokens += tokens
        text = self._tokenizer.decode(self.tokens)
        hits = [i for i in (text.find(s, max(0, self._sent - len(s) + 1)) for s in self._stops) if i >= 0]
        if hits:
            out, self._sent = text[self._sent:min(hits)], min(hits)
            return out, True
        final = len(text.rstrip("\ufffd")) - self._hold
        if final <= self._sent:
            return "", False
        out, self._sent = text[self._sent:final], final
        return out, False

    def rest(self) -> str:
        """The text held back, at the end of the row."""
        text = self._tokenizer.decode(self.tokens)
        out, self._sent = text[self._sent:], len(text)
        return out


def _with_row(staging: models.KVCache, first_logits, row_staging: models.KVCache, row_logits, row):
    """The batch's prefill with one prompt's (a batch of one) written at `row`."""
    put = lambda batch, one: jax.lax.dynamic_update_index_in_dim(batch, one[:, 0], row, axis=1)  # noqa: E731
    return (models.KVCache(k=put(staging.k, row_staging.k), v=put(staging.v, row_staging.v)),
            jax.lax.dynamic_update_index_in_dim(first_logits, row_logits[0].astype(first_logits.dtype), row, 0))


# In place (donated): the batch's prefill is never copied whole.
_put_row = jax.jit(_with_row, donate_argnums=(0, 1))
# An idle row repeats row 0.
_copy_first_row = jax.jit(lambda staging, first_logits, row: _with_row(
    staging, first_logits, models.KVCache(k=staging.k[:, :1], v=staging.v[:, :1]), first_logits[:1], row),
    donate_argnums=(0, 1))


def batch_rows(n: int, max_batch: int) -> int:
    """Rows a batch of n requests decodes with: the next power of two, at most max_batch."""
    return min(1 << (n - 1).bit_length(), max_batch)


class Engine:
    """Owns the model and the decode thread; handlers submit Jobs and read their Events.

    Args:
      params, config, tokenizer: the model (params as loaded, layers stacked).
      max_batch: most requests decoded together.
      max_queue: most requests waiting (beyond it, :meth:`submit` raises Overloaded).
      chunk_steps: decode steps between two deliveries of text.
    """

    def __init__(self, params, config: models.ModelConfig, tokenizer, *, max_batch: int = 8,
                 max_queue: int = 64, chunk_steps: int = 8):
        if max_batch < 1 or max_queue < 1 or chunk_steps < 1:
            raise ValueError(f"max_batch, max_queue and chunk_steps must be >= 1, got "
                             f"{max_batch}, {max_queue}, {chunk_steps}")
        self.params, self.config, self.tokenizer = params, config, tokenizer
        self.max_batch, self.max_queue, self.chunk_steps = max_batch, max_queue, chunk_steps
        self._split = None  # per-layer weights for decoding, made by the engine thread
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = self._draining = False
        self._deadline = float("inf")  # when a draining engine gives up its batch
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        # For /health: batches decoded, requests cancelled by their client, rows decoding now.
        self.batches = self.cancelled = self.running = 0

    def start(self) -> None:
        self._thread.start()

    def drain(self, grace: float = 0.0) -> None:
        """Refuse waiting and new requests; the batch being decoded goes on for `grace` seconds
        at most, then its unfinished requests end with an error."""
        with self._cond:
            self._draining = True
            self._deadline = min(self._deadline, time.monotonic() + grace)
            waiting, self._queue = list(self._queue), collections.deque()
        log.info("shutting down: %d waiting requests refused, %d being decoded get %.1f s", len(waiting),
                 self.running, grace)
        for job in waiting:
            job.emit(Event("error", SHUTTING_DOWN))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse waiting requests, cancel running ones at their next chunk, and join the thread."""
        self.drain()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._draining:
                raise Overloaded(SHUTTING_DOWN)
            if len(self._queue) >= self.max_queue:
                raise Overloaded(f"{len(self._queue)} requests are waiting (--max-queue {self.max_queue})")
            self._queue.append(job)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    # ------------------------------------------------------------------ the thread

    def _next_batch(self) -> list[Job] | None:
        """The oldest live request and up to max_batch - 1 more of its lane (None when stopping)."""
        with self._cond:
            while True:
                while self._queue and self._queue[0].cancelled.is_set():
                    self._queue.popleft()
                if self._stopping:
                    return None
                if self._queue:
                    break
                self._cond.wait()
            lane = self._queue[0].lane
            batch = [job for job in self._queue if job.lane == lane and not job.cancelled.is_set()]
            batch = batch[: self.max_batch]
            for job in batch:
                self._queue.remove(job)
            return batch

    def _run(self) -> None:
        self._split = models.unstack_layers(self.params, self.config.num_layers)
        while (batch := self._next_batch()) is not None:
            try:
                self._decode(batch)
            except Exception as err:  # one batch's failure is its requests' error, not the server's
                log.exception("batch of %d requests failed", len(batch))
                for job in batch:
                    job.emit(Event("error", f"decoding failed: {type(err).__name__}: {err}"))
            self.batches += 1

    def _prefill(self, batch: list[Job], rows: int, capacity: int) -> Prefilled:
        """Every prompt prefilled alone (as generate() would) and written into its row of the batch;
        idle rows repeat the first prompt. One prompt's cache is held beside the batch's at a time."""
        t0 = time.perf_counter()
        dtype = models.activation_dtype(self.params)
        staging = models.init_cache(self.config, rows, capacity, dtype)
        first_logits = jnp.zeros((rows, self.config.vocab_size), jnp.float32)
        for row, job in enumerate(batch):
            alone = prefill_prompts(self.params, self.config, [job.ids], capacity=capacity)
            staging, first_logits = _put_row(staging, first_logits, alone.staging, alone.first_logits, row)
            del alone
        for row in range(len(batch), rows):
            staging, first_logits = _copy_first_row(staging, first_logits, row)
        ids = [job.ids for job in batch] + [batch[0].ids] * (rows - len(batch))
        return Prefilled(ids, staging, first_logits, time.perf_counter() - t0)

    def _decode(self, batch: list[Job]) -> None:
        method, capacity, _ = batch[0].lane
        rows = batch_rows(len(batch), self.max_batch)
        idle = rows - len(batch)
        prefilled = self._prefill(batch, rows, capacity)
        decoding = start_decoding(
            self._split, self.config, prefilled,
            max_new_tokens=[job.max_tokens for job in batch] + [0] * idle,
            temperature=[job.temperature for job in batch] + [0.0] * idle,
            top_p=[job.top_p for job in batch] + [1.0] * idle,
            seed=[job.seed for job in batch] + [0] * idle,
            eos_ids=self.config.eos_token_ids, method=method.name, method_config=method.config,
            cache_config=method.cache)
        del prefilled
        texts = [TextStream(self.tokenizer, job.stops) for job in batch]
        ended = [False] * len(batch)
        self.running = len(batch)
        new = [[t] if t != PAD else [] for t in decoding.first_tokens]
        while True:
            done = decoding.done
            for i, job in enumerate(batch):
                if ended[i]:
                    continue
                text, stopped = texts[i].push(new[i])
                if text:
                    job.emit(Event("text", text))
                if stopped or done[i] or job.cancelled.is_set():
                    self.cancelled += job.cancelled.is_set()
                    rest = "" if stopped else texts[i].rest()
                    if rest:
                        job.emit(Event("text", rest))
                    limit = not stopped and len(texts[i].tokens) >= job.max_tokens
                    job.emit(Event("end", finish_reason="length" if limit else "stop",
                                   completion_tokens=len(texts[i].tokens)))
                    ended[i] = True
                    self.running -= 1
            cancel = [i for i in range(len(batch)) if ended[i] and not done[i]]
            if cancel:
                decoding.cancel(cancel)
            if decoding.finished or self._stopping or time.monotonic() > self._deadline:
                break
            new = decoding.advance(self.chunk_steps)
        for i, job in enumerate(batch):
            if not ended[i]:
                job.emit(Event("error", SHUTTING_DOWN))
        self.running = 0
