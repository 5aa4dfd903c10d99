"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices.

    python tests/sharding_worker.py '{"meshes": [[4, 2]], "methods": ["dense", "pariskv"]}'
    python tests/sharding_worker.py '{"cases": {"pariskv": [[1, 1, 8]]}, "methods": []}'

For each method: greedy tokens on one device, then for each mesh the tokens of
the sharded generate(), and the per-device shard shapes and memory kinds of the
parameters and of the decode state before and after the decode loop. Prints
one JSON object; the test asserts on it (the worker checks nothing itself).

With ``"selections": {"keys": N, "methods": [...]}`` it also compares, per method, one
device's selection and estimate over N random keys with those of ``select_sharded`` on
the shards of an 8-device context axis. With ``"memory": true`` it reports the bytes per device of one
sparse layer's retrieval fields at 4,096 positions for context axes of 1, 2, 4 and 8.

With ``"distributed": {"coordinator": "localhost:PORT", "num_processes": N,
"process_id": i}`` it is one of N processes joined by jax.distributed
(8 / N simulated devices each, gloo collectives) and reports only tokens.
"""
from __future__ import annotations

import dataclasses
import functools
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
import models  # noqa: E402
from jaxkv import cache as kvcache  # noqa: E402
from jaxkv import sharding  # noqa: E402
from jaxkv.attention import hybrid, magicpig, pariskv, pqcache, topk  # noqa: E402

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
    "hybrid": dict(method="hybrid", cache_config=CACHE, method_config=hybrid.HybridConfig(
        pariskv=pariskv.ParisKVConfig(m=4, top_k=6), sink=2, local=4, buffer=3)),
    "hybrid_lsh": dict(method="hybrid", cache_config=CACHE, method_config=hybrid.HybridConfig(
        pariskv=pariskv.ParisKVConfig(m=4, top_k=6), tail="lsh", sink=2, local=4, buffer=3,
        magicpig=magicpig.MagicPIGConfig(K=4, L=8, capacity=0.5, candidate_capacity=1.0))),
    "pqcache": dict(method="pqcache", cache_config=CACHE, method_config=pqcache.PQCacheConfig(
        n_sub=2, n_centroids=8, top_k=12, sink=2, local=4)),
    "topk": dict(method="topk", cache_config=CACHE, method_config=topk.TopKConfig(top_k=12, sink=2, local=4, buffer=3)),
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


def make_mesh(shape):
    """[data, model] or [data, model, context]."""
    return sharding.make_mesh(*shape[:2], context=shape[2] if len(shape) == 3 else None)


def reference_and_sharded(params, request):
    """(method, kwargs, mesh, one-device Generation, sharded Generation) for every requested case:
    each of "methods" on each of "meshes", or the meshes of each method in "cases"."""
    cases = request.get("cases") or {method: request["meshes"] for method in request["methods"]}
    for method, meshes in cases.items():
        kwargs = METHODS[method]
        reference = jaxkv.generate(params, CONFIG, prompts(), max_new_tokens=NEW_TOKENS, eos_ids=(), **kwargs)
        for shape in meshes:
            mesh = make_mesh(shape)
            out = jaxkv.generate(params, CONFIG, prompts(), max_new_tokens=NEW_TOKENS, eos_ids=(),
                                 mesh=mesh, **kwargs)
            yield method, kwargs, mesh, reference, out


def _case(method, mesh, reference, out) -> dict:
    return dict(method=method, mesh=list(mesh.devices.shape), reference=reference.tokens, sharded=out.tokens,
                reference_read=reference.keys_read_fraction, sharded_read=out.keys_read_fraction)


SELECTION_CONFIGS = {"hybrid": hybrid.HybridConfig(), "hybrid_lsh": hybrid.HybridConfig(tail="lsh"),
                     "magicpig": magicpig.MagicPIGConfig(),
                     "pariskv": pariskv.ParisKVConfig(top_k=100), "pqcache": pqcache.PQCacheConfig(),
                     "topk": topk.TopKConfig(top_k=100)}


def _picked(sel):
    """Which slots of a selection are read by some query head."""
    return sel.mask if sel.mask.ndim == 1 else sel.mask.any(axis=0)


def _estimate(method, cfg, index, q, keys, values, sel, correct):
    """The partial over a selection's rows, corrected as the method says (the cache's XLA path),
    and its estimate of the rest."""
    from jaxkv.attention import common
    k_rows, v_rows = keys[sel.idx], values[sel.idx]
    return common.with_rest(common.partial_attention(q, k_rows, v_rows, sel.mask, correct(index, q, k_rows, sel)),
                            sel)


def one_device(method, cfg, keys, values, n, queries):
    """Per query: the rows method.select picks over the first n of keys [cap, d], and the
    normalised estimate over them."""
    from jaxkv.attention import common
    index = method.build(cfg, keys, values, n, None)
    correct = functools.partial(method.correction, cfg)
    rows, outs = [], []
    for q in queries:
        sel = method.select(cfg, index, q)
        rows.append(sorted(set(np.asarray(sel.idx)[np.asarray(_picked(sel))].tolist())))
        outs.append(np.asarray(common.finalize(_estimate(method, cfg, index, q, keys, values, sel, correct))).tolist())
    return rows, outs


def sharded(method, cfg, keys, values, n, queries, buffer):
    """The same from select_sharded and correction_sharded on each shard of the 8 devices' context
    axis, the shards' partials merged (shards.merge_partials)."""
    from jax.sharding import PartitionSpec as P
    from jaxkv.attention import common
    from jaxkv.attention.shards import ContextShards, merge_partials
    count = jax.device_count()
    context = ContextShards.split("context", count, keys.shape[0], buffer)
    mesh = jax.make_mesh((count,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    first = np.arange(count) * context.rows_per_shard

    def blocks(x):  # [C, local_cap, d]: shard c's rows c·rows_per_shard onwards
        padded = np.pad(x, ((0, count * context.local_capacity), (0, 0)))
        return np.stack([padded[f:f + context.local_capacity] for f in first])

    def local(k, v, used, q):
        k, v = k[0], v[0]
        index = method.build_sharded(cfg, k, v, used[0], None, context)
        sel = method.select_sharded(cfg, index, q, context)
        correct = lambda *a: method.correction_sharded(cfg, *a, context)  # noqa: E731
        merged = merge_partials(_estimate(method, cfg, index, q, k, v, sel, correct), context)
        return jnp.where(_picked(sel), context.index() * context.rows_per_shard + sel.idx, -1)[None], \
            common.finalize(merged)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("context"),) * 3 + (P(),),
                                out_specs=(P("context"), P()), check_vma=False))
    used = np.clip(n - first, 0, context.rows_per_shard).astype(np.int32)
    rows, outs = [], []
    for q in queries:
        found, out = run(blocks(keys), blocks(values), used, q)
        found = np.asarray(found).reshape(-1)
        rows.append(sorted(set(found[found >= 0].tolist())))
        outs.append(np.asarray(out).tolist())
    return rows, outs


def selections(request: dict) -> list:
    """One device's selection and estimate against the shards', for random keys and queries."""
    from jaxkv.attention import registry
    rng = np.random.default_rng(1)
    n, d, buffer = request["selections"]["keys"], 64, 64
    keys = rng.standard_normal((n + buffer, d)).astype(np.float32)
    values = rng.standard_normal((n + buffer, d)).astype(np.float32)
    queries = [rng.standard_normal((3, d)).astype(np.float32) * 2 for _ in range(4)]
    found = []
    for name in request["selections"]["methods"]:
        method, cfg = registry.get(name.split("_")[0]), SELECTION_CONFIGS[name]
        rows, outs = one_device(method, cfg, jnp.asarray(keys), jnp.asarray(values), n, queries)
        shard_rows, shard_outs = sharded(method, cfg, keys, values, n, queries, buffer)
        found.append(dict(method=name, one_device=rows, sharded=shard_rows, one_device_out=outs,
                          sharded_out=shard_outs))
    return found


def retrieval_bytes() -> dict:
    """Bytes per device of a sparse layer's retrieval fields (K/V, index, count), per context size."""
    from jaxkv.attention import registry
    config = dataclasses.replace(CONFIG, num_layers=1, num_kv_heads=4, num_heads=12)
    staging = models.init_cache(config, 1, 4096)
    held = {}
    for context in (1, 2, 4, 8):
        mesh = sharding.make_mesh(1, 1, context=context)
        backend = kvcache.make_backend(config, "pariskv", pariskv.ParisKVConfig(m=4), kvcache.CacheConfig(
            local=64, buffer=16, dense_threshold=0), 4096 - 64, 64, context=sharding.context_split(mesh))
        (state,) = jax.jit(functools.partial(sharding.regions_per_shard, backend=backend, mesh=mesh))(
            staging, np.array([4000], np.int32))
        fields = {name: getattr(state, name) for name in kvcache.RETRIEVAL_FIELDS}
        held[context] = dict(bytes=sum(sharding.bytes_per_device(fields).values()),
                             rows_per_shard=backend.context.rows_per_shard, buffer=backend.cache.buffer,
                             capacity=backend.retrieval_capacity)
    return held


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
    if request.get("selections"):
        result["selections"] = selections(request)
    if request.get("memory"):
        result["memory"] = retrieval_bytes()
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
