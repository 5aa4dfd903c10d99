"""SimHash codes: project rows onto a Gaussian matrix, take signs, pack K bits per table.

Layout (MagicPIG): projection ``R`` float32 [d, K·L]; the code of row x in table
l packs the K sign bits of ``x · R[:, l·K:(l+1)·K]`` into a uint16 with bit j
set iff ``x · R[:, l·K + j] > 0``. Codes are uint16 [N, L] (K ≤ 16).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common

# Each table's K columns are padded to 16 so that a block of tables is a
# power-of-two tile; a zero column projects to 0, which is not > 0: bit unset.
_BITS_PER_TABLE = 16


def _check(x, proj, n_bits):
    _common.check_shape("x", x, (None, None))
    _common.check_shape("proj", proj, (x.shape[1], None))
    if not 1 <= n_bits <= 16:
        raise ValueError(f"n_bits: expected 1..16 bits per uint16 code, found {n_bits}")
    if proj.shape[1] % n_bits:
        raise ValueError(f"proj: {proj.shape[1]} columns is not a multiple of n_bits={n_bits}")


@functools.partial(jax.jit, static_argnames=("n_bits",))
def simhash_reference(x: jax.Array, proj: jax.Array, *, n_bits: int) -> jax.Array:
    """Codes uint16 [N, L] of rows x[N, d] under projection proj[d, n_bits·L]."""
    _check(x, proj, n_bits)
    n_tables = proj.shape[1] // n_bits
    p = jnp.dot(x.astype(jnp.float32), proj.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    bits = (p > 0).reshape(x.shape[0], n_tables, n_bits).astype(jnp.uint32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(n_bits, dtype=jnp.uint32))
    return jnp.sum(bits * weights, axis=-1).astype(jnp.uint16)


def _simhash_kernel(x_ref, proj_ref, pack_ref, codes_ref, *, precision):
    p = plgpu.dot(x_ref[...].astype(jnp.float32), proj_ref[...], precision=precision)
    bits = (p > 0).astype(jnp.bfloat16)
    # bits · pack sums 2^j over set bits: exact with bfloat16 inputs (0, 1 and
    # powers of two) and float32 accumulation (integers < 2^16), on tensor cores.
    codes = plgpu.dot(bits, pack_ref[...])
    codes_ref[...] = codes.astype(jnp.int32)


def _projection_precision(interpret: bool):
    """Three TF32 passes on a GPU: float32 accuracy (at most ≈ 6 eps per product,
    within the rounding bound the tests allow) on tensor cores. On an H200 at 64k keys × 150
    tables, 8.0 ms against 62 ms for IEEE float32 (HIGHEST). The CPU's dot, which
    interpret mode runs, has no TF32: there it is plain float32."""
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _pack_matrix(tables_per_block: int) -> np.ndarray:
    """[tables·16, tables] with 2^j at (l·16 + j, l): turns a block of sign bits into codes."""
    pack = np.zeros((tables_per_block * _BITS_PER_TABLE, tables_per_block), jnp.bfloat16)
    for l in range(tables_per_block):
        pack[l * _BITS_PER_TABLE:(l + 1) * _BITS_PER_TABLE, l] = 2.0 ** np.arange(_BITS_PER_TABLE)
    return pack


@functools.partial(jax.jit, static_argnames=("n_bits", "block_rows", "tables_per_block", "interpret"))
def simhash(x: jax.Array, proj: jax.Array, *, n_bits: int, block_rows: int = 128,
            tables_per_block: int = 8, interpret: bool = False) -> jax.Array:
    """Pallas kernel for :func:`simhash_reference`: codes uint16 [N, L].

    Blocks of 128 rows × 8 tables: on an H200 at 64k keys, 8.0 ms, against
    8.7 ms for 64 × 8 and 61 ms for 32 × 8; 16 tables overflow shared memory."""
    _check(x, proj, n_bits)
    n, d = x.shape
    n_tables = proj.shape[1] // n_bits
    d_pad = max(16, _common.next_pow2(d))
    n_pad = _common.round_up(max(n, 1), block_rows)
    l_pad = _common.round_up(n_tables, tables_per_block)

    xp = _common.pad_axis(_common.pad_axis(x, n_pad, 0), d_pad, 1)
    r = proj.astype(jnp.float32).reshape(d, n_tables, n_bits)
    r = _common.pad_axis(_common.pad_axis(r, _BITS_PER_TABLE, 2), l_pad, 1)
    r = _common.pad_axis(r.reshape(d, l_pad * _BITS_PER_TABLE), d_pad, 0)
    block_cols = tables_per_block * _BITS_PER_TABLE

    codes = _common.pallas_call(
        functools.partial(_simhash_kernel, precision=_projection_precision(interpret)),
        grid=(n_pad // block_rows, l_pad // tables_per_block),
        in_specs=[
            pl.BlockSpec((block_rows, d_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((d_pad, block_cols), lambda i, j: (0, j)),
            pl.BlockSpec((block_cols, tables_per_block), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((block_rows, tables_per_block), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_pad, l_pad), jnp.int32),
        interpret=interpret,
        name="simhash",
    )(xp, r, jnp.asarray(_pack_matrix(tables_per_block)))
    return codes[:n, :n_tables].astype(jnp.uint16)
