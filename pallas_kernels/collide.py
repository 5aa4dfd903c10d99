"""MagicPIG candidate selection: keys whose code matches the query's in ≥ min_hits tables.

Index layout per KV head: ``sorted_ids`` int32 [L, N] (key ids sorted stably by
that table's code) and ``bucket_start`` int32 [L, 2^K + 1] (CSR offsets: the keys
of bucket c in table l are ``sorted_ids[l, bucket_start[l, c]:bucket_start[l, c+1]]``).

Per table the query bucket's range is read, truncated to its first
``bucket_capacity`` entries (a static bound on the work; the number of entries
dropped is reported as ``truncated``). Hits are counted per key and the keys with
at least ``min_hits`` hits are listed in ascending key id, up to ``capacity``;
``overflow`` counts the selected keys that did not fit.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common
from pallas_kernels._compact import compact


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Collisions:
    idx: jax.Array        # [C] int32 key ids, ascending; 0 past the mask
    mask: jax.Array       # [C] bool
    n_hits: jax.Array     # [C] int32 tables in which the key collided; 0 past the mask
    overflow: jax.Array   # [] int32 selected keys beyond the capacity
    truncated: jax.Array  # [] int32 bucket entries dropped by bucket_capacity


def _check(query_codes, sorted_ids, bucket_start, capacity, bucket_capacity, min_hits):
    _common.check_shape("sorted_ids", sorted_ids, (None, None))
    n_tables = sorted_ids.shape[0]
    _common.check_shape("query_codes", query_codes, (n_tables,))
    _common.check_shape("bucket_start", bucket_start, (n_tables, None))
    if n_tables * sorted_ids.shape[1] >= 2**31:
        raise ValueError(f"sorted_ids: {sorted_ids.shape} has too many entries for int32 offsets")
    n_buckets = bucket_start.shape[1] - 1
    if n_buckets < 1 or n_buckets & (n_buckets - 1) or n_buckets > 2**16:
        raise ValueError(f"bucket_start: expected [L, 2^K + 1] with K <= 16, found {bucket_start.shape}")
    for name, value in (("capacity", capacity), ("bucket_capacity", bucket_capacity), ("min_hits", min_hits)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, found {value}")


def bucket_ranges(query_codes, bucket_start, bucket_capacity: int):
    """Per table: (start, entries read ≤ bucket_capacity, entries dropped), int32 [L] each."""
    code = query_codes.astype(jnp.int32)[:, None]
    start = jnp.take_along_axis(bucket_start, code, axis=1)[:, 0]
    end = jnp.take_along_axis(bucket_start, code + 1, axis=1)[:, 0]
    length = end - start
    read = jnp.minimum(length, bucket_capacity)
    return start, read, length - read


def _counts_reference(sorted_ids, start, read, bucket_capacity):
    n_tables, n = sorted_ids.shape
    offset = jnp.arange(bucket_capacity)
    valid = offset[None, :] < read[:, None]
    pos = jnp.clip(start[:, None] + offset[None, :], 0, n - 1)
    ids = jnp.take_along_axis(sorted_ids, pos, axis=1)
    return jnp.zeros((n,), jnp.int32).at[ids].add(valid.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("capacity", "bucket_capacity", "min_hits"))
def collide_reference(query_codes, sorted_ids, bucket_start, *, capacity: int,
                      bucket_capacity: int, min_hits: int = 2) -> Collisions:
    """Keys colliding with the query in ≥ min_hits tables (plain jnp)."""
    _check(query_codes, sorted_ids, bucket_start, capacity, bucket_capacity, min_hits)
    start, read, dropped = bucket_ranges(query_codes, bucket_start, bucket_capacity)
    counts = _counts_reference(sorted_ids, start, read, bucket_capacity)
    selected = counts >= min_hits
    n_selected = jnp.sum(selected, dtype=jnp.int32)
    idx = jnp.nonzero(selected, size=capacity, fill_value=0)[0].astype(jnp.int32)
    mask = jnp.arange(capacity) < n_selected
    return Collisions(
        idx=jnp.where(mask, idx, 0), mask=mask, n_hits=jnp.where(mask, counts[idx], 0),
        overflow=jnp.maximum(n_selected - capacity, 0), truncated=jnp.sum(dropped))


def _count_kernel(start_ref, read_ref, ids_ref, counts_in_ref, counts_ref, *, n_keys: int, block: int):
    del counts_in_ref  # aliased to counts_ref: the zeros the counts start from
    table = pl.program_id(0)
    start, read = start_ref[table], read_ref[table]
    base = table * n_keys + start
    spare = counts_ref.shape[0] - 1  # where entries past `read` add their 0

    def count_block(j, carry):
        offset = j * block + jnp.arange(block, dtype=jnp.int32)
        valid = offset < read
        ids = ids_ref[base + jnp.where(valid, offset, 0)]
        # Ids within one table are distinct, so one vector add has no duplicates
        # (interpret mode supports no atomic mask; invalid lanes add 0 to the spare slot).
        plgpu.atomic_add(counts_ref, jnp.where(valid, ids, spare), valid.astype(jnp.int32))
        return carry

    lax.fori_loop(0, pl.cdiv(read, block), count_block, 0)


def _counts(sorted_ids, start, read, *, block, interpret):
    n_tables, n = sorted_ids.shape
    kernel = functools.partial(_count_kernel, n_keys=n, block=block)
    counts = _common.pallas_call(
        kernel,
        grid=(n_tables,),
        in_specs=[
            pl.BlockSpec((n_tables,), lambda l: (0,)),
            pl.BlockSpec((n_tables,), lambda l: (0,)),
            pl.BlockSpec((n_tables * n,), lambda l: (0,)),
            pl.BlockSpec((n + 1,), lambda l: (0,)),
        ],
        out_specs=pl.BlockSpec((n + 1,), lambda l: (0,)),
        out_shape=jax.ShapeDtypeStruct((n + 1,), jnp.int32),
        input_output_aliases={3: 0},
        interpret=interpret,
        name="collide_count",
    )(start, read, sorted_ids.reshape(-1), jnp.zeros((n + 1,), jnp.int32))
    return counts[:n]


@functools.partial(jax.jit, static_argnames=(
    "capacity", "bucket_capacity", "min_hits", "block", "interpret"))
def collide(query_codes, sorted_ids, bucket_start, *, capacity: int, bucket_capacity: int,
            min_hits: int = 2, block: int = 128, interpret: bool = False) -> Collisions:
    """Pallas kernels for :func:`collide_reference` (hit counting, then compaction)."""
    _check(query_codes, sorted_ids, bucket_start, capacity, bucket_capacity, min_hits)
    start, read, dropped = bucket_ranges(query_codes, bucket_start, bucket_capacity)
    counts = _counts(sorted_ids.astype(jnp.int32), start, read, block=block, interpret=interpret)
    n = counts.shape[0]
    compact_block = min(1024, _common.next_pow2(n))
    # Padding keys have 0 hits: never selected since min_hits >= 1.
    counts = _common.pad_axis(counts, _common.round_up(n, compact_block))
    idx, n_hits, mask, n_selected = compact(
        counts, jnp.int32(min_hits - 1), jnp.int32(0),
        capacity=capacity, block=compact_block, interpret=interpret)
    return Collisions(idx=idx, mask=mask, n_hits=n_hits,
                      overflow=jnp.maximum(n_selected - capacity, 0), truncated=jnp.sum(dropped))
