"""Hybrid: retrieve the head of the attention exactly, estimate the tail.

One KV head (query group q[G, d], keys [N, d]); batch and heads come from vmap.

- Head: ParisKV's retrieval (coarse votes + RSQ-IP rerank) picks ``top_k`` rows
  of the retrieval region; they are attended exactly, like sink + local + buffer.
- Tail, two estimators (``tail``):

  ``"regression"`` (default) reads no K/V row. The tail is ParisKV's candidates
  minus the head. Their scores come from the RSQ codes the rerank already read
  (ŝ_i = ‖q_g‖⟨k̃_i, q̃_g⟩/√d per query head, k̃_i = :func:`rsq.reconstruct`), and
  their values from a least-squares map fitted over the region,
  v̂_i = [k̃_i, 1]·A (K and V are both projections of the same hidden states, so
  the key code predicts much of the value; A is refitted from running sums at
  every insert). The tail's partial is then
  Σ_i e^{ŝ_i} v̂_i = [Σ_i e^{ŝ_i} k̃_i, Σ_i e^{ŝ_i}]·A: one small matmul, merged
  with the exact partials by log-sum-exp. It is biased (keys outside the
  candidates are left out; v̂ is a regression) but has no sampling noise and
  costs no budget: docs/results/hybrid.md measures it against both papers.

  ``"lsh"``: MagicPIG's SimHash sampling over the retrieval region *minus* the
  head; a sampled row i gets the score correction −log u_i (u_i its inclusion
  probability). Both parts travel in one :class:`common.Selection` (idx = head
  slots then tail slots, mask [G, C], log_weight 0 on head slots and −log u on
  tail slots), so the cache's single gather and softmax compute

      ô = (Σ_E e^{s_j} v_j + Σ_H e^{s_i} v_i + Σ_{T∩S} e^{s_i}/u_i · v_i)
          / (Σ_E e^{s_j}   + Σ_H e^{s_i}   + Σ_{T∩S} e^{s_i}/u_i)

  with E the exact regions, H the head, T = retrieval − H the tail and S the LSH
  sample. H is a deterministic function of (q, keys), independent of the LSH
  projection, so given H both tail sums are Horvitz–Thompson estimates, unbiased
  for Σ_T e^{s_i} v_i and Σ_T e^{s_i}. Rows in both H and S are read once (their
  tail slot is masked out). ``top_k = 0`` is MagicPIG, exactly.

  ``"none"``: the head alone, i.e. ParisKV, exactly.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp

from jaxkv.attention import common, magicpig, pariskv, rsq
from models import fields


TAILS = ("regression", "lsh", "none")
# Ridge of the value regression, relative to each feature's own sum of squares (so it
# does not depend on the keys' scale): keeps the solve well posed for few or collinear
# keys and barely moves a fit over thousands.
RIDGE = 1e-3
# CG stops at this relative residual, or after this many iterations per feature (exact
# arithmetic needs one per feature; float32 a few more).
CG_TOL, CG_ITERATIONS_PER_FEATURE = 1e-6, 3
INDEX_USES_VALUES = True  # the regression tail fits values at build and insert


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Static hybrid settings.

    top_k: head rows retrieved by ParisKV (0: no head, i.e. MagicPIG; "lsh" tail only).
    tail: "regression" (RSQ scores + regressed values of the non-head candidates, no
        K/V read), "lsh" (MagicPIG's sampling of the rest) or "none" (ParisKV).
    K, L, min_hits, capacity, candidate_capacity, center: MagicPIG's settings ("lsh" tail).
    m, candidate_ratio, collision_ratio, official_levels: ParisKV's head settings.
    sink, local, buffer: the exact regions (small by default so the budget goes to the head).
    """

    top_k: int = 100
    tail: str = "regression"
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
        # Types of every field (from the annotations); the bounds of the parts' settings are the parts' own.
        fields.check(self, top_k=fields.NON_NEGATIVE, tail=fields.OneOf(TAILS))
        if self.top_k == 0 and self.tail != "lsh":
            raise ValueError(f"HybridConfig: top_k=0 with tail={self.tail!r} has no head to work from; "
                             "use top_k >= 1 or tail='lsh' (MagicPIG alone)")
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
    return cfg.top_k > 0


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
    return rsq.reconstruct(codes, cfg.m, centres)


def _features(recon: jax.Array) -> jax.Array:
    return jnp.concatenate([recon, jnp.ones((*recon.shape[:-1], 1), recon.dtype)], axis=-1)


def _fit(gram: jax.Array, cross: jax.Array) -> jax.Array:
    """The ridge solution A of (gram + ridge)·A = cross.

    By Jacobi-preconditioned conjugate gradients, not ``jnp.linalg.solve``: XLA
    CPU runs LAPACK as a custom call that, inside the cache's big vmapped build,
    deadlocked its intra-op thread pool (a 30-layer build never returned; the
    same build without the solve took 19 s). CG is plain XLA ops on every backend.
    """
    system = gram + jnp.diag(RIDGE * jnp.diagonal(gram) + 1e-30)  # + ε: an empty region fits A = 0
    diagonal = jnp.diagonal(system)
    hi = jax.lax.Precision.HIGHEST
    weights, _ = jax.scipy.sparse.linalg.cg(
        lambda x: jnp.matmul(system, x, precision=hi), cross, tol=CG_TOL,
        maxiter=CG_ITERATIONS_PER_FEATURE * gram.shape[0], M=lambda x: x / diagonal[:, None])
    return weights


def _value_model(cfg: HybridConfig, codes, values: jax.Array, live: jax.Array,
                 base: ValueModel | None = None) -> ValueModel:
    """``base`` (None: nothing) plus the live rows of code rows and their values [C, d], refitted."""
    x = _features(_reconstructions(cfg, codes)) * live[:, None]
    values = values.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gram = jnp.matmul(x.T, x, precision=hi)
    cross = jnp.matmul(x.T, values, precision=hi)
    low = jnp.min(jnp.where(live[:, None], values, jnp.inf), axis=0)
    high = jnp.max(jnp.where(live[:, None], values, -jnp.inf), axis=0)
    if base is not None:
        gram, cross = base.gram + gram, base.cross + cross
        low, high = jnp.minimum(base.low, low), jnp.maximum(base.high, high)
    return ValueModel(gram=gram, cross=cross, weights=_fit(gram, cross), low=low, high=high)


def _require_values(values):
    if values is None:
        raise ValueError("HybridConfig(tail='regression') fits values: pass values= to build and insert "
                         "(common.build_index / common.insert_index do)")


# ---------------------------------------------------------------- index

def build(cfg: HybridConfig, keys: jax.Array, n, key: jax.Array | None = None,
          values: jax.Array | None = None) -> HybridIndex:
    """Indices over the first n rows of keys[cap, d] (values[cap, d] for the regression tail).

    ``key`` draws a projection of its own for the "lsh" tail (None: MagicPIG's
    seeded one, ``magicpig.projection``).
    """
    head = pariskv.build(cfg.head_config(), keys, n) if _has_head(cfg) else None
    model = None
    if cfg.tail == "regression":
        _require_values(values)
        model = _value_model(cfg, head.codes, values, jnp.arange(keys.shape[0]) < n)
    return HybridIndex(
        head=head, values=model,
        tail=magicpig.build(cfg.tail_config(), keys, n, key) if cfg.tail == "lsh" else None)


def insert(cfg: HybridConfig, index: HybridIndex, keys_new: jax.Array, count,
           values_new: jax.Array | None = None) -> HybridIndex:
    """Append the first ``count`` rows of keys_new[U, d] (and values_new) to every index (the buffer's flush)."""
    head = pariskv.insert(cfg.head_config(), index.head, keys_new, count) if _has_head(cfg) else None
    model = None
    if cfg.tail == "regression":
        _require_values(values_new)
        # The rows just written, read back from the head index: encoded once.
        rows, live = pariskv.append_targets(index.head.n, keys_new.shape[0], count, index.head.signs.shape[0])
        new_codes = jax.tree.map(lambda x: x[jnp.minimum(rows, x.shape[0] - 1)], head.codes)
        model = _value_model(cfg, new_codes, values_new, live, index.values)
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


def _regression_tail(cfg: HybridConfig, index: HybridIndex, q, candidates, in_tail) -> common.Partial:
    """Partial [G] over the candidates in_tail (not read): RSQ scores, regressed values."""
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
    mean = jnp.matmul(weighted, index.values.weights, precision=hi) / jnp.where(l > 0, l, 1.0)[:, None]
    # The true tail mean lies in the values' bounding box: clipping to it can only
    # bring each coordinate closer, and keeps the output a convex-range estimate.
    mean = jnp.clip(mean, index.values.low, index.values.high)
    return common.Partial(o=jnp.where(l[:, None] > 0, l[:, None] * mean, 0.0), l=l, m=m)


def select(cfg: HybridConfig, index: HybridIndex, q: jax.Array) -> common.Selection:
    """The head's rows, then the tail's: sampled slots ("lsh", mask [G, k + C]) or an estimated ``rest``."""
    if cfg.tail == "regression":
        candidates, valid, best = pariskv.ranked_candidates(cfg.head_config(), index.head, q)
        in_tail = valid & ~jnp.zeros(candidates.shape, bool).at[best].set(True)
        return common.Selection(idx=candidates[best], mask=valid[best],
                                rest=_regression_tail(cfg, index, q, candidates, in_tail))
    head = pariskv.select(cfg.head_config(), index.head, q) if _has_head(cfg) else None
    tail = magicpig.select(cfg.tail_config(), index.tail, q) if cfg.tail == "lsh" else None
    if tail is None:
        return head
    if head is None:
        return tail
    tail_mask = tail.mask & ~_rows_in(tail.idx, head.idx, head.mask)[None, :]
    head_mask = jnp.broadcast_to(head.mask[None, :], (q.shape[0], head.mask.shape[0]))
    return common.Selection(idx=jnp.concatenate([head.idx, tail.idx]),
                            mask=jnp.concatenate([head_mask, tail_mask], axis=1))


def correction(cfg: HybridConfig, index: HybridIndex, q, k_rows, selection: common.Selection):
    """log_weight [G, k + C]: 0 on head slots (exact), −log u on sampled tail slots; None without an "lsh" tail."""
    if cfg.tail != "lsh":
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


def attend(cfg: HybridConfig, q, keys, values, key=None):
    """(output [G, d], keys read) over sink + local exactly, the head exactly and the tail sampled."""
    return common.attend_with_method(sys.modules[__name__], cfg, q, keys, values, key)
