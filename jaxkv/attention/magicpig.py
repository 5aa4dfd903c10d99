"""MagicPIG: SimHash LSH sampling with an importance-corrected softmax, for one KV head.

Keys, centred by the retrieval region's mean μ, get a K-bit SimHash code in each of L
tables; a key is sampled for a query head when its code equals the query's in at least
``min_hits`` tables, and its score is corrected by −log u (u its inclusion probability,
computed in log space). The index is inverted: per table, the key ids sorted by code.
Formulas and parameters: docs/methods/magicpig.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import native
from jaxkv.attention import common, shards
from jaxkv.attention.method import Regions, SparseMethod
from jaxkv.attention.shards import ContextShards
from models import fields
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels

# Public entry points compile once per (config, shapes); the config is static.
_jit_with_static_cfg = functools.partial(jax.jit, static_argnames="cfg")

# K·L hash bits per key and per query: the projection is [d, K·L].
MAX_HASH_BITS = 8192
# L·(2^K + 1) int32 bucket starts per KV head and layer (64 MiB).
MAX_BUCKET_STARTS = 1 << 24
# Candidate entries read per query head are at least this many per table, so
# short contexts are not starved by a fractional capacity.
MIN_CANDIDATES_PER_TABLE = 4
# Keys hashed per batch when building or inserting: bounds the projections held at once
# ([HASH_BATCH, K·L] float32: 24 MB at K10L150).
HASH_BATCH = 4096
# Per-key hit counts of one query head: up to L, and K·L ≤ MAX_HASH_BITS bounds L
# by 8192, so int16 holds them (its scatter-adds beat int32's on XLA CPU).
HIT_COUNT_DTYPE = jnp.int16
# Binomial tail terms summed directly when the tail decays fast (ratio ≤ 1/2:
# the remainder after 32 terms is below 2^-31 of the sum).
TAIL_TERMS = 32
# Lower bound on log u for a sampled key. Only reachable where the hash and the
# angle formula disagree (rounding at θ ≈ π); keeps −log u finite in float32.
LOG_U_FLOOR = math.log(jnp.finfo(jnp.float32).tiny)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _resolve(value: int | float, n_keys: int) -> int:
    """An int capacity as is; a float as that fraction of n_keys (rounded up)."""
    return value if _is_int(value) else math.ceil(value * n_keys)


@dataclasses.dataclass(frozen=True)
class MagicPIGConfig:
    """MagicPIG's settings (official defaults K=10, L=150, S=4, W=64).

    capacity: max sampled keys per KV head per query (int), or a fraction of
        the retrieval capacity (float in (0, 1]). 1/8 is ≈5× the 2–2.5% a head
        samples at K10L150, room for a GQA group's union.
    candidate_capacity: max inverted-index entries read per query head over
        all tables (int), or a multiple of the retrieval capacity (float > 0).
    dense_layers: layers that stay dense (used by generate()).
    center: subtract the retrieval-region mean from keys before hashing.
    seed: draws :func:`projection`, the hyperplanes every layer and KV head shares, and is
        folded into the PRNG key of an index built with its own (:func:`build`).
    kernels: "auto" (Pallas kernels iff the backend is a GPU), "xla" (never),
        "pallas" (always, compiled), "interpret" (always, Pallas interpret
        mode) or "native" (the query's hash and bucket lookups, which keys
        collide, the attention over them with the correction, and the
        insertion's merge, in ``jaxkv.native``'s CPU kernels; the id lists
        then stay in device memory, where the kernels read them in place).
        Hashing and candidate selection give the same result either way, but
        for a code bit whose product is within float32 rounding of 0.
    """

    K: int = 10
    L: int = 150
    sink: int = 4
    local: int = 64
    dense_layers: tuple[int, ...] = (0, 16, 32, 48, 64)
    min_hits: int = 2
    capacity: int | float = 0.125
    candidate_capacity: int | float = 0.5
    center: bool = True
    seed: int = 0
    kernels: Kernels = Kernels.AUTO

    def __post_init__(self):
        object.__setattr__(self, "kernels", Kernels.of(self.kernels, "MagicPIGConfig.kernels"))
        fields.check(self, K=fields.in_range(1, 16), L=fields.at_least(2), sink=fields.NON_NEGATIVE,
                     local=fields.NON_NEGATIVE, dense_layers=fields.NON_NEGATIVE, min_hits=fields.at_least(1),
                     seed=fields.SEED)

        def bad(field, rule):
            raise ValueError(f"MagicPIGConfig.{field} {rule}, got {getattr(self, field)!r}")

        if self.K * self.L > MAX_HASH_BITS:
            bad("L", f"makes K*L = {self.K * self.L} hash bits per key, above {MAX_HASH_BITS}")
        if self.L * (2**self.K + 1) > MAX_BUCKET_STARTS:
            bad("K", f"makes L*(2^K+1) = {self.L * (2**self.K + 1)} bucket starts, above {MAX_BUCKET_STARTS}")
        if self.min_hits > self.L:
            bad("min_hits", f"must be an int in 1..L={self.L}")
        # Fields typed int | float: an int counts entries, a float is relative to the retrieval capacity.
        if not (_is_int(self.capacity) and self.capacity >= 1) and not (
            isinstance(self.capacity, float) and 0 < self.capacity <= 1
        ):
            bad("capacity", "must be an int >= 1 or a float fraction in (0, 1]")
        # A multiple above L would read more entries than the L tables hold.
        if not (_is_int(self.candidate_capacity) and self.candidate_capacity >= 1) and not (
            isinstance(self.candidate_capacity, float) and 0 < self.candidate_capacity <= self.L
        ):
            bad("candidate_capacity", f"must be an int >= 1 or a float in (0, L={self.L}]")

    def sample_capacity(self, n_keys: int) -> int:
        """Static number of sampled-key slots for a retrieval capacity of n_keys."""
        return max(1, min(n_keys, _resolve(self.capacity, n_keys)))

    def candidate_entries(self, n_keys: int) -> int:
        """Static number of inverted-index entries a query head reads."""
        wanted = max(_resolve(self.candidate_capacity, n_keys), MIN_CANDIDATES_PER_TABLE * self.L)
        return max(1, min(self.L * n_keys, wanted))


def is_dense_layer(cfg: MagicPIGConfig, layer: int) -> bool:
    """Whether ``layer`` keeps dense attention (MagicPIG samples the others)."""
    return layer in cfg.dense_layers


def host_config(cfg: MagicPIGConfig) -> MagicPIGConfig | None:
    """The config the cache runs MagicPIG with in host memory when it offloads with
    ``CacheConfig(host_index=True)``: the paper's placement. The whole index (its id lists: 4·L bytes per key, more than bf16 K and V at
    L = 150) stays beside the retrieval rows, and the query's bucket lookup, the sampling,
    the attention over the sampled rows and the insertion of flushed keys run there, on the
    XLA path (no GPU kernel runs on the host). Only the query goes in and the partial comes
    out; a flush moves only its rows. With the id lists on the device instead, each step
    would move every sampled row (up to ``capacity`` slots) and each flush would rewrite
    the lists on the device (docs/architecture.md, "Data movement").

    None for the CPU kernels (``kernels="native"``): on the CPU the device's memory is host
    memory, and the lists stay where the kernels' merge rewrites them in place.
    """
    return None if cfg.kernels.uses_native() else dataclasses.replace(cfg, kernels=Kernels.XLA)


def index_bytes_per_key(cfg: MagicPIGConfig) -> int:
    """Index bytes per key: one int32 id per table (the bucket starts are per head, not per key)."""
    return 4 * cfg.L


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MagicPIGIndex:
    """One KV head's LSH index over a retrieval region of static capacity ``cap``.

    Inverted: bucket b of table l is ``sorted_ids[l, bucket_starts[l, b]:bucket_starts[l, b + 1]]``,
    so a query reads one bucket range per table. L int32 ids per key (600 B at L = 150).
    """

    mu: jax.Array  # [d] float32 centring mean (zeros when cfg.center is False)
    projection: jax.Array | None  # [d, K·L] float32 hyperplanes of its own; None: :func:`projection`'s
    sorted_ids: jax.Array  # [L, cap] int32 key ids sorted by (code, id); slots >= n are 0
    bucket_starts: jax.Array  # [L, 2^K + 1] int32 first slot of each bucket; [:, -1] = n
    n: jax.Array  # [] int32 keys indexed (rows 0..n-1 of the region)
    n_dropped: jax.Array  # [] int32 keys offered to insert beyond the capacity (not indexed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SelectStats:
    """What :func:`select_with_stats` could not do within its static capacities."""

    tables_used: jax.Array  # [G] int32 tables read per query head (< L: candidate overflow)
    entries_read: jax.Array  # [G] int32 inverted-index entries (key ids) read per query head
    n_sampled: jax.Array  # [G] int32 keys meeting the min_hits rule per query head
    truncated: jax.Array  # [] bool some sampled key did not fit in the selection capacity


@_jit_with_static_cfg
def hash_codes(cfg: MagicPIGConfig, projection: jax.Array, x: jax.Array) -> jax.Array:
    """SimHash codes of x[..., d]: [..., L] uint16, bit j of table l = [x·R[:, lK + j] > 0]."""
    if projection.shape != (x.shape[-1], cfg.K * cfg.L):
        raise ValueError(
            f"projection must be [d={x.shape[-1]}, K*L={cfg.K * cfg.L}], got shape {projection.shape}")
    if cfg.kernels.uses_pallas():
        flat = x.reshape(-1, x.shape[-1])
        codes = dispatch.simhash(flat, projection, n_bits=cfg.K, kernels=cfg.kernels)
        return codes.reshape(*x.shape[:-1], cfg.L)
    # HIGHEST: the sign of a near-zero projection must not depend on TF32 defaults.
    proj = jnp.einsum("...d,dh->...h", x.astype(jnp.float32), projection, precision=lax.Precision.HIGHEST)
    bits = (proj > 0).reshape(*x.shape[:-1], cfg.L, cfg.K).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(cfg.K, dtype=jnp.uint32), axis=-1).astype(jnp.uint16)


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 − e^x) for x ≤ 0, accurate near both ends."""
    return jnp.where(x > -math.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _log_binomial_terms(n_terms, n_tables, log_hit, log_miss):
    """log of C(L, j)·P^j·(1 − P)^(L − j) for j = 0..n_terms-1, one array per j; −inf for j > L.

    log C(L, j) is a running sum of log((L − i)/(i + 1)), per distinct L (a
    difference of lgammas of size L log L would lose ~1e-4 absolute in float32).
    A list, not one [..., n_terms] array: XLA CPU then fuses the sums over j
    into one loop instead of materialising [..., n_terms] twice.
    """
    i = jnp.arange(n_terms, dtype=jnp.float32)
    tables = n_tables[..., None]
    step = jnp.where(i < tables, jnp.log(jnp.maximum(tables - i, 1.0)) - jnp.log1p(i), -jnp.inf)
    log_choose = jnp.concatenate([jnp.zeros_like(step[..., :1]), jnp.cumsum(step[..., :-1], axis=-1)], axis=-1)
    return [log_choose[..., j] + (j * log_hit if j else 0.0)  # 0·log 0 = 0
            + jnp.where(n_tables > j, (n_tables - j) * log_miss, 0.0) for j in range(n_terms)]


def _log_sum_exp(terms):
    """log Σ_j exp(terms[j]) over a list of arrays (−inf when every term is −inf)."""
    top = functools.reduce(jnp.maximum, terms)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top + jnp.log(sum(jnp.exp(t - top) for t in terms))


@functools.partial(jax.jit, static_argnames=("K", "min_hits"))
def collision_log_prob(cos_theta: jax.Array, K: int, L, min_hits: int = 2) -> jax.Array:
    """log u, u = P(a key collides with the query in at least ``min_hits`` of L tables).

    p = 1 − arccos(clamp(cos θ))/π per bit, P = p^K per table, hits ~ Binomial(L, P).
    L may be an array broadcasting with cos_theta (tables actually read).
    Two exact evaluations, each used where it is accurate: the upper tail
    Σ_{j ≥ min_hits} as its first term (in log space) times a sum of running
    ratios T_{j+1}/T_j = (L − j)/(j + 1) · P/(1 − P) (no cancellation; used when
    the ratios are at most 1/2, so its 32 terms leave out < 2^−31 of it), else
    log(1 − lower tail), accurate there because u is not small (the ratio
    above 1/2 puts the binomial's mean at ≥ (min_hits + 1)/2 hits).
    """
    c = jnp.clip(jnp.asarray(cos_theta, jnp.float32), -1.0, 1.0)
    log_p = jnp.log1p(-jnp.arccos(c) / jnp.pi)
    log_hit = K * log_p  # log P
    log_miss = _log1mexp(log_hit)  # log(1 − P)
    n_tables = jnp.asarray(L, jnp.float32)  # not broadcast: log C(L, j) is computed per distinct L
    terms = _log_binomial_terms(min_hits + 1, n_tables, log_hit, log_miss)
    complement = _log1mexp(jnp.minimum(_log_sum_exp(terms[:min_hits]), 0.0))
    # Ratios in linear space: one exp per key, not one per term. The odds
    # P/(1 − P) are capped at min_hits + 1 (P = 1 makes them infinite): past the
    # cap the first ratio is ≥ 1 wherever L > min_hits, so the tail is not used.
    odds = jnp.exp(jnp.minimum(log_hit - log_miss, math.log(min_hits + 1)))
    first_ratio = jnp.maximum(n_tables - min_hits, 0.0) / (min_hits + 1) * odds
    ratio, total = first_ratio, 1.0 + first_ratio
    for j in range(min_hits + 1, min_hits + TAIL_TERMS - 1):
        ratio = ratio * (jnp.maximum(n_tables - j, 0.0) / (j + 1)) * odds
        total = total + ratio
    tail = terms[min_hits] + jnp.log(total)
    # A probability: float32 rounding can leave log u a hair above 0 at cos θ = 1.
    return jnp.minimum(jnp.where(first_ratio <= 0.5, tail, complement), 0.0)


def projection(cfg: MagicPIGConfig, d: int) -> np.ndarray:
    """The SimHash hyperplanes R[d, K·L] for head size d: float32 N(0, 1) entries drawn
    from ``cfg.seed``, one matrix for every layer and KV head (a read-only constant), as in
    the official code. A constant of the compiled step, not index state: a query's hashing
    reads one matrix, not a copy per head (docs/results/implementation_notes.md, "MagicPIG")."""
    return common.seeded_constant(jax.random.normal, cfg.seed, (d, cfg.K * cfg.L))


def _own_or_shared(cfg: MagicPIGConfig, own: jax.Array | None, d: int) -> jax.Array:
    return jnp.asarray(projection(cfg, d)) if own is None else own


def hyperplanes(cfg: MagicPIGConfig, index: MagicPIGIndex) -> jax.Array:
    """The [d, K·L] projection ``index`` hashes with: its own, else :func:`projection`."""
    return _own_or_shared(cfg, index.projection, index.mu.shape[-1])


def _retrieval_mean(keys: jax.Array, n: jax.Array) -> jax.Array:
    live = (jnp.arange(keys.shape[0]) < n)[:, None]
    total = jnp.sum(jnp.where(live, keys.astype(jnp.float32), 0.0), axis=0)
    return total / jnp.maximum(n, 1).astype(jnp.float32)


def _check_keys(name: str, keys: jax.Array, d: int | None = None) -> None:
    if keys.ndim != 2 or keys.shape[0] < 1 or (d is not None and keys.shape[1] != d):
        want = "[N >= 1, d]" if d is None else f"[U >= 1, d={d}]"
        raise ValueError(f"{name} must be {want}, got shape {keys.shape}")


def _masked_codes(cfg, proj, mu, keys, count):
    """Codes [U, L] int32 of keys − μ; rows >= count get 2^K, which sorts after every bucket."""
    u, d = keys.shape
    batch = min(u, HASH_BATCH)
    batches = jnp.pad(keys, ((0, -u % batch), (0, 0))).reshape(-1, batch, d)
    codes = lax.map(lambda rows: hash_codes(cfg, proj, rows.astype(jnp.float32) - mu), batches)
    codes = codes.reshape(-1, cfg.L)[:u].astype(jnp.int32)
    return jnp.where((jnp.arange(keys.shape[0]) < count)[:, None], codes, 2**cfg.K)


def _sort_codes(codes, n_buckets):
    """(codes sorted, their row positions), ties in row order; codes lie in [0, n_buckets].

    One packed int32 key (code·U + row) sorts far faster on XLA CPU than a stable
    argsort (docs/results/implementation_notes.md, "MagicPIG").
    """
    u = codes.shape[0]
    if (n_buckets + 1) * u < 2**31:
        packed = jnp.sort(codes * u + jnp.arange(u, dtype=jnp.int32))
        return packed // u, packed % u
    order = jnp.argsort(codes, stable=True)
    return codes[order], order


def _sort_table(codes, n_buckets):
    """One table from scratch: (sorted codes, row ids in that order (0 past the used rows), bucket starts)."""
    sorted_codes, rows = _sort_codes(codes, n_buckets)
    starts = jnp.searchsorted(sorted_codes, jnp.arange(n_buckets + 1), side="left").astype(jnp.int32)
    return sorted_codes, jnp.where(sorted_codes < n_buckets, rows, 0), starts


@_jit_with_static_cfg
def build(cfg: MagicPIGConfig, keys: jax.Array, n, key=None, *, mu: jax.Array | None = None) -> MagicPIGIndex:
    """Index the first n rows of keys[cap, d] (rows >= n are padding, capacity = cap).

    Hashes with :func:`projection` when ``key`` is None (what the cache does:
    one matrix for every layer and head), else with a projection of its own
    drawn from ``key`` folded with ``cfg.seed``. μ is the mean of the n keys
    when ``cfg.center`` (zeros otherwise); pass ``mu`` to reuse one fixed
    earlier.
    """
    _check_keys("keys", keys)
    cap, d = keys.shape
    offered = jnp.maximum(jnp.asarray(n, jnp.int32), 0)
    n = jnp.minimum(offered, cap)
    if mu is None:
        mu = _retrieval_mean(keys, n) if cfg.center else jnp.zeros((d,), jnp.float32)
    elif mu.shape != (d,):
        raise ValueError(f"mu must be [d={d}], got shape {mu.shape}")
    mu = jnp.asarray(mu, jnp.float32)
    own = None if key is None else jax.random.normal(jax.random.fold_in(key, cfg.seed), (d, cfg.K * cfg.L),
                                                     jnp.float32)
    codes = _masked_codes(cfg, _own_or_shared(cfg, own, d), mu, keys, n)
    _, sorted_ids, starts = jax.vmap(_sort_table, in_axes=(1, None))(codes, 2**cfg.K)
    return MagicPIGIndex(mu=mu, projection=own, sorted_ids=sorted_ids, bucket_starts=starts,
                         n=n, n_dropped=offered - n)


def _merge_table(sorted_ids, starts, new_codes, n):
    """Merge new keys (ids n, n+1, ...; code 2^K marks an unused row) into one table."""
    cap, n_buckets = sorted_ids.shape[0], starts.shape[0] - 1
    new_codes, new_rows, new_before = _sort_table(new_codes, n_buckets)
    slot = jnp.arange(cap)
    live = new_codes < n_buckets
    # New key j lands after the old entries of its bucket and the new keys before it.
    new_target = jnp.where(
        live, jnp.arange(new_codes.shape[0]) + starts[jnp.minimum(new_codes + 1, n_buckets)], cap)
    # Gathered, not scattered (XLA CPU scatters slower): slot t holds the
    # next new key where one lands, else the old entry shifted right by the
    # new keys landed at or before t.
    is_new = jnp.zeros(cap, bool).at[new_target].set(True, mode="drop")
    # By popcounts of the packed slots: jnp.cumsum over every slot is a slow reduce-window
    # on XLA CPU (docs/results/implementation_notes.md, "MagicPIG").
    new_upto = common.set_bits_through(common.pack_words(is_new))[:cap]
    old_entry = sorted_ids[jnp.maximum(slot - new_upto, 0)]
    merged = jnp.where(is_new, n + new_rows[jnp.maximum(new_upto - 1, 0)],
                       jnp.where(slot < n + jnp.sum(live), old_entry, 0))
    # No bucket has more new keys before it than landed in all (new_upto[-1]):
    # the clamp changes nothing, but it schedules the new starts after the merge, so
    # they share its buffer and the flush cond's untaken branch copies no table's starts
    # (docs/results/implementation_notes.md, "MagicPIG").
    return merged, starts + jnp.minimum(new_before, new_upto[-1])


@_jit_with_static_cfg
def insert(cfg: MagicPIGConfig, index: MagicPIGIndex, keys_new: jax.Array, count) -> MagicPIGIndex:
    """Append the first ``count`` rows of keys_new[U, d] as keys n..n+count-1.

    Nothing is retrained (μ and the projection stay). Each table takes the new keys
    in one linear pass: an old entry moves right by the new keys in smaller buckets,
    a new one lands after its bucket's old entries. Ids are appended in increasing
    order, so the index equals one built from all keys at once, bit for bit. Rows
    that do not fit in the capacity are not indexed and are counted in ``index.n_dropped``.
    """
    _check_keys("keys_new", keys_new, index.mu.shape[0])
    cap, u = index.sorted_ids.shape[1], keys_new.shape[0]
    count = jnp.maximum(jnp.asarray(count, jnp.int32), 0)
    taken = jnp.minimum(count, jnp.minimum(u, cap - index.n))
    codes = _masked_codes(cfg, hyperplanes(cfg, index), index.mu, keys_new, taken)
    if cfg.kernels.uses_native():
        sorted_ids, starts = native.magicpig_merge(index.sorted_ids, index.bucket_starts, codes, index.n)
    else:
        sorted_ids, starts = jax.vmap(_merge_table, in_axes=(0, 0, 1, None))(
            index.sorted_ids, index.bucket_starts, codes, index.n)
    return dataclasses.replace(
        index, sorted_ids=sorted_ids, bucket_starts=starts,
        n=index.n + taken, n_dropped=index.n_dropped + count - taken)


def _query_buckets(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array):
    """Per query head and table: bucket range start and size, their running total, tables read.

    Tables are read in order while the running total of entries fits in the
    candidate capacity; shapes [G, L], [G, L], [G, L], [G].
    """
    return _code_buckets(cfg, index, hash_codes(cfg, hyperplanes(cfg, index), q))


def _code_buckets(cfg: MagicPIGConfig, index: MagicPIGIndex, codes: jax.Array, context: ContextShards | None = None):
    """:func:`_query_buckets` for the query codes [G, L].

    With ``context`` (a shard's index): the tables read are those whose buckets, summed over
    every shard, fit the whole region's candidate capacity; the rest is the shard's own.
    """
    codes = codes.astype(jnp.int32)
    tables = jnp.arange(cfg.L)[None, :]
    lo = index.bucket_starts[tables, codes]
    sizes = index.bucket_starts[tables, codes + 1] - lo
    running = jnp.cumsum(sizes, axis=-1)
    if context is None:
        every, limit = running, cfg.candidate_entries(index.sorted_ids.shape[1])
    else:
        every, limit = jnp.cumsum(context.total(sizes), axis=-1), cfg.candidate_entries(context.capacity)
    tables_used = jnp.sum((every <= limit).astype(jnp.int32), axis=-1)
    return lo, sizes, running, tables_used


def _native_query_buckets(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array):
    """(codes [G, L], tables_used [G], entries_read [G]) of q [G, d] by one ``jaxkv.native``
    kernel: what :func:`hash_codes` and :func:`_code_buckets` give (a code's bit may differ
    where its product is within float32 rounding of 0), in one call instead of XLA's product,
    bit packing, gathers of bucket starts and running sum."""
    return native.magicpig_query_buckets(q, hyperplanes(cfg, index), index.bucket_starts, K=cfg.K,
                                         limit=cfg.candidate_entries(index.sorted_ids.shape[1]))


def _entries_read(running, tables_used):
    """Entries in the first ``tables_used`` tables' buckets, per query head."""
    last = jnp.take_along_axis(running, jnp.maximum(tables_used - 1, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(tables_used > 0, last, 0)


def _entry_positions(cfg, cap, lo, sizes, running, entries):
    """Flat positions in ``sorted_ids.reshape(-1)`` of one query head's candidate slots.

    The query's buckets, table after table, form one ragged list: slot s in
    table l (running[l−1] ≤ s < running[l]) is entry l·cap + lo[l] + s − start_l.
    That is s plus a term constant per table, so the term's steps are scattered
    at the tables' starts and summed, instead of finding each slot's table by a
    binary search (slower on XLA CPU). Slots past the tables read hold clipped
    positions; callers mask them. ``entries``: the static number of slots.
    """
    slot = jnp.arange(entries, dtype=jnp.int32)
    starts = running - sizes
    shift = jnp.arange(cfg.L, dtype=jnp.int32) * cap + lo - starts
    steps = jnp.zeros_like(slot).at[starts].add(jnp.diff(shift, prepend=0), mode="drop")
    return jnp.clip(slot + lax.associative_scan(jnp.add, steps), 0, cfg.L * cap - 1)


def _head_hits(cfg, sorted_ids, lo, sizes, running, read, entries):
    """One query head's sampled keys, bool [cap]: ids in >= min_hits of the buckets it reads.

    An id occurs at most once per table, so its count among the first ``read``
    entries of the ragged bucket list is its number of hits: a histogram of the
    entries, cheaper on XLA CPU than sorting them. ``entries``: at least ``read`` (static).
    """
    cap = sorted_ids.shape[1]
    positions = _entry_positions(cfg, cap, lo, sizes, running, entries)
    ids = jnp.where(jnp.arange(positions.shape[0]) < read, sorted_ids.reshape(-1)[positions], cap)
    hits = jnp.zeros((cap + 1,), HIT_COUNT_DTYPE).at[ids].add(1)  # slot cap counts the unread slots
    return hits[:cap] >= cfg.min_hits


def _head_hits_kernel(cfg, index, codes, tables_used, capacity):
    """:func:`_head_hits` by the collide kernel (its lowest ``capacity`` ids) and the full count.

    The kernel reads every table's bucket (up to a static bucket capacity); the
    tables this head does not read get empty buckets (all starts 0), and no
    table it reads holds more entries than the candidate capacity, which is
    therefore the bucket capacity: nothing is truncated.
    """
    cap = index.sorted_ids.shape[1]
    read_table = (jnp.arange(cfg.L) < tables_used)[:, None]
    found = dispatch.collide(
        codes, index.sorted_ids, jnp.where(read_table, index.bucket_starts, 0), capacity=capacity,
        bucket_capacity=cfg.candidate_entries(cap), min_hits=cfg.min_hits, kernels=cfg.kernels)
    hits = jnp.zeros((cap + 1,), bool).at[jnp.where(found.mask, found.idx, cap)].set(True)[:cap]
    return hits, jnp.sum(found.mask, dtype=jnp.int32) + found.overflow


@_jit_with_static_cfg
def select_with_stats(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array):
    """:func:`select` plus what overflowed (:class:`SelectStats`), never silently:

    - ``candidate_capacity`` bounds the inverted-index entries a query head reads over
      all tables. When its buckets hold more, only the first L' tables that fit are read
      and u is computed with L' tables, so the estimator stays consistent with what was
      read (``tables_used`` < L).
    - ``capacity`` bounds the sampled keys per KV head (the union over its query heads);
      keys beyond it are dropped, highest ids first (``truncated``).
    """
    cap = index.sorted_ids.shape[1]
    capacity = cfg.sample_capacity(cap)
    if cfg.kernels.uses_native():
        codes, tables_used, read = _native_query_buckets(cfg, index, q)
        idx, member, n_sampled, n_union = native.magicpig_collide(
            index.sorted_ids, index.bucket_starts, codes, tables_used, capacity, cfg.min_hits)
        selection = common.Selection(idx=idx, mask=member)
    else:
        codes = hash_codes(cfg, hyperplanes(cfg, index), q)
        lo, sizes, running, tables_used = _code_buckets(cfg, index, codes)
        read = _entries_read(running, tables_used)
        selection, n_sampled, n_union = _sample_xla(cfg, index, codes, lo, sizes, running, tables_used, read,
                                                    capacity)
    stats = SelectStats(tables_used=tables_used, entries_read=read, n_sampled=n_sampled,
                        truncated=(jnp.max(n_sampled) > capacity) | (n_union > capacity))
    return selection, stats


def _sample_xla(cfg, index, codes, lo, sizes, running, tables_used, read, capacity):
    """:func:`select_with_stats`'s sample by XLA or the Pallas collide kernel: (selection,
    n_sampled [G], size of the union before the capacity)."""
    cap = index.sorted_ids.shape[1]
    if cfg.kernels.uses_pallas():
        hits, n_sampled = jax.vmap(
            lambda c, t: _head_hits_kernel(cfg, index, c, t, capacity))(codes, tables_used)
    else:
        entries = cfg.candidate_entries(cap)
        hits = jax.vmap(lambda *a: _head_hits(cfg, index.sorted_ids, *a, entries))(lo, sizes, running, read)
        n_sampled = jnp.sum(hits, axis=1, dtype=jnp.int32)
    # The lowest `capacity` ids of the union: each is among its heads' lowest
    # `capacity` too, so the kernel's per-head lists (those) give the same slots.
    in_union = jnp.any(hits, axis=0)
    union = common.compact_rows(in_union, capacity, fill=cap)
    member = hits[:, jnp.minimum(union, cap - 1)] & (union < cap)[None, :]
    selection = common.Selection(idx=jnp.where(union < cap, union, 0), mask=member)
    return selection, n_sampled, jnp.sum(in_union, dtype=jnp.int32)


def select(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array) -> common.Selection:
    """Sampled rows for q[G, d]: idx [C] (union over heads), mask [G, C] (each head's own sample)."""
    return select_with_stats(cfg, index, q)[0]


def select_sharded(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array, context: ContextShards) -> common.Selection:
    """:func:`select` over a region split into shards (``jaxkv.attention.shards``): this shard's
    part of the one-device sample, by the XLA path whatever ``cfg.kernels`` says.

    The hash functions and μ (:meth:`MagicPIG.build_sharded`) are every shard's; the tables
    read follow the bucket sizes summed over the shards ([G, L] int32 per step); a key's hits
    are its own shard's count; the capacity keeps the lowest rows of the union, shard by
    shard (one count per shard).
    """
    cap = index.sorted_ids.shape[1]
    codes = hash_codes(cfg, hyperplanes(cfg, index), q)
    lo, sizes, running, tables_used = _code_buckets(cfg, index, codes, context)
    read = _entries_read(running, tables_used)
    entries = min(cfg.candidate_entries(context.capacity), cfg.L * cap)
    hits = jax.vmap(lambda *a: _head_hits(cfg, index.sorted_ids, *a, entries))(lo, sizes, running, read)
    in_union = jnp.any(hits, axis=0)
    capacity = cfg.sample_capacity(context.capacity)
    kept = capacity - context.before(jnp.sum(in_union, dtype=jnp.int32))
    union = common.compact_rows(in_union, min(capacity, cap), fill=cap)
    union = jnp.where(jnp.arange(union.shape[0]) < kept, union, cap)
    member = hits[:, jnp.minimum(union, cap - 1)] & (union < cap)[None, :]
    return common.Selection(idx=jnp.where(union < cap, union, 0), mask=member)


def _cosine(q: jax.Array, x: jax.Array) -> jax.Array:
    """cos θ between every q[G, d] and x[C, d]; 0 where either is the zero vector."""
    dots = jnp.einsum("gd,cd->gc", q.astype(jnp.float32), x, precision=lax.Precision.HIGHEST)
    norms = jnp.linalg.norm(q.astype(jnp.float32), axis=-1)[:, None] * jnp.linalg.norm(x, axis=-1)[None, :]
    return jnp.where(norms > 0, dots / jnp.where(norms > 0, norms, 1.0), 0.0)


@_jit_with_static_cfg
def correction(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array, k_rows: jax.Array,
               selection: common.Selection) -> jax.Array:
    """Importance correction −log u [G, C] for the gathered rows k_rows[C, d] (0 where unsampled).

    Where the official code is weak: the cosine is clamped to [−1, 1] and is 0 for a
    zero query or centred key (p = 1/2 keeps the weight finite), and log u is computed
    without cancellation (:func:`collision_log_prob`), not as log(u + 1e-4).
    """
    _, _, _, tables_used = _query_buckets(cfg, index, q)
    return _corrected(cfg, index, q, k_rows, selection, tables_used)


def _corrected(cfg, index, q, k_rows, selection, tables_used):
    """−log u [G, C] of the selected rows for the tables each query head read."""
    cos = _cosine(q, k_rows.astype(jnp.float32) - index.mu)
    log_u = collision_log_prob(cos, cfg.K, tables_used[:, None], cfg.min_hits)
    return jnp.where(selection.mask, -jnp.maximum(log_u, LOG_U_FLOOR), 0.0)


@_jit_with_static_cfg
def attend_in_place(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array, keys: jax.Array, values: jax.Array,
                    selection: common.Selection) -> common.Partial:
    """The partial of q[G, d] over the selection's rows of keys, values [cap, d], each score
    corrected by :func:`correction`: what gathering the rows and ``common.partial_attention``
    give, in one ``jaxkv.native`` kernel that reads the rows where they lie (host memory
    included) and evaluates the correction only for the (head, row) pairs sampled."""
    _, tables_used, _ = _native_query_buckets(cfg, index, q)  # select's call: XLA keeps one of the two
    o, l, m = native.magicpig_attend(q, keys, values, index.mu, selection.idx, selection.mask, tables_used,
                                     K=cfg.K, min_hits=cfg.min_hits, tail_terms=TAIL_TERMS,
                                     log_u_floor=LOG_U_FLOOR, masked_score=common.MASKED_SCORE)
    return common.Partial(o=o, l=l, m=m)


def build_sharded(cfg: MagicPIGConfig, keys: jax.Array, n, key, context: ContextShards) -> MagicPIGIndex:
    """:func:`build` of a shard's rows, centred by the mean of every shard's keys."""
    if not cfg.center:
        return build(cfg, keys, n, key)
    live = (jnp.arange(keys.shape[0]) < n)[:, None]
    total = context.total(jnp.sum(jnp.where(live, keys.astype(jnp.float32), 0.0), axis=0))
    return build(cfg, keys, n, key, mu=total / jnp.maximum(context.total(n), 1).astype(jnp.float32))


def correction_sharded(cfg: MagicPIGConfig, index: MagicPIGIndex, q: jax.Array, k_rows: jax.Array,
                       selection: common.Selection, context: ContextShards) -> jax.Array:
    """:func:`correction` with the tables read over every shard (:func:`select_sharded`'s)."""
    _, _, _, tables_used = _code_buckets(cfg, index, hash_codes(cfg, hyperplanes(cfg, index), q), context)
    return _corrected(cfg, index, q, k_rows, selection, tables_used)


class MagicPIG(SparseMethod):
    """MagicPIG through the cache's interface: LSH sampling, the −log u correction slot by slot."""

    config_class = MagicPIGConfig
    slot_wise_correction = True

    def build(self, cfg, keys, values, n, key):
        return build(cfg, keys, n, key)

    def insert(self, cfg, index, keys_new, values_new, count):
        return insert(cfg, index, keys_new, count)

    def select(self, cfg, index, q):
        return select(cfg, index, q)

    def correction(self, cfg, index, q, k_rows, selection):
        return correction(cfg, index, q, k_rows, selection)

    def splits_context(self, cfg):
        """The XLA and Pallas paths; the CPU kernels' attention reads the tables used itself."""
        return not cfg.kernels.uses_native()

    def build_sharded(self, cfg, keys, values, n, key, context):
        return build_sharded(cfg, keys, n, key, context)

    def select_sharded(self, cfg, index, q, context):
        return select_sharded(cfg, index, q, context)

    def correction_sharded(self, cfg, index, q, k_rows, selection, context):
        return correction_sharded(cfg, index, q, k_rows, selection, context)

    def regions(self, cfg):
        return Regions(cfg.sink, cfg.local, None)

    def kernels(self, cfg):
        return cfg.kernels

    def host_config(self, cfg):
        return host_config(cfg)

    def inserts_in_place(self, cfg):
        """The CPU kernels' merge rewrites the id lists in place."""
        return cfg.kernels.uses_native()

    def reads_rows_in_place(self, cfg, keys):
        """The CPU kernels, rows in float32, bfloat16 or bfloat16 bits (``jaxkv.native.ROW_DTYPES``)."""
        return cfg.kernels.uses_native() and keys.dtype in native.ROW_DTYPES

    def attend_in_place(self, cfg, index, q, keys, values, selection):
        return attend_in_place(cfg, index, q, keys, values, selection)


METHOD = MagicPIG()


@_jit_with_static_cfg
def attend(cfg: MagicPIGConfig, q, keys, values, key=None):
    """MagicPIG's estimate for q[G, d] over a whole context keys, values [N, d].

    Sink and local keys exact, the rest sampled; returns (out [G, d], n_read).
    """
    return METHOD.attend(cfg, q, keys, values, key)
