"""TopK oracle as an index-based method: exact top-k of the true scores.

It "indexes" by keeping a full-precision copy of the retrieval keys, so it
reads every key to choose — an upper bound on what any top-k retriever
(ParisKV, PQCache) can select at the same k, not a practical method. Like
ParisKV, one retrieval per KV head from the query averaged over its group.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.attention import common, shards
from jaxkv.attention.common import Selection
from jaxkv.attention.method import IndexFunctions, KeyRetriever
from jaxkv.attention.shards import ContextShards
from models import fields


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    top_k: int = 100
    sink: int = 4
    local: int = 512
    buffer: int = 512
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        fields.check(self, top_k=fields.at_least(1), sink=fields.NON_NEGATIVE, local=fields.NON_NEGATIVE,
                     buffer=fields.NON_NEGATIVE, dense_layers=fields.NON_NEGATIVE)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TopKIndex:
    keys: jax.Array  # [cap, d]
    n: jax.Array  # int32 count of valid rows


def build(cfg: TopKConfig, keys, n, key=None) -> TopKIndex:
    return TopKIndex(keys=keys, n=jnp.asarray(n, jnp.int32))


def insert(cfg: TopKConfig, index: TopKIndex, keys_new, count) -> TopKIndex:
    keys = jax.lax.dynamic_update_slice(index.keys, keys_new.astype(index.keys.dtype), (index.n, 0))
    # Rows beyond count are written too but stay invalid (n advances by count only).
    return TopKIndex(keys=keys, n=index.n + count)


def _best(index: TopKIndex, q, k: int):
    """(scores [k], rows [k]) of the k best valid rows by the group-mean score (−inf: none)."""
    s = jnp.matmul(index.keys.astype(jnp.float32), jnp.mean(q.astype(jnp.float32), axis=0), precision=common.FULL_F32)
    valid = jnp.arange(index.keys.shape[0]) < index.n
    return jax.lax.top_k(jnp.where(valid, s, -jnp.inf), k)


def select(cfg: TopKConfig, index: TopKIndex, q) -> Selection:
    top_s, idx = _best(index, q, min(cfg.top_k, index.keys.shape[0]))
    return Selection(idx=idx.astype(jnp.int32), mask=top_s > -jnp.inf)


def select_sharded(cfg: TopKConfig, index: TopKIndex, q, context: ContextShards) -> Selection:
    """:func:`select` over a split region: each shard's best, merged by score (``shards.best_of_shards``)."""
    k = min(cfg.top_k, context.capacity)
    top_s, idx = _best(index, q, min(k, index.keys.shape[0]))
    return shards.shard_selection(*shards.best_of_shards(top_s, context.order(idx), k, context), context)


class TopK(KeyRetriever):
    """The TopK oracle through the cache's interface: the exact top-k of the group-mean scores."""

    config_class = TopKConfig
    functions = IndexFunctions(build, insert, select)

    def splits_context(self, cfg):
        return True

    def select_sharded(self, cfg, index, q, context):
        return select_sharded(cfg, index, q, context)


METHOD = TopK()
