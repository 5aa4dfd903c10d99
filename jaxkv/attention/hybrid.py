"""Hybrid: retrieve the head of the attention exactly, sample the tail.

One KV head (query group q[G, d], keys [N, d]); batch and heads come from vmap.

- Head: ParisKV's retrieval (coarse votes + RSQ-IP rerank) picks ``top_k`` rows
  of the retrieval region; they are attended exactly, like sink + local + buffer.
- Tail: MagicPIG's SimHash sampling over the retrieval region *minus* the head.
  A sampled row i gets the score correction −log u_i (u_i its inclusion
  probability).

Both parts travel in one :class:`common.Selection` (idx = head slots then tail
slots, mask [G, C], log_weight 0 on head slots and −log u on tail slots), so the
cache's single gather and softmax compute

    ô = (Σ_E e^{s_j} v_j + Σ_H e^{s_i} v_i + Σ_{T∩S} e^{s_i}/u_i · v_i)
        / (Σ_E e^{s_j}   + Σ_H e^{s_i}   + Σ_{T∩S} e^{s_i}/u_i)

with E the exact regions, H the head, T = retrieval − H the tail and S the LSH
sample. H is a deterministic function of (q, keys) and independent of the LSH
projection, so given H each tail row is in S with probability u_i and both tail
sums are Horvitz–Thompson estimates, unbiased for Σ_T e^{s_i} v_i and Σ_T e^{s_i}:
ô is the self-normalised importance estimate of the tail completed by the exact
head terms (the estimator MagicPIG uses with E alone).

Rows in both H and S are read once: their tail slot is masked out, so
``Selection.distinct_rows`` counts distinct rows. ``top_k = 0`` is MagicPIG,
``tail = False`` is ParisKV, exactly (the selections are theirs, unchanged).
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jaxkv.attention import common, magicpig, pariskv


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Static hybrid settings.

    top_k: head rows retrieved by ParisKV (0: no head, i.e. MagicPIG).
    tail: sample the rest with MagicPIG's LSH (False: head only, i.e. ParisKV).
    K, L, min_hits, capacity, candidate_capacity, center: MagicPIG's tail settings.
    m, candidate_ratio, collision_ratio, official_levels: ParisKV's head settings.
    sink, local, buffer: the exact regions (small by default so the budget goes to the head).
    """

    top_k: int = 100
    tail: bool = True
    K: int = 10
    L: int = 150
    sink: int = 4
    local: int = 64
    buffer: int = 64
    min_hits: int = 2
    capacity: int | float = 0.125
    candidate_capacity: int | float = 0.5
    center: bool = True
    m: int = 8
    candidate_ratio: float | None = None
    collision_ratio: float | None = None
    official_levels: bool = False
    seed: int = 0
    dense_layers: tuple = ()

    def __post_init__(self):
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"HybridConfig.top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.tail, bool):
            raise ValueError(f"HybridConfig.tail must be a bool, got {self.tail!r}")
        if self.top_k == 0 and not self.tail:
            raise ValueError("HybridConfig: top_k=0 with tail=False selects nothing; "
                             "use top_k >= 1 or tail=True")
        if isinstance(self.dense_layers, list):
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        try:  # the parts validate their own fields; name this config in the message
            self.head_config()
            self.tail_config()
        except ValueError as e:
            raise ValueError(f"HybridConfig: {e}") from None

    def head_config(self) -> pariskv.ParisKVConfig:
        """ParisKV's config for the head (top_k ≥ 1 even when the head is off, for validation)."""
        return pariskv.ParisKVConfig(
            m=self.m, top_k=max(self.top_k, 1), sink=self.sink, local=self.local, buffer=self.buffer,
            candidate_ratio=self.candidate_ratio, collision_ratio=self.collision_ratio,
            official_levels=self.official_levels, seed=self.seed, dense_layers=self.dense_layers)

    def tail_config(self) -> magicpig.MagicPIGConfig:
        """MagicPIG's config for the tail."""
        return magicpig.MagicPIGConfig(
            K=self.K, L=self.L, sink=self.sink, local=self.local, dense_layers=self.dense_layers,
            min_hits=self.min_hits, capacity=self.capacity,
            candidate_capacity=self.candidate_capacity, center=self.center, seed=self.seed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridIndex:
    """Both indices of one KV head's retrieval region (None for a disabled part)."""

    head: pariskv.ParisKVIndex | None
    tail: magicpig.MagicPIGIndex | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ReadStats:
    """What one query group reads, head and tail apart (int32 scalars / float32 bytes)."""

    head_rows: jax.Array  # distinct full-precision K/V rows of the head
    tail_rows: jax.Array  # distinct K/V rows sampled in the tail (head rows excluded)
    head_index_bytes: jax.Array  # ParisKV metadata read: every key's bucket ids, the candidates' codes
    tail_index_bytes: jax.Array  # MagicPIG metadata read: bucket bounds and inverted-index entries


def _has_head(cfg: HybridConfig) -> bool:
    return cfg.top_k > 0


def n_head_slots(cfg: HybridConfig, capacity: int) -> int:
    """Static number of head slots at the front of a selection."""
    return pariskv.n_retrieved(cfg.head_config(), capacity) if _has_head(cfg) else 0


def index_bytes_per_key(cfg: HybridConfig, d: int) -> int:
    """Index memory per key: ParisKV's codes (head) plus MagicPIG's table entries (tail)."""
    head = pariskv.index_bytes_per_key(cfg.head_config(), d) if _has_head(cfg) else 0
    return head + (magicpig.index_bytes_per_key(cfg.tail_config()) if cfg.tail else 0)


def build(cfg: HybridConfig, keys: jax.Array, n, key: jax.Array | None = None) -> HybridIndex:
    """Both indices over the first n rows of keys[cap, d]; ``key`` draws the LSH projection."""
    key = jax.random.key(0) if key is None else key
    return HybridIndex(
        head=pariskv.build(cfg.head_config(), keys, n) if _has_head(cfg) else None,
        tail=magicpig.build(cfg.tail_config(), keys, n, key) if cfg.tail else None)


def insert(cfg: HybridConfig, index: HybridIndex, keys_new: jax.Array, count) -> HybridIndex:
    """Append the first ``count`` rows of keys_new[U, d] to both indices (the update buffer's flush)."""
    return HybridIndex(
        head=pariskv.insert(cfg.head_config(), index.head, keys_new, count) if _has_head(cfg) else None,
        tail=magicpig.insert(cfg.tail_config(), index.tail, keys_new, count) if cfg.tail else None)


def _rows_in(rows: jax.Array, members: jax.Array, member_valid: jax.Array) -> jax.Array:
    """[C] bool: which rows[C] occur among the valid members[k]."""
    sentinel = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(member_valid, members, sentinel).astype(jnp.int32))
    at = jnp.minimum(jnp.searchsorted(ordered, rows.astype(jnp.int32)), ordered.shape[0] - 1)
    return ordered[at] == rows


def select(cfg: HybridConfig, index: HybridIndex, q: jax.Array) -> common.Selection:
    """Head slots [k] (mask shared by the group) then tail slots [C] (per query head), mask [G, k + C]."""
    head = pariskv.select(cfg.head_config(), index.head, q) if _has_head(cfg) else None
    tail = magicpig.select(cfg.tail_config(), index.tail, q) if cfg.tail else None
    if tail is None:
        return head
    if head is None:
        return tail
    tail_mask = tail.mask & ~_rows_in(tail.idx, head.idx, head.mask)[None, :]
    head_mask = jnp.broadcast_to(head.mask[None, :], (q.shape[0], head.mask.shape[0]))
    return common.Selection(idx=jnp.concatenate([head.idx, tail.idx]),
                            mask=jnp.concatenate([head_mask, tail_mask], axis=1))


def correction(cfg: HybridConfig, index: HybridIndex, q, k_rows, selection: common.Selection):
    """log_weight [G, k + C]: 0 on head slots (exact), −log u on sampled tail slots; None without a tail."""
    if not cfg.tail:
        return None
    k = n_head_slots(cfg, index.tail.sorted_ids.shape[1])
    tail = common.Selection(idx=selection.idx[k:], mask=selection.mask[:, k:])
    tail_weight = magicpig.correction(cfg.tail_config(), index.tail, q, k_rows[k:], tail)
    return jnp.concatenate([jnp.zeros((q.shape[0], k), tail_weight.dtype), tail_weight], axis=1)


def read_stats(cfg: HybridConfig, index: HybridIndex, q: jax.Array,
               selection: common.Selection) -> ReadStats:
    """Distinct K/V rows and index bytes one query group reads, head and tail apart."""
    g = q.shape[0]
    zero_rows, zero_bytes = jnp.int32(0), jnp.float32(0)
    head_rows, head_bytes, k = zero_rows, zero_bytes, 0
    if _has_head(cfg):
        pcfg = cfg.head_config()
        capacity, b = index.head.signs.shape
        k = n_head_slots(cfg, capacity)
        head_rows = jnp.sum(jnp.any(selection.mask[..., :k].reshape(-1, k), axis=0).astype(jnp.int32))
        # every valid key's bucket ids (its sign bytes) are voted on; only the
        # candidates' other code bytes (magnitudes, weights) are read
        per_candidate = sum(x.nbytes for x in jax.tree.leaves(index.head.codes)) // capacity - b
        candidates = jnp.minimum(pariskv.n_candidates(pcfg, capacity), index.head.n)
        head_bytes = (index.head.n * b + candidates * per_candidate).astype(jnp.float32)
    tail_rows, tail_bytes = zero_rows, zero_bytes
    if cfg.tail:
        mcfg = cfg.tail_config()
        tail_rows = jnp.sum(jnp.any(selection.mask[:, k:], axis=0).astype(jnp.int32))
        # magicpig has no public "entries read"; its own bookkeeping is reused, not re-derived
        _, _, running, tables_used = magicpig._query_buckets(mcfg, index.tail, q)
        entries = jnp.where(tables_used > 0, running[jnp.arange(g), jnp.maximum(tables_used - 1, 0)], 0)
        # two int32 bucket bounds per table read and one int32 id per entry, per query head
        tail_bytes = (4.0 * jnp.sum(2 * tables_used + entries)).astype(jnp.float32)
    return ReadStats(head_rows=head_rows, tail_rows=tail_rows,
                     head_index_bytes=head_bytes, tail_index_bytes=tail_bytes)


def attend(cfg: HybridConfig, q, keys, values, key=None):
    """(output [G, d], keys read) over sink + local exactly, the head exactly and the tail sampled."""
    return common.attend_with_method(sys.modules[__name__], cfg, q, keys, values, key)
