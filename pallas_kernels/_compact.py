"""Stream compaction in key order: write the ids of selected keys to a static-capacity list.

Both MagicPIG's collide (keys with ≥ min_hits table matches) and ParisKV's vote
(the C highest vote totals) end the same way: given an int32 value per key and
a threshold t, select every key with value > t plus the first ``n_ties`` keys
(in key order) whose value equals t, and list them in ascending key id. Each
program compacts one block of keys; where a block writes is the exclusive
prefix sum of the blocks before it, computed here in XLA over [n_blocks].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _compact_kernel(scalars_ref, out_start_ref, tie_start_ref, values_ref, idx_ref, val_ref,
                    *, block: int, capacity: int):
    i = pl.program_id(0)
    threshold, n_ties = scalars_ref[0], scalars_ref[1]
    v = values_ref[...]
    tie = v == threshold
    tie_rank = tie_start_ref[i] + jnp.cumsum(tie.astype(jnp.int32)) - 1
    selected = (v > threshold) | (tie & (tie_rank < n_ties))
    pos = out_start_ref[i] + jnp.cumsum(selected.astype(jnp.int32)) - 1
    # Keys not written go to the spare slot at index `capacity` (sliced off
    # afterwards): the same code then runs on GPU and in interpret mode.
    pos = jnp.where(selected & (pos < capacity), pos, capacity)
    idx_ref[pos] = i * block + jnp.arange(block, dtype=jnp.int32)
    val_ref[pos] = v


def compact(values: jax.Array, threshold: jax.Array, n_ties: jax.Array, *, capacity: int,
            block: int, interpret: bool):
    """Ids (ascending) and values of the selected keys, at most ``capacity`` of them.

    values: int32 [N], N a multiple of ``block``. Returns (idx [capacity],
    values [capacity], mask [capacity], n_selected) where slots past the mask are
    0 and n_selected counts every selected key, including those that did not fit.
    """
    n = values.shape[0]
    n_blocks = n // block
    blocks = values.reshape(n_blocks, block)
    greater = jnp.sum(blocks > threshold, axis=1, dtype=jnp.int32)
    ties = jnp.sum(blocks == threshold, axis=1, dtype=jnp.int32)
    tie_start = _exclusive_cumsum(ties)
    ties_taken = jnp.clip(n_ties - tie_start, 0, ties)
    out_start = _exclusive_cumsum(greater + ties_taken)
    n_selected = jnp.sum(greater + ties_taken)
    scalars = jnp.stack([threshold, n_ties]).astype(jnp.int32)

    out_len = capacity + 1
    kernel = lambda *refs: _compact_kernel(*refs, block=block, capacity=capacity)
    idx, val = _common.pallas_call(
        kernel,
        grid=(n_blocks,),
        in_specs=[
            pl.BlockSpec((2,), lambda i: (0,)),
            pl.BlockSpec((n_blocks,), lambda i: (0,)),
            pl.BlockSpec((n_blocks,), lambda i: (0,)),
            pl.BlockSpec((block,), lambda i: (i,)),
        ],
        out_specs=[pl.BlockSpec((out_len,), lambda i: (0,)), pl.BlockSpec((out_len,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((out_len,), jnp.int32)] * 2,
        interpret=interpret,
        name="compact",
    )(scalars, out_start, tie_start, values)
    mask = jnp.arange(capacity) < jnp.minimum(n_selected, capacity)
    return jnp.where(mask, idx[:capacity], 0), jnp.where(mask, val[:capacity], 0), mask, n_selected
