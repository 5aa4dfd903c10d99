"""generate(): chunked prefill, then decoding in jitted chunks of steps.

The prompt is always prefilled with exact attention into a dense staging
cache (a right-padded batch: row b's token t sits at cache index t). For
``method="dense"`` that staging cache, sized for the generated tokens too, is
split into one decode cache per layer. For a sparse method it is split into the
four regions of :mod:`jaxkv.cache` and each layer's index is built over its
retrieval region; decoding then reads the retrieval region only through the
method's selection.

Decoding is resumable: :func:`start_decoding` samples each row's first token and
returns a :class:`Decoding`, whose ``advance(steps)`` runs up to ``steps`` steps
in one ``lax.while_loop`` and returns the tokens they produced. generate() runs
one chunk of every step; the server (:mod:`jaxkv.serve`) runs short chunks and
streams each one. Cache lengths are bucketed (:func:`jaxkv.compilation.bucket`)
so requests of different lengths share compiled programs.

On a mesh, sharding happens at the boundary of each jitted program
(:class:`jaxkv.sharding.MeshJit`: in_shardings, and attention under shard_map);
on one device no sharding code runs.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import models
from jaxkv import cache as kvcache
from jaxkv import compilation, memory, request, sharding
from jaxkv.sampling import SamplingConfig, sample_rows

PAD = -1  # marks "no token" in generated outputs


@dataclasses.dataclass
class Generation:
    """What generate() returns: tokens per prompt (EOS excluded) and timings.

    prefill_seconds and decode_seconds exclude compile time, which is
    compile_seconds (tracing, lowering and compiling, or loading programs from
    the persistent cache): the rates below are steady-state rates.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    # Per row: distinct keys read / keys in context, over decode steps and layers
    # (dense layers read everything). None for method="dense".
    keys_read_fraction: list[float] | None = None
    compile_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return sum(self.prompt_lengths) / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Batch tokens produced per second of the decode loop (first token excluded)."""
        n = len(self.tokens) * max(self.decode_steps - 1, 0)
        return n / max(self.decode_seconds, 1e-9)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------
# The jitted programs (one device: plain jit; a mesh: _Programs.on_mesh).


def _prefill_chunk(params, tokens, start, lengths, staging, last_hidden, *, config, attention):
    """Run one chunk [B, C] at positions start..start+C; keep each row's last real hidden state."""
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    hidden, staging = models.forward_hidden(params, config, tokens, positions, staging, attention)
    offset = lengths - 1 - start
    in_chunk = (offset >= 0) & (offset < c)
    picked = hidden[jnp.arange(b), jnp.clip(offset, 0, c - 1)]
    last_hidden = jnp.where(in_chunk[:, None], picked.astype(last_hidden.dtype), last_hidden)
    return staging, last_hidden


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static description of the decode programs (hashable: a jit static argument).

    per_shard: how the programs run an attention step (``_Programs.per_shard``).
    top_k: keep only the k most likely tokens when a row samples (None: all).
    """

    config: models.ModelConfig
    backend: kvcache.Backend
    per_shard: Callable
    eos_ids: tuple[int, ...]
    top_k: int | None = None

    @property
    def attention(self):
        """Every layer's attention step, as the programs run it."""
        return self.per_shard(self.backend.attention)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Where a batch's decoding stands between chunks of steps (every array leads with [B])."""

    caches: Any  # every layer's decode cache (Backend.from_prefill)
    token: jax.Array  # int32, the last token sampled: the next step's input
    position: jax.Array  # int32, the position of `token`
    emitted: jax.Array  # int32, tokens emitted so far (an EOS is not emitted)
    budget: jax.Array  # int32, the most tokens the row may emit
    done: jax.Array  # bool
    keys: jax.Array  # uint32 [B, 2], the row's PRNG key data (drawn from at each position)
    temperature: jax.Array  # float32, 0 = greedy
    top_p: jax.Array  # float32, 1 = no nucleus cut


def _emit(spec: DecodeSpec, state: DecodeState, logits) -> tuple[DecodeState, jax.Array]:
    """Every row's next token from logits [B, V] at `state.position`.

    Returns the new state and the tokens emitted [B] (PAD for rows done before or at this step).
    """
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.keys), state.position)
    token = sample_rows(logits, keys, state.temperature, state.top_p, spec.top_k)
    eos = jnp.isin(token, jnp.asarray(spec.eos_ids if spec.eos_ids else (-2,), jnp.int32))
    live = ~state.done & ~eos
    emitted = state.emitted + live
    done = state.done | eos | (emitted >= state.budget)
    state = dataclasses.replace(state, token=token, emitted=emitted, done=done)
    return state, jnp.where(live, token, PAD)


def _start(first_logits, state, *, spec):
    """The first token of every row, from the prefill's last logits."""
    return _emit(spec, state, first_logits)


def _decode_chunk(params, state, *, spec: DecodeSpec, steps: int):
    """Up to `steps` decode steps (fewer when every row is done) inside one while_loop.

    params has its layer weights split per layer (:func:`models.unstack_layers`):
    a stacked weight is copied by XLA CPU each time the loop slices a layer from it.

    Returns (the new state, tokens [B, steps] with PAD where a row emitted none, steps run).
    """
    out = jnp.full((state.token.shape[0], steps), PAD, jnp.int32)

    def cond(carry):
        i, state, _ = carry
        return (i < steps) & ~jnp.all(state.done)

    def body(carry):
        i, state, out = carry
        hidden, caches = models.forward_hidden(params, spec.config, state.token[:, None], state.position[:, None],
                                               state.caches, spec.attention)
        logits = models.lm_head(params, spec.config, hidden)[:, 0]
        state = dataclasses.replace(state, caches=caches, position=state.position + 1)
        state, token = _emit(spec, state, logits)
        return i + 1, state, out.at[:, i].set(token)

    run, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out))
    return state, out, run


def _one_device_regions(staging, lengths, *, backend):
    return backend.from_prefill(staging, lengths)


@dataclasses.dataclass(frozen=True)
class _Programs:
    """generate()'s jitted programs and the few steps around them that depend on placement.

    One device: plain jit, nothing placed. A mesh: the same functions under
    :class:`jaxkv.sharding.MeshJit` (arguments placed by in_shardings at the
    program's boundary) and attention under shard_map.
    """

    prefill_chunk: Callable
    regions: Callable  # (staging, lengths, *, backend) -> every layer's decode cache
    start: Callable
    decode_chunk: Callable
    per_shard: Callable  # an attention step -> the step the programs run
    place_params: Callable  # (params, config, batch) -> params ready for the programs
    fetch: Callable  # a result array -> numpy

    @staticmethod
    @functools.cache
    def on_mesh(mesh: jax.sharding.Mesh) -> "_Programs":
        return _Programs(
            prefill_chunk=sharding.MeshJit(_prefill_chunk, mesh, donate_argnames=("staging",)),
            regions=sharding.MeshJit(functools.partial(sharding.regions_per_shard, mesh=mesh), mesh),
            start=sharding.MeshJit(_start, mesh, donate_argnames=("state",)),
            decode_chunk=sharding.MeshJit(_decode_chunk, mesh, donate_argnames=("state",)),
            per_shard=functools.partial(sharding.per_shard, mesh=mesh),
            place_params=lambda params, config, batch: sharding.shard_params(params, config, mesh, batch),
            fetch=sharding.fetch)


_ONE_DEVICE = _Programs(
    prefill_chunk=jax.jit(_prefill_chunk, static_argnames=("config", "attention"), donate_argnames=("staging",)),
    regions=_one_device_regions,
    start=jax.jit(_start, static_argnames=("spec",), donate_argnames=("state",)),
    decode_chunk=jax.jit(_decode_chunk, static_argnames=("spec", "steps"), donate_argnames=("state",)),
    per_shard=lambda attention: attention,
    place_params=lambda params, config, batch: params,
    fetch=np.asarray)


def _programs(mesh: jax.sharding.Mesh | None) -> _Programs:
    return _ONE_DEVICE if mesh is None else _Programs.on_mesh(mesh)


# Its own program: split inside the decode loop, the same slices ran ≈ 6× slower.
_split_layers = jax.jit(models.unstack_layers, static_argnums=(1,))


# ----------------------------------------------------------------------------
# Prefill.


def prefill(params, config, rows: Sequence[Sequence[int]], capacity: int, chunk: int, dtype,
            mesh=None):
    """Prefill right-padded prompts into a dense staging cache of `capacity` positions.

    Returns (staging cache, logits of each row's last prompt token [B, V]).
    With a mesh, params must already be on it (sharding.shard_params).
    """
    programs = _programs(mesh)
    b = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = _round_up(int(lengths.max()), chunk)
    tokens = np.zeros((b, padded), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    staging = models.init_cache(config, b, max(capacity, padded), dtype)
    last_hidden = jnp.zeros((b, config.hidden_size), dtype)
    attention = programs.per_shard(models.cached_attention)
    for start in range(0, padded, chunk):
        staging, last_hidden = programs.prefill_chunk(
            params, tokens[:, start:start + chunk], np.int32(start), lengths, staging, last_hidden,
            config=config, attention=attention)
    return staging, models.lm_head(params, config, last_hidden[:, None, :])[:, 0]


@dataclasses.dataclass
class Prefilled:
    """Prompts prefilled once, reusable by several generate() calls (e.g. one per method)."""

    rows: list[list[int]]
    staging: models.KVCache
    first_logits: jax.Array
    seconds: float

    @property
    def capacity(self) -> int:
        return self.staging.max_len


MAX_PREFILL_CHUNK = 512


def default_prefill_chunk(longest_prompt: int) -> int:
    """Tokens per prefill step by default: the longest prompt's bucket, at most
    MAX_PREFILL_CHUNK (a short prompt is not padded to a long chunk)."""
    return min(MAX_PREFILL_CHUNK, compilation.bucket(longest_prompt, smallest=16))


def prefill_prompts(params, config, prompts, *, capacity: int, prefill_chunk: int | None = None,
                    dtype=None, mesh=None) -> Prefilled:
    """Validate and prefill prompts into a dense cache of `capacity` positions (≥ prompt + new tokens).

    prefill_chunk: tokens per prefill step (None: :func:`default_prefill_chunk`).
    mesh: a jaxkv.sharding mesh to prefill on (the cache comes back sharded on it).
    """
    request.check_model(params, config)
    rows = request.prompt_rows(prompts, config)
    request.check_prefill(prefill_chunk=prefill_chunk, dtype=dtype, mesh=mesh, capacity=capacity)
    params = _programs(mesh).place_params(params, config, len(rows))
    if prefill_chunk is None:
        prefill_chunk = default_prefill_chunk(max(map(len, rows)))
    dtype = dtype or models.activation_dtype(params)
    t0 = time.perf_counter()
    staging, first_logits = prefill(params, config, rows, capacity, prefill_chunk, dtype, mesh)
    jax.block_until_ready(first_logits)
    return Prefilled(rows, staging, first_logits, time.perf_counter() - t0)


def capacity_for(longest_prompt: int, max_new_tokens: int) -> int:
    """Positions generate() gives the caches of a batch: prompt + new tokens rounded up to a
    bucket (:func:`jaxkv.compilation.bucket`), so that nearby lengths share compiled programs,
    and at least the prompt padded to whole default prefill chunks."""
    padded = _round_up(longest_prompt, default_prefill_chunk(longest_prompt))
    return max(compilation.bucket(longest_prompt + max_new_tokens), padded)


# ----------------------------------------------------------------------------
# Decoding in chunks.


def _per_row(value, n: int, name: str) -> list:
    """A setting given once for every row or once per row, as a list of n values."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


class Decoding:
    """A batch being decoded, resumable between chunks of steps (from :func:`start_decoding`).

    ``first_tokens`` holds each row's first token (PAD where the row stopped
    at once). ``advance(steps)`` runs up to that many steps and returns what
    they emitted; ``cancel(rows)`` stops rows before the next chunk.
    """

    def __init__(self, params, spec: DecodeSpec, state: DecodeState, first_tokens, programs: _Programs):
        self._params, self._spec, self._state, self._programs = params, spec, state, programs
        self.first_tokens = [int(t) for t in programs.fetch(first_tokens)]
        self._done = programs.fetch(state.done)
        self.steps = 1  # decode steps so far; the first token is one

    @property
    def finished(self) -> bool:
        """Every row is done (EOS, its budget, or cancelled)."""
        return bool(np.all(self._done))

    @property
    def done(self) -> list[bool]:
        return [bool(d) for d in self._done]

    @property
    def caches(self):
        """Every layer's decode cache as it stands (for tools and tests)."""
        return self._state.caches

    def advance(self, steps: int) -> list[list[int]]:
        """Run up to `steps` steps (fewer when every row finishes first); the tokens each row emitted."""
        if self.finished or steps < 1:
            return [[] for _ in self._done]
        self._state, out, run = self._programs.decode_chunk(self._params, self._state, spec=self._spec, steps=steps)
        out = self._programs.fetch(out)
        self._done = self._programs.fetch(self._state.done)
        self.steps += int(self._programs.fetch(run))
        return [[int(t) for t in row if t != PAD] for row in out]

    def lower(self, steps: int):
        """The chunk program of `steps` steps, lowered (``.compile().as_text()`` shows its HLO)."""
        return self._programs.decode_chunk.lower(self._params, self._state, spec=self._spec, steps=steps)

    def cancel(self, rows: Sequence[int]) -> None:
        """Stop these rows: they emit nothing more (the batch still steps them until all are done)."""
        done = self._done.copy()
        done[list(rows)] = True
        self._state = dataclasses.replace(self._state, done=jnp.asarray(done))
        self._done = done

    def keys_read_fraction(self) -> list[float] | None:
        """Per row: distinct keys read / keys in context, so far (None for dense decoding)."""
        return _keys_read_fraction(self._state.caches, self._spec.backend, self._programs.fetch)


def start_decoding(
    params,
    config,
    prefilled: Prefilled,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 0.0,
    top_p: float | None | Sequence[float | None] = None,
    top_k: int | None = None,
    seed: int | Sequence[int] = 0,
    eos_ids: Sequence[int] = (),
    method: str = "dense",
    method_config=None,
    cache_config: kvcache.CacheConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Decoding:
    """Split a prefill into decode caches and sample each row's first token.

    Args:
      params: weights split per layer (models.unstack_layers) and placed for `mesh`.
      prefilled: the prompts' prefill; its capacity must hold every row's prompt and the
        largest max_new_tokens (the caches take that capacity).
      max_new_tokens, temperature, top_p: one value for every row, or one per row
        (temperature 0: greedy; top_p None: no nucleus cut).
      seed: one seed (each row draws from its own key split from it) or one per row.
      eos_ids: tokens that end a row (not emitted).
      method, method_config, cache_config: as generate().
    Returns:
      a Decoding; the caller's prefill is left intact.
    """
    programs = _programs(mesh)
    rows = prefilled.rows
    b = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    budget = np.array(_per_row(max_new_tokens, b, "max_new_tokens"), np.int32)
    samplings = [SamplingConfig(t, top_k, p) for t, p in zip(_per_row(temperature, b, "temperature"),
                                                              _per_row(top_p, b, "top_p"))]
    needed = int((lengths + budget.max()).max())
    if prefilled.capacity < needed:
        raise ValueError(f"prefilled cache holds {prefilled.capacity} positions; this request needs "
                         f"{needed} (prompt + max_new_tokens)")
    backend = kvcache.make_backend(config, method, method_config, cache_config,
                                   prefilled.capacity - int(budget.max()), int(budget.max()),
                                   context=None if mesh is None else sharding.context_split(mesh))
    seeds = _per_row(seed, b, "seed") if isinstance(seed, (list, tuple, np.ndarray)) else None
    keys = (jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds]) if seeds is not None
            else jax.random.key_data(jax.random.split(jax.random.key(seed), b)))
    # Every layer's state is new arrays (slices or regions): the caller's prefill stays intact.
    caches = programs.regions(prefilled.staging, lengths, backend=backend)
    state = DecodeState(
        caches=caches, token=np.zeros(b, np.int32), position=lengths, emitted=np.zeros(b, np.int32),
        budget=budget, done=budget < 1, keys=keys,
        temperature=np.array([s.temperature for s in samplings], np.float32),
        top_p=np.array([1.0 if s.top_p is None else s.top_p for s in samplings], np.float32))
    spec = DecodeSpec(config, backend, programs.per_shard, tuple(eos_ids), top_k)
    state, first = programs.start(prefilled.first_logits, state, spec=spec)
    layers_split = params if models.layers_are_split(params) else _split_layers(params, config.num_layers)
    return Decoding(layers_split, spec, state, first, programs)


def _keys_read_fraction(states, backend, fetch) -> list[float] | None:
    if backend.method == "dense":
        return None
    read = seen = 0.0
    for state in states:
        if isinstance(state, kvcache.RegionKV):
            read, seen = read + fetch(state.keys_read), seen + fetch(state.keys_seen)
    if np.all(np.asarray(seen) == 0):
        return None
    n_dense = len(backend.dense_layers)
    n_layers = backend.num_layers
    # Dense layers read every key: weight them in by layer count.
    frac = (read / np.maximum(seen, 1) * (n_layers - n_dense) + n_dense) / n_layers
    return [float(x) for x in frac]


def generate(
    params,
    config,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_ids: Sequence[int] | None = None,
    seed: int = 0,
    method: str = "dense",
    method_config=None,
    cache_config: kvcache.CacheConfig | None = None,
    prefill_chunk: int | None = None,
    allow_beyond_context: bool = False,
    dtype=None,
    prefilled: Prefilled | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Generation:
    """Generate up to max_new_tokens tokens for each prompt (token-id lists of any lengths).

    prompts: a list of prompts, each a list of int token ids, or a 2-D int array; a flat
    list of ints (or a 1-D array) is one prompt (see jaxkv.request). Every argument is
    checked before any work, and a request whose caches cannot fit in memory is refused
    (jaxkv.memory.RequestTooLargeError, a ValueError).

    method: "dense" or a sparse method name (see jaxkv.cache.METHODS); method_config
    overrides that method's defaults; cache_config sizes the four regions.
    Stops per row on any of eos_ids (default: the model's EOS tokens).
    Positions beyond config.max_position_embeddings raise unless allow_beyond_context.
    prefill_chunk: tokens per prefill step (None: :func:`default_prefill_chunk`).
    The caches hold :func:`capacity_for` positions (a bucket), so calls with
    nearby lengths reuse compiled programs.
    prefilled: the result of prefill_prompts() for these prompts (then `prompts`
    may be None); it is left intact, so several methods can share one prefill. The
    caches are sized to its capacity, so calls on prefills of one capacity (and one
    batch size) reuse one compiled decode loop.
    mesh: a ("data", "model") mesh (jaxkv.sharding.make_mesh) to decode on, the
    batch split over "data" and the KV heads over "model"; see docs/sharding.md.
    params: as loaded (layer weights stacked), or split once per layer by
    models.unstack_layers. The decode loop needs them split: stacked weights are
    split (copied) on every call, split ones are used as they are.
    """
    request.check_model(params, config)
    rows = prefilled.rows if prefilled is not None else request.prompt_rows(prompts, config)
    eos_ids = request.check_generate(
        config, rows, max_new_tokens=max_new_tokens, eos_ids=eos_ids, seed=seed, method=method,
        cache_config=cache_config, prefill_chunk=prefill_chunk, allow_beyond_context=allow_beyond_context,
        dtype=dtype, mesh=mesh)
    params = _programs(mesh).place_params(params, config, len(rows))
    SamplingConfig(temperature, top_k, top_p)  # raises on a bad setting
    lengths = [len(r) for r in rows]
    if max_new_tokens == 0:
        return Generation([[] for _ in rows], lengths, 0.0, 0.0, 0)

    with compilation.CompileClock() as clock:
        t0 = time.perf_counter()
        capacity = capacity_for(max(lengths), max_new_tokens) if prefilled is None else prefilled.capacity
        # The method's settings and the caches' size are checked before the prefill is spent on them.
        backend = kvcache.make_backend(config, method, method_config, cache_config, capacity - max_new_tokens,
                                       max_new_tokens, context=None if mesh is None else sharding.context_split(mesh))
        memory.check_fits(memory.request_need(backend, config, batch=len(rows), max_new_tokens=max_new_tokens,
                                              dtype=dtype or models.activation_dtype(params),
                                              prefilled=prefilled is not None),
                          devices=None if mesh is None else mesh.devices.flat)
        if prefilled is None:
            prefilled = prefill_prompts(params, config, rows, capacity=capacity, prefill_chunk=prefill_chunk,
                                        dtype=dtype, mesh=mesh)
        decoding = start_decoding(
            params, config, prefilled, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, eos_ids=eos_ids, method=method, method_config=method_config,
            cache_config=cache_config, mesh=mesh)
        del prefilled  # a prefill of our own is freed before decoding (a caller's stays theirs)
        t1, compile_prefill = time.perf_counter(), clock.seconds
        # Steps in a bucket too: the loop stops at max_new_tokens, the program is shared.
        rest = decoding.advance(compilation.bucket(max_new_tokens - 1, smallest=16)) if max_new_tokens > 1 else None
        t2 = time.perf_counter()
    tokens = [([first] if first != PAD else []) + (more if rest else [])
              for first, more in zip(decoding.first_tokens, rest or [[]] * len(rows))]
    return Generation(tokens, lengths, (t1 - t0) - compile_prefill, (t2 - t1) - (clock.seconds - compile_prefill),
                      decoding.steps, decoding.keys_read_fraction(), clock.seconds)
