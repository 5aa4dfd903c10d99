"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices.

    python tests/sharding_worker.py '{"meshes": [[4, 2]], "methods": ["dense", "pariskv"]}'

For each method: greedy tokens on one device, then for each mesh the tokens of
the sharded generate(), and the per-device shard shapes and memory kinds of the
parameters and of the decode state before and after the decode loop. Prints
one JSON object; the test asserts on it (the worker checks nothing itself).

With ``"distributed": {"coordinator": "localhost:PORT", "num_processes": N,
"process_id": i}`` it is one of N processes joined by jax.distributed
(8 / N simulated devices each, gloo collectives) and reports only tokens.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys

TOTAL_DEVICES = 8
REQUEST = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
PROCESSES = REQUEST.get("distributed", {}).get("num_processes", 1)
# Before JAX creates its backend: the device count is fixed then.
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={TOTAL_DEVICES // PROCESSES}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
import models  # noqa: E402
from jaxkv import cache as kvcache  # noqa: E402
from jaxkv import sharding  # noqa: E402
from jaxkv.attention import magicpig, pariskv  # noqa: E402

gen = importlib.import_module("jaxkv.generate")  # the module (jaxkv.generate is also the function)

# 12 KV heads split over model axes 1, 2, 3, 4 and 6; three query heads per KV
# head as in SmolLM2 (9 / 3); MLP width 96 splits over all of them too.
CONFIG = models.ModelConfig(
    model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
    num_heads=36, num_kv_heads=12, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True,
    attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))
NEW_TOKENS = 9
# Sparse from the first decode step (no dense fallback); a 3-token buffer
# flushes into the index three times in 9 steps. MagicPIG keeps layer 0 dense,
# so the per-layer state tuple mixes a dense cache and a RegionKV.
CACHE = kvcache.CacheConfig(sink=2, local=4, buffer=3, dense_threshold=0)
METHODS = {
    "dense": {},
    "magicpig": dict(method="magicpig", cache_config=CACHE, method_config=magicpig.MagicPIGConfig(
        K=4, L=8, sink=2, local=4, dense_layers=(0,), capacity=0.5, candidate_capacity=1.0)),
    "pariskv": dict(method="pariskv", cache_config=CACHE, method_config=pariskv.ParisKVConfig(
        m=4, top_k=12, sink=2, local=4, buffer=3)),
    # Contexts 23–42 straddle the threshold: on one device the shortest row keeps
    # every row dense; shards holding only long rows must decide the same way.
    "pariskv_fallback": dict(method="pariskv", cache_config=dataclasses.replace(CACHE, dense_threshold=32),
                             method_config=pariskv.ParisKVConfig(m=4, top_k=12, sink=2, local=4, buffer=3)),
}


def tiny_params():
    # std 0.02 init makes every logit nearly equal; scale up so greedy choices are clear-cut.
    p = models.init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, p)


def prompts():
    """8 prompts of different lengths (every mesh's data axis divides 8)."""
    rng = np.random.default_rng(0)
    return [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (30, 27, 31, 25, 30, 29, 33, 22)]


def layout(tree) -> list:
    """Per leaf: path, global shape, bytes, memory kind, distinct shard shapes, shard count."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shard_shapes = sorted({tuple(s.data.shape) for s in leaf.addressable_shards})
        rows.append(dict(path=jax.tree_util.keystr(path), shape=list(leaf.shape), nbytes=leaf.nbytes,
                         memory_kind=leaf.sharding.memory_kind, shard_shapes=[list(s) for s in shard_shapes],
                         shards=len(leaf.addressable_shards)))
    return rows


def states_before_and_after_decode(params, mesh, kwargs):
    """generate()'s own steps, keeping the decode state that generate() does not return."""
    rows = prompts()
    params = sharding.shard_params(params, CONFIG, mesh)
    capacity = max(map(len, rows)) + NEW_TOKENS
    prefilled = jaxkv.prefill_prompts(params, CONFIG, rows, capacity=capacity, mesh=mesh)
    decoding = gen.start_decoding(params, CONFIG, prefilled, max_new_tokens=NEW_TOKENS, mesh=mesh, **kwargs)
    before = layout(decoding.caches)
    compiled = decoding.lower(NEW_TOKENS - 1).compile()
    decoding.advance(NEW_TOKENS - 1)
    states = decoding.caches
    return (before, layout(states), sharding.bytes_per_device(states), prefilled.first_logits,
            collectives(compiled.as_text()))


COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                        r"(?:-start)?\(")
SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def collectives(hlo: str) -> list:
    """[op, [element count of each result]] for every cross-device op of a compiled program."""
    found = []
    for match in COLLECTIVE.finditer(hlo):
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in SHAPE.findall(match.group(1))]
        found.append([match.group(2), sizes])
    return found


def reference_and_sharded(params, request):
    """(method, kwargs, mesh, one-device Generation, sharded Generation) for every requested case."""
    for method in request["methods"]:
        kwargs = METHODS[method]
        reference = jaxkv.generate(params, CONFIG, prompts(), max_new_tokens=NEW_TOKENS, eos_ids=(), **kwargs)
        for data, model in request["meshes"]:
            mesh = sharding.make_mesh(data, model)
            out = jaxkv.generate(params, CONFIG, prompts(), max_new_tokens=NEW_TOKENS, eos_ids=(),
                                 mesh=mesh, **kwargs)
            yield method, kwargs, mesh, reference, out


def _case(method, mesh, reference, out) -> dict:
    return dict(method=method, mesh=list(mesh.devices.shape), reference=reference.tokens, sharded=out.tokens,
                reference_read=reference.keys_read_fraction, sharded_read=out.keys_read_fraction)


def main(request: dict) -> dict:
    params = tiny_params()
    capacity = max(map(len, prompts())) + NEW_TOKENS  # as generate() sizes it
    one_device_logits = np.asarray(jaxkv.prefill_prompts(params, CONFIG, prompts(), capacity=capacity).first_logits)
    top2 = np.sort(one_device_logits, axis=-1)[:, -2:]
    result = {"devices": jax.device_count(), "new_tokens": NEW_TOKENS, "hidden_size": CONFIG.hidden_size,
              "batch": len(prompts()), "cases": [], "split_cases": [],
              "first_logits_abs_max": float(np.abs(one_device_logits).max()),
              "first_logits_top2_gap_min": float(np.min(top2[:, 1] - top2[:, 0]))}
    for method, kwargs, mesh, reference, out in reference_and_sharded(params, request):
        before, after, held, logits, moved = states_before_and_after_decode(params, mesh, kwargs)
        result["cases"].append(dict(
            _case(method, mesh, reference, out),
            params=layout(sharding.shard_params(params, CONFIG, mesh)),
            states_before=before, states_after=after, bytes_per_device=held, decode_collectives=moved,
            first_logits_max_diff=float(np.max(np.abs(np.asarray(logits) - one_device_logits)))))
    if request.get("split_params"):  # weights split (q, k and v joined) by the caller, dense decode
        split = models.unstack_layers(params, CONFIG.num_layers)
        reference = jaxkv.generate(params, CONFIG, prompts(), max_new_tokens=NEW_TOKENS, eos_ids=())
        for data, model in request["meshes"]:
            mesh = sharding.make_mesh(data, model)
            out = jaxkv.generate(split, CONFIG, prompts(), max_new_tokens=NEW_TOKENS, eos_ids=(), mesh=mesh)
            result["split_cases"].append(dict(_case("dense", mesh, reference, out),
                                              params=layout(sharding.shard_params(split, CONFIG, mesh))))
    return result


def main_distributed(request: dict) -> dict:
    """One process of several: one-device tokens on a local device vs generate() on a mesh over all."""
    joined = request["distributed"]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(joined["coordinator"], num_processes=joined["num_processes"],
                               process_id=joined["process_id"])
    params = tiny_params()
    result = {"process": jax.process_index(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count(), "cases": []}
    for method, _, mesh, reference, out in reference_and_sharded(params, request):
        result["cases"].append(dict(_case(method, mesh, reference, out),
                                    mesh_processes=sorted({d.process_index for d in mesh.devices.flat})))
    jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    print(json.dumps(main_distributed(REQUEST) if "distributed" in REQUEST else main(REQUEST)))
