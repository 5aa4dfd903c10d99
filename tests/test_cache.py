"""The four-region cache: region invariants, host placement, and exactness."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import models
from jaxkv import cache as kvcache
from jaxkv.attention import common, magicpig, topk

S, W, U = 2, 4, 3
H, HD = 2, 8


def _config(**kw):
    mcfg = topk.TopKConfig(top_k=kw.pop("top_k", 8), sink=S, local=W, buffer=U)
    return mcfg, kvcache.CacheConfig(**kw).resolve(mcfg)


@functools.partial(jax.jit, static_argnames=("mcfg", "ccfg", "capacity"))
def _prefill(k, v, lengths, mcfg, ccfg, capacity):
    """Regions from position-major test arrays [B, T, H, d] (the staging cache is head-major)."""
    return kvcache.regions_from_prefill(k.swapaxes(1, 2), v.swapaxes(1, 2), lengths, method=topk.METHOD, mcfg=mcfg, ccfg=ccfg,
                                        capacity=capacity, key=jax.random.key(0))


@functools.partial(jax.jit, static_argnames=("mcfg", "ccfg"))
def _append(state, k, v, positions, mcfg, ccfg):
    return kvcache.append(state, k, v, positions, method=topk.METHOD, mcfg=mcfg, ccfg=ccfg)


def _run(lengths, steps, offload, seed=0, dtype=np.float32):
    """Prefill rows of the given lengths, append `steps` tokens; return (state, full K, full V)."""
    mcfg, ccfg = _config(offload=offload)
    b, total = len(lengths), max(lengths) + steps
    rng = np.random.default_rng(seed)
    full_k = rng.standard_normal((b, total, H, HD)).astype(dtype)
    full_v = rng.standard_normal((b, total, H, HD)).astype(dtype)
    capacity = max(total - S - W, 0) + U
    lengths = np.asarray(lengths, np.int32)
    staging_k = np.where(np.arange(total)[None, :, None, None] < lengths[:, None, None, None], full_k, 0)
    staging_v = np.where(np.arange(total)[None, :, None, None] < lengths[:, None, None, None], full_v, 0)
    state = _prefill(jnp.asarray(staging_k), jnp.asarray(staging_v), jnp.asarray(lengths),
                     mcfg, ccfg, capacity)
    rows = np.arange(b)
    for step in range(steps):
        pos = lengths + step
        state = _append(state, jnp.asarray(full_k[rows, pos]), jnp.asarray(full_v[rows, pos]),
                        jnp.asarray(pos), mcfg, ccfg)
    return state, full_k, full_v, lengths + steps


# Three quarters of the profile's examples (15 by default): each runs jitted prefill and decode steps.
@settings(max_examples=settings.default.max_examples * 3 // 4)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=3), steps=st.integers(0, 25))
def test_regions_partition_the_sequence_exactly(lengths, steps):
    state, full_k, full_v, totals = _run(lengths, steps, offload=False)
    k, v, length = kvcache.all_tokens(state)
    np.testing.assert_array_equal(np.asarray(length), totals)
    for b, n in enumerate(totals):
        # Bit-for-bit: the regions hold exactly the tokens, in position order.
        np.testing.assert_array_equal(np.asarray(k[b, :, :n]), full_k[b, :n].swapaxes(0, 1))
        np.testing.assert_array_equal(np.asarray(v[b, :, :n]), full_v[b, :n].swapaxes(0, 1))
    sink, win, retr = (np.asarray(x) for x in (state.sink_len, state.win_len, state.retr_len))
    np.testing.assert_array_equal(sink, np.minimum(totals, S))
    assert np.all(win <= W + U)
    assert np.all(win[totals >= S + W] >= W)  # the local window is always full once it can be
    np.testing.assert_array_equal(sink + win + retr, totals)
    # The index covers exactly the retrieval region.
    np.testing.assert_array_equal(np.asarray(state.index.n), np.broadcast_to(retr[:, None], (len(totals), H)))


def test_retrieval_region_lives_in_pinned_host_memory():
    state, full_k, _, totals = _run([20, 13], steps=9, offload=True)
    assert state.retr_k.sharding.memory_kind == "pinned_host"
    assert state.retr_v.sharding.memory_kind == "pinned_host"
    assert state.win_k.sharding.memory_kind == "device"
    k, _, _ = kvcache.all_tokens(state)
    for b, n in enumerate(totals):
        np.testing.assert_array_equal(np.asarray(k[b, :, :n]), full_k[b, :n].swapaxes(0, 1))


def test_bfloat16_rows_are_kept_as_bits_and_read_back_exactly():
    """A bfloat16 cache's regions hold their rows' bits (uint16) and give back the rows bit
    for bit, after prefill and the flushes of 9 appended tokens (U = 3)."""
    state, full_k, full_v, totals = _run([20, 13], steps=9, offload=True, dtype=jnp.bfloat16)
    for store in (state.sink_k, state.sink_v, state.win_k, state.win_v, state.retr_k, state.retr_v):
        assert store.dtype == models.ROW_BITS
    assert np.all(np.asarray(state.retr_len) > 0)
    k, v, _ = kvcache.all_tokens(state)
    assert k.dtype == v.dtype == jnp.bfloat16
    for b, n in enumerate(totals):
        np.testing.assert_array_equal(np.asarray(k[b, :, :n]), full_k[b, :n].swapaxes(0, 1))
        np.testing.assert_array_equal(np.asarray(v[b, :, :n]), full_v[b, :n].swapaxes(0, 1))
    slots = jnp.asarray([[[2, 0]] * H] * 2, jnp.int32)  # retrieval rows 2 and 0 of every (row, head)
    rows = kvcache.gather_rows(state.retr_v, slots, kvcache.CacheConfig(offload=True))
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows[1, :, 0]), full_v[1, S + 2])


def test_offloaded_rows_move_to_the_device_in_their_final_shape():
    """On a GPU, XLA (jax 0.11.2) failed to compile a reshape of rows moved from pinned_host
    ("Bitcast cannot have different memory spaces"; docs/results/gpu.md): gather_rows
    reshapes them in host memory, so the move is its last step."""
    store = jax.device_put(np.zeros((1, 2, 16, 4), np.float32), kvcache.HOST)
    idx = np.zeros((1, 2, 3), np.int32)
    ccfg = kvcache.CacheConfig(offload=True)
    jaxpr = jax.make_jaxpr(lambda s, i: kvcache.gather_rows(s, i, ccfg))(store, idx).jaxpr
    move = jaxpr.eqns[-1]
    assert move.primitive.name == "device_put" and move.outvars == jaxpr.outvars
    assert move.invars[0].aval.shape == (1, 2, 3, 4)


# The second case's short row attends while its token goes to the sink (position 1 < S).
@pytest.mark.parametrize("lengths, steps", [([30, 17], 6), ([25, 1], 0)])
def test_region_attention_reading_everything_equals_dense(lengths, steps):
    """With top_k ≥ every retrieval row the merged regions give exact attention."""
    mcfg, ccfg = _config(top_k=64, dense_threshold=0, offload=True)
    state, full_k, full_v, totals = _run(lengths, steps=steps, offload=True)
    rng = np.random.default_rng(1)
    b, g = len(totals), 3
    q = rng.standard_normal((b, 1, H * g, HD)).astype(np.float32)
    pos = totals  # the next token
    k_new = rng.standard_normal((b, 1, H, HD)).astype(np.float32)
    v_new = rng.standard_normal((b, 1, H, HD)).astype(np.float32)
    out, _ = jax.jit(functools.partial(kvcache.region_attention, method=topk.METHOD, mcfg=mcfg, ccfg=ccfg))(
        jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(pos[:, None]), state)
    for row, n in enumerate(totals):
        keys = np.concatenate([full_k[row, :n], k_new[row]], axis=0)  # [n+1, H, hd]
        vals = np.concatenate([full_v[row, :n], v_new[row]], axis=0)
        for head in range(H * g):
            kv_head = head // g
            s = keys[:, kv_head] @ q[row, 0, head] / np.sqrt(HD)
            w = np.exp(s - s.max())
            expected = (w / w.sum()) @ vals[:, kv_head]
            # float32 softmax over ≤ 40 keys, merged from three partials: ~1e-6 relative.
            np.testing.assert_allclose(np.asarray(out[row, 0, head]), expected, rtol=2e-5, atol=2e-6)


# Small enough to index a few dozen keys; capacity 1.0 keeps every sample in the selection.
SMALL_MAGICPIG = magicpig.MagicPIGConfig(K=4, L=6, sink=S, local=W, capacity=1.0, candidate_capacity=2.0)


def _magicpig_decode(offload: bool, steps: int = 12, **cache_kw):
    """MagicPIG through the regions: prefill, `steps` appends (several flushes), one attention."""
    mcfg = SMALL_MAGICPIG
    ccfg = kvcache.CacheConfig(buffer=U, dense_threshold=0, offload=offload, **cache_kw).resolve(mcfg)
    rng = np.random.default_rng(3)
    lengths, b, g = np.array([40, 25], np.int32), 2, 3
    total = int(lengths.max()) + steps + 1  # the attended token too
    full_k = rng.standard_normal((b, total, H, HD)).astype(np.float32)
    full_v = rng.standard_normal((b, total, H, HD)).astype(np.float32)
    live = np.arange(total)[None, :, None, None] < lengths[:, None, None, None]
    prefill = jax.jit(functools.partial(kvcache.regions_from_prefill, method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg,
                                        capacity=total + U, key=jax.random.key(0)))
    state = prefill(jnp.asarray(np.where(live, full_k, 0).swapaxes(1, 2)),
                    jnp.asarray(np.where(live, full_v, 0).swapaxes(1, 2)),
                    jnp.asarray(lengths))
    append = jax.jit(functools.partial(kvcache.append, method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg))
    rows = np.arange(b)
    for step in range(steps):
        pos = lengths + step
        state = append(state, jnp.asarray(full_k[rows, pos]), jnp.asarray(full_v[rows, pos]), jnp.asarray(pos))
    q = rng.standard_normal((b, 1, H * g, HD)).astype(np.float32)
    attend = jax.jit(functools.partial(kvcache.region_attention, method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg))
    out, state = attend(jnp.asarray(q), jnp.asarray(full_k[rows, lengths + steps][:, None]),
                        jnp.asarray(full_v[rows, lengths + steps][:, None]),
                        jnp.asarray((lengths + steps)[:, None]), state)
    return out, state, q


def test_magicpig_index_lives_in_host_memory_and_decodes_the_same():
    """Offloaded, MagicPIG's whole index stays beside the retrieval rows (its paper's placement:
    the selection and the sampled rows' attention run there) and decodes as on the device."""
    out_host, state, _ = _magicpig_decode(offload=True, host_index=True)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.index)} == {"pinned_host"}
    out_device, state_device, _ = _magicpig_decode(offload=False)
    assert state_device.index.sorted_ids.sharding.memory_kind == "device"
    # Same index, same samples: the host gather only changes where rows are read.
    np.testing.assert_array_equal(np.asarray(state.index.sorted_ids), np.asarray(state_device.index.sorted_ids))
    np.testing.assert_array_equal(np.asarray(out_host), np.asarray(out_device))
    assert int(np.min(np.asarray(state.retr_len))) > 0  # flushes happened: the index was updated


def test_magicpig_read_in_blocks_of_slots_decodes_as_one_pass():
    """Gathering, correcting and attending 3 slots at a time up to the last used slot = one pass over all."""
    whole, state, q = _magicpig_decode(offload=True)  # the default block exceeds the whole selection
    out, _, _ = _magicpig_decode(offload=True, slot_block=3)
    # The same rows and weights, their partials merged in another order: float32 rounding only.
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole), rtol=1e-5, atol=1e-6)
    # What the blocks covered: several blocks used, and unused ones past them (skipped).
    q = jnp.asarray(q.reshape(2, H, 3, HD))  # the query group of each KV head
    mcfg = SMALL_MAGICPIG
    index = jax.device_put(state.index, kvcache.DEVICE)  # offloaded, the cache selects in host memory
    sel = jax.jit(kvcache.over_batch_heads(lambda ix, qq: magicpig.select(mcfg, ix, qq)))(index, q)
    used, slots = int(kvcache._used_slots(sel)), sel.idx.shape[-1]
    assert used % 3 and 2 * 3 < used < slots - 3, (used, slots)  # a partial last block


def test_bfloat16_flush_converts_no_retrieval_region():
    """XLA CPU (jax 0.10.2) converts a whole bfloat16 array to float32 and back for a write
    into it: a flush's 64 rows into a 3 × 256k × 64 region took 69 ms (float32: 0.04 ms).
    Kept as bits, the region is written as integers, in place: the compiled flush (MagicPIG's,
    whose index has no array of the region's shape) makes no array of the region's size in
    any other dtype, and no copy of it."""
    mcfg = SMALL_MAGICPIG
    ccfg = kvcache.CacheConfig(buffer=U, dense_threshold=0, offload=True).resolve(mcfg)
    keys = jnp.asarray(np.random.default_rng(5).standard_normal((2, H, 30, HD)), jnp.bfloat16)
    state = jax.jit(functools.partial(kvcache.regions_from_prefill, method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg,
                                      capacity=40, key=jax.random.key(0)))(keys, keys, jnp.asarray([30, 21]))
    assert state.retr_k.dtype == models.ROW_BITS
    flush = jax.jit(functools.partial(kvcache.flush, method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg), donate_argnums=0)
    hlo = flush.lower(state).compile().as_text()
    b, h, cap, hd = state.retr_k.shape
    dims = {f"[{b},{h},{cap},{hd}]", f"[{b * h * cap},{hd}]"}  # the region, and its rows flattened
    results = (re.match(r"(\w+)(\[[\d,]*\])", line.split(" = ", 1)[1]) for line in hlo.splitlines() if " = " in line)
    region_arrays = [r.string for r in results if r and r.group(2) in dims]
    assert all(rhs.startswith("u16") and " copy(" not in rhs for rhs in region_arrays), region_arrays[:4]
    # K and V written by contiguous updates (a scatter into host memory is the pattern of
    # openxla/xla#34565), one per batch row: the check sees them.
    assert not any("scatter" in rhs for rhs in region_arrays), region_arrays
    assert sum("dynamic-update-slice" in rhs for rhs in region_arrays) >= 2 * b


def test_used_slots_is_one_past_the_last_slot_any_head_uses():
    mask = np.zeros((2, 3, 4, 10), bool)  # [B, Hkv, G, C]
    mask[1, 2, 3, 6] = mask[0, 0, 0, 2] = True
    sel = common.Selection(idx=jnp.zeros((2, 3, 10), jnp.int32), mask=jnp.asarray(mask))
    assert int(kvcache._used_slots(sel)) == 7
    shared = common.Selection(idx=sel.idx, mask=jnp.asarray(mask.any(axis=2)))  # one mask per KV head
    assert int(kvcache._used_slots(shared)) == 7
    none = common.Selection(idx=sel.idx, mask=jnp.zeros((2, 3, 10), bool))
    assert int(kvcache._used_slots(none)) == 0
