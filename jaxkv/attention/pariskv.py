"""ParisKV retrieval for one KV head: sign-pattern buckets, six-tier voting, RSQ-IP rerank.

Keys are normalised and rotated (``rotate``); each subspace of m coordinates buckets a key
by its sign pattern (``bucket_ids``: fixed centroids, so inserting never retrains); the
query's vote table ranks the patterns into tiers (``vote_table``), the most-voted keys are
reranked from their 4-bit RSQ-IP codes (``rsq``), and the best ``top_k`` are attended
exactly. Formulas and parameters: docs/methods/pariskv.md.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import native
from jaxkv.attention import common, rsq, shards
from jaxkv.attention.method import IndexFunctions, KeyRetriever
from jaxkv.attention.shards import ContextShards
from models import fields
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels

TIER_FRACTIONS = (0.05, 0.15, 0.30, 0.50, 0.75, 1.0)
N_TIERS = len(TIER_FRACTIONS)
# (retrieval length below which it applies, candidate_ratio, collision_ratio)
LENGTH_ADAPTIVE_RATIOS = (
    (5_000, 0.5, 0.5),
    (10_000, 0.25, 0.3),
    (30_000, 0.2, 0.25),
    (math.inf, 0.1, 0.2),
)
MAX_M = 8  # bucket ids are uint8 and the vote table has 2^m columns


@dataclasses.dataclass(frozen=True)
class ParisKVConfig:
    """Static ParisKV settings (official defaults); dense_layers: layers the cache keeps dense.

    kernels: "auto" (Pallas kernels iff the backend is a GPU), "xla" (never),
    "pallas" (always, compiled) or "interpret" (always, Pallas interpret mode)
    for the coarse vote, the rerank and the cache's gather-attention; "native":
    the coarse vote, the rerank and the final top-k in ``jaxkv.native``'s CPU
    kernels (m = 8, d ≤ 128, a CPU with AVX-512 VBMI and VBMI2, or AVX2, and a C++ compiler),
    and the attention over the top-k rows too where its kernel is built (AVX-512), the rest in XLA.
    """

    m: int = 8
    top_k: int = 100
    sink: int = 4
    local: int = 512
    buffer: int = 512
    candidate_ratio: float | None = None  # None: length-adaptive, from the capacity
    collision_ratio: float | None = None  # None: length-adaptive, from the capacity
    official_levels: bool = False  # True: the official m=8 Lloyd–Max table
    seed: int = 0
    dense_layers: tuple[int, ...] = ()
    kernels: Kernels = Kernels.AUTO

    def __post_init__(self):
        object.__setattr__(self, "kernels", Kernels.of(self.kernels, "ParisKVConfig.kernels"))
        fields.check(self, m=fields.in_range(2, MAX_M), top_k=fields.at_least(1), sink=fields.NON_NEGATIVE,
                     local=fields.NON_NEGATIVE, buffer=fields.NON_NEGATIVE, candidate_ratio=fields.FRACTION,
                     collision_ratio=fields.FRACTION, seed=fields.SEED, dense_layers=fields.NON_NEGATIVE)
        if self.official_levels and self.m != 8:
            raise ValueError(f"ParisKVConfig.official_levels needs m=8, got m={self.m}")
        if self.kernels.uses_native() and self.m != 8:
            raise ValueError(f"ParisKVConfig.kernels='native' needs m=8, got m={self.m}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ParisKVIndex:
    """Index of one KV head's retrieval region; rows >= n are unused.

    The per-(subspace, bucket) key counts are updated at insertion, so the vote
    table's tiers need no pass over the keys at query time.
    """

    codes: rsq.RSQCodes       # leaves [cap, ...]; codes.signs uint8 [cap, B] is the bucket id per subspace
    bucket_counts: jax.Array  # int32 [B, 2^m] valid keys per (subspace, bucket)
    n: jax.Array              # int32 valid rows

    @property
    def signs(self) -> jax.Array:
        """uint8 [cap, B]: each key's bucket id (sign pattern) per subspace — what the coarse stage reads."""
        return self.codes.signs


# ---------------------------------------------------------------- static sizes

def padded_dim(d: int) -> int:
    """The power of two the rotation works in."""
    return 1 << max(d - 1, 0).bit_length()


def n_subspaces(cfg: ParisKVConfig, d: int) -> int:
    p = padded_dim(d)
    if p % cfg.m:
        raise ValueError(f"ParisKVConfig.m={cfg.m} must divide the padded head dim {p} (d={d})")
    if p < 8:  # the magnitude bit planes hold 8 coordinates per byte
        raise ValueError(f"ParisKV needs a head dim of at least 5 (padded to 8), got d={d}")
    return p // cfg.m


def resolve_ratios(cfg: ParisKVConfig, length: int) -> tuple[float, float]:
    """(candidate_ratio, collision_ratio): explicit config values, else the length-adaptive
    rule (:data:`LENGTH_ADAPTIVE_RATIOS`) at ``length`` (the static capacity, never the data n)."""
    for limit, candidate, collision in LENGTH_ADAPTIVE_RATIOS:
        if length < limit:
            break
    return (
        candidate if cfg.candidate_ratio is None else cfg.candidate_ratio,
        collision if cfg.collision_ratio is None else cfg.collision_ratio,
    )


def n_retrieved(cfg: ParisKVConfig, capacity: int) -> int:
    return min(cfg.top_k, capacity)


def n_candidates(cfg: ParisKVConfig, capacity: int) -> int:
    """ceil(candidate_ratio·capacity), at least the final top-k, at most the capacity."""
    candidate_ratio, _ = resolve_ratios(cfg, capacity)
    wanted = math.ceil(candidate_ratio * capacity)
    return min(max(wanted, n_retrieved(cfg, capacity)), capacity)


def index_bytes_per_key(cfg: ParisKVConfig, d: int) -> int:
    """Index memory per key: sign bytes (= bucket ids) + 3-bit magnitudes + bf16 scale + 4-bit weights."""
    n_subspaces(cfg, d)  # validates m
    return rsq.bytes_per_key(padded_dim(d), cfg.m)


# ---------------------------------------------------------------- transform

def _hadamard(p: int) -> np.ndarray:
    """Sylvester–Hadamard matrix of order p (a power of two), entries ±1."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation_diagonal(cfg: ParisKVConfig, p: int) -> np.ndarray:
    """The seeded ±1 diagonal D of the rotation (float32 [p]), a constant."""
    return common.seeded_constant(jax.random.rademacher, cfg.seed, (p,))


def rotate(cfg: ParisKVConfig, x: jax.Array) -> jax.Array:
    """Normalise then rotate: x[..., d] → y[..., P] = H·D·(x/‖x‖)/√P (zero x stays zero)."""
    d = x.shape[-1]
    n_subspaces(cfg, d)  # validates m against the padded dim
    p = padded_dim(d)
    x = x.astype(jnp.float32)
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    unit = x / jnp.where(norm > 0, norm, 1.0)
    padded = jnp.pad(unit, [(0, 0)] * (x.ndim - 1) + [(0, p - d)])
    h = jnp.asarray(_hadamard(p) / math.sqrt(p))
    # Full f32 matmul: TF32 (the GPU default) would flip signs of near-zero coordinates.
    return jnp.matmul(padded * rotation_diagonal(cfg, p), h, precision=jax.lax.Precision.HIGHEST)


def bucket_ids(cfg: ParisKVConfig, y: jax.Array) -> jax.Array:
    """Sign pattern per subspace: y[..., P] → uint8 [..., P/m], bit j ⇔ y[b·m + j] ≥ 0."""
    return rsq.sign_bytes(y, cfg.m)


def _levels(cfg: ParisKVConfig):
    return rsq.magnitude_levels(cfg.m, cfg.official_levels)


# ---------------------------------------------------------------- index

def empty_index(cfg: ParisKVConfig, capacity: int, d: int) -> ParisKVIndex:
    b, p = n_subspaces(cfg, d), padded_dim(d)
    return ParisKVIndex(
        codes=rsq.empty_codes(capacity, p, cfg.m),
        bucket_counts=jnp.zeros((b, 2**cfg.m), jnp.int32),
        n=jnp.int32(0),
    )


def append_targets(n, n_new: int, count, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Where the first ``count`` of ``n_new`` new rows go in an index holding n rows.

    Returns (target [n_new] rows, live [n_new] bool). Unused slots and rows at or
    past the capacity target ``capacity``, which ``.at[target].set(..., mode="drop")``
    drops. (Shared with pqcache; a candidate for ``common``.)
    """
    slot = jnp.arange(n_new)
    rows = n + slot
    live = (slot < count) & (rows < capacity)
    return jnp.where(live, rows, capacity), live


def insert(cfg: ParisKVConfig, index: ParisKVIndex, keys_new: jax.Array, count) -> ParisKVIndex:
    """Append the first ``count`` rows of keys_new[U, d] at rows n, n+1, ….

    Nothing is retrained: buckets and codes depend only on the key itself.
    Rows that would land at or beyond the capacity are dropped (the cache that
    owns the capacity must not overflow it).
    """
    capacity = index.signs.shape[0]
    y = rotate(cfg, keys_new)
    thresholds, centres = _levels(cfg)
    codes = rsq.encode(y, jnp.linalg.norm(keys_new.astype(jnp.float32), axis=-1), cfg.m, thresholds, centres)
    signs = codes.signs
    target, live = append_targets(index.n, keys_new.shape[0], count, capacity)
    subspace = jnp.arange(signs.shape[1])[None, :]
    return ParisKVIndex(
        codes=jax.tree.map(lambda rows, new: rows.at[target].set(new, mode="drop"), index.codes, codes),
        bucket_counts=index.bucket_counts.at[subspace, signs].add(
            jnp.broadcast_to(live[:, None], signs.shape).astype(jnp.int32)),
        n=index.n + jnp.sum(live, dtype=jnp.int32),
    )


def build(cfg: ParisKVConfig, keys: jax.Array, n, key=None) -> ParisKVIndex:
    """Index of the first n rows of keys[cap, d]; capacity = keys.shape[0].

    ``key`` is accepted for the common method interface and unused: the index
    is deterministic given ``cfg.seed``.
    """
    del key
    return insert(cfg, empty_index(cfg, keys.shape[0], keys.shape[-1]), keys, n)


# ---------------------------------------------------------------- coarse stage

def _pattern_signs(m: int) -> np.ndarray:
    """[2^m, m] ±1: coordinate j of pattern p is +1 iff bit j of p is set."""
    bits = (np.arange(2**m)[:, None] >> np.arange(m)[None, :]) & 1
    return (2 * bits - 1).astype(np.float32)


def pattern_scores_and_caps(cfg: ParisKVConfig, q_rot: jax.Array, n, capacity: int):
    """The vote table's inputs: (scores float32 [B, 2^m] ∝ ⟨centroid, q_b⟩ of every sign
    pattern, tier caps float32 [N_TIERS] in keys).

    q_rot [P] the rotated query; n the valid keys; capacity (static) picks the
    length-adaptive collision ratio.
    """
    _, collision_ratio = resolve_ratios(cfg, capacity)
    q_blocks = q_rot.astype(jnp.float32).reshape(-1, cfg.m)
    scores = jnp.matmul(q_blocks, jnp.asarray(_pattern_signs(cfg.m).T), precision=jax.lax.Precision.HIGHEST)
    return scores, n * collision_ratio * jnp.asarray(TIER_FRACTIONS, jnp.float32)


def vote_table(cfg: ParisKVConfig, q_rot: jax.Array, n, bucket_counts: jax.Array,
               capacity: int) -> jax.Array:
    """Votes per subspace per sign pattern, int32 [B, 2^m]: the coarse stage's LUT.

    bucket_counts [B, 2^m] keys per bucket; the rest as :func:`pattern_scores_and_caps`.
    """
    pattern_scores, caps = pattern_scores_and_caps(cfg, q_rot, n, capacity)
    # covered[b, p]: keys in the buckets ranked at or before p (score descending, ties
    # to the lower pattern) — a comparison matrix times the counts, not an argsort
    # (slow on XLA CPU: docs/results/implementation_notes.md, "ParisKV").
    # The product is a dot, so the table stays materialised: a table built by
    # gathers was fused into the per-key lookup and recomputed for every key.
    patterns = jnp.arange(pattern_scores.shape[-1])
    score_p, score_q = pattern_scores[:, :, None], pattern_scores[:, None, :]
    at_or_before = (score_q > score_p) | ((score_q == score_p) & (patterns[None, :] <= patterns[:, None]))
    covered = jnp.einsum("bpq,bq->bp", at_or_before.astype(jnp.int32), bucket_counts,
                         preferred_element_type=jnp.int32)
    tier = jnp.sum(covered[..., None] > caps, axis=-1)  # caps passed = tiers skipped
    return jnp.maximum(N_TIERS - tier, 0).astype(jnp.int32)


def _row_votes(index: ParisKVIndex, table: jax.Array) -> jax.Array:
    """Total votes per row of ``index`` from the vote table [B, 2^m], int32 [cap]; rows >= n get -1."""
    capacity, b = index.signs.shape
    votes = jnp.sum(table[jnp.arange(b)[None, :], index.signs], axis=-1, dtype=jnp.int32)
    return jnp.where(jnp.arange(capacity) < index.n, votes, -1)


def coarse_votes(cfg: ParisKVConfig, index: ParisKVIndex, q_rot: jax.Array) -> jax.Array:
    """Total votes per key, int32 [cap]; rows >= n get -1."""
    return _row_votes(index, vote_table(cfg, q_rot, index.n, index.bucket_counts, index.signs.shape[0]))


# ---------------------------------------------------------------- rerank and selection

def _query(cfg: ParisKVConfig, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(rotated unit query [P], its norm) of the one retrieval query per KV head.

    q[G, d] is averaged over the GQA group; a single q[d] is used as it is.
    """
    q = q.astype(jnp.float32)
    q = jnp.mean(q, axis=0) if q.ndim == 2 else q
    return rotate(cfg, q), jnp.linalg.norm(q)


def _rerank(cfg, index, q_rot, q_norm, candidate_idx):
    _, centres = _levels(cfg)
    if cfg.kernels.uses_native():  # reads the candidates' rows in place: no gathered copy
        return native.rerank(index.codes, q_rot, q_norm, centres, candidate_idx)
    rows = jax.tree.map(lambda x: x[candidate_idx], index.codes)
    if cfg.kernels.uses_pallas():
        # The kernel reads 4-bit nibbles and f32 weights: the candidates' rows are
        # converted after the gather (C rows, not the whole index).
        nibbles, weight = rsq.kernel_layout(rows, cfg.m)
        return dispatch.rsq_rerank(q_rot, q_norm, nibbles, weight, jnp.asarray(centres, jnp.float32),
                                   jnp.arange(candidate_idx.shape[0]), kernels=cfg.kernels)
    return rsq.estimate(rows, q_rot, q_norm, cfg.m, centres)


def rerank_scores(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array,
                  candidate_idx: jax.Array) -> jax.Array:
    """RSQ-IP estimate of ⟨k, q̄⟩ for rows candidate_idx[C] (q̄ the group mean), float32 [C]."""
    return _rerank(cfg, index, *_query(cfg, q), candidate_idx)


SELECTION_BLOCK = 256


def top_indices(values: jax.Array, k: int) -> jax.Array:
    """Positions [k] of the k largest values[N], ties to the lower position: lax.top_k's answer.

    The final top-k's selection (the coarse stage uses :func:`most_voted_rows`).
    When N ≥ 2·k·SELECTION_BLOCK it runs in two exact stages, far cheaper than
    lax.top_k on XLA CPU (docs/results/implementation_notes.md, "ParisKV"): the k blocks
    with the largest maxima hold every top-k element
    (a block left out has k blocks whose maxima precede its best), and taking
    those blocks in ascending order keeps lax.top_k's tie order.
    """
    n = values.shape[0]
    if n < 2 * k * SELECTION_BLOCK:
        return jax.lax.top_k(values, k)[1]
    n_blocks = -(-n // SELECTION_BLOCK)
    lowest = -jnp.inf if jnp.issubdtype(values.dtype, jnp.floating) else jnp.iinfo(values.dtype).min
    blocks = jnp.pad(values, (0, n_blocks * SELECTION_BLOCK - n), constant_values=lowest)
    blocks = blocks.reshape(n_blocks, SELECTION_BLOCK)
    best_blocks = jnp.sort(jax.lax.top_k(jnp.max(blocks, axis=1), k)[1])
    within = jax.lax.top_k(blocks[best_blocks].reshape(-1), k)[1]
    return best_blocks[within // SELECTION_BLOCK] * SELECTION_BLOCK + within % SELECTION_BLOCK


def final_top_k(cfg: ParisKVConfig, values: jax.Array, k: int) -> jax.Array:
    """:func:`top_indices` of the rerank's estimates, by the CPU kernel when cfg uses it (the same positions)."""
    return native.top_k(values, k) if cfg.kernels.uses_native() else top_indices(values, k)


def vote_threshold(votes: jax.Array, count, most: int, total=lambda n: n) -> tuple[jax.Array, jax.Array]:
    """(t, rows voting above t): t the largest value with at least ``count`` rows voting ≥ t.

    votes[N] are integers in [−1, most], 1 ≤ count ≤ N. A bisection over the
    values, one counting pass over the votes per halving (⌈log2(most + 2)⌉
    passes), instead of a histogram by scatter-add (slower on XLA CPU).
    total: sums a count over the shards of a split region (``ContextShards.total``).
    """
    lo, hi, above = jnp.int32(-1), jnp.int32(most + 1), jnp.int32(0)  # #(≥ lo) ≥ count > #(≥ hi) = above
    for _ in range(math.ceil(math.log2(most + 2))):
        mid = (lo + hi) // 2
        at_least = total(jnp.sum(votes >= mid, dtype=jnp.int32))
        enough = at_least >= count
        lo, hi = jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)
        above = jnp.where(enough, above, at_least)
    return lo, above


def most_voted_rows(votes: jax.Array, count: int, most: int) -> jax.Array:
    """Rows [count] with the most votes, ties to the lower row, in ascending row order.

    votes[N] are integers in [−1, most] (−1: unused row), count ≤ N. The set is
    the one lax.top_k(votes, count) selects, found without a sort: every row
    above the threshold of :func:`vote_threshold` and the lowest rows at it,
    as bit masks (``common.pack_words``) compacted to rows.
    """
    t, above = vote_threshold(votes, count, most)
    ties = common.first_set_bits(common.pack_words(votes == t), count - above)
    return common.compact_words(common.pack_words(votes > t) | ties, count)


def _kernel_candidates(cfg, index, q_rot, count):
    """:func:`_coarse_candidates` by the vote kernel: the same rows in the same order.

    The kernel lists the best keys in ascending id (ties to the lower id). When
    fewer than ``count`` keys are valid, all valid keys are taken and slot j ≥ n
    gets the invalid row j, as :func:`most_voted_rows` takes rows n, n+1, ….
    """
    capacity = index.signs.shape[0]
    table = vote_table(cfg, q_rot, index.n, index.bucket_counts, capacity)
    found = dispatch.vote(index.signs, table, index.n, capacity=count, kernels=cfg.kernels)
    return jnp.where(found.mask, found.idx, jnp.arange(count))


def _coarse_candidates(cfg, index, q_rot):
    capacity, b = index.signs.shape
    count = n_candidates(cfg, capacity)
    if cfg.kernels.uses_native():  # the vote table is ranked in the kernel too
        scores, caps = pattern_scores_and_caps(cfg, q_rot, index.n, capacity)
        return native.coarse_rows(index.signs, scores, index.bucket_counts, caps, index.n, count)
    if cfg.kernels.uses_pallas():
        return _kernel_candidates(cfg, index, q_rot, count)
    return most_voted_rows(coarse_votes(cfg, index, q_rot), count, N_TIERS * b)


def coarse_candidates(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array) -> jax.Array:
    """Row indices [n_candidates] of the keys with the most votes, ascending (unused rows last)."""
    return _coarse_candidates(cfg, index, _query(cfg, q)[0])


def ranked_candidates(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array):
    """(candidate rows [C], valid [C], positions [k] in them of the final top-k after the rerank)."""
    q_rot, q_norm = _query(cfg, q)
    candidates = _coarse_candidates(cfg, index, q_rot)
    valid = candidates < index.n
    estimate = jnp.where(valid, _rerank(cfg, index, q_rot, q_norm, candidates), -jnp.inf)
    return candidates, valid, final_top_k(cfg, estimate, n_retrieved(cfg, index.signs.shape[0]))


def _retrieve(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array):
    """(row indices [k], valid [k]) of the final top-k after reranking the candidates."""
    candidates, valid, best = ranked_candidates(cfg, index, q)
    return candidates[best], valid[best]


def retrieve(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array) -> jax.Array:
    """Row indices [min(top_k, cap)] of the final top-k (slots past n hold rows >= n)."""
    return _retrieve(cfg, index, q)[0]


def select(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array) -> common.Selection:
    """The final top-k rows for the group q[G, d]; mask False on slots past the valid count."""
    idx, valid = _retrieve(cfg, index, q)
    return common.Selection(idx=idx, mask=valid)


def ranked_candidates_sharded(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array, context: ContextShards):
    """:func:`ranked_candidates` over a retrieval region split into shards: (this shard's valid
    candidates [C] as local rows, valid [C], this shard's part of the final top-k as a
    :func:`shards.shard_selection`), the rows one device picks from the whole region (the
    same votes, threshold, ties and rerank).

    The vote table reads the bucket counts and row count summed over the shards; the vote
    threshold's bisection counts every shard's votes; ties at the threshold go to the lowest
    rows, shard by shard; each shard reranks its candidates and the shards' best merge by
    score (:func:`shards.best_of_shards`). Per step that moves the counts
    (``2^m·P/m`` int32), ~log2(6·P/m) scalars and ``top_k`` (score, row) pairs per shard.
    The coarse stage runs in XLA whatever ``cfg.kernels`` says.
    """
    local_cap, b = index.signs.shape
    q_rot, q_norm = _query(cfg, q)
    n = context.total(index.n)
    votes = _row_votes(index, vote_table(cfg, q_rot, n, context.total(index.bucket_counts), context.capacity))
    # The valid rows among one device's candidates (its candidates past n are never read).
    wanted = n_candidates(cfg, context.capacity)
    threshold, above = vote_threshold(votes, jnp.minimum(wanted, n), N_TIERS * b, total=context.total)
    ties = votes == threshold
    take = jnp.minimum(wanted, n) - above - context.before(jnp.sum(ties, dtype=jnp.int32))
    words = common.pack_words(votes > threshold) | common.first_set_bits(common.pack_words(ties), take)
    size = min(wanted, local_cap)
    candidates = common.compact_words(words, size, fill=local_cap)
    valid = candidates < local_cap
    estimate = jnp.where(valid, _rerank(cfg, index, q_rot, q_norm, jnp.minimum(candidates, local_cap - 1)),
                         -jnp.inf)
    k = n_retrieved(cfg, context.capacity)
    best = final_top_k(cfg, estimate, min(k, size))
    scores, order = shards.best_of_shards(estimate[best], context.order(candidates[best]), k, context)
    return candidates, valid, shards.shard_selection(scores, order, context)


def select_sharded(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array, context: ContextShards) -> common.Selection:
    """:func:`select` over a retrieval region split into shards (:func:`ranked_candidates_sharded`)."""
    return ranked_candidates_sharded(cfg, index, q, context)[2]


def attend_in_place(cfg: ParisKVConfig, index: ParisKVIndex, q: jax.Array, keys: jax.Array, values: jax.Array,
                    selection: common.Selection) -> common.Partial:
    """The partial of q[G, d] over the selection's rows of keys, values [cap, d] in one
    ``jaxkv.native`` call that reads the rows where they lie (host memory included):
    ``common.partial_attention`` over gathered copies gives the same, up to float32 rounding.
    The top-k's rows lie scattered over the region, and XLA's gather copies them one at a
    time (docs/results/implementation_notes.md, "ParisKV")."""
    mask = jnp.broadcast_to(selection.mask, (q.shape[0], selection.idx.shape[-1]))
    o, l, m = native.attend_rows(q, keys, values, selection.idx, mask, masked_score=common.MASKED_SCORE)
    return common.Partial(o=o, l=l, m=m)


class ParisKV(KeyRetriever):
    """ParisKV through the cache's interface; its CPU kernels attend the top-k where the rows lie."""

    config_class = ParisKVConfig
    functions = IndexFunctions(build, insert, select)

    def kernels(self, cfg):
        return cfg.kernels

    def splits_context(self, cfg):
        return True

    def select_sharded(self, cfg, index, q, context):
        return select_sharded(cfg, index, q, context)

    def reads_rows_in_place(self, cfg, keys):
        """The CPU kernels, their attention kernel built (not on an AVX2 CPU, where the rows are
        gathered and attended in XLA), rows in float32, bfloat16 or bfloat16 bits
        (``jaxkv.native.ROW_DTYPES``)."""
        return cfg.kernels.uses_native() and keys.dtype in native.ROW_DTYPES and native.available("jaxkv_attend_rows")

    def attend_in_place(self, cfg, index, q, keys, values, selection):
        return attend_in_place(cfg, index, q, keys, values, selection)


METHOD = ParisKV()


def attend(cfg: ParisKVConfig, q, keys, values, key=None):
    """(output [G, d], keys read) over sink + local exactly and retrieved top-k of the rest."""
    return METHOD.attend(cfg, q, keys, values, key)
