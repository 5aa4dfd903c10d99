"""A decode step updates the stacked dense cache in place instead of copying it,
generate()'s token loop reads the layer weights where they lie, a sparse
layer's sink and window are written in place, and a MagicPIG layer's bucket
starts are copied only by a flush.

forward_hidden scans the layers with every layer's cache in the scan's carry;
cached_attention writes only the new tokens. Scanning the cache as xs → ys
instead allocates a second full cache every step (measured: 208 → 129 ms per
dense SmolLM2 step at 8k context). The compiled step's temporary memory tells
the two apart without timing anything.
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import models
from helpers_tiny_models import tiny_config
from jaxkv import cache as kvcache
from jaxkv.attention import magicpig, topk

generate_module = importlib.import_module("jaxkv.generate")

CONFIG = tiny_config(num_layers=8)


def _compiled_step_memory(cache):
    params = models.init_params(CONFIG, jax.random.key(0))
    tokens = jnp.zeros((2, 1), jnp.int32)
    positions = jnp.full((2, 1), 100, jnp.int32)
    step = jax.jit(lambda p, c, t, pos: models.forward(p, CONFIG, t, c, positions=pos), donate_argnums=(1,))
    return step.lower(params, cache, tokens, positions).compile().memory_analysis()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_decode_step_does_not_copy_the_cache(dtype):
    """Nor widen it: XLA CPU widened a bfloat16 cache to float32 for each write into it
    (models.stored_rows); the cache holds its bits instead."""
    cache = models.init_cache(CONFIG, 2, 4096, dtype)
    assert cache.dtype == dtype
    cache_bytes = cache.k.nbytes + cache.v.nbytes
    memory = _compiled_step_memory(cache)
    # The cache is donated and aliased to the output...
    assert memory.alias_size_in_bytes == cache_bytes
    # ...and the temporaries are one layer's working set (its K/V slices and
    # scores: 0.145 of this 8-layer cache, the same bytes at any layer count),
    # not a second cache: scanning the cache as xs → ys measured >= 1.0.
    assert memory.temp_size_in_bytes < cache_bytes / 4, (memory.temp_size_in_bytes, cache_bytes)


def test_stacked_and_per_layer_cached_attention_agree():
    """cached_attention on the stack (with a layer index) equals it on that layer alone."""
    rng = np.random.default_rng(0)
    b, h, g, s, hd, layers = 2, 2, 3, 16, 8, 3
    stack = models.KVCache(*(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                             for shape in ((layers, b, h, hd, s), (layers, b, h, s, hd))))
    q = jnp.asarray(rng.standard_normal((b, 2, h * g, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, 2, h, hd)), jnp.float32) for _ in "kv")
    positions = jnp.asarray([[5, 6], [9, 10]], jnp.int32)
    out_stack, new_stack = models.cached_attention(q, k, v, positions, stack, jnp.int32(1))
    one = models.KVCache(k=stack.k[1], v=stack.v[1])
    out_one, new_one = models.cached_attention(q, k, v, positions, one)
    np.testing.assert_array_equal(np.asarray(out_stack), np.asarray(out_one))
    np.testing.assert_array_equal(np.asarray(new_stack.k[1]), np.asarray(new_one.k))
    # Only layer 1 changed, and in it only the written positions.
    for other in (0, 2):
        np.testing.assert_array_equal(np.asarray(new_stack.k[other]), np.asarray(stack.k[other]))
    np.testing.assert_array_equal(np.asarray(new_one.v[0, :, 5]), np.asarray(v[0, 0]))
    np.testing.assert_array_equal(np.asarray(new_one.k[0, :, :, 5]), np.asarray(k[0, 0]))
    changed = np.any(np.asarray(new_one.k) != np.asarray(one.k), axis=(1, 2))  # [B, S]
    assert changed.sum() == 4 and changed[0, 5] and changed[0, 6] and changed[1, 9] and changed[1, 10]


def _decode_loop_hlo(config, prompt, new, method, method_config=None, cache_config=None, dtype=jnp.float32):
    """The compiled text of generate()'s real token loop for one prompt, weights (and so the
    cache) of dtype."""
    params = models.cast_params(models.init_params(config, jax.random.key(0)), dtype)
    prefilled = jaxkv.prefill_prompts(params, config, [prompt], capacity=len(prompt) + new)
    decoding = generate_module.start_decoding(params, config, prefilled, max_new_tokens=new, method=method,
                                              method_config=method_config, cache_config=cache_config)
    return decoding.lower(new - 1).compile().as_text()


def _arrays_of_shape(hlo, *shapes):
    """The right-hand sides of the HLO's instructions whose result has one of these shapes."""
    rhs = [line.split(" = ", 1)[-1] for line in hlo.splitlines() if " = " in line]
    return [r for r in rhs if r.startswith(shapes)]


# HLO element type of a cache that holds rows of dtype (bfloat16 as bits: models.stored_rows).
STORED = {jnp.float32: "f32", jnp.bfloat16: "u16"}


def _written_in_place(hlo, dims: list[str], dtype) -> list[str]:
    """The row writes into caches of these dims ("1,2,17,8") as the HLO makes them, after
    checking that none copies such a cache and, for bfloat16 rows, that none is widened
    (XLA CPU wrote a bfloat16 buffer as float32: a convert of it, the write, a convert back)."""
    stored = _arrays_of_shape(hlo, *(f"{STORED[dtype]}[{d}]" for d in dims))
    copies = [rhs for rhs in stored if " copy(" in rhs]
    assert not copies, copies[:4]
    if dtype == jnp.bfloat16:
        widened = [rhs for rhs in _arrays_of_shape(hlo, *(f"{t}[{d}]" for d in dims for t in ("f32", "bf16")))
                   if "dynamic-update-slice" in rhs]
        assert not widened, widened[:4]
    return [rhs for rhs in stored if "dynamic-update-slice" in rhs]


@functools.cache
def _magicpig_loop_hlo():
    """The compiled token loop of a 3-layer model, MagicPIG on layer 1, dense layers 0 and 2."""
    config = tiny_config(num_layers=3)
    mcfg = magicpig.MagicPIGConfig(dense_layers=(0, 2))
    hlo = _decode_loop_hlo(config, [3 + i % 100 for i in range(80)], 12, "magicpig", mcfg,
                           kvcache.CacheConfig(dense_threshold=0))
    return config, mcfg, hlo


@pytest.mark.parametrize("method", ["dense", "topk"])
def test_decode_loop_copies_no_layer_weight_per_token(method):
    """No array of an MLP weight's shape is made inside generate()'s token loop.

    XLA CPU copies a stacked weight's layer slice before the matmul that reads
    it; sliced inside the loop, every weight was copied on every token (≈ 70 ms
    of a ≈ 170 ms SmolLM2 token at 8k context in XLA's trace). generate()
    splits the stack once per call, before the loop (models.unstack_layers).
    """
    d, f = 32, 72  # an MLP shape no activation of this model has
    config = tiny_config(num_layers=3, hidden_size=d, intermediate_size=f)
    mcfg, ccfg = (None, None) if method == "dense" else (
        topk.TopKConfig(top_k=4, sink=2, local=4, buffer=2), kvcache.CacheConfig(dense_threshold=0))
    hlo = _decode_loop_hlo(config, list(range(3, 23)), 4, method, mcfg, ccfg)
    weight_shapes = (f"f32[{d},{f}]", f"f32[{f},{d}]")
    weight_arrays = [line for line in hlo.splitlines() if line.split(" = ", 1)[-1].startswith(weight_shapes)]
    made_in_loop = [line for line in weight_arrays if "/while/body/" in line]
    assert not made_in_loop, made_in_loop[:3]
    # The shapes are there, the loop's split inputs: the check can see them.
    assert len(weight_arrays) >= 3 * 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_decode_loop_copies_no_sink_or_window(dtype):
    """generate()'s token loop writes each layer's sink and window in place and copies neither.

    Written in line, the window's row write was fused with the reshape of the
    attention that reads it and the whole window copied twice per layer per
    token (4 copies of 0.77 MB per layer: ≈ 26 ms of a ≈ 167 ms ParisKV
    SmolLM2 token at 8k in XLA's trace); a flush that shifted the window
    copied it as well. The writes run in conds and the window is a ring.
    """
    config = tiny_config(num_layers=3)
    sink, local, buffer = 3, 11, 6  # 17 window slots: no other array of the model has this shape
    hlo = _decode_loop_hlo(config, [3 + i % 100 for i in range(60)], 12, "topk",
                           topk.TopKConfig(top_k=4, sink=sink, local=local, buffer=buffer),
                           kvcache.CacheConfig(dense_threshold=0), dtype)
    b, hkv, hd = 1, config.num_kv_heads, config.head_dim
    writes = _written_in_place(hlo, [f"{b},{hkv},{n},{hd}" for n in (sink, local + buffer)], dtype)
    # The regions are in the loop (the writes are there to see): the check can see them.
    assert len(writes) >= 2 * 3 * 2


def test_magicpig_decode_loop_copies_bucket_starts_only_when_flushing():
    """A MagicPIG layer's bucket starts are copied only where a flush computes new ones.

    When the flush computed the new starts before its merge, XLA CPU gave them
    a buffer of their own, and the untaken branch of the flush cond copied the
    starts into it on every token, then the loop copied them back (2 copies of
    1.8 MB per layer: ≈ 15 ms of a ≈ 236 ms SmolLM2 token at 8k in XLA's trace).
    """
    config, mcfg, hlo = _magicpig_loop_hlo()
    starts_arrays = _arrays_of_shape(hlo, f"s32[1,{config.num_kv_heads},{mcfg.L},{2 ** mcfg.K + 1}]")
    copied_as_they_stand = [rhs for rhs in starts_arrays if " copy(%get-tuple-element" in rhs]
    assert not copied_as_they_stand, copied_as_they_stand
    # The flushes' new starts are there to see: one computed per sparse layer.
    sparse_layers = config.num_layers - len(mcfg.dense_layers)
    assert sum(" fusion(" in rhs for rhs in starts_arrays) >= sparse_layers


@pytest.mark.parametrize("method, dtype", [("dense", jnp.float32), ("dense", jnp.bfloat16), ("magicpig", jnp.float32)])
def test_decode_loop_copies_no_dense_layer_cache(method, dtype):
    """generate()'s token loop attends each dense layer's K and V where they lie and copies neither.

    From a stacked [L, ...] cache XLA CPU copied each layer's K and V slice
    before attending them (≈ 60 ms of a ≈ 200 ms dense SmolLM2 token at 8k in
    XLA's trace); a per-layer cache written in line was copied too (the
    window's failure, see above). Dense layers keep one cache per layer,
    written in a cond.
    """
    if method == "dense":
        config = tiny_config(num_layers=3)
        hlo = _decode_loop_hlo(config, [3 + i % 100 for i in range(80)], 12, "dense", dtype=dtype)
    else:
        config, _, hlo = _magicpig_loop_hlo()
    chunk = generate_module.default_prefill_chunk(80)
    capacity = max(80 + 12, -(-80 // chunk) * chunk)  # the staging cache: at least whole prefill chunks
    layer_dims = [f"1,{config.num_kv_heads},{a},{b}"
                  for a, b in ((config.head_dim, capacity), (capacity, config.head_dim))]  # K, V
    writes = _written_in_place(hlo, layer_dims, dtype)
    for dims in layer_dims:
        assert f"{STORED[dtype]}[{config.num_layers},{dims}]" not in hlo  # no stacked cache
    # Each dense layer's K and V writes are there to see.
    dense_layers = config.num_layers if method == "dense" else 2
    assert len(writes) >= 2 * dense_layers
