"""The four-region KV cache of a sparse layer, and what generate() plugs in per layer.

Per layer and sequence: the sink (first S tokens, exact), the retrieval region
(host memory, reached through the method's index) and the window (the local W
tokens plus the update buffer of U, exact). A full window moves its oldest U
tokens into retrieval and the index (the flush). Shapes are static, lengths are
data; a sparse method plugs in through the hooks of ``jaxkv.attention.method``.
docs/architecture.md draws the regions and the data path of a step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import models
from jaxkv import native, offload
from models import fields, row_values, rows_to_store, stored_rows
from jaxkv.attention import common, dense, registry
from jaxkv.attention.method import SparseMethod
from jaxkv.attention.shards import ContextShards, merge_partials
from pallas_kernels import dispatch

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


# ----------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Region sizes and placement. None takes the method's own default.

    dense_threshold: contexts shorter than this are attended exactly (every
    retrieval row read). None = ParisKV's rule max(2000, S + W + 2·top_k);
    0 disables the fallback.
    offload: keep retrieval K/V in pinned host memory (False: on the device).
    host_index: with offload, keep the index of a method that works in host memory
    (its ``host_config`` hook: MagicPIG) there, beside the rows, and select and
    attend there (see :func:`host_config`). Off by default: XLA's GPU compiler
    (jaxlib 0.10.2) rejects those host computations (docs/results/gpu.md); every
    index then stays on the device, selecting there and fetching the selected rows.
    slot_block: slots of a selection gathered and attended at a time on the
    XLA path, for a method whose correction is slot-wise (MagicPIG): blocks
    past the last slot in use are not read.
    """

    sink: int | None = None
    local: int | None = None
    buffer: int | None = None
    dense_threshold: int | None = None
    offload: bool = True
    host_index: bool = False
    slot_block: int = 2048

    def __post_init__(self):
        # buffer >= 1: the update buffer is how keys reach the index.
        fields.check(self, sink=fields.NON_NEGATIVE, local=fields.NON_NEGATIVE, buffer=fields.at_least(1),
                     dense_threshold=fields.NON_NEGATIVE, slot_block=fields.at_least(1))

    def resolve(self, method_cfg) -> "CacheConfig":
        """Concrete sizes: this config's values, else the defaults of the method of
        ``method_cfg`` (its ``regions`` and ``top_k`` hooks)."""
        method = registry.for_config(method_cfg)
        defaults = method.regions(method_cfg)
        sink = self.sink if self.sink is not None else defaults.sink
        local = self.local if self.local is not None else defaults.local
        default_buffer = local if defaults.buffer is None else defaults.buffer
        buffer = self.buffer if self.buffer is not None else default_buffer or 64
        threshold = (self.dense_threshold if self.dense_threshold is not None
                     else max(2000, sink + local + 2 * method.top_k(method_cfg)))
        return dataclasses.replace(self, sink=sink, local=local, buffer=buffer, dense_threshold=threshold)


# ----------------------------------------------------------------------------
# The four-region cache of one layer.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RegionKV:
    # K and V rows of every region: bfloat16 ones as their bits (models.stored_rows)
    sink_k: jax.Array  # [B, Hkv, S, hd] device
    sink_v: jax.Array
    win_k: jax.Array  # [B, Hkv, W + U, hd] device, a ring: position order from slot win_start
    win_v: jax.Array
    retr_k: jax.Array  # [B, Hkv, cap, hd] host (or device without offload)
    retr_v: jax.Array
    index: Any  # the method's index, leaves with leading [B, Hkv]
    sink_len: jax.Array  # [B] int32
    win_start: jax.Array  # [B] int32, the window slot of its oldest token
    win_len: jax.Array  # [B] int32
    retr_len: jax.Array  # [B] int32
    keys_read: jax.Array  # [B] float32, distinct keys read per KV head, summed over steps
    keys_seen: jax.Array  # [B] float32, context length summed over steps


# With the retrieval region split over a context axis (ContextShards), these fields hold a
# shard's own rows, index and count; the others are the same on every shard.
RETRIEVAL_FIELDS = ("retr_k", "retr_v", "index", "retr_len")


def _host(x, ccfg):
    return jax.device_put(x, HOST) if ccfg.offload else x


# Every region of a bfloat16 cache holds its rows' bits, as models.KVCache does (see
# models.stored_rows: XLA CPU widens and copies a whole bfloat16 buffer for any write into
# it); readers take the rows back as bfloat16 (row_values), the CPU kernels read the bits in
# place (jaxkv.native.ROW_DTYPES).


def _flat_rows(b: int, h: int, cap: int, idx):
    """Flat row numbers into a [B, H, cap, hd] array for per-(b, h) row indices [B, H, ...]."""
    base = (jnp.arange(b)[:, None] * h + jnp.arange(h)[None, :]) * cap
    return (base.reshape(b, h, *([1] * (idx.ndim - 2))) + idx).reshape(-1)


def _take_rows(store, flat_idx, shape):
    """store [B, H, cap, hd]'s rows at flat row numbers flat_idx (:func:`_flat_rows`), as ``shape``."""
    b, h, cap, hd = store.shape
    return store.reshape(b * h * cap, hd).at[flat_idx].get(mode="promise_in_bounds").reshape(shape)


def host_take(store, flat_idx, shape):
    """:func:`_take_rows` of a store in host memory, on the device.

    Host memory cannot be read by device kernels in JAX: the gather is an explicit
    host computation (:func:`jaxkv.offload.on_host`); only the indices move in and the
    taken rows out, already in their final shape: on a GPU (jax 0.11.2), a reshape of
    moved rows failed to compile ("Bitcast cannot have different memory spaces").
    """
    take = functools.partial(_take_rows, shape=shape)
    return offload.to_device(offload.on_host(take)(store, offload.to_host(flat_idx)))


def gather_rows(store, idx, ccfg):
    """store [B, H, cap, hd] (host or device), idx [B, H, C] → rows [B, H, C, hd] on the device
    (as :func:`row_values`)."""
    b, h, cap, hd = store.shape
    flat_idx, shape = _flat_rows(b, h, cap, idx), (*idx.shape, hd)
    return row_values(host_take(store, flat_idx, shape) if ccfg.offload else _take_rows(store, flat_idx, shape))


def host_config(method, mcfg, ccfg):
    """The method config whose index lives in host memory, where its insertion, selection and
    attention over the selected rows run as host computations: the method's
    ``host_config(mcfg)`` when the cache offloads (MagicPIG's placement in its paper: only
    the query goes to the host and the partial comes back). None: the index lives on the
    device (also when ``ccfg.host_index`` is False), selects there, and only the selected
    rows come from host memory."""
    if not (ccfg.offload and ccfg.host_index):
        return None
    return method.host_config(mcfg)


def place_index(index, method, mcfg, ccfg):
    """The index where the cache keeps it: in host memory when :func:`host_config` says so."""
    return offload.to_host(index) if host_config(method, mcfg, ccfg) is not None else index


def _write_rows_here(store, start, rows, live):
    """store [B, H, cap, hd] with rows [B, H, U, hd] (as it holds them) at rows start[b]..start[b] + U − 1
    of every head of batch row b where live[b]; the other batch rows keep what they hold.

    One contiguous dynamic-update-slice per batch row: U·H rows read (what a row that is
    not live writes back) and written, nothing else. A start past cap − U is clamped
    (writing back what is there); generate() sizes cap so a live row's never is.
    """
    if rows.dtype != store.dtype:
        raise ValueError(f"rows of dtype {rows.dtype} cannot be written into a store of {store.dtype}")
    for b in range(store.shape[0]):
        at = (b, 0, start[b], 0)
        kept = jax.lax.dynamic_slice(store, at, (1, *rows.shape[1:]))
        store = jax.lax.dynamic_update_slice(store, jnp.where(live[b], rows[b:b + 1], kept), at)
    return store


def write_rows(store, start, rows, live, ccfg):
    """:func:`_write_rows_here` for a store on the device, or in host memory with offload: then an
    explicit host computation writes the rows, moved in first (O(U·d) bytes; no round trip
    of the store, and no scatter into host memory, the pattern of openxla/xla#34565)."""
    if not ccfg.offload:
        return _write_rows_here(store, start, rows, live)
    return offload.on_host(_write_rows_here)(store, *offload.to_host((start, rows, live)))


def over_batch_heads(f):
    """vmap over batch and KV heads, as one vmap over their B·H pairs.

    Every argument leads with [B, H]. One batch dimension instead of two: XLA CPU's
    gathers with two are slower (docs/results/implementation_notes.md, "The cache").
    """
    def over_pairs(*args):
        b, h = jax.tree.leaves(args)[0].shape[:2]
        out = jax.vmap(f)(*jax.tree.map(lambda x: x.reshape(b * h, *x.shape[2:]), args))
        return jax.tree.map(lambda x: x.reshape(b, h, *x.shape[1:]), out)
    return over_pairs


def _over_batch_heads_for_insert(method, mcfg):
    """over_batch_heads, or two nested vmaps for a method whose insert rewrites its index in
    place (``method.inserts_in_place(mcfg)``: MagicPIG's CPU merge). The nested vmaps hand
    the in-place call the [B, H, ...] buffers themselves; a reshape to B·H pairs makes XLA
    copy them (docs/results/implementation_notes.md, "The cache")."""
    return (lambda f: jax.vmap(jax.vmap(f))) if method.inserts_in_place(mcfg) else over_batch_heads


def regions_from_prefill(staging_k, staging_v, lengths, *, method, mcfg, ccfg: CacheConfig,
                         capacity: int, key=None, context: ContextShards | None = None) -> RegionKV:
    """Split one layer's prefilled K and V (both head-major [B, Hkv, T, hd], rows or a cache's
    bits) into the four regions, each holding bfloat16 rows as bits (``models.stored_rows``).

    ``key`` is handed to the method's ``build``. generate() passes None: MagicPIG then
    hashes every layer and head with its one seeded projection, as the official code does.
    With ``context`` (inside shard_map over its axis) the retrieval region and its index are
    this shard's part: rows ``rows_per_shard`` times its place onwards, in a store of
    ``context.local_capacity`` rows.
    """
    s, w, u = ccfg.sink, ccfg.local, ccfg.buffer
    b, h, t, hd = staging_k.shape
    extent = capacity if context is None else max(capacity, context.count * context.rows_per_shard + u)
    pad = max(0, s + extent + w + u - t)
    k = jnp.pad(stored_rows(staging_k), ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(stored_rows(staging_v), ((0, 0), (0, 0), (0, pad), (0, 0)))
    sink_len = jnp.minimum(lengths, s)
    win_len = jnp.minimum(w, jnp.maximum(lengths - s, 0))
    retr_len = lengths - sink_len - win_len

    def window(x, start):
        return jax.lax.dynamic_slice_in_dim(x, start, w + u, axis=1)

    win_start = lengths - win_len
    win_k = jax.vmap(window)(k, win_start)
    win_v = jax.vmap(window)(v, win_start)
    if context is None:
        retr_k, retr_v = k[:, :, s:s + capacity], v[:, :, s:s + capacity]
    else:
        first = context.index() * context.rows_per_shard
        retr_k, retr_v = (jax.lax.dynamic_slice_in_dim(x, s + first, context.local_capacity, axis=2) for x in (k, v))
        retr_len = jnp.clip(retr_len - first, 0, context.rows_per_shard)
    n = jnp.broadcast_to(retr_len[:, None], (b, h))
    if context is None:
        build = lambda kk, vv, nn: method.build(mcfg, kk, vv, nn, key)  # noqa: E731
    else:
        build = lambda kk, vv, nn: method.build_sharded(mcfg, kk, vv, nn, key, context)  # noqa: E731
    index = over_batch_heads(build)(row_values(retr_k), row_values(retr_v), n)
    index = place_index(index, method, mcfg, ccfg)
    return RegionKV(
        sink_k=k[:, :, :s], sink_v=v[:, :, :s], win_k=win_k, win_v=win_v,
        retr_k=_host(retr_k, ccfg), retr_v=_host(retr_v, ccfg), index=index,
        sink_len=sink_len, win_start=jnp.zeros_like(win_len), win_len=win_len, retr_len=retr_len,
        keys_read=jnp.zeros((b,), jnp.float32), keys_seen=jnp.zeros((b,), jnp.float32))


def _window_slots(state: RegionKV, first, count: int):
    """[B, count] window slots of the tokens first[B], first + 1, ... counted from each row's oldest."""
    return (state.win_start[:, None] + first[:, None] + jnp.arange(count)[None, :]) % state.win_k.shape[2]


def _window_rows(x, slots):
    """x [B, H, W + U, hd] at slots [B, n]: [B, H, n, hd]."""
    return jax.vmap(lambda xb, sb: xb[:, sb])(x, slots)


def _insert(index, keys, values, count, *, method, mcfg, context=None):
    """The index with each (batch row, head)'s first count[b, h] of keys, values [B, H, U, hd] inserted."""
    if context is None:
        insert = lambda ix, kk, vv, c: method.insert(mcfg, ix, kk, vv, c)  # noqa: E731
    else:
        insert = lambda ix, kk, vv, c: method.insert_sharded(mcfg, ix, kk, vv, c, context)  # noqa: E731
    return _over_batch_heads_for_insert(method, mcfg)(insert)(index, keys, values, count)


def _write_and_insert(retr_k, retr_v, index, new_k, new_v, start, count, *, method, mcfg):
    """Retrieval K and V with new_k, new_v [B, H, U, hd] (as they hold them) at rows start[b]..,
    and the index with them inserted, for the batch rows with count[b, :] > 0: a flush's work
    where the region and the index are (the device, or one host computation)."""
    live = count[:, 0] > 0
    index = _insert(index, row_values(new_k), row_values(new_v), count, method=method, mcfg=mcfg)
    return _write_rows_here(retr_k, start, new_k, live), _write_rows_here(retr_v, start, new_v, live), index


def flush(state: RegionKV, *, method, mcfg, ccfg: CacheConfig, context: ContextShards | None = None) -> RegionKV:
    """Move the oldest U window tokens of every full row into retrieval and its index.

    The window is a ring: the moved tokens' slots are freed by advancing
    win_start, and the window arrays are not written. Shifting them instead
    made XLA copy both whole windows every step, flush or not (the cond's
    untaken branch must hand back the buffer the taken one writes).

    With offload, the U·H rows of K and V of each batch row are what crosses to the
    host: they are written there contiguously at the row's retrieval length, and a
    host-resident index (:func:`host_config`) inserts them in the same host
    computation. A device-resident index inserts them on the device.

    With ``context``, every shard frees the window alike and the shard that holds the next
    positions (``context.first_open``) takes the rows: nothing crosses shards but that choice.
    """
    w, u = ccfg.local, ccfg.buffer
    full = state.win_len == w + u
    taken = full if context is None else full & (context.first_open(state.retr_len) == context.index())
    b, h = state.win_k.shape[:2]
    oldest = _window_slots(state, jnp.zeros_like(state.win_start), u)
    new_k, new_v = _window_rows(state.win_k, oldest), _window_rows(state.win_v, oldest)
    count = jnp.broadcast_to(jnp.where(taken, u, 0)[:, None], (b, h)).astype(jnp.int32)
    hcfg = host_config(method, mcfg, ccfg)
    if hcfg is not None:
        write_and_insert = functools.partial(_write_and_insert, method=method, mcfg=hcfg)
        retr_k, retr_v, index = offload.on_host(write_and_insert)(
            state.retr_k, state.retr_v, state.index, *offload.to_host((new_k, new_v, state.retr_len, count)))
    else:
        index = _insert(state.index, row_values(new_k), row_values(new_v), count, method=method, mcfg=mcfg,
                        context=context)
        retr_k = write_rows(state.retr_k, state.retr_len, new_k, taken, ccfg)
        retr_v = write_rows(state.retr_v, state.retr_len, new_v, taken, ccfg)
    moved = jnp.where(full, u, 0)
    return dataclasses.replace(
        state, retr_k=retr_k, retr_v=retr_v, index=index,
        win_start=(state.win_start + moved) % state.win_k.shape[2],
        win_len=state.win_len - moved, retr_len=state.retr_len + jnp.where(taken, u, 0))


def _flush_if_full(state: RegionKV, *, method, mcfg, ccfg: CacheConfig, context=None) -> RegionKV:
    """The state with every full window row flushed (no row is full after it)."""
    return jax.lax.cond(
        jnp.any(state.win_len == ccfg.local + ccfg.buffer),
        functools.partial(flush, method=method, mcfg=mcfg, ccfg=ccfg, context=context), lambda st: st, state)


def _put_rows(buf, x, where, keep):
    """buf [B, H, S, hd] with x [B, H, hd] at row where[B], or the row already there where keep[B].

    One row per batch row, updated in place: a select over the whole buffer
    would copy it every step.
    """
    rows = jnp.arange(buf.shape[0])
    return buf.at[rows, :, where].set(jnp.where(keep[:, None, None], buf[rows, :, where], rows_to_store(x, buf)))


def _write_sink(state: RegionKV, k, v, in_sink, positions, ccfg: CacheConfig) -> RegionKV:
    """The token of each row whose position is below the sink size, written to the sink."""
    if not ccfg.sink:
        return state
    at = jnp.minimum(positions, ccfg.sink - 1)
    sink_k, sink_v = models.write_if(
        jnp.any(in_sink), lambda sk, sv: (_put_rows(sk, k, at, ~in_sink), _put_rows(sv, v, at, ~in_sink)),
        state.sink_k, state.sink_v)
    return dataclasses.replace(state, sink_k=sink_k, sink_v=sink_v, sink_len=state.sink_len + in_sink)


def _write_window(state: RegionKV, k, v, in_sink) -> RegionKV:
    """The token of each row not in the sink, written after its window's newest (never full after a flush).

    A row whose token went to the sink writes it past its window all the same,
    where nothing is read: no row is read back and no select spans the window.
    """
    rows = jnp.arange(state.win_k.shape[0])
    slot = _window_slots(state, state.win_len, 1)[:, 0]
    win_k, win_v = models.write_if(
        jnp.any(~in_sink),
        lambda wk, wv: (wk.at[rows, :, slot].set(rows_to_store(k, wk)), wv.at[rows, :, slot].set(rows_to_store(v, wv))),
        state.win_k, state.win_v)
    return dataclasses.replace(state, win_k=win_k, win_v=win_v, win_len=state.win_len + ~in_sink)


def _write_token(state: RegionKV, k, v, positions, ccfg: CacheConfig) -> RegionKV:
    """One token per row (k, v [B, Hkv, hd] at positions [B]) written to the sink or the window."""
    in_sink = positions < ccfg.sink
    return _write_window(_write_sink(state, k, v, in_sink, positions, ccfg), k, v, in_sink)


def append(state: RegionKV, k, v, positions, *, method, mcfg, ccfg: CacheConfig) -> RegionKV:
    """Add one token per row (k, v [B, Hkv, hd] at positions [B]), flushing first if needed."""
    return _write_token(_flush_if_full(state, method=method, mcfg=mcfg, ccfg=ccfg), k, v, positions, ccfg)


def _region_partial(q, keys, values, length, start=None):
    """Partial of q [B, Hkv, G, hd] over length[B] rows of keys, values [B, Hkv, S, hd] (rows
    or their stores).

    The rows are the first ones, or with start[B] those of a ring from slot start.
    """
    slots = jnp.arange(keys.shape[2])[None, :]
    if start is not None:
        slots = (slots - start[:, None]) % keys.shape[2]
    mask = jnp.broadcast_to((slots < length[:, None])[:, None], keys.shape[:3])
    return over_batch_heads(common.partial_attention)(q, row_values(keys), row_values(values), mask)


def _partial_in_place(q, keys, values, slots, live) -> common.Partial:
    """Partial of q [B, Hkv, G, hd] over keys, values [B, Hkv, S, hd] at slots [B, n] where
    live [B, n], by ``jaxkv.native.attend_rows``: the rows read where they lie."""
    b, h, g = q.shape[:3]
    n = slots.shape[1]
    o, l, m = native.attend_rows(q, keys, values, jnp.broadcast_to(slots[:, None], (b, h, n)),
                                 jnp.broadcast_to(live[:, None, None], (b, h, g, n)),
                                 masked_score=common.MASKED_SCORE)
    return common.Partial(o=o, l=l, m=m)


def _window_partial_in_place(q, state: RegionKV) -> common.Partial:
    """The window's partial by ``jaxkv.native.attend_rows``: its rows in position order,
    up to the last one in use.

    XLA's product of q with the [W + U, hd] rows repacked (transposed) every row
    of every window on every step, in use or not.
    """
    w = state.win_k.shape[2]
    slots = _window_slots(state, jnp.zeros_like(state.win_start), w)
    return _partial_in_place(q, state.win_k, state.win_v, slots, jnp.arange(w)[None, :] < state.win_len[:, None])


def _sink_partial_in_place(q, state: RegionKV) -> common.Partial:
    """The sink's partial by ``jaxkv.native.attend_rows``, as the window's (never slower than
    XLA's two small dot fusions)."""
    b, s = state.sink_k.shape[0], state.sink_k.shape[2]
    slots = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
    return _partial_in_place(q, state.sink_k, state.sink_v, slots, slots < state.sink_len[:, None])


def _exact_partial(q, state: RegionKV, *, method, mcfg):
    """Partials over the sink and the window, which hold this step's token already.

    Each region is attended where it lies, after the token's write: read before
    its write, a window (a while-loop carry) was copied twice per step by XLA
    (into a temporary, then back for the in-place write); concatenating the
    regions copied them too. A method config that attends its selection in place
    (the CPU kernels) attends the sink and the window that way too.
    """
    if attends_in_place(method, mcfg, state.win_k):
        sink, window = _sink_partial_in_place(q, state), _window_partial_in_place(q, state)
    else:
        sink = _region_partial(q, state.sink_k, state.sink_v, state.sink_len)
        window = _region_partial(q, state.win_k, state.win_v, state.win_len, state.win_start)
    return over_batch_heads(common.merge)(sink, window)


def _leading_rows(store, n: int, ccfg):
    """The first n rows of every (batch row, head) of store [B, H, cap, hd], on the device (with
    offload: cut by a host computation and moved, B·H·n rows)."""
    if not ccfg.offload:
        return store[:, :, :n]
    if n < store.shape[2]:
        store = offload.on_host(lambda x: x[:, :, :n])(store)
    return offload.to_device(store)


def _retrieval_dense(q, state: RegionKV, ccfg, every_short):
    """Exact partial over the retrieval rows in use (the short-context fallback).

    While every row's context is below ``ccfg.dense_threshold`` (every_short), no row
    holds that many retrieval rows: only the first ``dense_threshold`` are read (and
    moved from host memory). A batch that mixes short and long rows reads them all.
    """
    cap = state.retr_k.shape[2]

    def over(n):
        keys, values = _leading_rows(state.retr_k, n, ccfg), _leading_rows(state.retr_v, n, ccfg)
        return _region_partial(q, keys, values, state.retr_len)

    first = min(cap, ccfg.dense_threshold)
    part = over(cap) if first == cap else jax.lax.cond(every_short, lambda: over(first), lambda: over(cap))
    return part, state.retr_len.astype(jnp.float32)


def _retrieval(q, state: RegionKV, lengths, *, method, mcfg, ccfg, batch_axis, context=None):
    """The retrieval region's partial and keys read per row: exact (:func:`_retrieval_dense`) while
    any row's context (lengths [B]) is below ``ccfg.dense_threshold`` (0: never; no fallback is
    compiled), the method's estimate otherwise. With batch_axis the decision spans every
    shard's rows; with ``context`` each shard's partial and reads are summed over the shards."""
    sparse = functools.partial(_retrieval_sparse, q, state, method=method, mcfg=mcfg, ccfg=ccfg, context=context)
    if not ccfg.dense_threshold:
        part, reads = sparse()
    else:
        short = lengths < ccfg.dense_threshold
        some_short, long_rows = jnp.any(short).astype(jnp.int32), jnp.sum(~short, dtype=jnp.int32)
        if batch_axis is not None:
            some_short, long_rows = jax.lax.psum((some_short, long_rows), batch_axis)
        part, reads = jax.lax.cond(some_short > 0, lambda: _retrieval_dense(q, state, ccfg, long_rows == 0), sparse)
    if context is None:
        return part, reads
    return merge_partials(part, context), context.total(reads)


def _keys_and_correction(q, state: RegionKV, sel, *, method, mcfg, ccfg, context=None):
    """(the selected key rows, the method's score correction for them: None or [B, H, G, C])."""
    k_rows = gather_rows(state.retr_k, sel.idx, ccfg)
    if context is None:
        correct = lambda ix, qq, kr, s: method.correction(mcfg, ix, qq, kr, s)  # noqa: E731
    else:
        correct = lambda ix, qq, kr, s: method.correction_sharded(mcfg, ix, qq, kr, s, context)  # noqa: E731
    return k_rows, over_batch_heads(correct)(state.index, q, k_rows, sel)


def _attend_rows(q, state: RegionKV, sel, *, method, mcfg, ccfg, context=None) -> common.Partial:
    """Partial over the selection's rows (not its ``rest``): gather K, correct, gather V, attend."""
    k_rows, log_weight = _keys_and_correction(q, state, sel, method=method, mcfg=mcfg, ccfg=ccfg, context=context)
    v_rows = gather_rows(state.retr_v, sel.idx, ccfg)
    return over_batch_heads(common.partial_attention)(q, k_rows, v_rows, sel.mask, log_weight)


def _used_slots(sel) -> jax.Array:
    """One past the last slot any (batch, head, query head) uses: the slots worth reading."""
    live = sel.mask if sel.mask.ndim == sel.idx.ndim else jnp.any(sel.mask, axis=-2)
    return jnp.max(jnp.where(live, jnp.arange(1, live.shape[-1] + 1), 0))


def _attend_rows_by_blocks(q, state: RegionKV, sel, *, method, mcfg, ccfg, context=None) -> common.Partial:
    """:func:`_attend_rows` over blocks of ``ccfg.slot_block`` slots, up to the last used one.

    A sampling method sizes its selection for the largest sample it allows
    (MagicPIG: N/8 slots per KV head) and fills part of it (the union of a GQA
    group's samples, compacted to the front): gathering,
    correcting and attending block by block skips the unused tail, so a step
    costs what its sample holds, not its capacity.
    """
    block = ccfg.slot_block
    pad = -sel.idx.shape[-1] % block

    def padded(x):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])

    idx, mask = padded(sel.idx), padded(sel.mask)

    def one_block(j, acc):
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=x.ndim - 1)
        part = _attend_rows(q, state, common.Selection(idx=take(idx), mask=take(mask)),
                            method=method, mcfg=mcfg, ccfg=ccfg, context=context)
        return over_batch_heads(common.merge)(acc, part)

    g, hd = q.shape[-2:]
    empty = over_batch_heads(lambda qq: common.empty_partial(g, hd))(q)
    return jax.lax.fori_loop(0, (_used_slots(sel) + block - 1) // block, one_block, empty)


def attends_in_place(method, mcfg, retr_k) -> bool:
    """Whether the method attends its selection where the rows lie (``method.attend_in_place``:
    gather, correction and attention in one call), for this config and retrieval region."""
    return method.reads_rows_in_place(mcfg, retr_k)


def attend_rows_in_place(q, state: RegionKV, sel, *, method, mcfg) -> common.Partial:
    """Partial over the selection's rows by ``method.attend_in_place`` (see :func:`attends_in_place`)."""
    return over_batch_heads(lambda ix, qq, kk, vv, s: method.attend_in_place(mcfg, ix, qq, kk, vv, s))(
        state.index, q, state.retr_k, state.retr_v, sel)


def _retrieval_on_host(q, state: RegionKV, hcfg, *, method, ccfg):
    """:func:`_retrieval_sparse` as one host computation over the host-resident index and rows,
    run with the method's host config ``hcfg``: the query [B, H, G, hd] moves to the host and
    the partial ((o, l, m) per query head) and the keys read come back, nothing else."""
    local = dataclasses.replace(ccfg, offload=False)  # inside, every array is the computation's own

    def estimate(q, index, keys, values):
        here = dataclasses.replace(state, index=index, retr_k=keys, retr_v=values)
        return _retrieval_sparse(q, here, method=method, mcfg=hcfg, ccfg=local)

    return offload.to_device(offload.on_host(estimate)(offload.to_host(q), state.index, state.retr_k, state.retr_v))


def _retrieval_sparse(q, state: RegionKV, *, method, mcfg, ccfg, context=None):
    """The method's estimate over the retrieval region: select, gather, correct, attend.

    With a host-resident index (:func:`host_config`: MagicPIG offloaded) all of it
    runs in one host computation (:func:`_retrieval_on_host`). Otherwise the method
    selects on the device. With the retrieval region on the device and a method
    config whose ``method.kernels(mcfg)`` runs the Pallas kernels, the attention runs in the
    gather-attention kernel; a method whose ``reads_rows_in_place(mcfg, keys)`` holds (the CPU kernels
    of MagicPIG and ParisKV) attends the rows where they lie, host memory included;
    otherwise offloaded rows are gathered by a host computation, moved, and attended
    by XLA, block by block for a method whose correction is slot-wise
    (``slot_wise_correction``) and whose selection exceeds a block.

    No kernel attends offloaded rows: they arrive gathered and contiguous, so the
    gather-attention kernel's in-kernel gather has nothing left to save, and on the
    one GPU run the kernel lost to XLA's fused attention at 2,048 rows
    (docs/results/gpu.md). The step's cost there is the rows' transfer.

    With ``context`` the method selects this shard's rows (``select_sharded``): the partial
    and reads are the shard's own.
    """
    hcfg = host_config(method, mcfg, ccfg)
    if hcfg is not None:
        return _retrieval_on_host(q, state, hcfg, method=method, ccfg=ccfg)
    if context is None:
        select = lambda ix, qq: method.select(mcfg, ix, qq)  # noqa: E731
    else:
        select = lambda ix, qq: method.select_sharded(mcfg, ix, qq, context)  # noqa: E731
    sel = over_batch_heads(select)(state.index, q)
    kernels = method.kernels(mcfg)
    if not ccfg.offload and kernels.uses_pallas():
        # The kernel gathers rows of the device-resident region itself: no copy of V.
        # Only a correction needs k_rows on this path; XLA drops the gather otherwise.
        _, log_weight = _keys_and_correction(q, state, sel, method=method, mcfg=mcfg, ccfg=ccfg, context=context)

        def one_row(q, k, v, idx, mask, log_weight):
            return dispatch.gather_attention_heads(q, k, v, idx, mask, log_weight, kernels=kernels)

        o, l, m = jax.vmap(one_row)(q, row_values(state.retr_k), row_values(state.retr_v), sel.idx, sel.mask,
                                    log_weight)
        read = common.Partial(o=o, l=l, m=m)
    elif attends_in_place(method, mcfg, state.retr_k):
        read = attend_rows_in_place(q, state, sel, method=method, mcfg=mcfg)
    elif method.slot_wise_correction and sel.idx.shape[-1] > ccfg.slot_block:
        read = _attend_rows_by_blocks(q, state, sel, method=method, mcfg=mcfg, ccfg=ccfg, context=context)
    else:
        read = _attend_rows(q, state, sel, method=method, mcfg=mcfg, ccfg=ccfg, context=context)
    part = over_batch_heads(common.with_rest)(read, sel)
    reads = jnp.mean(over_batch_heads(lambda s: s.distinct_rows())(sel).astype(jnp.float32), axis=1)
    return part, reads


def region_attention(q, k, v, positions, state: RegionKV, *, method, mcfg, ccfg: CacheConfig,
                     batch_axis: str | None = None, context: ContextShards | None = None):
    """Decode-step attention (T = 1) through the four regions: a flush if a window is full,
    then :func:`region_step`.

    batch_axis: the mesh axis the batch is split over when this runs per shard
    (jaxkv.sharding); the dense fallback is then decided for the whole batch,
    as on one device, not per shard.
    context: the retrieval region's split over a mesh axis (``jaxkv.sharding``'s ``context``),
    when this runs per shard of it: the state's retrieval fields are the shard's own.
    """
    state = _flush_if_full(state, method=method, mcfg=mcfg, ccfg=ccfg, context=context)
    return region_step(q, k, v, positions, state, method=method, mcfg=mcfg, ccfg=ccfg, batch_axis=batch_axis,
                       context=context)


def region_step(q, k, v, positions, state: RegionKV, *, method, mcfg, ccfg: CacheConfig,
                batch_axis: str | None = None, context: ContextShards | None = None):
    """:func:`region_attention` of a state whose windows have room (no flush): the token
    written, the regions attended and merged."""
    if q.shape[1] != 1:
        raise ValueError(f"the four-region cache decodes one token at a time, got {q.shape[1]}")
    b, _, hq, hd = q.shape
    hkv = k.shape[2]
    pos = positions[:, 0]
    qg = q[:, 0].reshape(b, hkv, hq // hkv, hd)
    state = _write_token(state, k[:, 0], v[:, 0], pos, ccfg)
    exact = _exact_partial(qg, state, method=method, mcfg=mcfg)
    lengths = pos + 1
    retrieval, reads = _retrieval(qg, state, lengths, method=method, mcfg=mcfg, ccfg=ccfg, batch_axis=batch_axis,
                                  context=context)
    out = over_batch_heads(lambda a, r: common.finalize(common.merge(a, r)))(exact, retrieval)
    state = dataclasses.replace(
        state,
        keys_read=state.keys_read + reads + (state.sink_len + state.win_len).astype(jnp.float32),
        keys_seen=state.keys_seen + lengths.astype(jnp.float32))
    return out.reshape(b, 1, hq, hd).astype(q.dtype), state


def all_tokens(state: RegionKV):
    """Every cached token of every row in position order, gathered from the regions.

    Returns (k, v) [B, Hkv, S + cap + W + U, hd] and the per-row length; row b's
    first `length[b]` entries are positions 0..length-1. For tests and tools.
    """
    def on_device(store):
        return row_values(jax.device_put(store, DEVICE) if store.sharding.memory_kind != "device" else store)

    sink_k, sink_v, retr_k, retr_v = (on_device(x) for x in (state.sink_k, state.sink_v, state.retr_k, state.retr_v))
    in_order = _window_slots(state, jnp.zeros_like(state.win_start), state.win_k.shape[2])
    win_k, win_v = (row_values(_window_rows(x, in_order)) for x in (state.win_k, state.win_v))

    def one(sk, sv, rk, rv, wk, wv, sl, rl, wl):
        parts_k = jnp.concatenate([sk, rk, wk], axis=1)
        parts_v = jnp.concatenate([sv, rv, wv], axis=1)
        s, cap = sk.shape[1], rk.shape[1]
        j = jnp.arange(parts_k.shape[1])
        # position j comes from: sink j (< sl), retrieval j - s, window j - s - rl.
        src = jnp.where(j < sl, j, jnp.where(j < s + rl, j, s + cap + (j - s - rl)))
        src = jnp.clip(src, 0, parts_k.shape[1] - 1)
        return parts_k[:, src], parts_v[:, src]

    k, v = jax.vmap(one)(sink_k, sink_v, retr_k, retr_v, win_k, win_v,
                         state.sink_len, state.retr_len, state.win_len)
    return k, v, state.sink_len + state.retr_len + state.win_len


# ----------------------------------------------------------------------------
# What generate() plugs in: the per-layer attention and state for a method.


@dataclasses.dataclass(frozen=True)
class Backend:
    """A hashable description of how every layer caches and attends."""

    num_layers: int
    method: str
    method_config: Any
    cache: CacheConfig | None
    staging_capacity: int
    retrieval_capacity: int
    context: ContextShards | None = None  # the retrieval region split over a mesh axis

    @property
    def sparse_method(self) -> SparseMethod:
        """The registered method of a sparse backend."""
        return registry.get(self.method)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        if self.method == registry.DENSE:
            return tuple(range(self.num_layers))
        return tuple(l for l in self.sparse_method.dense_layers(self.method_config) if l < self.num_layers)

    @property
    def attention(self):
        # Dense layers' decode steps go to the CPU kernel when the config asks for the
        # native kernels (DenseConfig; a sparse method's config for its dense layers, where
        # that kernel is built: ParisKV's selection alone is, on an AVX2 CPU).
        if self.method == registry.DENSE:
            dense_layer = dense.cached_attention((self.method_config or dense.DenseConfig()).kernels.uses_native())
            return (dense_layer,) * self.num_layers
        native_kernels = (self.sparse_method.kernels(self.method_config).uses_native()
                          and native.available("jaxkv_dense_decode"))
        dense_layer = dense.cached_attention(native_kernels)
        sparse = functools.partial(region_attention, method=self.sparse_method,
                                   mcfg=self.method_config, ccfg=self.cache, context=self.context)
        return tuple(dense_layer if l in self.dense_layers else sparse for l in range(self.num_layers))

    def from_prefill(self, staging: models.KVCache, lengths):
        """Every layer's decode state from the prefilled staging cache (dense layers keep their slice).

        Per layer, dense ones too: from a stacked cache, XLA CPU copied each
        layer's K and V slice before attending them, on every decode step. One
        jitted call per sparse layer: in one program over all layers, XLA CPU
        kept every layer's index-build temporaries alive at once.
        """
        return tuple(
            models.KVCache(k=staging.k[layer], v=staging.v[layer]) if layer in self.dense_layers
            else _layer_regions(self, models.transpose_keys(staging.k[layer]), staging.v[layer], lengths)
            for layer in range(self.num_layers))


@functools.partial(jax.jit, static_argnames=("backend",))
def _layer_regions(backend: Backend, k, v, lengths) -> RegionKV:
    return regions_from_prefill(k, v, lengths, method=backend.sparse_method, mcfg=backend.method_config,
                                ccfg=backend.cache, capacity=backend.retrieval_capacity, context=backend.context)


def _context_shards(context, method: str, mcfg, ccfg: CacheConfig, capacity: int) -> ContextShards | None:
    """The retrieval region's split for ``context`` = (mesh axis, shards), or None; ValueError for a
    method that cannot split it."""
    if context is None:
        return None
    method_obj = registry.get(method)
    if host_config(method_obj, mcfg, ccfg) is not None:
        raise ValueError(f"CacheConfig(host_index=True) runs {method!r} in host memory as one computation, "
                         f"which the mesh's {context[0]!r} axis does not split: use host_index=False")
    if not method_obj.splits_context(mcfg):
        able = [n for n in registry.names() if registry.get(n).splits_context(registry.get(n).config_class())]
        raise ValueError(f"method {method!r} (with these settings) does not split its retrieval region over the mesh's "
                         f"{context[0]!r} axis; methods that do at their defaults: {', '.join(able)}")
    return ContextShards.split(*context, capacity, ccfg.buffer)


def make_backend(config, method: str, method_config, cache_config, max_prompt: int,
                 max_new_tokens: int, context: tuple[str, int] | None = None) -> Backend:
    """Validate a generate() request and size every cache for it.

    context: (mesh axis, its size) to split each sparse layer's retrieval region over
    (``jaxkv.sharding``'s ``context`` axis), or None.
    """
    total = max_prompt + max_new_tokens
    if method == registry.DENSE and context is not None and context[1] > 1:
        raise ValueError(f"method='dense' keeps every layer's cache whole: a {context[0]!r} axis of size "
                         f"{context[1]} needs a sparse method that splits its retrieval region")
    if method == registry.DENSE:
        if method_config is not None and not isinstance(method_config, dense.DenseConfig):
            raise ValueError(f"method_config for 'dense' must be a DenseConfig, got {type(method_config).__name__}")
        if cache_config is not None:
            raise ValueError("method='dense' takes no cache_config")
        return Backend(config.num_layers, "dense", method_config, None, total, 0)
    config_class = registry.get(method).config_class
    mcfg = method_config if method_config is not None else config_class()
    if not isinstance(mcfg, config_class):
        raise ValueError(f"method_config for {method!r} must be a {config_class.__name__}, "
                         f"got {type(mcfg).__name__}")
    ccfg = (cache_config or CacheConfig()).resolve(mcfg)
    # Retrieval holds at most every token but the sink and local ones; the
    # slack of one buffer keeps a flush's writes in bounds.
    capacity = max(total - ccfg.sink - ccfg.local, 0) + ccfg.buffer
    # Dense layers and the prefill staging cache keep every position.
    return Backend(config.num_layers, method, mcfg, ccfg, total, capacity,
                   _context_shards(context, method, mcfg, ccfg, capacity))
