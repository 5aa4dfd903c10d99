"""ParisKV RSQ-IP rerank: approximate ⟨k, q⟩ for candidate keys from 4-bit codes.

Layout: ``codes`` uint8 [N, Dp/2], two coordinates per byte, the LOW nibble the
even coordinate; a nibble is ``(sign_bit << 3) | mag_idx`` (sign_bit 1 = negative)
and dequantises to ±centres[mag_idx]. ``weight`` float32 [N, B] per key and
subspace (B = Dp/m). With q̃ the rotated, normalised query [Dp]:

    score[n] = ‖q‖ · Σ_b weight[n, b] · ⟨v_{n,b}, q̃_b⟩

where v_{n,b} is the dequantised m-vector of subspace b.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common

N_LEVELS = 8  # 3 magnitude bits


def _check(q_rot, codes, weight, centres, idx):
    _common.check_shape("codes", codes, (None, None))
    n, half = codes.shape
    _common.check_dtype("codes", codes, (jnp.uint8,))
    _common.check_shape("q_rot", q_rot, (2 * half,))
    _common.check_shape("weight", weight, (n, None))
    _common.check_shape("centres", centres, (N_LEVELS,))
    _common.check_shape("idx", idx, (None,))
    if (2 * half) % weight.shape[1]:
        raise ValueError(f"weight: {weight.shape[1]} subspaces do not divide Dp={2 * half}")


def dequantize_reference(codes, centres):
    """float32 [N, Dp] coordinates of 4-bit codes [N, Dp/2]."""
    n, half = codes.shape
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(n, 2 * half).astype(jnp.int32)
    sign = jnp.where(nibbles >> 3 == 1, -1.0, 1.0)
    return sign * centres.astype(jnp.float32)[nibbles & 0x7]


@jax.jit
def rsq_rerank_reference(q_rot, q_norm, codes, weight, centres, idx):
    """Scores float32 [C] of the candidate keys idx [C] (plain jnp)."""
    _check(q_rot, codes, weight, centres, idx)
    n_subspaces = weight.shape[1]
    v = dequantize_reference(codes[idx], centres)                         # [C, Dp]
    per_subspace = (v * q_rot.astype(jnp.float32)).reshape(idx.shape[0], n_subspaces, q_rot.shape[0] // n_subspaces).sum(-1)
    return q_norm * jnp.sum(weight[idx].astype(jnp.float32) * per_subspace, axis=-1)


def _dequantize(nibble, centres_ref):
    magnitude = centres_ref[nibble & 0x7]
    return jnp.where((nibble >> 3) == 1, -magnitude, magnitude)


def _rerank_kernel(q_norm_ref, q_even_ref, q_odd_ref, centres_ref, idx_ref, codes_ref, weight_ref,
                   scores_ref, *, bytes_per_subspace: int):
    rows = idx_ref[...]                                          # [block]
    packed = codes_ref[rows, :].astype(jnp.int32)                # [block, Dp/2] gathered rows
    even = _dequantize(packed & 0xF, centres_ref)
    odd = _dequantize(packed >> 4, centres_ref)
    per_byte = even * q_even_ref[...][None, :] + odd * q_odd_ref[...][None, :]
    # Each byte's subspace weight, gathered from the flat [N·B] weights.
    n_subspaces = weight_ref.shape[0] // codes_ref.shape[0]
    subspace = jnp.arange(packed.shape[1], dtype=jnp.int32) // bytes_per_subspace
    w = weight_ref[rows[:, None] * n_subspaces + subspace[None, :]]
    scores_ref[...] = q_norm_ref[0] * jnp.sum(w * per_byte, axis=1)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def rsq_rerank(q_rot, q_norm, codes, weight, centres, idx, *, block: int = 128,
               interpret: bool = False):
    """Pallas kernel for :func:`rsq_rerank_reference`: scores float32 [C]."""
    _check(q_rot, codes, weight, centres, idx)
    n, half = codes.shape
    n_subspaces = weight.shape[1]
    if half & (half - 1):
        raise ValueError(f"codes: the kernel needs Dp/2 a power of two, found {half}")
    c = idx.shape[0]
    if c == 0:
        return jnp.zeros((0,), jnp.float32)
    c_pad = _common.round_up(c, block)
    # Padding slots read row 0; their scores are sliced off.
    idx_p = _common.pad_axis(jnp.clip(idx.astype(jnp.int32), 0, n - 1), c_pad)
    q = q_rot.astype(jnp.float32)
    kernel = functools.partial(_rerank_kernel, bytes_per_subspace=half // n_subspaces)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    scores = _common.pallas_call(
        kernel,
        grid=(c_pad // block,),
        in_specs=[whole((1,)), whole((half,)), whole((half,)), whole((N_LEVELS,)),
                  pl.BlockSpec((block,), lambda i: (i,)), whole((n, half)), whole((n * n_subspaces,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((c_pad,), jnp.float32),
        interpret=interpret,
        name="rsq_rerank",
    )(jnp.asarray(q_norm, jnp.float32).reshape(1), q[0::2], q[1::2], centres.astype(jnp.float32),
      idx_p, codes, weight.astype(jnp.float32).reshape(-1))
    return scores[:c]
