"""ParisKV coarse stage: per-subspace vote lookup, summed votes, the C best keys.

Layout: ``signs`` uint8 [N, B] (the bucket id of each key in each subspace, m
sign bits → 2^m patterns, 256 for ParisKV's m=8) and ``lut`` int32 [B, 2^m] (the votes a pattern earns
in a subspace for the current query, in [0, max_vote_per_subspace]). A key's
total is ``Σ_b lut[b, signs[n, b]]``. The candidates are the C highest totals,
ties broken by the lower key id — exactly the set ``lax.top_k`` picks — listed
in ascending key id. Keys at or past ``n_valid`` are never candidates.

Kernel: one pass computes the totals and a per-block histogram of them; the
threshold total t follows from the histogram (XLA, [n_blocks, V]); a second
pass compacts (totals > t) and the first ties at t in key order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels._compact import compact

N_PATTERNS = 256  # m = 8 sign bits
# ParisKV's six tiers give at most 6 votes per subspace.
DEFAULT_MAX_VOTE_PER_SUBSPACE = 6


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Candidates:
    idx: jax.Array    # [C] int32 key ids, ascending; 0 past the mask
    mask: jax.Array   # [C] bool (False only when fewer than C keys are valid)
    votes: jax.Array  # [C] int32 vote totals; 0 past the mask


def _check(signs, lut, capacity):
    _common.check_shape("signs", signs, (None, None))
    _common.check_shape("lut", lut, (signs.shape[1], None))
    if not 1 <= lut.shape[1] <= N_PATTERNS:
        raise ValueError(f"lut: expected at most {N_PATTERNS} patterns per subspace, found {lut.shape[1]}")
    _common.check_dtype("signs", signs, (jnp.uint8,))
    if not 1 <= capacity <= signs.shape[0]:
        raise ValueError(f"capacity: expected 1..N={signs.shape[0]} candidates, found {capacity}")


def vote_totals_reference(signs, lut):
    """Σ_b lut[b, signs[n, b]]: int32 [N]."""
    per_subspace = jnp.take_along_axis(lut.T, signs.astype(jnp.int32), axis=0)  # [N, B]
    return jnp.sum(per_subspace, axis=1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("capacity",))
def vote_reference(signs, lut, n_valid=None, *, capacity: int) -> Candidates:
    """The ``capacity`` best keys by total votes (plain jnp, via lax.top_k)."""
    _check(signs, lut, capacity)
    n = signs.shape[0]
    n_valid = n if n_valid is None else n_valid
    totals = jnp.where(jnp.arange(n) < n_valid, vote_totals_reference(signs, lut), -1)
    best_votes, best = lax.top_k(totals, capacity)
    mask = best_votes >= 0
    order = jnp.argsort(jnp.where(mask, best, n))  # ascending id, invalid slots last
    idx, votes, mask = best[order], best_votes[order], mask[order]
    return Candidates(idx=jnp.where(mask, idx, 0), mask=mask, votes=jnp.where(mask, votes, 0))


def _totals_kernel(n_valid_ref, signs_ref, lut_ref, totals_ref, hist_ref, *, block: int, n_subspaces: int,
                   n_patterns: int):
    i = pl.program_id(0)
    signs = signs_ref[...].astype(jnp.int32)                      # [block, B]
    subspace = jnp.arange(signs.shape[1], dtype=jnp.int32)[None, :]
    real = subspace < n_subspaces                                 # B is padded to a power of two
    votes = lut_ref[jnp.where(real, subspace * n_patterns + signs, 0)]  # gather from the flat LUT
    votes = jnp.where(real, votes, 0)
    totals = jnp.sum(votes, axis=1)
    key = i * block + jnp.arange(block, dtype=jnp.int32)
    totals = jnp.where(key < n_valid_ref[0], totals, -1)
    totals_ref[...] = totals
    levels = jnp.arange(hist_ref.shape[-1], dtype=jnp.int32)
    hist_ref[...] = jnp.sum((totals[:, None] == levels[None, :]).astype(jnp.int32), axis=0)[None, :]


def _threshold(hist, capacity):
    """Largest total t with ≥ capacity keys at or above it (0 if there are fewer), and
    how many keys at exactly t are taken."""
    at_least = jnp.cumsum(hist[::-1])[::-1]                       # keys with total >= v
    levels = jnp.arange(hist.shape[0])
    t = jnp.max(jnp.where(at_least >= capacity, levels, 0))
    above = at_least[t] - hist[t]
    return t.astype(jnp.int32), jnp.minimum(hist[t], capacity - above).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("capacity", "max_vote_per_subspace", "block", "interpret"))
def vote(signs, lut, n_valid=None, *, capacity: int,
         max_vote_per_subspace: int = DEFAULT_MAX_VOTE_PER_SUBSPACE,
         block: int = 256, interpret: bool = False) -> Candidates:
    """Pallas kernels for :func:`vote_reference`. LUT entries must lie in
    [0, max_vote_per_subspace] (the histogram's range)."""
    _check(signs, lut, capacity)
    n, n_subspaces = signs.shape
    n_valid = jnp.asarray(n if n_valid is None else n_valid, jnp.int32).reshape(1)
    b_pad = _common.next_pow2(n_subspaces)
    n_pad = _common.round_up(n, block)
    signs_p = _common.pad_axis(_common.pad_axis(signs, b_pad, 1), n_pad, 0)
    n_levels = _common.next_pow2(max_vote_per_subspace * n_subspaces + 1)
    n_blocks = n_pad // block

    kernel = functools.partial(_totals_kernel, block=block, n_subspaces=n_subspaces, n_patterns=lut.shape[1])
    totals, hist = _common.pallas_call(
        kernel,
        grid=(n_blocks,),
        in_specs=[
            pl.BlockSpec((1,), lambda i: (0,)),
            pl.BlockSpec((block, b_pad), lambda i: (i, 0)),
            pl.BlockSpec((lut.size,), lambda i: (0,)),
        ],
        out_specs=[pl.BlockSpec((block,), lambda i: (i,)), pl.BlockSpec((1, n_levels), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_pad,), jnp.int32),
                   jax.ShapeDtypeStruct((n_blocks, n_levels), jnp.int32)],
        interpret=interpret,
        name="vote_totals",
    )(n_valid, signs_p, lut.astype(jnp.int32).reshape(-1))
    threshold, n_ties = _threshold(jnp.sum(hist, axis=0), capacity)
    # compact() needs a multiple of its block; −1 (an invalid row's total) is never selected.
    compact_block = min(1024, n_pad)
    totals = _common.pad_axis(totals, _common.round_up(n_pad, compact_block), 0, value=-1)
    idx, votes, mask, _ = compact(totals, threshold, n_ties, capacity=capacity,
                                  block=compact_block, interpret=interpret)
    return Candidates(idx=idx, mask=mask, votes=votes)
