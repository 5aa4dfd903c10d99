"""Context-parallel decoding: each sparse layer's retrieval region split over a mesh's
``context`` axis gives one device's tokens and selections, and its memory divides.

The mesh cases run tests/sharding_worker.py with 8 simulated CPU devices in a
subprocess (see tests/test_sharding.py); the request checks run here.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest

import models
from jaxkv import cache as kvcache
from jaxkv.attention import magicpig, pariskv
from test_sharding import DEVICES, _result, _start_worker

MESHES = [[1, 1, 8], [2, 1, 4], [1, 2, 4]]
# Every method (the hybrid with both tails), each on one mesh and ParisKV on all three;
# the slow test runs every pair.
METHODS = ["hybrid", "hybrid_lsh", "magicpig", "pariskv", "pqcache", "topk"]
# pariskv_fallback: rows straddle the dense threshold (each shard's exact partial merged).
CASES = {"hybrid": [[2, 1, 4]], "hybrid_lsh": [[1, 2, 4]], "magicpig": [[2, 1, 4]], "pariskv": MESHES,
         "pqcache": [[1, 2, 4]], "topk": [[1, 1, 8]], "pariskv_fallback": [[2, 1, 4]]}


def _leaf_shard_shape(leaf, data, model, context):
    """The shape one device holds of a decode-state leaf (tests/sharding_worker.layout's rows)."""
    shape = list(leaf["shape"])
    retrieval = any(f".{name}" in leaf["path"] for name in kvcache.RETRIEVAL_FIELDS)
    if retrieval:  # [C, B, Hkv, ...] or the count [C, B]
        shape[0] //= context
    batch = 1 if retrieval else 0
    per_row = len(shape) == batch + 1
    shape[batch] //= data
    if not per_row:
        shape[batch + 1] //= model
    return shape


@pytest.fixture(scope="module")
def worker():
    return _result(_start_worker({"cases": CASES, "selections": {"keys": 3000, "methods": METHODS},
                                  "memory": True}), timeout=1200)


def _check_tokens(cases, new_tokens):
    for case in cases:
        where = f"{case['method']} on mesh {case['mesh']}"
        assert case["sharded"] == case["reference"], where
        assert all(len(row) == new_tokens for row in case["reference"]), where
        # Distinct rows per shard summed over shards, then the mean over KV heads: float32 sums
        # of a few small integers, exact; the means' rounding ≤ 1e-6 relative.
        assert case["sharded_read"] == pytest.approx(case["reference_read"], rel=1e-6), where


def test_context_sharded_generate_gives_one_devices_tokens(worker):
    """Greedy tokens and keys read equal one device's: the shards select exactly the one-device
    rows (below) and the partials' log-sum-exp merge only reorders sums, rounding far below
    these logits' top-2 gaps (tests/test_sharding.py)."""
    assert [(c["method"], c["mesh"]) for c in worker["cases"]] == [(m, s) for m, ms in CASES.items() for s in ms]
    _check_tokens(worker["cases"], worker["new_tokens"])


@pytest.mark.slow  # ≈ 10 min on 2 cores: 12 sharded decode loops to compile
def test_every_method_on_every_context_mesh_gives_one_devices_tokens():
    result = _result(_start_worker({"meshes": MESHES, "methods": METHODS}), timeout=2400)
    assert len(result["cases"]) == len(MESHES) * len(METHODS)
    _check_tokens(result["cases"], result["new_tokens"])


def test_every_device_holds_its_shard_of_the_retrieval_region(worker):
    for case in worker["cases"]:
        data, model, context = case["mesh"]
        for name in ("states_before", "states_after"):
            for leaf in case[name]:
                where = (case["method"], case["mesh"], name, leaf["path"])
                assert leaf["shard_shapes"] == [_leaf_shard_shape(leaf, data, model, context)], where
                assert leaf["shards"] == data * model * context, where
                if leaf["path"].endswith((".retr_k", ".retr_v")):
                    assert leaf["memory_kind"] == "pinned_host", where


def test_sharded_selection_and_estimate_are_one_devices(worker):
    """Over 3,000 random keys split in 8 shards, for every query: the union of the shards'
    selections is the one-device set (ParisKV: global votes, threshold ties and rerank;
    MagicPIG: the same hash functions, μ, tables read and capacity cut; the exact top-k; the
    hybrid's head, with its value model and tail partial summed over the shards; PQCache's
    k-means from the same initial rows, its sums over the shards — equal centroids up to
    rounding, which moves no row's code here), and the merged estimate is one device's up to
    float32 rounding."""
    assert [s["method"] for s in worker["selections"]] == METHODS
    for found in worker["selections"]:
        if found["method"] in ("pariskv", "pqcache", "topk"):  # the samplers' sizes vary by query
            assert all(len(rows) == 100 for rows in found["one_device"]), found["method"]
        assert all(rows for rows in found["one_device"]), found["method"]
        assert found["sharded"] == found["one_device"], found["method"]
        # Outputs |o| ≤ 1.2: the merge reorders float32 sums of ≤ 8 partials (measured 3e-7).
        np.testing.assert_allclose(found["sharded_out"], found["one_device_out"], rtol=0, atol=1e-5,
                                   err_msg=found["method"])


def test_retrieval_memory_per_device_falls_as_one_over_shards(worker):
    """Bytes per device of a layer's retrieval K/V, index and count, measured from the arrays'
    shardings: each shard holds ⌈(capacity − U)/C⌉ rows plus a slack of one update buffer U."""
    held = {int(c): v for c, v in worker["memory"].items()}
    one = held[1]["bytes"]
    for context, h in held.items():
        assert h["rows_per_shard"] == -(-(h["capacity"] - h["buffer"]) // context)
        # The slack adds U / (capacity / C) ≤ 3.2% here (U = 16, capacity 4,044, C ≤ 8).
        assert one / context <= h["bytes"] <= 1.035 * one / context, (context, h, one)


def test_a_method_that_cannot_split_its_region_is_refused():
    config = models.ModelConfig(
        model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
        num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True,
        attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))
    refused = (r"method 'magicpig' \(with these settings\) does not split .* 'context' axis; "
               r"methods that do at their defaults: hybrid, magicpig, pariskv, pqcache, topk")
    with pytest.raises(ValueError, match=refused):
        kvcache.make_backend(config, "magicpig", magicpig.MagicPIGConfig(kernels="native"), None, 100, 10,
                             context=("context", 2))
    with pytest.raises(ValueError, match="method='dense' keeps every layer's cache whole"):
        kvcache.make_backend(config, "dense", None, None, 100, 10, context=("context", 2))
    with pytest.raises(ValueError, match=r"host_index=True\) runs 'magicpig' in host memory"):
        kvcache.make_backend(config, "magicpig", magicpig.MagicPIGConfig(), kvcache.CacheConfig(host_index=True),
                             100, 10, context=("context", 2))
    backend = kvcache.make_backend(config, "pariskv", pariskv.ParisKVConfig(), None, 100, 10, context=("context", 2))
    assert backend.context.count == 2 and backend.context.capacity == backend.retrieval_capacity


def test_two_processes_split_one_context_and_give_one_devices_tokens():
    """A (1, 1, 8) mesh whose context axis spans 2 processes × 4 devices (gloo collectives);
    ≈ 35 s on 2 cores."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    procs = [_start_worker({"meshes": [[1, 1, 8]], "methods": ["pariskv"], "distributed": {
        "coordinator": f"localhost:{port}", "num_processes": 2, "process_id": i}}) for i in range(2)]
    results = [_result(proc, timeout=900) for proc in procs]
    assert all(r["local_devices"] == DEVICES // 2 for r in results)
    for case in results[0]["cases"]:
        assert case["mesh_processes"] == [0, 1]
        assert case["sharded"] == case["reference"]
        assert case["sharded_read"] == pytest.approx(case["reference_read"], rel=1e-6)
    assert results[0]["cases"] == results[1]["cases"]
