"""The offloaded cache's data movement: explicit host work, O(U) flushes, the same results.

What a program moves is read two ways: from its jaxpr by ``jaxkv.offload.transfers``
(the sum of its host↔device ``device_put``s) and, independently, from the StableHLO it
lowers to for CUDA (the memory-placement annotations XLA's host offloader acts on).
"""
import dataclasses
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cache as kvcache
from jaxkv import offload
from jaxkv.attention import hybrid, magicpig, pariskv, pqcache, topk
from pallas_kernels.testing import lower_for_cuda, triton_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import data_movement  # noqa: E402

B, H, G, HD = 2, 2, 3, 16
S, W, U = 2, 4, 3

# The methods, small enough to trace and lower quickly; MagicPIG twice: its index in host
# memory (the default with offload) and on the device. The tests below take the ones whose
# paths differ (every device-resident index flushes and fetches rows alike).
METHODS = {
    "magicpig": (magicpig.METHOD, magicpig.MagicPIGConfig(K=4, L=6, sink=S, local=W, dense_layers=()), True),
    "magicpig_device_index": (magicpig.METHOD, magicpig.MagicPIGConfig(K=4, L=6, sink=S, local=W, dense_layers=()), False),
    "pariskv": (pariskv.METHOD, pariskv.ParisKVConfig(m=4, top_k=5, sink=S, local=W, buffer=U), True),
    "hybrid": (hybrid.METHOD, hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=4, m=4), sink=S, local=W,
                                                  buffer=U), True),
    "hybrid_lsh": (hybrid.METHOD, hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=4, m=4), tail="lsh",
                                                      magicpig=magicpig.MagicPIGConfig(K=4, L=6), sink=S, local=W,
                                                      buffer=U), True),
    "topk": (topk.METHOD, topk.TopKConfig(top_k=5, sink=S, local=W, buffer=U), True),
    "pqcache": (pqcache.METHOD, pqcache.PQCacheConfig(top_k=5, n_centroids=4, sink=S, local=W), True),
}


def _ccfg(mcfg, host_index, offload_on=True, dense_threshold=0):
    return kvcache.CacheConfig(buffer=U, dense_threshold=dense_threshold, offload=offload_on,
                               host_index=host_index).resolve(mcfg)


def _abstract(shape, dtype=jnp.float32):
    return jax.core.ShapedArray(shape, jnp.dtype(dtype))


def _abstract_state(method, mcfg, ccfg, capacity, dtype=jnp.float32):
    """A layer's decode state after prefilling ``capacity`` tokens, abstract, memory kinds kept."""
    prefill = functools.partial(kvcache.regions_from_prefill, method=method, mcfg=mcfg, ccfg=ccfg, capacity=capacity)
    staging = _abstract((B, H, capacity + S + W, HD), dtype)
    traced = jax.jit(prefill).trace(staging, staging, _abstract((B,), jnp.int32))
    return jax.tree.unflatten(jax.tree.structure(traced.out_info), traced.jaxpr.out_avals)


def _step_args(dtype=jnp.float32):
    return (_abstract((B, 1, H * G, HD), dtype), _abstract((B, 1, H, HD), dtype), _abstract((B, 1, H, HD), dtype),
            _abstract((B, 1), jnp.int32))


# ---------------------------------------------------------------- the tools


def test_on_host_runs_a_body_that_makes_its_own_arrays_and_keeps_its_results_there():
    x = jax.device_put(jnp.arange(12.0).reshape(3, 4), offload.HOST)
    f = jax.jit(lambda x: offload.on_host(lambda a: a * jnp.arange(4.0) + jnp.ones((3, 4)))(x))
    out = f(x)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), np.arange(12.0).reshape(3, 4) * np.arange(4.0) + 1)
    assert '_xla_compute_type = "host"' in f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


def test_transfers_counts_each_move_once_per_execution():
    host = jax.core.ShapedArray((5, 4), jnp.float32, memory_space=offload.HOST)
    small = _abstract((3,))

    def f(h, x):
        down = jax.device_put(h, offload.DEVICE)  # 80 bytes to the device
        up = jax.device_put(x, offload.HOST)  # 12 bytes to the host
        # one branch moves 80 bytes, the other 12: an execution takes one
        picked = jax.lax.cond(x[0] > 0, lambda: jax.device_put(h, offload.DEVICE)[0, :3],
                              lambda: jax.device_put(up, offload.DEVICE))
        looped = jax.lax.scan(lambda c, _: (c + jax.device_put(up, offload.DEVICE), None), x, None, length=4)[0]
        return down, picked, looped

    moved = offload.transfers(f, host, small)
    assert (moved.to_device, moved.to_host, moved.implicit) == (80 + 80 + 4 * 12, 12, ())
    # Work on host memory outside a host computation is named; work inside one is not.
    assert offload.transfers(lambda h: h * 2, host).implicit == ("mul",)
    assert offload.transfers(lambda h: offload.on_host(lambda a: a * 2)(h), host) == offload.Transfers()
    with pytest.raises(ValueError, match="while loop"):
        offload.transfers(lambda h: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: c + jax.device_put(
            h, offload.DEVICE)[0, :3], jnp.zeros(3)), host)


# What a lowered program moves, read from its StableHLO: the operands of XLA's placement
# annotations (`annotate_device_placement`, one per jax.device_put between memory kinds),
# except those that only label a host computation's results as staying in host memory.
_ELEMENT_BYTES = {"f32": 4, "i32": 4, "ui32": 4, "bf16": 2, "ui16": 2, "i16": 2, "ui8": 1, "i8": 1, "i1": 1}


def _tensor_bytes(tensor: str) -> int:
    *dims, element = tensor.split("x")
    return int(np.prod([int(d) for d in dims])) * _ELEMENT_BYTES[element]


def lowered_moves(text: str) -> dict[str, int]:
    """Bytes the lowered module places into each memory kind by a transfer."""
    host_results = set(re.findall(r"(%[\w#]+)(?::\d+)? = (?:func\.)?call @compute_on", text))
    moves = {"pinned_host": 0, "device": 0}
    pattern = (r"custom_call @annotate_device_placement\((%[\w#]+)\).*?_xla_buffer_placement = \"(\w+)\".*?"
               r"-> tensor<([\w]+)>")
    for operand, placement, tensor in re.findall(pattern, text):
        if operand.split("#")[0] not in host_results:
            moves[placement] += _tensor_bytes(tensor)
    return moves


# ---------------------------------------------------------------- a flush moves its rows


@pytest.mark.parametrize("name", ["magicpig", "magicpig_device_index", "pariskv"])
def test_flush_moves_its_rows_whatever_the_context(name):
    """A flush moves U rows of K and V per (batch row, head) to the host and a few counters:
    the same bytes at 64 and 512 retrieval rows, in the traced program and in the program
    lowered for CUDA; nothing comes back, and no op outside a host computation reads host memory."""
    method, mcfg, host_index = METHODS[name]
    ccfg = _ccfg(mcfg, host_index)
    rows = 2 * B * H * U * HD * 4  # K and V, float32
    traced, lowered = [], []
    for capacity in (64, 512):
        state = _abstract_state(method, mcfg, ccfg, capacity)
        flush = functools.partial(kvcache.flush, method=method, mcfg=mcfg, ccfg=ccfg)
        traced.append(offload.transfers(flush, state))
        lowered.append(lowered_moves(lower_for_cuda(flush, state)))
    assert traced[0] == traced[1] and lowered[0] == lowered[1], (traced, lowered)
    moved = traced[0]
    assert moved.implicit == () and moved.to_device == 0
    # The rows, and at most their batch rows' starts, flags and counts (int32 / bool per (row, head)).
    assert rows <= moved.to_host <= rows + 3 * 4 * B * H, moved
    assert lowered[0] == {"pinned_host": moved.to_host, "device": 0}


@pytest.mark.parametrize("name", ["magicpig", "pariskv"])
def test_decode_step_moves_what_its_selection_needs_whatever_the_context(name):
    """MagicPIG with its index on the host moves the query in and the partial out; ParisKV
    moves its top-k rows' indices in and the rows out: bytes fixed by the shapes, not the context."""
    method, mcfg, host_index = METHODS[name]
    ccfg = _ccfg(mcfg, host_index)
    step = functools.partial(kvcache.region_step, method=method, mcfg=mcfg, ccfg=ccfg)
    moved = [offload.transfers(step, *_step_args(), _abstract_state(method, mcfg, ccfg, n)) for n in (64, 512)]
    assert moved[0] == moved[1] and moved[0].implicit == (), moved
    if name == "magicpig":
        query, partial, reads = B * H * G * HD * 4, B * H * G * (HD + 2) * 4, B * 4
        assert (moved[0].to_host, moved[0].to_device) == (query, partial + reads)
    else:
        k = mcfg.top_k
        assert (moved[0].to_host, moved[0].to_device) == (2 * B * H * k * 4, 2 * B * H * k * HD * 4)


# MagicPIG with its index in host memory: tests/test_cache.py.
@pytest.mark.parametrize("name", ["magicpig_device_index", "pariskv"])
def test_offloaded_decoding_equals_decoding_on_the_device(name):
    """Prefill, 8 appended tokens (flushes of U = 3), one attention: the same outputs and the
    same index with the cache offloaded as with everything on the device."""
    method, mcfg, host_index = METHODS[name]
    rng = np.random.default_rng(7)
    lengths, steps = np.array([30, 17], np.int32), 8
    total = int(lengths.max()) + steps + 1
    k_all, v_all = (rng.standard_normal((B, H, total, HD)).astype(np.float32) for _ in "kv")
    live = np.arange(total)[None, None, :, None] < lengths[:, None, None, None]
    q = jnp.asarray(rng.standard_normal((B, 1, H * G, HD)), jnp.float32)
    results = []
    for offload_on in (True, False):
        ccfg = _ccfg(mcfg, host_index, offload_on)
        kw = dict(method=method, mcfg=mcfg, ccfg=ccfg)
        state = jax.jit(functools.partial(kvcache.regions_from_prefill, capacity=total, key=jax.random.key(0), **kw))(
            jnp.asarray(np.where(live, k_all, 0)), jnp.asarray(np.where(live, v_all, 0)), jnp.asarray(lengths))
        attend = jax.jit(functools.partial(kvcache.region_attention, **kw))
        rows = np.arange(B)
        for step in range(steps + 1):
            pos = lengths + step
            out, state = attend(q, jnp.asarray(k_all[rows, :, pos][:, None]), jnp.asarray(v_all[rows, :, pos][:, None]),
                                jnp.asarray(pos[:, None]), state)
        kinds = (state.retr_k.sharding.memory_kind, {x.sharding.memory_kind for x in jax.tree.leaves(state.index)})
        results.append((np.asarray(out), jax.tree.map(np.asarray, state), kinds))
    (out_off, state_off, kinds_off), (out_dev, state_dev, kinds_dev) = results
    assert kinds_off == ("pinned_host", {"device"}) and kinds_dev == ("device", {"device"})
    assert np.all(state_off.retr_len > 0)  # flushes happened
    # The same arithmetic in the same order, placed elsewhere: equal, bit for bit.
    np.testing.assert_array_equal(out_off, out_dev)
    jax.tree.map(np.testing.assert_array_equal, state_off, state_dev)


# ---------------------------------------------------------------- lowering for a GPU


@pytest.mark.parametrize("name", ["magicpig", "magicpig_device_index", "pariskv", "hybrid_lsh"])
def test_offloaded_decode_step_lowers_for_cuda(name):
    """A whole offloaded decode step (a flush, the token's write, the attention) of every
    method, kernels on: it lowers for CUDA, MagicPIG's host-resident work inside host
    computations and every Pallas kernel outside them."""
    method, mcfg, host_index = METHODS[name]
    if hasattr(mcfg, "kernels"):
        mcfg = dataclasses.replace(mcfg, kernels="pallas")
    ccfg = _ccfg(mcfg, host_index, dense_threshold=100)  # the short-context fallback compiled too
    state = _abstract_state(method, mcfg, ccfg, 1000, jnp.bfloat16)
    step = functools.partial(kvcache.region_attention, method=method, mcfg=mcfg, ccfg=ccfg)
    text = lower_for_cuda(step, *_step_args(jnp.bfloat16), state)
    host_calls = text.count('{mhlo.frontend_attributes = {_xla_compute_type = "host"}}')
    host_functions = re.findall(r"func\.func private @(compute_on\w*)\(.*?\n  \}", text, re.S)
    assert host_calls >= 3  # the gather (or the host-resident selection), the flush's writes, the fallback's cut
    assert not any("triton" in body for body in host_functions)
    kernels = triton_kernels(text)
    expected = {"magicpig": [], "magicpig_device_index": ["simhash", "collide_count", "compact"],
                "pariskv": ["vote_totals", "compact", "rsq_rerank"]}.get(name, [])
    assert sorted(set(kernels)) == sorted(set(expected)), kernels


# ---------------------------------------------------------------- the data-movement table


def test_data_movement_table_runs_and_its_rows_follow_from_the_shapes():
    """benchmarks/data_movement.py at 4k context: every row computed from the traced code, and
    the rows that follow from the shapes by hand agree with it."""
    shapes = data_movement.LLAMA_31_8B
    n = 4096
    results = {r["method"]: r for r in data_movement.table(shapes, [n])}
    kv_row = shapes.num_kv_heads * shapes.head_dim * 2  # one token's K (or V) over the KV heads, bf16
    layers = shapes.num_layers
    assert results["dense, KV on the device"]["step_to_device"] == 0
    # Dense from the host reads every retrieval row of every layer each step.
    dense_host = results["dense reading host KV"]
    capacity = n + 1 - 4 - 512 + 512
    assert dense_host["step_to_device"] == 2 * layers * capacity * kv_row
    # ParisKV: its top-100 K and V rows in, their int32 indices out; a flush: U = 512 rows out.
    paris = results["ParisKV"]
    assert paris["step_to_device"] == 2 * layers * 100 * kv_row
    assert paris["step_to_host"] == 2 * layers * 100 * shapes.num_kv_heads * 4
    assert paris["flush_to_host"] >= 2 * layers * 512 * kv_row and paris["flush_to_device"] == 0
    # MagicPIG (30 sparse layers): a bf16 query in, a float32 partial and a read count out.
    pig = results["MagicPIG, index on the host"]
    g, h, d = shapes.group, shapes.num_kv_heads, shapes.head_dim
    assert pig["step_to_host"] == 30 * h * g * d * 2
    assert pig["step_to_device"] == 30 * (h * g * (d + 2) * 4 + 4)
    assert pig["step_to_device"] < results["MagicPIG (default)"]["step_to_device"] / 100
    markdown = data_movement.markdown(shapes, list(results.values()))
    assert markdown.count("\n| 4,096 |") == len(results)


def test_the_documented_table_is_what_the_script_computes():
    """docs/architecture.md's rows for MagicPIG and ParisKV at 32k, recomputed."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    documented = {line for line in doc.splitlines() if line.startswith("| 32,768 |")}
    shapes, n = data_movement.LLAMA_31_8B, 32_768
    for row in data_movement.rows(n):
        if row.label in ("MagicPIG (default)", "MagicPIG, index on the host", "ParisKV"):
            line = data_movement.markdown(shapes, [data_movement.measure(row, shapes, n)]).splitlines()[-1]
            assert line in documented, line


@pytest.mark.parametrize("field", ["offload", "host_index"])
def test_placement_switches_must_be_bools(field):
    with pytest.raises(ValueError, match=rf"CacheConfig\.{field} must be a bool, got 'no'"):
        kvcache.CacheConfig(**{field: "no"})
