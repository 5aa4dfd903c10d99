"""generate(): chunked prefill, then the whole decode loop inside one jit.

The prompt is always prefilled with exact attention into a dense staging
cache (a right-padded batch: row b's token t sits at cache index t). For
``method="dense"`` that staging cache, sized for the generated tokens too, is
split into one decode cache per layer. For a sparse method it is split into the
four regions of :mod:`jaxkv.cache` and each layer's index is built over its
retrieval region; decoding then reads the retrieval region only through the
method's selection.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import models
from jaxkv import cache as kvcache
from jaxkv import memory, request, sharding
from jaxkv.sampling import SamplingConfig, sample

PAD = -1  # marks "no token" in generated outputs


@dataclasses.dataclass
class Generation:
    """What generate() returns: tokens per prompt (EOS excluded) and timings."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    # Per row: distinct keys read / keys in context, over decode steps and layers
    # (dense layers read everything). None for method="dense".
    keys_read_fraction: list[float] | None = None

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


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("staging",))
def _prefill_chunk(params, config, tokens, start, lengths, staging, last_hidden, mesh=None):
    """Run one chunk [B, C] at positions start..start+C; keep each row's last real hidden state."""
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    hidden, staging = models.forward_hidden(
        params, config, tokens, positions, staging, sharding.per_shard(models.cached_attention, mesh))
    offset = lengths - 1 - start
    in_chunk = (offset >= 0) & (offset < c)
    picked = hidden[jnp.arange(b), jnp.clip(offset, 0, c - 1)]
    last_hidden = jnp.where(in_chunk[:, None], picked.astype(last_hidden.dtype), last_hidden)
    return staging, last_hidden


def prefill(params, config, rows: Sequence[Sequence[int]], capacity: int, chunk: int, dtype,
            mesh=None):
    """Prefill right-padded prompts into a dense staging cache of `capacity` positions.

    Returns (staging cache, logits of each row's last prompt token [B, V]).
    With a mesh, params must already be on it (sharding.shard_params).
    """
    b = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = _round_up(int(lengths.max()), chunk)
    tokens = np.zeros((b, padded), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    staging = sharding.shard_states(models.init_cache(config, b, max(capacity, padded), dtype), mesh)
    last_hidden = sharding.shard_rows(jnp.zeros((b, config.hidden_size), dtype), mesh)
    lengths_j = sharding.shard_rows(jnp.asarray(lengths), mesh)
    for start in range(0, padded, chunk):
        chunk_tokens = sharding.shard_rows(jnp.asarray(tokens[:, start:start + chunk]), mesh)
        staging, last_hidden = _prefill_chunk(
            params, config, chunk_tokens, jnp.int32(start), lengths_j, staging, last_hidden, mesh)
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


def prefill_prompts(params, config, prompts, *, capacity: int, prefill_chunk: int = 512,
                    dtype=None, mesh=None) -> Prefilled:
    """Validate and prefill prompts into a dense cache of `capacity` positions (≥ prompt + new tokens).

    mesh: a jaxkv.sharding mesh to prefill on (the cache comes back sharded on it).
    """
    request.check_model(params, config)
    rows = request.prompt_rows(prompts, config)
    request.check_prefill(prefill_chunk=prefill_chunk, dtype=dtype, mesh=mesh, capacity=capacity)
    params = sharding.shard_params(params, config, mesh, batch=len(rows))
    dtype = dtype or models.activation_dtype(params)
    t0 = time.perf_counter()
    staging, first_logits = prefill(params, config, rows, capacity, prefill_chunk, dtype, mesh)
    jax.block_until_ready(first_logits)
    return Prefilled(rows, staging, first_logits, time.perf_counter() - t0)


def _keys_read_fraction(states, backend) -> list[float] | None:
    if backend.method == "dense":
        return None
    read = seen = 0.0
    for state in states:
        if isinstance(state, kvcache.RegionKV):
            read, seen = read + sharding.fetch(state.keys_read), seen + sharding.fetch(state.keys_seen)
    if np.all(np.asarray(seen) == 0):
        return None
    n_dense = len(backend.dense_layers)
    n_layers = backend.num_layers
    # Dense layers read every key: weight them in by layer count.
    frac = (read / np.maximum(seen, 1) * (n_layers - n_dense) + n_dense) / n_layers
    return [float(x) for x in frac]


@dataclasses.dataclass(frozen=True)
class _LoopSpec:
    """Static description of a decode loop (hashable: a jit static argument)."""

    config: models.ModelConfig
    max_new_tokens: int
    sampling: SamplingConfig
    eos_ids: tuple[int, ...]
    backend: kvcache.Backend
    mesh: jax.sharding.Mesh | None = None


# Its own program: split inside _decode_loop, the same slices ran ≈ 6× slower
# (≈ 0.8 s per generate() call of SmolLM2 in XLA's trace; 131 ms alone).
_split_layers = jax.jit(models.unstack_layers, static_argnums=(1,))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("states",))
def _decode_loop(params, spec: _LoopSpec, first_logits, lengths, states, key):
    """Sample max_new_tokens tokens (fewer when every row has hit EOS) inside one while_loop.

    params has its layer weights split per layer (:func:`models.unstack_layers`):
    a stacked weight is copied by XLA CPU each time the loop slices a layer from it.
    """
    b = first_logits.shape[0]
    eos = jnp.asarray(spec.eos_ids if spec.eos_ids else (-2,), jnp.int32)
    out = jnp.full((b, spec.max_new_tokens), PAD, jnp.int32)

    def emit(step, logits, out, done, key):
        key, sub = jax.random.split(key)
        token = sample(logits, sub, spec.sampling)
        done = done | jnp.isin(token, eos)
        out = out.at[:, step].set(jnp.where(done, PAD, token))
        return token, out, done, key

    token, out, done, key = emit(0, first_logits, out, jnp.zeros((b,), bool), key)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < spec.max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, token, out, states, done, key = carry
        positions = (lengths + step - 1)[:, None]
        hidden, states = models.forward_hidden(
            params, spec.config, token[:, None], positions, states,
            sharding.per_shard(spec.backend.attention, spec.mesh))
        logits = models.lm_head(params, spec.config, hidden)[:, 0]
        token, out, done, key = emit(step, logits, out, done, key)
        return step + 1, token, out, states, done, key

    step, _, out, states, _, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), token, out, states, done, key))
    return out, step, states


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
    prefill_chunk: int = 512,
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
    prefilled: the result of prefill_prompts() for these prompts (then `prompts`
    may be None); it is left intact, so several methods can share one prefill. The
    caches are sized to its capacity, so calls on prefills of one capacity (and one
    batch size and max_new_tokens) reuse one compiled decode loop.
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
    params = sharding.shard_params(params, config, mesh, batch=len(rows))
    sampling = SamplingConfig(temperature, top_k, top_p)
    lengths = [len(r) for r in rows]
    if max_new_tokens == 0:
        return Generation([[] for _ in rows], lengths, 0.0, 0.0, 0)

    needed = max(lengths) + max_new_tokens
    if prefilled is not None and prefilled.capacity < needed:
        raise ValueError(f"prefilled cache holds {prefilled.capacity} positions; this request needs "
                         f"{needed} (prompt + max_new_tokens)")
    # With a shared prefill the caches take its capacity, not this request's need:
    # batches prefilled to one capacity then share one compiled decode loop.
    positions = needed if prefilled is None else prefilled.capacity
    backend = kvcache.make_backend(config, method, method_config, cache_config, positions - max_new_tokens,
                                   max_new_tokens)
    memory.check_fits(memory.request_need(backend, config, batch=len(rows), max_new_tokens=max_new_tokens,
                                          dtype=dtype or models.activation_dtype(params),
                                          prefilled=prefilled is not None),
                      devices=None if mesh is None else mesh.devices.flat)
    t0 = time.perf_counter()
    if prefilled is None:
        prefilled = prefill_prompts(params, config, rows, capacity=backend.staging_capacity,
                                    prefill_chunk=prefill_chunk, dtype=dtype, mesh=mesh)
    lengths_j = sharding.shard_rows(jnp.asarray(lengths, jnp.int32), mesh)
    # Every layer's state is new arrays (slices or regions): the caller's prefill stays intact.
    states = sharding.states_from_prefill(backend, sharding.shard_states(prefilled.staging, mesh), lengths_j, mesh)
    first_logits = sharding.shard_rows(prefilled.first_logits, mesh)
    del prefilled  # a prefill of our own is freed before decoding (a caller's stays theirs)
    jax.block_until_ready(states)
    t1 = time.perf_counter()
    spec = _LoopSpec(config, max_new_tokens, sampling, eos_ids, backend, mesh)
    # Weights already split by the caller are used as they are; stacked ones are
    # split here, once per call, and the split is timed with the decode.
    layers_split = params if models.layers_are_split(params) else _split_layers(params, config.num_layers)
    out, steps, states = _decode_loop(layers_split, spec, first_logits, lengths_j, states,
                                      jax.random.key(seed))
    out = sharding.fetch(out)
    t2 = time.perf_counter()
    tokens = [[int(t) for t in row if t != PAD] for row in out]
    return Generation(tokens, lengths, t1 - t0, t2 - t1, int(steps),
                      _keys_read_fraction(states, backend))
