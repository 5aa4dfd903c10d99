"""Attention of one query group over keys/values gathered by index, split-K flash-decoding.

For one KV head: q [G, d], k, v [N, d], a selection idx [C] with mask [C] or
[G, C] and an optional additive score correction log_weight [C] or [G, C]
(MagicPIG's −log u). The result is the unnormalised partial (o [G, d], l [G],
m [G]) over the selected keys, with scores ``q·k/√d + log_weight``:
``m = max s``, ``l = Σ exp(s − m)``, ``o = Σ exp(s − m) v`` — the convention of
``jaxkv.attention.common.Partial``: masked scores are MASKED_SCORE, so a fully
masked row gives l = 0, o = 0, m = MASKED_SCORE.

Kernel: the C slots are cut into splits (one program each); a program loops over
blocks of its split, gathers those rows of K and V, and keeps a running (o, l, m).
The splits are combined by the same log-sum-exp merge that joins the exact part.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common
from pallas_kernels._common import MASKED_SCORE

# Triton's dot needs at least 16 rows; the query group is padded to this.
_MIN_ROWS = 16


def _check(q, k, v, idx, mask, log_weight):
    _common.check_shape("q", q, (None, None))
    g, d = q.shape
    _common.check_shape("k", k, (None, d))
    _common.check_shape("v", v, k.shape)
    _common.check_shape("idx", idx, (None,))
    c = idx.shape[0]
    if mask.shape not in ((c,), (g, c)):
        raise ValueError(f"mask: expected shape ({c},) or ({g}, {c}), found {tuple(mask.shape)}")
    if log_weight is not None and log_weight.shape not in ((c,), (g, c)):
        raise ValueError(f"log_weight: expected shape ({c},) or ({g}, {c}), found {tuple(log_weight.shape)}")


def merge_partials(*parts):
    """Exact log-sum-exp merge of partials (o, l, m) over disjoint key sets."""
    return combine_partials(*(jnp.stack(x) for x in zip(*parts)))


def combine_partials(o, l, m):
    """Merge partials stacked on a leading axis: o [S, G, d], l [S, G], m [S, G]."""
    m_all = jnp.max(m, axis=0)
    # A part that attended nothing has l = 0 and o = 0, whatever its scale.
    scale = jnp.exp(m - m_all[None])
    return jnp.sum(o * scale[..., None], axis=0), jnp.sum(l * scale, axis=0), m_all


@jax.jit
def gather_attention_reference(q, k, v, idx, mask, log_weight=None):
    """Partial (o, l, m) over rows idx of k, v (plain jnp; idx is clipped where masked)."""
    _check(q, k, v, idx, mask, log_weight)
    g, d = q.shape
    rows = jnp.clip(idx, 0, k.shape[0] - 1)
    s = jnp.einsum("gd,cd->gc", q.astype(jnp.float32), k[rows].astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) / math.sqrt(d)
    if log_weight is not None:
        s = s + jnp.broadcast_to(log_weight, s.shape).astype(jnp.float32)
    live = jnp.broadcast_to(mask, s.shape)
    s = jnp.where(live, s, MASKED_SCORE)
    m = jnp.max(s, axis=-1, initial=MASKED_SCORE)
    p = jnp.where(live, jnp.exp(s - m[:, None]), 0.0)
    o = jnp.einsum("gc,cd->gd", p, v[rows].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o, jnp.sum(p, axis=-1), m


def _split_kernel(q_ref, k_ref, v_ref, idx_ref, live_ref, bias_ref, o_ref, l_ref, m_ref,
                  *, block: int, scale: float):
    q = q_ref[...].astype(jnp.float32)
    n_rows = k_ref.shape[0]

    def step(j, carry):
        o, l, m = carry
        cols = pl.ds(j * block, block)
        rows = jnp.clip(idx_ref[cols], 0, n_rows - 1)
        k = k_ref[rows, :].astype(jnp.float32)
        v = v_ref[rows, :].astype(jnp.float32)
        live = live_ref[:, cols] != 0
        s = plgpu.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale + bias_ref[:, cols]
        s = jnp.where(live, s, MASKED_SCORE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(live, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        o = o * correction[:, None] + plgpu.dot(p, v, precision=lax.Precision.HIGHEST)
        return o, l * correction + jnp.sum(p, axis=1), m_new

    heads, d = q.shape
    init = (jnp.zeros((heads, d), jnp.float32), jnp.zeros((heads,), jnp.float32),
            jnp.full((heads,), MASKED_SCORE, jnp.float32))
    o, l, m = lax.fori_loop(0, idx_ref.shape[0] // block, step, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def default_splits(capacity: int, block: int) -> int:
    """Enough splits to spread a decode step over the GPU, at least 4 blocks each."""
    return max(1, min(32, pl.cdiv(capacity, 4 * block)))


@functools.partial(jax.jit, static_argnames=("block", "n_splits", "interpret"))
def gather_attention(q, k, v, idx, mask, log_weight=None, *, block: int = 64,
                     n_splits: int | None = None, interpret: bool = False):
    """Pallas kernel for :func:`gather_attention_reference`: (o [G, d], l [G], m [G])."""
    _check(q, k, v, idx, mask, log_weight)
    g, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"q: the kernel needs a power-of-two head dim >= 16, found {d}")
    c = idx.shape[0]
    if c == 0:  # nothing to launch: the empty partial
        return gather_attention_reference(q, k, v, idx, mask, log_weight)
    n_splits = default_splits(c, block) if n_splits is None else n_splits
    per_split = _common.round_up(pl.cdiv(c, n_splits), block)
    c_pad = per_split * n_splits
    heads = max(_MIN_ROWS, _common.next_pow2(g))

    def per_head(x):  # [C] or [G, C] → [heads, c_pad]; padded slots and heads masked
        x = jnp.broadcast_to(x, (g, c))
        return _common.pad_axis(_common.pad_axis(x, c_pad, 1), heads, 0)

    live = per_head(mask.astype(jnp.int32))
    bias = per_head(jnp.zeros((c,), jnp.float32) if log_weight is None else log_weight.astype(jnp.float32))
    kernel = functools.partial(_split_kernel, block=block, scale=1.0 / math.sqrt(d))
    whole = lambda shape: pl.BlockSpec(shape, lambda s: (0,) * len(shape))
    o, l, m = _common.pallas_call(
        kernel,
        grid=(n_splits,),
        in_specs=[
            whole((heads, d)), whole(k.shape), whole(v.shape),
            pl.BlockSpec((per_split,), lambda s: (s,)),
            pl.BlockSpec((heads, per_split), lambda s: (0, s)),
            pl.BlockSpec((heads, per_split), lambda s: (0, s)),
        ],
        out_specs=[
            pl.BlockSpec((pl.Squeezed(), heads, d), lambda s: (s, 0, 0)),
            pl.BlockSpec((pl.Squeezed(), heads), lambda s: (s, 0)),
            pl.BlockSpec((pl.Squeezed(), heads), lambda s: (s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_splits, heads, d), jnp.float32),
            jax.ShapeDtypeStruct((n_splits, heads), jnp.float32),
            jax.ShapeDtypeStruct((n_splits, heads), jnp.float32),
        ],
        interpret=interpret,
        name="gather_attention",
    )(_common.pad_axis(q, heads), k, v, _common.pad_axis(idx.astype(jnp.int32), c_pad), live, bias)
    o, l, m = combine_partials(o, l, m)
    return o[:g], l[:g], m[:g]
