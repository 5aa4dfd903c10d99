"""Sharded generate(): the same tokens as one device, and each device holds only its shard.

The mesh cases run tests/sharding_worker.py in a subprocess with 8 simulated CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before
JAX starts, and would change every other test's device count). The request
checks run here, on abstract meshes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

import jaxkv
import models
from jaxkv import cache as kvcache
from jaxkv import sharding
from jaxkv.attention import topk

WORKER = pathlib.Path(__file__).with_name("sharding_worker.py")
DEVICES = 8


def _start_worker(request: dict) -> subprocess.Popen:
    # The worker sets XLA_FLAGS itself, before JAX starts.
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(request)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=WORKER.parents[1],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _result(proc: subprocess.Popen, timeout: int) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"worker failed:\n{err[-4000:]}"
    result = json.loads(out.splitlines()[-1])
    assert result["devices"] == DEVICES
    return result


def _run_worker(meshes, methods, timeout: int, split_params: bool = False) -> dict:
    return _result(_start_worker({"meshes": meshes, "methods": methods, "split_params": split_params}), timeout)


def _local_shape(shape, batch_axis, head_axis, data, model):
    """A global shape with its batch axis split `data` ways and its head axis `model` ways."""
    local = list(shape)
    if batch_axis is not None:
        local[batch_axis] //= data
    if head_axis is not None:
        local[head_axis] //= model
    return local


# Parameters: (axis split over model) per name; the rest are replicated. Layer
# leaves are stacked [L, ...]: wq [L, D, Hq, hd], wk/wv [L, D, Hkv, hd],
# wo [L, Hq, hd, D], w_gate/w_up [L, D, F], w_down [L, F, D].
PARAM_MODEL_AXIS = {".layers.wq": 2, ".layers.wk": 2, ".layers.wv": 2, ".layers.wo": 1,
                    ".layers.w_gate": 2, ".layers.w_up": 2, ".layers.w_down": 1}


def _state_axes(path: str, ndim: int):
    """(batch axis, KV-head axis) of a decode-state leaf, by what the leaf is."""
    if path.endswith((".k", ".v")):  # dense cache: [L, B, Hkv, T, hd] stacked or [B, Hkv, T, hd]
        return (1, 2) if ndim == 5 else (0, 1)
    if path.endswith(("_len", ".win_start", ".keys_read", ".keys_seen")):  # per-row counters [B]
        return 0, None
    return 0, 1  # every other RegionKV leaf, index included: [B, Hkv, ...]


def _check_decode_collectives(case, result):
    """The compiled decode loop moves activations between devices, never cache or index data.

    Attention runs per shard, so the only collectives are all-reduces: of the
    [B/data, 1, D] partial sums of the wo and w_down contractions over ``model``,
    of per-row [B/data] values (the read counter's mean over ``model``) and of
    scalars (the loop's all-rows-done test over ``data``).
    """
    data, model = case["mesh"]
    rows = result["batch"] // data
    allowed = {1, rows, rows * result["hidden_size"]}
    where = f"{case['method']} on mesh {case['mesh']}"
    for op, sizes in case["decode_collectives"]:
        assert op == "all-reduce" and set(sizes) <= allowed, (where, op, sizes)
    if model > 1:  # the head-split contractions must show up: the HLO scan is not blind
        assert any(rows * result["hidden_size"] in sizes for _, sizes in case["decode_collectives"]), where


def _check_case(case, new_tokens):
    data, model = case["mesh"]
    where = f"{case['method']} on mesh {case['mesh']}"
    # Greedy float32 decoding of a model with clear-cut logits: a mesh changes only
    # rounding (summation order of the split wo / w_down contractions, kernels for
    # smaller shapes), far below the top-2 logit gaps, so the tokens must be identical.
    assert case["sharded"] == case["reference"], where
    assert all(len(row) == new_tokens for row in case["reference"]), where
    # The prefill's last logits (|logit| ≲ 6): measured ≤ 4e-5 apart over all meshes, the
    # float32 rounding of other summation orders and kernel blockings; a misplaced head or
    # row would move them by O(1).
    assert case["first_logits_max_diff"] < 1e-3, where
    if case["reference_read"] is not None:
        # A per-row mean over KV heads, taken per shard then averaged over the model
        # axis: float32 rounding of ≤ 12 terms, ≤ a few ulp (1e-6 relative).
        np.testing.assert_allclose(case["sharded_read"], case["reference_read"], rtol=1e-6)
    for leaf in case["params"]:
        axis = PARAM_MODEL_AXIS.get(leaf["path"])
        expected = _local_shape(leaf["shape"], None, axis, data, model)
        assert leaf["shard_shapes"] == [expected], (where, leaf)
        assert leaf["shards"] == data * model, (where, leaf)
    for name in ("states_before", "states_after"):
        host = 0
        for leaf in case[name]:
            batch_axis, head_axis = _state_axes(leaf["path"], len(leaf["shape"]))
            expected = _local_shape(leaf["shape"], batch_axis, head_axis, data, model)
            assert leaf["shard_shapes"] == [expected], (where, name, leaf)
            assert leaf["shards"] == data * model, (where, name, leaf)
            if leaf["path"].endswith((".retr_k", ".retr_v")):
                assert leaf["memory_kind"] == "pinned_host", (where, name, leaf)
            if leaf["memory_kind"] == "pinned_host":
                host += leaf["nbytes"]
        if name == "states_after" and host:
            # Host-resident leaves are all [B, Hkv, ...]: a device's host share is 1/(data·model).
            assert case["bytes_per_device"]["pinned_host"] == host // (data * model), where


def test_sharded_generate_on_a_4x2_mesh_equals_one_device():
    """Dense (stacked cache under scan), MagicPIG (a dense layer 0, then RegionKV) and
    ParisKV with a dense-fallback threshold that only some shards' rows are below."""
    result = _run_worker([[4, 2]], ["dense", "magicpig", "pariskv_fallback"], timeout=600, split_params=True)
    assert len(result["cases"]) == 3
    for case in result["cases"]:
        _check_case(case, result["new_tokens"])
        _check_decode_collectives(case, result)
    fallback = result["cases"][2]
    # One device: the shortest row (22 tokens) keeps the whole batch dense for all 9
    # steps, so every row reads all its keys. A shard deciding alone (rows of 29 and 30
    # tokens reach 32 after 2 steps) would read fewer: _check_case compared the reads.
    assert all(r == pytest.approx(1.0) for r in fallback["reference_read"]), fallback["reference_read"]
    # Weights split by the caller: q, k and v joined per KV head, [D, Hkv, G + 2, hd] split by KV head.
    (split,) = result["split_cases"]
    assert split["sharded"] == split["reference"]
    joined = [leaf for leaf in split["params"] if leaf["path"].endswith(".wqkv")]
    assert len(joined) == 2 and all(leaf["shard_shapes"] == [[48, 6, 5, 8]] for leaf in joined), joined


@pytest.mark.slow  # ≈ 6 min on the shared 2-core machine: 15 sharded decode loops to compile
def test_sharded_generate_on_every_mesh_equals_one_device():
    meshes = [[8, 1], [4, 2], [2, 4], [1, 3], [2, 3]]
    result = _run_worker(meshes, ["dense", "magicpig", "pariskv"], timeout=1800)
    assert len(result["cases"]) == len(meshes) * 3
    for case in result["cases"]:
        _check_case(case, result["new_tokens"])
        _check_decode_collectives(case, result)
    # With -s: how far the sharded float32 arithmetic moved the logits (prefill's last position).
    print(f"\nlogits |max| {result['first_logits_abs_max']:.3g}, smallest top-2 gap "
          f"{result['first_logits_top2_gap_min']:.3g}; max |sharded - one device| per mesh:",
          {str(c["mesh"]): c["first_logits_max_diff"] for c in result["cases"]})


@pytest.mark.slow  # ≈ 2 min: two processes compile dense and MagicPIG decode loops side by side
def test_two_processes_joined_by_jax_distributed_give_the_one_device_tokens():
    """A (4, 2) mesh over 2 processes × 4 devices: `model` pairs within a process, `data` across both."""
    with socket.socket() as probe:  # a free port for the coordinator
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    procs = [_start_worker({"meshes": [[4, 2]], "methods": ["dense", "magicpig"], "distributed": {
        "coordinator": f"localhost:{port}", "num_processes": 2, "process_id": i}}) for i in range(2)]
    results = [_result(proc, timeout=900) for proc in procs]
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["local_devices"] == DEVICES // 2 for r in results)
    for case in results[0]["cases"]:
        assert case["mesh_processes"] == [0, 1], case["method"]
        # Same greedy tokens as one device (the argument of _check_case), gathered to both processes.
        assert case["sharded"] == case["reference"], case["method"]
        if case["reference_read"] is not None:
            np.testing.assert_allclose(case["sharded_read"], case["reference_read"], rtol=1e-6)
    assert results[0]["cases"] == results[1]["cases"]


# ---------------------------------------------------------------------------- requests

CONFIG = models.ModelConfig(
    model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=1,
    num_heads=9, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True,
    attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))


def _abstract(data, model, names=sharding.AXES, kind=AxisType.Auto):
    return AbstractMesh((data, model), names, axis_types=(kind, kind))


@pytest.mark.parametrize("mesh, batch, message", [
    (_abstract(2, 3), 3, "batch of 3 prompts does not split over the mesh's data axis of size 2"),
    (_abstract(1, 2), 4, "num_kv_heads = 3 does not split over the mesh's model axis of size 2"),
    (_abstract(1, 3, names=("batch", "heads")), 1, r"mesh axes must be \('data', 'model'\)"),
    (_abstract(1, 3, kind=AxisType.Explicit), 1, "are not AxisType.Auto"),
])
def test_a_mesh_that_does_not_fit_the_request_raises_naming_it(mesh, batch, message):
    with pytest.raises(ValueError, match=message):
        sharding.validate_mesh(mesh, CONFIG, batch)


def test_validate_accepts_meshes_that_divide_batch_and_kv_heads():
    for data, model in [(1, 1), (2, 3), (4, 1), (1, 3)]:
        sharding.validate_mesh(_abstract(data, model), CONFIG, 4 * data)


def test_make_mesh_refuses_more_devices_than_visible():
    with pytest.raises(ValueError, match=f"needs {2 * jax.device_count()} devices"):
        sharding.make_mesh(2, jax.device_count())


def _record_sharding_calls(monkeypatch) -> list[str]:
    """Every function and class of jaxkv.sharding replaced by one that records its name, then runs."""
    calls = []

    def recording(name, target):
        def call(*args, **kwargs):
            calls.append(name)
            return target(*args, **kwargs)
        return call

    for name, value in list(vars(sharding).items()):
        if callable(value) and getattr(value, "__module__", None) == sharding.__name__:
            monkeypatch.setattr(sharding, name, recording(name, value))
    return calls


def test_one_device_generate_makes_no_sharding_call(monkeypatch):
    """Without a mesh, prefill and decoding (dense, and a sparse method through the
    four-region cache) call nothing in jaxkv.sharding; with a mesh the same patch
    sees the placement at the programs' boundary, so it would see a call."""
    params = models.init_params(CONFIG, jax.random.key(0))
    sparse = dict(method="topk", method_config=topk.TopKConfig(top_k=4, sink=2, local=4, buffer=3),
                  cache_config=kvcache.CacheConfig(dense_threshold=0))
    calls = _record_sharding_calls(monkeypatch)
    for kwargs in (dict(), sparse):
        jaxkv.generate(params, CONFIG, [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4]], max_new_tokens=6, **kwargs)
    assert calls == []
    jaxkv.generate(params, CONFIG, [[5, 6, 7, 8]], max_new_tokens=2, mesh=jax.make_mesh(
        (1, 1), sharding.AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1]))
    assert {"shard_params", "argument_specs", "place"} <= set(calls), calls


def test_param_specs_split_heads_and_mlp_over_model_and_replicate_the_rest():
    params = models.init_params(CONFIG, jax.random.key(0))
    mesh = sharding.make_mesh(1, 1)
    specs = sharding.param_specs(params, mesh)
    layers = specs.layers
    assert layers.wq == layers.wk == layers.wv == jax.P(None, None, "model", None)
    assert layers.wo == jax.P(None, "model", None, None)
    assert layers.w_gate == layers.w_up == jax.P(None, None, "model")
    assert layers.w_down == jax.P(None, "model", None)
    assert specs.embed == specs.final_norm == layers.attn_norm == jax.P()


def test_param_specs_of_split_layers_are_the_stacked_specs_without_the_layer_axis():
    params = models.init_params(CONFIG, jax.random.key(0))
    mesh = sharding.make_mesh(1, 1)
    stacked = sharding.param_specs(params, mesh).layers
    split = sharding.param_specs(models.unstack_layers(params, CONFIG.num_layers, join=False), mesh).layers
    assert len(split) == CONFIG.num_layers
    for layer in split:
        for field in dataclasses.fields(layer):
            spec, stacked_spec = getattr(layer, field.name), getattr(stacked, field.name)
            assert spec == (None if stacked_spec is None else jax.P(*stacked_spec[1:]))  # P()[1:] is P()


def test_param_specs_of_joined_projections_split_whole_gqa_groups_over_model():
    params = models.init_params(CONFIG, jax.random.key(0))
    split = sharding.param_specs(models.unstack_layers(params, CONFIG.num_layers), sharding.make_mesh(1, 1)).layers
    for layer in split:
        assert layer.wqkv == jax.P(None, "model", None, None)  # [D, Hkv, G + 2, hd]: by KV head
        assert layer.wq is layer.wk is layer.wv is None


def test_bytes_per_device_counts_each_memory_kind_once_per_device():
    mesh = sharding.make_mesh(1, 1)
    cache = sharding.shard_states(models.init_cache(CONFIG, 2, 8), mesh)
    host = sharding.place(np.zeros((2, 3, 5), np.float32), jax.P(), mesh)
    host = jax.device_put(host, host.sharding.with_memory_kind("pinned_host"))
    held = sharding.bytes_per_device((cache, host))
    assert held == {"device": cache.k.nbytes + cache.v.nbytes, "pinned_host": math.prod((2, 3, 5)) * 4}
