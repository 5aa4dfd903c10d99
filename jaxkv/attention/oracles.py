"""Oracle estimators that may look at every score: TopK, sampling, hybrid.

They bound what any retrieval (TopK) or sampling (MagicPIG) method could reach
at a given budget, so a study can place a method between them.

Budgets. ``budget`` is a static int applying to each query head (one attention
row) separately, the study's unit. The returned ``n_read`` is the number of
distinct keys read by the whole query group (the union over its G heads), the
same count :meth:`common.Selection.distinct_rows` gives for sparse methods; with
G = 1 it is the row's own count.

Sampling and distinct keys. A key drawn twice is read once, so B draws read
fewer than B distinct keys. ``sampling_oracle`` therefore offers two budgets:

- ``count="draws"``: exactly ``budget`` i.i.d. draws (the textbook estimator);
- ``count="distinct"`` (default): the number of draws M is the smallest whose
  *expected* number of distinct keys, ``Σ_i 1 − (1 − w_i)^M``, reaches
  ``budget`` (capped at ``max_draws``). M depends on the true weights only,
  never on the draws, so the estimator stays exactly unbiased; the realised
  distinct count fluctuates around the budget and is what ``n_read`` reports.
  (Drawing *until* ``budget`` distinct keys are seen would hit the budget
  exactly, but that stopping rule makes the average biased.)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention import common
from jaxkv.attention.dense import check_qkv

# Default cap on draws per query head, as a multiple of the distinct budget.
# It only binds for very peaked weights; n_read then reports the shortfall.
DEFAULT_DRAWS_PER_BUDGET = 32


def _check_budget(budget) -> int:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be a positive int (distinct keys per query head), got {budget!r}")
    return budget


def _distinct(read: jax.Array) -> jax.Array:
    """Distinct keys read by the group, from a [G, N] read mask."""
    return jnp.sum(jnp.any(read, axis=0).astype(jnp.int32))


def _masked_scores(q, k, mask) -> jax.Array:
    """Scores [G, N]; keys outside ``mask`` ([N] or [G, N]) at MASKED_SCORE (weight 0)."""
    s = common.scores(q, k)
    return s if mask is None else jnp.where(jnp.broadcast_to(mask, s.shape), s, common.MASKED_SCORE)


def _weights(q, k, mask) -> jax.Array:
    return jax.nn.softmax(_masked_scores(q, k, mask), axis=-1)


def _top_mask(w: jax.Array, count: int) -> jax.Array:
    """[G, N] mask of each row's ``count`` largest weights."""
    g, n = w.shape
    mask = jnp.zeros((g, n), bool)
    if count == 0:
        return mask
    _, top = lax.top_k(w, count)
    return mask.at[jnp.arange(g)[:, None], top].set(True)


# Budgets and modes shape the computation: static, one compile per value.
@functools.partial(jax.jit, static_argnames="budget")
def topk_oracle(q, k, v, budget: int, mask=None):
    """Exact attention over each query head's ``budget`` highest-scoring keys.

    Returns (out [G, d], n_read).
    """
    check_qkv(q, k, v)
    budget = min(_check_budget(budget), k.shape[0])
    top = _top_mask(_masked_scores(q, k, mask), budget)
    # Where fewer than `budget` keys are visible, the masked ones must not count.
    mask = top if mask is None else top & jnp.broadcast_to(mask, top.shape)
    return common.finalize(common.partial_attention(q, k, v, mask)), _distinct(mask)


def draws_for_distinct(p: jax.Array, budget: int, max_draws: int) -> jax.Array:
    """Smallest M in [1, max_draws] with Σ_i 1 − (1 − p_i)^M ≥ budget, per row of p[G, N].

    Rows that cannot reach the budget (fewer than ``budget`` keys with weight)
    get ``max_draws``. The expectation is increasing in M: a binary search.
    """
    log_miss = jnp.log1p(-jnp.clip(p, 0.0, 1.0))  # log(1 − p_i); −inf where p_i = 1

    def expected_distinct(m):
        return jnp.sum(-jnp.expm1(m[:, None].astype(jnp.float32) * log_miss), axis=-1)

    def step(_, bounds):
        lo, hi = bounds  # the answer lies in [lo, hi]
        mid = (lo + hi) // 2
        enough = expected_distinct(mid) >= budget
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    g = p.shape[0]
    bounds = (jnp.ones((g,), jnp.int32), jnp.full((g,), max_draws, jnp.int32))
    _, hi = lax.fori_loop(0, max(1, math.ceil(math.log2(max_draws)) + 1), step, bounds)
    return hi


def _sample_mean(w, v, budget, key, count, max_draws):
    """Mean of v over i.i.d. draws from each row of the nonnegative weights w[G, N].

    The rows are normalised first; a row with zero total weight draws nothing.
    Returns (mean [G, d] float32, read [G, N] bool).
    """
    g, n = w.shape
    total = jnp.sum(w, axis=-1)
    p = w / jnp.where(total > 0, total, 1.0)[:, None]
    if count == "draws":
        max_draws = budget
        draws = jnp.full((g,), budget, jnp.int32)
    else:
        draws = draws_for_distinct(p, budget, max_draws)
    draws = jnp.where(total > 0, draws, 0)
    # Inverse-CDF sampling: O(N + M log N), unlike Gumbel-max's O(N·M).
    cdf = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(key, (g, max_draws)) * cdf[:, -1:]
    idx = jnp.minimum(jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(cdf, u), n - 1)
    live = (jnp.arange(max_draws)[None, :] < draws[:, None]).astype(jnp.float32)
    counts = jnp.zeros((g, n), jnp.float32).at[jnp.arange(g)[:, None], idx].add(live)
    drawn_sum = jnp.einsum("gn,nd->gd", counts, v.astype(jnp.float32), precision=common.FULL_F32)
    mean = drawn_sum / jnp.maximum(draws, 1)[:, None]
    return mean, counts > 0


def _check_sampling(budget, count, max_draws) -> int:
    _check_budget(budget)
    if count not in ("distinct", "draws"):
        raise ValueError(f"count must be 'distinct' or 'draws', got {count!r}")
    if max_draws is None:
        return DEFAULT_DRAWS_PER_BUDGET * budget
    if not isinstance(max_draws, int) or max_draws < 1:
        raise ValueError(f"max_draws must be a positive int, got {max_draws!r}")
    return max_draws


@functools.partial(jax.jit, static_argnames=("budget", "count", "max_draws"))
def sampling_oracle(q, k, v, budget: int, key, *, count: str = "distinct", max_draws: int | None = None,
                    mask=None):
    """Average of values drawn i.i.d. with replacement from the true weights.

    count="distinct": ``budget`` is the expected number of distinct keys per
    query head (see the module docstring); "draws": the number of draws.
    ``max_draws`` (static) caps the draws per head (default 32·budget).
    Unbiased: E[out] = softmax(q·k/√d)·v. Returns (out [G, d], n_read).
    """
    check_qkv(q, k, v)
    max_draws = _check_sampling(budget, count, max_draws)
    mean, read = _sample_mean(_weights(q, k, mask), v, budget, key, count, max_draws)
    return mean, _distinct(read)


@functools.partial(jax.jit, static_argnames=("budget", "max_draws"))
def hybrid_oracle(q, k, v, budget: int, key, *, max_draws: int | None = None, mask=None):
    """Top ``budget // 2`` keys exactly, the rest of the budget sampled from the remaining weight.

    out = Σ_top w_i v_i + W_rest · mean(v over draws from w restricted to the
    rest), with W_rest the exact remaining weight — unbiased. The sampled part
    uses the "distinct" budget ``budget − budget // 2``. Returns (out [G, d], n_read).
    """
    check_qkv(q, k, v)
    n_top = min(_check_budget(budget) // 2, k.shape[0])
    max_draws = _check_sampling(budget - n_top, "distinct", max_draws)
    w = _weights(q, k, mask)
    top = _top_mask(w, n_top)
    if mask is not None:
        top = top & jnp.broadcast_to(mask, top.shape)
    exact = jnp.einsum("gn,nd->gd", jnp.where(top, w, 0.0), v.astype(jnp.float32), precision=common.FULL_F32)
    rest = jnp.where(top, 0.0, w)
    mean, sampled = _sample_mean(rest, v, budget - n_top, key, "distinct", max_draws)
    # Sum the remaining weights directly: 1 − Σ_top w loses them to rounding.
    out = exact + jnp.sum(rest, axis=-1)[:, None] * mean
    return out, _distinct(top | sampled)
