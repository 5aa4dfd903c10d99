"""PQCache baseline: per-head product quantisation of the keys, top-k by PQ score.

One KV head (query group q[G, d], keys [N, d]); batch and heads come from vmap.
Keys split into ``n_sub`` sub-vectors; each subspace gets ``n_centroids``
centroids from seeded k-means on the prefill keys (a fixed number of Lloyd
iterations). Keys inserted later are assigned to those centroids, which are
never retrained — the drift ParisKV is designed to avoid. The score of a key
is Σ_s q_s·centroid[s, code_s] with q the group-mean query (the same ranking
as summing the G heads' scores).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.attention import common, pariskv, shards  # pariskv: shared top-k and row appends
from jaxkv.attention.method import IndexFunctions, KeyRetriever, Regions
from jaxkv.attention.shards import ContextShards
from models import fields

MAX_CENTROIDS = 256  # codes are uint8


@dataclasses.dataclass(frozen=True)
class PQCacheConfig:
    n_sub: int = 2
    n_centroids: int = 64
    kmeans_iters: int = 20
    top_k: int = 100
    sink: int = 4
    local: int = 512
    seed: int = 0

    def __post_init__(self):
        fields.check(self, n_sub=fields.at_least(1), n_centroids=fields.in_range(1, MAX_CENTROIDS),
                     kmeans_iters=fields.at_least(1), top_k=fields.at_least(1), sink=fields.NON_NEGATIVE,
                     local=fields.NON_NEGATIVE, seed=fields.SEED)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PQCacheIndex:
    """PQ index of one KV head's retrieval region; rows >= n are unused."""

    centroids: jax.Array  # float32 [n_sub, n_centroids, d/n_sub], fixed after build
    codes: jax.Array      # uint8 [cap, n_sub]
    n: jax.Array          # int32 valid rows


def index_bytes_per_key(cfg: PQCacheConfig, d: int) -> int:
    """Per-key index memory: one uint8 code per subspace (the centroids are a fixed
    n_sub·n_centroids·d/n_sub floats per head, not per key)."""
    del d  # the codes do not depend on the head dim
    return cfg.n_sub


def _split(cfg: PQCacheConfig, x: jax.Array) -> jax.Array:
    """x[..., d] → float32 [..., n_sub, d/n_sub]."""
    d = x.shape[-1]
    if d % cfg.n_sub:
        raise ValueError(f"PQCacheConfig.n_sub={cfg.n_sub} must divide the head dim {d}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], cfg.n_sub, d // cfg.n_sub)


def _assign(parts: jax.Array, centroids: jax.Array) -> jax.Array:
    """Nearest centroid per subspace: parts [N, S, e], centroids [S, C, e] → int32 [N, S]."""
    # ‖x − c‖² = ‖x‖² − 2x·c + ‖c‖²; ‖x‖² does not change the argmin.
    cross = jnp.einsum("nse,sce->nsc", parts, centroids, precision=jax.lax.Precision.HIGHEST)
    dist = jnp.sum(centroids**2, axis=-1)[None] - 2 * cross
    return jnp.argmin(dist, axis=-1).astype(jnp.int32)


def _lloyd_step(parts, valid, centroids, total=lambda x: x):
    """One k-means iteration over the valid rows; empty clusters keep their centroid.
    total: sums over the shards of a split region (``ContextShards.total``)."""
    onehot = jax.nn.one_hot(_assign(parts, centroids), centroids.shape[1]) * valid[:, None, None]
    sums = total(jnp.einsum("nsc,nse->sce", onehot, parts, precision=jax.lax.Precision.HIGHEST))
    counts = total(jnp.sum(onehot, axis=0)[..., None])
    return jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), centroids)


def _init_noise(cfg: PQCacheConfig, capacity: int) -> jax.Array:
    """The k-means initialisation's draw per row of a region of ``capacity`` rows."""
    return jax.random.uniform(jax.random.key(cfg.seed), (capacity,))


def kmeans(cfg: PQCacheConfig, keys: jax.Array, n) -> jax.Array:
    """Per-subspace centroids [n_sub, n_centroids, d/n_sub] of the first n rows of keys.

    Initialised at n_centroids distinct valid rows drawn with ``cfg.seed``; with
    fewer valid rows than centroids the rows repeat (duplicates stay empty and unused).
    """
    parts = _split(cfg, keys)
    valid = jnp.arange(keys.shape[0]) < n
    shuffled_valid_first = jnp.argsort(jnp.where(valid, _init_noise(cfg, keys.shape[0]), 2.0))
    start_rows = shuffled_valid_first[jnp.arange(cfg.n_centroids) % jnp.maximum(n, 1)]
    centroids = jnp.swapaxes(parts[start_rows], 0, 1)
    return jax.lax.fori_loop(0, cfg.kmeans_iters,
                             lambda _, c: _lloyd_step(parts, valid, c), centroids)


def kmeans_sharded(cfg: PQCacheConfig, keys: jax.Array, n, context: ContextShards) -> jax.Array:
    """:func:`kmeans` of every shard's rows, on each (keys [local cap, d] this shard's).

    The same initial rows (each row's draw is its one-device row's, the lowest draws merged
    over the shards) and Lloyd steps over the sums of every shard; the centroids equal one
    device's up to the rounding of those sums.
    """
    parts = _split(cfg, keys)
    rows = jnp.arange(keys.shape[0])
    valid = rows < n
    draw = _init_noise(cfg, context.capacity)[jnp.minimum(context.index() * context.rows_per_shard + rows,
                                                          context.capacity - 1)]
    k = min(cfg.n_centroids, keys.shape[0])
    lowest, local_rows = jax.lax.top_k(jnp.where(valid, -draw, -jnp.inf), k)
    _, order = shards.best_of_shards(lowest, context.order(local_rows), cfg.n_centroids, context)
    start = order[jnp.arange(cfg.n_centroids) % jnp.maximum(context.total(n), 1)]
    mine = context.owns(start)[:, None, None]
    centroids = context.total(jnp.where(mine, parts[context.local_row(start)], 0.0))  # [n_centroids, S, e]
    centroids = jnp.swapaxes(centroids, 0, 1)
    return jax.lax.fori_loop(0, cfg.kmeans_iters,
                             lambda _, c: _lloyd_step(parts, valid, c, context.total), centroids)


def insert(cfg: PQCacheConfig, index: PQCacheIndex, keys_new: jax.Array, count) -> PQCacheIndex:
    """Append the first ``count`` rows of keys_new[U, d], coded with the existing centroids.

    Rows that would land at or beyond the capacity are dropped.
    """
    capacity = index.codes.shape[0]
    codes = _assign(_split(cfg, keys_new), index.centroids).astype(jnp.uint8)
    target, live = pariskv.append_targets(index.n, keys_new.shape[0], count, capacity)
    return PQCacheIndex(
        centroids=index.centroids,
        codes=index.codes.at[target].set(codes, mode="drop"),
        n=index.n + jnp.sum(live, dtype=jnp.int32),
    )


def build(cfg: PQCacheConfig, keys: jax.Array, n, key=None, context: ContextShards | None = None) -> PQCacheIndex:
    """k-means on the first n rows of keys[cap, d] and their codes; capacity = keys.shape[0].

    ``key`` is accepted for the common method interface and unused (``cfg.seed`` seeds k-means).
    ``context``: a shard's rows, the centroids trained on every shard's (:func:`kmeans_sharded`).
    """
    del key
    centroids = kmeans(cfg, keys, n) if context is None else kmeans_sharded(cfg, keys, n, context)
    empty = PQCacheIndex(centroids=centroids,
                         codes=jnp.zeros((keys.shape[0], cfg.n_sub), jnp.uint8),
                         n=jnp.int32(0))
    return insert(cfg, empty, keys, n)


def scores(cfg: PQCacheConfig, index: PQCacheIndex, q: jax.Array) -> jax.Array:
    """PQ score Σ_s q̄_s·centroid[s, code_s] per row, float32 [cap]; rows >= n get -inf."""
    q_mean = jnp.mean(q.astype(jnp.float32), axis=0) if q.ndim == 2 else q.astype(jnp.float32)
    table = jnp.einsum("se,sce->sc", _split(cfg, q_mean), index.centroids,
                       precision=jax.lax.Precision.HIGHEST)
    per_row = jnp.sum(table[jnp.arange(cfg.n_sub)[None, :], index.codes], axis=-1)
    return jnp.where(jnp.arange(index.codes.shape[0]) < index.n, per_row, -jnp.inf)


def retrieve(cfg: PQCacheConfig, index: PQCacheIndex, q: jax.Array) -> jax.Array:
    """Row indices [min(top_k, cap)] with the best PQ scores (ties: lower row first)."""
    k = min(cfg.top_k, index.codes.shape[0])
    return pariskv.top_indices(scores(cfg, index, q), k)


def select(cfg: PQCacheConfig, index: PQCacheIndex, q: jax.Array) -> common.Selection:
    idx = retrieve(cfg, index, q)
    return common.Selection(idx=idx, mask=idx < index.n)


def select_sharded(cfg: PQCacheConfig, index: PQCacheIndex, q: jax.Array, context: ContextShards) -> common.Selection:
    """:func:`select` over a split region: each shard's best PQ scores, merged (``shards.best_of_shards``)."""
    k = min(cfg.top_k, context.capacity)
    values = scores(cfg, index, q)
    local = pariskv.top_indices(values, min(k, values.shape[0]))
    return shards.shard_selection(*shards.best_of_shards(values[local], context.order(local), k, context), context)


class PQCache(KeyRetriever):
    """PQCache through the cache's interface (its config has no buffer and no dense layers)."""

    config_class = PQCacheConfig
    functions = IndexFunctions(build, insert, select)

    def regions(self, cfg):
        return Regions(cfg.sink, cfg.local, None)

    def dense_layers(self, cfg):
        return ()

    def splits_context(self, cfg):
        return True

    def build_sharded(self, cfg, keys, values, n, key, context):
        return build(cfg, keys, n, key, context)

    def select_sharded(self, cfg, index, q, context):
        return select_sharded(cfg, index, q, context)


METHOD = PQCache()


def attend(cfg: PQCacheConfig, q, keys, values, key=None):
    """(output [G, d], keys read) over sink + local exactly and the PQ top-k of the rest."""
    return METHOD.attend(cfg, q, keys, values, key)
