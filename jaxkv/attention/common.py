"""What every attention method shares: partial results and their merge, selections, bit-packed masks.

Everything here is for ONE KV head: a query group ``q[G, d]`` (the G query heads that
share the KV head), keys and values ``[N, d]``; batch and heads come from ``jax.vmap``.
Partials over disjoint key sets merge exactly by log-sum-exp (:func:`merge`): that is
how the exact regions are combined with a sparse method's estimate over the retrieval region.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Scores of masked-out keys. Finite (not -inf) so that a fully masked row
# gives l = 0 and o = 0 instead of NaN from (-inf) - (-inf).
MASKED_SCORE = -1e30
# Precision of the float32 products over keys and values. On a GPU, XLA's default
# for float32 is TF32 (a 10-bit mantissa: ~1e-3 relative error in a score); these
# products are matrix-vector, bound by memory, so full float32 costs nothing there.
FULL_F32 = jax.lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Partial:
    """Unnormalised attention over a subset of keys, for G query heads: the flash-decoding
    triple (o, l, m) over the scores s_i it covers."""

    o: jax.Array  # [G, d] float32, Σ exp(s_i − m) v_i
    l: jax.Array  # [G] float32,   Σ exp(s_i − m)
    m: jax.Array  # [G] float32,   max_i s_i (MASKED_SCORE when nothing was attended)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Selection:
    """Rows of the retrieval region a method wants read, for one KV head (static capacity C).

    idx:        [C] int32 row indices in [0, cap) (any such row where the slot is unused).
    mask:       [C] or [G, C] bool; per query head where heads sample separately.
    log_weight: None, [C] or [G, C] float32 added to the scores (importance
                correction, e.g. −log u for MagicPIG).
    rest:       None or a :class:`Partial` over rows that are NOT read, estimated
                from index data; disjoint from the selected rows.
    """

    idx: jax.Array
    mask: jax.Array
    log_weight: jax.Array | None = None
    rest: Partial | None = None

    def distinct_rows(self) -> jax.Array:
        """How many rows this selection reads (slots are distinct by construction)."""
        mask = self.mask if self.mask.ndim == 1 else jnp.any(self.mask, axis=0)
        return jnp.sum(mask.astype(jnp.int32))


def scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled dot-product scores ``q·k/√d`` in float32: [G, d] × [N, d] → [G, N]."""
    d = q.shape[-1]
    return jnp.einsum("gd,nd->gn", q.astype(jnp.float32), k.astype(jnp.float32), precision=FULL_F32) / math.sqrt(d)


def partial_attention(q, k, v, mask=None, log_weight=None) -> Partial:
    """Attention of q[G, d] over k, v [N, d] as an unnormalised partial.

    mask: None, [N] or [G, N] bool (False = not attended).
    log_weight: None, [N] or [G, N], added to the scores before the softmax.
    """
    s = scores(q, k)
    if log_weight is not None:
        s = s + jnp.broadcast_to(log_weight, s.shape).astype(jnp.float32)
    if mask is not None:
        s = jnp.where(jnp.broadcast_to(mask, s.shape), s, MASKED_SCORE)
    return partial_from_scores(s, v)


def partial_from_scores(s: jax.Array, v: jax.Array) -> Partial:
    """Partial from final scores s[G, N] (masked entries at MASKED_SCORE) and v[N, d]."""
    m = jnp.max(s, axis=-1, initial=MASKED_SCORE)
    # "not masked" rather than "above the floor": a NaN score stays live, so NaN
    # inputs propagate to the output instead of silently dropping a key.
    live = ~(s <= MASKED_SCORE / 2)
    p = jnp.where(live, jnp.exp(s - m[:, None]), 0.0)
    o = jnp.einsum("gn,nd->gd", p, v.astype(jnp.float32), precision=FULL_F32)
    return Partial(o=o, l=jnp.sum(p, axis=-1), m=m)


def empty_partial(g: int, d: int) -> Partial:
    """The partial of attending to nothing: the identity of :func:`merge`."""
    return Partial(
        o=jnp.zeros((g, d), jnp.float32),
        l=jnp.zeros((g,), jnp.float32),
        m=jnp.full((g,), MASKED_SCORE, jnp.float32),
    )


def merge(*parts: Partial) -> Partial:
    """Log-sum-exp merge of partials over disjoint key sets (exact)."""
    m = parts[0].m
    for p in parts[1:]:
        m = jnp.maximum(m, p.m)
    o = jnp.zeros_like(parts[0].o)
    l = jnp.zeros_like(parts[0].l)
    for p in parts:
        # A part that attended nothing has l = 0, o = 0: its factor is irrelevant.
        scale = jnp.exp(p.m - m)
        o = o + p.o * scale[:, None]
        l = l + p.l * scale
    return Partial(o=o, l=l, m=m)


def finalize(p: Partial) -> jax.Array:
    """Normalised output [G, d]; zeros for a head that attended nothing."""
    safe_l = jnp.where(p.l > 0, p.l, 1.0)
    return p.o / safe_l[:, None]


def with_rest(read: Partial, selection: Selection) -> Partial:
    """The partial over the rows read, completed by the selection's estimate of the rest."""
    return read if selection.rest is None else merge(read, selection.rest)


def attend_selection(q, k_rows, v_rows, selection: Selection) -> Partial:
    """Partial over gathered rows k_rows, v_rows [C, d] of a selection (plus its ``rest``)."""
    return with_rest(partial_attention(q, k_rows, v_rows, selection.mask, selection.log_weight), selection)


WORD_BITS = 32


def pack_words(mask: jax.Array) -> jax.Array:
    """mask[N] as uint32 [⌈N/32⌉] words: bit j of word w is row 32·w + j (rows past N are False)."""
    bits = jnp.pad(mask, (0, -mask.shape[0] % WORD_BITS)).reshape(-1, WORD_BITS).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(WORD_BITS, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def _select_bit(words: jax.Array, r: jax.Array) -> jax.Array:
    """Bit position (uint32) of the r-th (≥ 1) set bit of each uint32 word, by halving the range."""
    pos = jnp.zeros(words.shape, jnp.uint32)
    half = WORD_BITS // 2
    while half:
        low = jax.lax.population_count((words >> pos) & jnp.uint32((1 << half) - 1)).astype(r.dtype)
        past = r > low
        r = jnp.where(past, r - low, r)
        pos = jnp.where(past, pos + half, pos)
        half //= 2
    return pos


def _bits_before(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(set bits per word, set bits in the words before it), int32 [W] each."""
    counts = jax.lax.population_count(words).astype(jnp.int32)
    # Running sums and maxima here are associative scans: jnp.cumsum and lax.cummax lower to
    # a slow reduce-window on XLA CPU (docs/results/implementation_notes.md, "Selections").
    return counts, jax.lax.associative_scan(jnp.add, counts) - counts


def first_set_bits(words: jax.Array, n) -> jax.Array:
    """words with only their first n set bits (in row order) kept."""
    counts, before = _bits_before(words)
    r = jnp.clip(n - before, 1, WORD_BITS)  # the last kept bit's rank in a word that keeps some
    through = (jnp.uint32(2) << _select_bit(words, r)) - 1  # that bit and those below (bit 31: all)
    return jnp.where(before + counts <= n, words, jnp.where(before < n, words & through, 0))


def set_bits_through(words: jax.Array) -> jax.Array:
    """Running count of a mask packed by :func:`pack_words`: int32 [32·W], Trues at rows ≤ r for row r.

    jnp.cumsum over the rows without a pass per row: the words' counts are
    summed (W of them) and each row adds the popcount of its word below it.
    """
    _, before = _bits_before(words)
    through = (jnp.uint32(2) << jnp.arange(WORD_BITS, dtype=jnp.uint32)) - 1  # bits 0..j (j = 31: all)
    within = jax.lax.population_count(words[:, None] & through[None, :]).astype(jnp.int32)
    return (before[:, None] + within).reshape(-1)


def compact_words(words: jax.Array, size: int, fill: int = 0) -> jax.Array:
    """:func:`compact_rows` of a mask packed by :func:`pack_words`."""
    if words.shape[0] == 0:
        return jnp.full((size,), fill, jnp.int32)
    counts, before = _bits_before(words)
    word_ids = jnp.arange(words.shape[0], dtype=jnp.int32)
    first_slot = jnp.where(counts > 0, before, size)
    word_of_slot = jax.lax.associative_scan(
        jnp.maximum, jnp.zeros((size,), jnp.int32).at[first_slot].max(word_ids, mode="drop"))
    slot = jnp.arange(size, dtype=jnp.int32)
    bit = _select_bit(words[word_of_slot], slot - before[word_of_slot] + 1)
    return jnp.where(slot < jnp.sum(counts), word_of_slot * WORD_BITS + bit.astype(jnp.int32), fill)


def compact_rows(mask: jax.Array, size: int, fill: int = 0) -> jax.Array:
    """Rows of the first ``size`` Trues of mask[N], ascending, int32 [size]; slots past them ``fill``.

    ``jnp.nonzero(mask, size=size, fill_value=fill)`` without a scatter per row
    (XLA CPU runs a scatter one update at a time): the mask is packed into
    32-row words; each word that holds a True writes its index into the slot of
    its first True (N/32 updates), a running max hands it to the slots after,
    and a slot's row is found inside its word by popcounts
    (docs/results/implementation_notes.md, "Selections").
    """
    return compact_words(pack_words(mask), size, fill)


@functools.lru_cache(maxsize=None)
def seeded_constant(sampler, seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """``sampler(jax.random.key(seed), shape, float32)`` (a ``jax.random`` distribution) as a
    read-only numpy array, drawn once on the CPU and shared by every caller. Not traced:
    inside a jitted decode loop the generator's threefry rounds otherwise ran for every
    sparse layer on every token; a constant is also packed for a product at compile time."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]), jax.ensure_compile_time_eval():
        drawn = np.array(sampler(jax.random.key(seed), shape, jnp.float32))
    drawn.setflags(write=False)
    return drawn


def exact_and_retrieval_split(n: int, sink: int, local: int) -> tuple[int, int]:
    """(retrieval start, retrieval end) for a context of n keys; empty when n ≤ sink+local."""
    if n <= sink + local:
        return n, n
    return sink, n - local
