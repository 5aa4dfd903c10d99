"""Hybrid, for one KV head: retrieve the head of the attention exactly, estimate the tail.

The head is ParisKV's top-k, attended exactly like the sink, local and buffer tokens.
The tail (``HybridConfig.tail``) is either ``"regression"`` (ParisKV's other candidates,
scored from their RSQ codes, their values from a least-squares map of the codes: no K/V
row read), ``"lsh"`` (MagicPIG's importance-corrected sample of the rest) or ``"none"``
(ParisKV alone). Without a head it is MagicPIG. docs/results/hybrid.md measures it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxkv.attention import common, magicpig, pariskv, rsq
from jaxkv.attention.magicpig import MagicPIGConfig
from jaxkv.attention.method import SparseMethod
from jaxkv.attention.shards import ContextShards
from jaxkv.attention.pariskv import ParisKVConfig
from models import fields


TAILS = ("regression", "lsh", "none")
# Ridge of the value regression, relative to each feature's own sum of squares (so it
# does not depend on the keys' scale): keeps the solve well posed for few or collinear
# keys and barely moves a fit over thousands.
RIDGE = 1e-3
# CG stops at this relative residual, or after this many iterations per feature (exact
# arithmetic needs one per feature; float32 a few more).
CG_TOL, CG_ITERATIONS_PER_FEATURE = 1e-6, 3


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Static hybrid settings: the configs of the two methods it combines, and its own regions.

    pariskv: the head, ParisKV's retrieval of its ``top_k`` rows (with its m, candidate
        and collision ratios, levels, seed, kernels). None: no head ("lsh" tail only,
        i.e. MagicPIG).
    tail: "regression" (RSQ scores + regressed values of the non-head candidates, no
        K/V read), "lsh" (MagicPIG's sampling of the rest) or "none" (ParisKV).
    magicpig: the "lsh" tail's sampling (K, L, min_hits, capacity, candidate_capacity,
        center, seed, kernels).
    sink, local, buffer, dense_layers: the hybrid's exact regions and dense layers
        (small regions by default so the budget goes to the head). They replace the
        nested configs' own (:meth:`head_config`, :meth:`tail_config`).
    On the command line: ``--set pariskv.top_k=2048 --set magicpig.L=100``.
    """

    pariskv: ParisKVConfig | None = ParisKVConfig()
    tail: str = "regression"
    magicpig: MagicPIGConfig = MagicPIGConfig()
    sink: int = 4
    local: int = 64
    buffer: int = 64
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        fields.check(self, tail=fields.OneOf(TAILS), sink=fields.NON_NEGATIVE, local=fields.NON_NEGATIVE,
                     buffer=fields.NON_NEGATIVE, dense_layers=fields.NON_NEGATIVE)
        if self.pariskv is None and self.tail != "lsh":
            raise ValueError(f"HybridConfig: pariskv=None with tail={self.tail!r} has no head to work from; "
                             "give a ParisKVConfig or use tail='lsh' (MagicPIG alone)")

    def head_config(self) -> ParisKVConfig | None:
        """The head's ParisKV config with the hybrid's regions and dense layers (None: no head)."""
        if self.pariskv is None:
            return None
        return dataclasses.replace(self.pariskv, sink=self.sink, local=self.local, buffer=self.buffer,
                                   dense_layers=self.dense_layers)

    def tail_config(self) -> MagicPIGConfig:
        """The "lsh" tail's MagicPIG config with the hybrid's regions and dense layers."""
        return dataclasses.replace(self.magicpig, sink=self.sink, local=self.local, dense_layers=self.dense_layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ValueModel:
    """Least-squares map from a key's RSQ reconstruction (and a constant) to its value.

    x = [k̃, 1] (P + 1 features); the running sums make insertion exact and cheap.
    """

    gram: jax.Array     # [P + 1, P + 1] float32, Σ x xᵀ over the indexed keys
    cross: jax.Array    # [P + 1, d] float32, Σ x vᵀ
    weights: jax.Array  # [P + 1, d] float32, the ridge solution A (refitted at every insert)
    low: jax.Array      # [d] float32, per-coordinate min of the indexed values (+inf when empty)
    high: jax.Array     # [d] float32, per-coordinate max (−inf when empty)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridIndex:
    """One KV head's retrieval-region indices (None for a part the config does not use)."""

    head: pariskv.ParisKVIndex | None
    tail: magicpig.MagicPIGIndex | None  # the "lsh" tail
    values: ValueModel | None            # the "regression" tail


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ReadStats:
    """What one query group reads, head and tail apart (int32 scalars / float32 bytes)."""

    head_rows: jax.Array  # distinct full-precision K/V rows of the head
    tail_rows: jax.Array  # distinct K/V rows sampled in the tail (head rows excluded; 0 for "regression")
    head_index_bytes: jax.Array  # ParisKV metadata read: every key's bucket ids, the candidates' codes
    tail_index_bytes: jax.Array  # "lsh": bucket bounds and inverted-index entries; "regression": A


def _has_head(cfg: HybridConfig) -> bool:
    return cfg.pariskv is not None


def n_head_slots(cfg: HybridConfig, capacity: int) -> int:
    """Static number of head slots at the front of a selection."""
    return pariskv.n_retrieved(cfg.head_config(), capacity) if _has_head(cfg) else 0


def index_bytes_per_key(cfg: HybridConfig, d: int) -> int:
    """Index memory per key: ParisKV's codes (head) plus MagicPIG's table entries ("lsh" tail).

    The regression tail adds no per-key bytes: its :class:`ValueModel` is
    (P + 1)·(P + 1 + 2d) float32 per KV head (33 KB at d = 64), whatever the length.
    """
    head = pariskv.index_bytes_per_key(cfg.head_config(), d) if _has_head(cfg) else 0
    return head + (magicpig.index_bytes_per_key(cfg.tail_config()) if cfg.tail == "lsh" else 0)


# ---------------------------------------------------------------- the value regression

def _reconstructions(cfg: HybridConfig, codes) -> jax.Array:
    """k̃ [C, P] of ParisKV code rows (what the rerank's estimate is a dot product with)."""
    _, centres = pariskv._levels(cfg.head_config())
    return rsq.reconstruct(codes, cfg.pariskv.m, centres)


def _features(recon: jax.Array) -> jax.Array:
    return jnp.concatenate([recon, jnp.ones((*recon.shape[:-1], 1), recon.dtype)], axis=-1)


def _fit(gram: jax.Array, cross: jax.Array) -> jax.Array:
    """The ridge solution A of (gram + ridge)·A = cross.

    By Jacobi-preconditioned conjugate gradients, not ``jnp.linalg.solve``: XLA CPU's
    LAPACK custom call deadlocked its thread pool inside the cache's vmapped build
    (docs/results/hybrid.md, "The solve"). CG is plain XLA ops on every backend.
    """
    system = gram + jnp.diag(RIDGE * jnp.diagonal(gram) + 1e-30)  # + ε: an empty region fits A = 0
    diagonal = jnp.diagonal(system)
    hi = jax.lax.Precision.HIGHEST
    weights, _ = jax.scipy.sparse.linalg.cg(
        lambda x: jnp.matmul(system, x, precision=hi), cross, tol=CG_TOL,
        maxiter=CG_ITERATIONS_PER_FEATURE * gram.shape[0], M=lambda x: x / diagonal[:, None])
    return weights


def _value_model(cfg: HybridConfig, codes, values: jax.Array, live: jax.Array,
                 base: ValueModel | None = None, context: ContextShards | None = None) -> ValueModel:
    """``base`` (None: nothing) plus the live rows of code rows and their values [C, d], refitted.

    With ``context`` the rows are every shard's (sums and bounds over the shards): each
    shard keeps the whole region's model.
    """
    x = _features(_reconstructions(cfg, codes)) * live[:, None]
    values = values.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gram = jnp.matmul(x.T, x, precision=hi)
    cross = jnp.matmul(x.T, values, precision=hi)
    low = jnp.min(jnp.where(live[:, None], values, jnp.inf), axis=0)
    high = jnp.max(jnp.where(live[:, None], values, -jnp.inf), axis=0)
    if context is not None:
        gram, cross = context.total(gram), context.total(cross)
        low, high = jax.lax.pmin(low, context.axis), jax.lax.pmax(high, context.axis)
    if base is not None:
        gram, cross = base.gram + gram, base.cross + cross
        low, high = jnp.minimum(base.low, low), jnp.maximum(base.high, high)
    return ValueModel(gram=gram, cross=cross, weights=_fit(gram, cross), low=low, high=high)


def _require_values(values):
    if values is None:
        raise ValueError("HybridConfig(tail='regression') fits values: pass values= to build and insert "
                         "(the cache's calls, Hybrid.build and Hybrid.insert, do)")


# ---------------------------------------------------------------- index

def build(cfg: HybridConfig, keys: jax.Array, n, key: jax.Array | None = None,
          values: jax.Array | None = None, context: ContextShards | None = None) -> HybridIndex:
    """Indices over the first n rows of keys[cap, d] (values[cap, d] for the regression tail).

    ``key`` draws a projection of its own for the "lsh" tail (None: MagicPIG's
    seeded one, ``magicpig.projection``). ``context``: a shard's rows (the value model
    and MagicPIG's μ then cover every shard's).
    """
    head = pariskv.build(cfg.head_config(), keys, n) if _has_head(cfg) else None
    model = None
    if cfg.tail == "regression":
        _require_values(values)
        model = _value_model(cfg, head.codes, values, jnp.arange(keys.shape[0]) < n, context=context)
    tail = None
    if cfg.tail == "lsh":
        tail = (magicpig.build(cfg.tail_config(), keys, n, key) if context is None
                else magicpig.build_sharded(cfg.tail_config(), keys, n, key, context))
    return HybridIndex(head=head, values=model, tail=tail)


def insert(cfg: HybridConfig, index: HybridIndex, keys_new: jax.Array, count,
           values_new: jax.Array | None = None, context: ContextShards | None = None) -> HybridIndex:
    """Append the first ``count`` rows of keys_new[U, d] (and values_new) to every index (the buffer's flush)."""
    head = pariskv.insert(cfg.head_config(), index.head, keys_new, count) if _has_head(cfg) else None
    model = None
    if cfg.tail == "regression":
        _require_values(values_new)
        # The rows just written, read back from the head index: encoded once.
        rows, live = pariskv.append_targets(index.head.n, keys_new.shape[0], count, index.head.signs.shape[0])
        new_codes = jax.tree.map(lambda x: x[jnp.minimum(rows, x.shape[0] - 1)], head.codes)
        model = _value_model(cfg, new_codes, values_new, live, index.values, context)
    return HybridIndex(
        head=head, values=model,
        tail=magicpig.insert(cfg.tail_config(), index.tail, keys_new, count) if cfg.tail == "lsh" else None)


# ---------------------------------------------------------------- selection

def _rows_in(rows: jax.Array, members: jax.Array, member_valid: jax.Array) -> jax.Array:
    """[C] bool: which rows[C] occur among the valid members[k]."""
    sentinel = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(member_valid, members, sentinel).astype(jnp.int32))
    at = jnp.minimum(jnp.searchsorted(ordered, rows.astype(jnp.int32)), ordered.shape[0] - 1)
    return ordered[at] == rows


def _regression_tail(cfg: HybridConfig, index: HybridIndex, q, candidates, in_tail,
                     context: ContextShards | None = None) -> common.Partial:
    """Partial [G] over the candidates in_tail (not read): RSQ scores, regressed values.

    ŝ_i = ‖q_g‖⟨k̃_i, q̃_g⟩/√d per query head (k̃_i = ``rsq.reconstruct``, the codes the
    rerank read) and v̂_i = [k̃_i, 1]·A (K and V project the same hidden states, so the
    key code predicts much of the value), so Σ_i e^{ŝ_i} v̂_i = [Σ_i e^{ŝ_i} k̃_i, Σ_i e^{ŝ_i}]·A:
    one small matmul. Biased (keys outside the candidates are left out) but free of
    sampling noise and of K/V reads.

    With ``context`` the sums run over every shard's tail candidates and the whole partial
    comes back on the first shard (an empty one on the others, so merging counts it once).
    """
    pcfg = cfg.head_config()
    recon = _reconstructions(cfg, jax.tree.map(lambda x: x[candidates], index.head.codes))
    q = q.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.matmul(pariskv.rotate(pcfg, q), recon.T, precision=hi)  # ⟨k̃, q̃_g⟩ [G, C]
    s = s * jnp.linalg.norm(q, axis=-1, keepdims=True) / math.sqrt(q.shape[-1])
    s = jnp.where(in_tail[None, :], s, common.MASKED_SCORE)
    m = jnp.max(s, axis=-1, initial=common.MASKED_SCORE)
    p = jnp.where(in_tail[None, :], jnp.exp(s - m[:, None]), 0.0)
    l = jnp.sum(p, axis=-1)
    weighted = jnp.matmul(p, _features(recon), precision=hi)  # Σ_i p_i [k̃_i, 1]; · A = Σ_i p_i v̂_i
    if context is not None:
        every_m = jax.lax.pmax(m, context.axis)
        scale = jnp.exp(m - every_m)
        m, l, weighted = every_m, context.total(l * scale), context.total(weighted * scale[:, None])
    mean = jnp.matmul(weighted, index.values.weights, precision=hi) / jnp.where(l > 0, l, 1.0)[:, None]
    # The true tail mean lies in the values' bounding box: clipping to it can only
    # bring each coordinate closer, and keeps the output a convex-range estimate.
    mean = jnp.clip(mean, index.values.low, index.values.high)
    tail = common.Partial(o=jnp.where(l[:, None] > 0, l[:, None] * mean, 0.0), l=l, m=m)
    if context is None:
        return tail
    first = context.index() == 0
    return jax.tree.map(lambda x, none: jnp.where(first, x, none), tail, common.empty_partial(*tail.o.shape))


def _head_and_tail(head: common.Selection | None, tail: common.Selection | None, g: int) -> common.Selection:
    """One selection of the head's slots then the tail's, a tail row in the head read once."""
    if tail is None:
        return head
    if head is None:
        return tail
    tail_mask = tail.mask & ~_rows_in(tail.idx, head.idx, head.mask)[None, :]
    head_mask = jnp.broadcast_to(head.mask[None, :], (g, head.mask.shape[0]))
    return common.Selection(idx=jnp.concatenate([head.idx, tail.idx]),
                            mask=jnp.concatenate([head_mask, tail_mask], axis=1))


def select(cfg: HybridConfig, index: HybridIndex, q: jax.Array) -> common.Selection:
    """The head's rows, then the tail's: sampled slots ("lsh", mask [G, k + C]) or an estimated ``rest``.

    With the "lsh" tail, head slots and sampled tail slots travel in one selection
    (:func:`correction`: 0 on head slots, −log u on tail slots), so the cache's one
    softmax computes ô = (Σ_E e^{s} v + Σ_H e^{s} v + Σ_{T∩S} e^{s}/u · v) / (the same
    without v), E the exact regions, H the head, T the rest of the region, S the LSH
    sample. H does not depend on the LSH projection, so given H both tail sums are
    unbiased Horvitz–Thompson estimates. A row in both H and S is read once.
    """
    if cfg.tail == "regression":
        candidates, valid, best = pariskv.ranked_candidates(cfg.head_config(), index.head, q)
        in_tail = valid & ~jnp.zeros(candidates.shape, bool).at[best].set(True)
        return common.Selection(idx=candidates[best], mask=valid[best],
                                rest=_regression_tail(cfg, index, q, candidates, in_tail))
    head = pariskv.select(cfg.head_config(), index.head, q) if _has_head(cfg) else None
    tail = magicpig.select(cfg.tail_config(), index.tail, q) if cfg.tail == "lsh" else None
    return _head_and_tail(head, tail, q.shape[0])


def select_sharded(cfg: HybridConfig, index: HybridIndex, q: jax.Array, context: ContextShards) -> common.Selection:
    """:func:`select` over a split region: the head's and the tail's sharded selections, joined
    as on one device (the regression tail's partial summed over the shards)."""
    if cfg.tail == "regression":
        candidates, valid, head = pariskv.ranked_candidates_sharded(cfg.head_config(), index.head, q, context)
        in_tail = valid & ~_rows_in(candidates, head.idx, head.mask)
        return dataclasses.replace(head, rest=_regression_tail(cfg, index, q, candidates, in_tail, context))
    head = pariskv.select_sharded(cfg.head_config(), index.head, q, context) if _has_head(cfg) else None
    tail = magicpig.select_sharded(cfg.tail_config(), index.tail, q, context) if cfg.tail == "lsh" else None
    return _head_and_tail(head, tail, q.shape[0])


def _tail_weight(cfg, index, q, k_rows, selection, correct):
    """log_weight [G, k + C]: 0 on head slots, ``correct`` (MagicPIG's) on the tail's."""
    k = n_head_slots(cfg, index.tail.sorted_ids.shape[1])
    tail = common.Selection(idx=selection.idx[k:], mask=selection.mask[:, k:])
    tail_weight = correct(cfg.tail_config(), index.tail, q, k_rows[k:], tail)
    return jnp.concatenate([jnp.zeros((q.shape[0], k), tail_weight.dtype), tail_weight], axis=1)


def correction(cfg: HybridConfig, index: HybridIndex, q, k_rows, selection: common.Selection):
    """log_weight [G, k + C]: 0 on head slots (exact), −log u on sampled tail slots; None without an "lsh" tail."""
    if cfg.tail != "lsh":
        return None
    return _tail_weight(cfg, index, q, k_rows, selection, magicpig.correction)


def correction_sharded(cfg: HybridConfig, index: HybridIndex, q, k_rows, selection, context: ContextShards):
    """:func:`correction` of a shard's part (the tail's tables read over every shard)."""
    if cfg.tail != "lsh":
        return None
    return _tail_weight(cfg, index, q, k_rows, selection,
                        lambda *a: magicpig.correction_sharded(*a, context))


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
    if cfg.tail == "regression":
        # the candidates' codes are the head's; the tail reads only the fitted map A
        tail_bytes = jnp.float32(index.values.weights.nbytes)
    elif cfg.tail == "lsh":
        mcfg = cfg.tail_config()
        tail_rows = jnp.sum(jnp.any(selection.mask[:, k:], axis=0).astype(jnp.int32))
        # magicpig has no public "entries read"; its own bookkeeping is reused, not re-derived
        _, _, running, tables_used = magicpig._query_buckets(mcfg, index.tail, q)
        entries = jnp.where(tables_used > 0, running[jnp.arange(g), jnp.maximum(tables_used - 1, 0)], 0)
        # two int32 bucket bounds per table read and one int32 id per entry, per query head
        tail_bytes = (4.0 * jnp.sum(2 * tables_used + entries)).astype(jnp.float32)
    return ReadStats(head_rows=head_rows, tail_rows=tail_rows,
                     head_index_bytes=head_bytes, tail_index_bytes=tail_bytes)


class Hybrid(SparseMethod):
    """The hybrid through the cache's interface; its index models the values too (the regression tail)."""

    config_class = HybridConfig

    def build(self, cfg, keys, values, n, key):
        return build(cfg, keys, n, key, values=values)

    def insert(self, cfg, index, keys_new, values_new, count):
        return insert(cfg, index, keys_new, count, values_new=values_new)

    def select(self, cfg, index, q):
        return select(cfg, index, q)

    def correction(self, cfg, index, q, k_rows, selection):
        return correction(cfg, index, q, k_rows, selection)

    def top_k(self, cfg):
        return cfg.pariskv.top_k if _has_head(cfg) else 0

    def splits_context(self, cfg):
        """Every tail (the "lsh" one as MagicPIG does)."""
        return cfg.tail != "lsh" or magicpig.METHOD.splits_context(cfg.tail_config())

    def build_sharded(self, cfg, keys, values, n, key, context):
        return build(cfg, keys, n, key, values=values, context=context)

    def insert_sharded(self, cfg, index, keys_new, values_new, count, context):
        return insert(cfg, index, keys_new, count, values_new=values_new, context=context)

    def select_sharded(self, cfg, index, q, context):
        return select_sharded(cfg, index, q, context)

    def correction_sharded(self, cfg, index, q, k_rows, selection, context):
        return correction_sharded(cfg, index, q, k_rows, selection, context)


METHOD = Hybrid()


def attend(cfg: HybridConfig, q, keys, values, key=None):
    """(output [G, d], keys read) over sink + local exactly, the head exactly and the tail sampled."""
    return METHOD.attend(cfg, q, keys, values, key)
