"""Capture a real model's keys, values and queries for the attention studies.

One dense prefill of a long text; every layer's keys and values (after k-norm
and RoPE, as the cache holds them) for all positions, and the queries of the
last `n_queries` positions — the rows whose attention the studies estimate.
"""
from __future__ import annotations

import dataclasses
import functools
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

import models
from models import files


@dataclasses.dataclass
class Captured:
    """keys, values: [L, Hkv, N, hd]; queries: [L, Hkv, G, Q, hd]; query_positions: [Q]."""

    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    query_positions: np.ndarray

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]


def _capturing_attention(q, k, v, positions, state, layer, *, first_query: int):
    """Dense attention (a StackedAttentionFn) that also records q at positions >= first_query."""
    kv, q_buf = state
    out, kv = models.cached_attention(q, k, v, positions, kv, layer)
    slot = positions - first_query
    slot = jnp.where(slot >= 0, slot, q_buf.shape[2])  # out of range → dropped
    rows = jnp.arange(q.shape[0])[:, None]
    q_buf = q_buf.at[layer, rows, slot].set(q.astype(q_buf.dtype), mode="drop")
    return out, (kv, q_buf)


@functools.partial(jax.jit, static_argnames=("config", "first_query"), donate_argnames=("state",))
def _prefill_chunk(params, config, tokens, positions, state, first_query):
    attention = functools.partial(_capturing_attention, first_query=first_query)
    _, state = models.forward_hidden(params, config, tokens, positions, state, attention)
    return state


def capture(params, config, tokens, n_queries: int = 64, chunk: int = 512) -> Captured:
    """Prefill `tokens` (a 1-D id sequence) and return the captured tensors."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = tokens.shape[0]
    if not 0 < n_queries <= n:
        raise ValueError(f"n_queries must be in [1, {n}] for a {n}-token text, got {n_queries}")
    padded = -(-n // chunk) * chunk
    dtype = models.activation_dtype(params)
    kv = models.init_cache(config, 1, padded, dtype)
    q_buf = jnp.zeros((config.num_layers, 1, n_queries, config.num_heads, config.head_dim), dtype)
    state = (kv, q_buf)
    ids = np.zeros((1, padded), np.int32)
    ids[0, :n] = tokens
    for start in range(0, padded, chunk):
        positions = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
        state = _prefill_chunk(params, config, jnp.asarray(ids[:, start:start + chunk]), positions,
                               state, first_query=n - n_queries)
    kv, q_buf = state
    g = config.num_heads // config.num_kv_heads
    keys = np.asarray(models.row_values(models.transpose_keys(kv.k[:, 0, :, :, :n])), np.float32)
    values = np.asarray(models.row_values(kv.v[:, 0, :, :n]), np.float32)
    queries = np.asarray(q_buf[:, 0], np.float32)  # [L, Q, Hq, hd]
    queries = queries.reshape(config.num_layers, n_queries, config.num_kv_heads, g, config.head_dim)
    return Captured(keys=keys, values=values, queries=queries.transpose(0, 2, 3, 1, 4),
                    query_positions=np.arange(n - n_queries, n))


def load_or_capture(args) -> Captured:
    """The study's captured tensors, from ``args.capture_cache`` when that file exists.

    Otherwise capture ``args.tokens`` tokens of Wikipedia text (seed ``args.seed``)
    with the model at ``args.model`` (default: the embedded SmolLM2) and, when a
    cache path is given, write them there (atomically) for the next study.
    """
    from pathlib import Path

    from jaxkv.eval import text

    cache = Path(args.capture_cache) if getattr(args, "capture_cache", None) else None
    if cache is not None and cache.exists():
        return read_capture(cache)
    config, params, tokenizer = models.load(Path(args.model) if args.model else models.default_model_path())
    _, ids = text.long_text(tokenizer, args.tokens, seed=args.seed)
    captured = capture(params, config, list(ids)[: args.tokens], n_queries=args.queries)
    if cache is not None:
        write_capture(cache, captured)
    return captured


def write_capture(path, captured: Captured) -> None:
    """Write ``captured`` to the .npz file ``path``, whole or not at all."""
    with files.atomic_file(path) as staging, open(staging, "wb") as f:
        np.savez(f, **dataclasses.asdict(captured))


def read_capture(path) -> Captured:
    """A capture written by :func:`write_capture`, its arrays' names, shapes and values checked.

    Raises:
        ValueError: naming the file and what is wrong (not an .npz file, truncated, other arrays,
            inconsistent shapes, non-finite values).
    """
    expected = [f.name for f in dataclasses.fields(Captured)]
    try:
        with np.load(path, allow_pickle=False) as z:
            if sorted(z.files) != sorted(expected):
                raise ValueError(f"{path}: a capture cache holds the arrays {expected}, this file {sorted(z.files)}")
            arrays = {name: z[name] for name in expected}
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a readable capture cache, truncated or not an .npz file ({err})") from None
    problem = _capture_problem(**arrays)
    if problem:
        raise ValueError(f"{path}: {problem}; delete it to capture again")
    return Captured(**arrays)


def _capture_problem(keys, values, queries, query_positions) -> str | None:
    """What makes these arrays not a capture (shapes as :class:`Captured` documents), or None."""
    if keys.ndim != 4 or values.shape != keys.shape:
        return f"keys {keys.shape} and values {values.shape} must both be [layers, KV heads, tokens, head dim]"
    layers, heads, n, dim = keys.shape
    if queries.ndim != 5 or queries.shape[:2] != (layers, heads) or queries.shape[4] != dim:
        return f"queries {queries.shape} must be [{layers}, {heads}, G, Q, {dim}] to match the keys"
    if query_positions.shape != (queries.shape[3],) or not np.issubdtype(query_positions.dtype, np.integer):
        return f"query_positions {query_positions.shape} {query_positions.dtype} must be {queries.shape[3]} ints"
    if query_positions.size and not (0 <= query_positions.min() and query_positions.max() < n
                                     and np.all(np.diff(query_positions) > 0)):
        return f"query_positions must increase within [0, {n})"
    for name, array in (("keys", keys), ("values", values), ("queries", queries)):
        if not np.issubdtype(array.dtype, np.floating) or not np.isfinite(array).all():
            return f"{name} must be finite floats"
    return None


def parse_layers(text: str | None, flag: str = "--layers") -> list[int] | None:
    """The layer numbers of a comma-separated flag value; None for no value or 'all' (every layer).

    Raises:
        ValueError: naming the flag, when the value is not such a list.
    """
    if text is None or text.strip() == "all":
        return None
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        layers = []
    if not layers or min(layers) < 0:
        raise ValueError(f"{flag} must be 'all' or comma-separated layer numbers >= 0, got {text!r}")
    return layers


def check_layers(layers: list[int] | None, num_layers: int, flag: str = "--layers") -> list[int]:
    """``layers`` (None: every layer) checked against a capture of ``num_layers`` layers."""
    if layers is None:
        return list(range(num_layers))
    bad = [x for x in layers if x >= num_layers]
    if bad:
        raise ValueError(f"{flag} {bad} out of range: the capture has {num_layers} layers")
    return layers


def check_sizes(tokens: int, queries: int) -> None:
    """--queries (scored positions) must fit in --tokens (the context)."""
    if queries > tokens:
        raise ValueError(f"--queries {queries} must be at most --tokens {tokens}")
