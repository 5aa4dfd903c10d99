"""The Pallas kernels wired into the methods and generate(): same results as the XLA path.

The kernel path is ``kernels="interpret"`` off a GPU (every kernel in Pallas
interpret mode) and ``kernels="pallas"`` (compiled) on one; ``kernels="xla"`` is
the path the methods always had. Integer outputs (hash codes, candidate and sample
ids) must agree exactly; float outputs differ only by float32 summation order.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import cache as kvcache
from jaxkv.attention import magicpig, pariskv
from jaxkv.cache import CacheConfig
from models.params import init_params
from pallas_kernels.testing import INTERPRET, lower_for_cuda, triton_kernels
from tests.test_generate import CONFIG, _prompts

# Small enough that interpret mode stays fast; K·L bits and B subspaces still > 1.
MAGICPIG = magicpig.MagicPIGConfig(K=4, L=8, sink=2, local=4, dense_layers=(), capacity=0.5,
                                   candidate_capacity=1.0)
PARISKV = pariskv.ParisKVConfig(m=4, top_k=12, sink=2, local=4, buffer=3)
# float32 scores over d = 16 summed in another order: relative error ~ d·eps ≈ 2e-6.
SCORE_RTOL = 1e-5
# Interpret mode on a GPU runs each grid step as separate device ops: far slower than
# the compiled kernels there, and not what a GPU user runs.
KERNELS = "interpret" if INTERPRET else "pallas"


def _with(cfg, kernels):
    return dataclasses.replace(cfg, kernels=kernels)


def _jaxpr_text(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def _keys(seed, n, d=16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, d)), jnp.float32)


@pytest.mark.parametrize("cls", [magicpig.MagicPIGConfig, pariskv.ParisKVConfig])
def test_kernels_field_is_validated_and_defaults_to_auto(cls):
    assert cls().kernels == "auto"
    assert cls().kernels.uses_pallas() == (jax.default_backend() == "gpu")
    assert not cls(kernels="xla").kernels.uses_pallas() and cls(kernels="interpret").kernels.uses_pallas()
    with pytest.raises(ValueError, match="kernels"):
        cls(kernels="triton")
    with pytest.raises(ValueError, match="kernels"):
        cls(kernels=["xla"])


def test_magicpig_hash_codes_equal_the_xla_path():
    keys, projection = _keys(0, 150), _keys(1, MAGICPIG.K * MAGICPIG.L).T
    xla = magicpig.hash_codes(_with(MAGICPIG, "xla"), projection, keys)
    kernel = magicpig.hash_codes(_with(MAGICPIG, KERNELS), projection, keys)
    # Integer codes: exact, since no projection is within the float32 rounding bound
    # of a length-d dot product (d·eps·Σ|x_i r_i|) of 0, where summation order could flip a bit.
    x64, r64 = np.asarray(keys, np.float64), np.asarray(projection, np.float64)
    assert np.all(np.abs(x64 @ r64) > 16 * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(r64)))
    np.testing.assert_array_equal(xla, kernel)
    assert kernel.shape == (150, MAGICPIG.L) and kernel.dtype == jnp.uint16


def test_magicpig_selection_equals_the_xla_path():
    """One index (built and extended on the XLA path); selections on both paths, with a
    candidate budget of 70 entries that stops some query heads before the last table
    and a sample capacity of 12 that one head overflows."""
    base = dataclasses.replace(MAGICPIG, candidate_capacity=70, capacity=12)
    xla_cfg = _with(base, "xla")
    index = magicpig.build(xla_cfg, _keys(2, 160), jnp.int32(120), jax.random.key(3))
    index = magicpig.insert(xla_cfg, index, _keys(4, 5), 5)
    q = _keys(5, 3)
    xla = magicpig.select_with_stats(xla_cfg, index, q)
    kernel = magicpig.select_with_stats(_with(base, KERNELS), index, q)
    # Sampled ids, per-head masks, tables read and counts are integers: exact.
    for a, b in zip(jax.tree.leaves(xla), jax.tree.leaves(kernel)):
        np.testing.assert_array_equal(a, b)
    stats = xla[1]
    assert np.all(stats.n_sampled > 0)  # the comparison covers real samples
    assert np.any(stats.tables_used < base.L) and np.any(stats.tables_used == base.L)
    assert bool(stats.truncated)
    cfg = _with(base, KERNELS)
    jaxpr = _jaxpr_text(lambda q: magicpig.select(cfg, index, q), q)
    assert all(name in jaxpr for name in ("simhash", "collide_count", "compact"))


@functools.partial(jax.jit, static_argnames="cfg")
def _pariskv_steps(cfg, index, q):
    candidates = pariskv.coarse_candidates(cfg, index, q)
    return candidates, pariskv.rerank_scores(cfg, index, q, candidates), pariskv.select(cfg, index, q)


@pytest.mark.parametrize("n", [150, 9])  # 9 < n_candidates: invalid rows fill the candidates
def test_pariskv_candidates_rerank_and_selection_equal_the_xla_path(n):
    # The index has no kernel path (insertion is elementwise); built once.
    index = pariskv.build(PARISKV, _keys(6, 200), jnp.int32(n))
    q = _keys(7, 2)
    cand_x, score_x, sel_x = _pariskv_steps(_with(PARISKV, "xla"), index, q)
    cand_k, score_k, sel_k = _pariskv_steps(_with(PARISKV, KERNELS), index, q)
    np.testing.assert_array_equal(cand_x, cand_k)  # same rows in ascending order
    np.testing.assert_allclose(score_k, score_x, rtol=SCORE_RTOL, atol=SCORE_RTOL * np.abs(score_x).max())
    np.testing.assert_array_equal(sel_x.idx, sel_k.idx)
    np.testing.assert_array_equal(sel_x.mask, sel_k.mask)
    assert int(sel_x.mask.sum()) == min(n, PARISKV.top_k)
    jaxpr = _jaxpr_text(lambda q: _pariskv_steps(_with(PARISKV, KERNELS), index, q), q)
    assert all(name in jaxpr for name in ("vote_totals", "compact", "rsq_rerank"))


# The GPU path ("pallas": compiled kernels) lowered for CUDA on this CPU machine:
# catches block shapes and batching (vmap over batch, heads, query heads) Triton
# cannot compile, without a GPU. SmolLM2-like head (d = 64, GQA 3), retrieval on
# the device, a capacity that is not a power of two.
_CUDA_CASES = [
    (magicpig.METHOD, magicpig.MagicPIGConfig(K=8, L=20, kernels="pallas"),
     ["simhash", "collide_count", "compact", "gather_attention"]),
    (pariskv.METHOD, pariskv.ParisKVConfig(kernels="pallas"), ["vote_totals", "compact", "rsq_rerank", "gather_attention"]),
]


def _lower_retrieval_step(method, mcfg, capacity, offload=False):
    batch, kv_heads, group, d = 1, 2, 3, 64
    ccfg = CacheConfig(offload=offload).resolve(mcfg)
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    state = jax.eval_shape(
        lambda k, v, n: kvcache.regions_from_prefill(k, v, n, method=method, mcfg=mcfg, ccfg=ccfg,
                                                     capacity=capacity, key=jax.random.key(0)),
        f32((batch, kv_heads, 2048, d)), f32((batch, kv_heads, 2048, d)),
        jax.ShapeDtypeStruct((batch,), jnp.int32))
    return lower_for_cuda(
        lambda q, st: kvcache._retrieval_sparse(q, st, method=method, mcfg=mcfg, ccfg=ccfg),
        f32((batch, kv_heads, group, d)), state)


@pytest.mark.parametrize("method, mcfg, kernels", _CUDA_CASES)
def test_decode_step_lowers_for_cuda_through_the_kernels(method, mcfg, kernels):
    assert triton_kernels(_lower_retrieval_step(method, mcfg, capacity=1000)) == kernels


def test_pariskv_vote_kernel_takes_a_capacity_above_1024_not_a_multiple_of_1024():
    _lower_retrieval_step(pariskv.METHOD, pariskv.ParisKVConfig(kernels="pallas"), capacity=1300)


@pytest.fixture(scope="module")
def one_layer():
    """test_generate's tiny model cut to one layer (half the decode loop to compile),
    weights scaled the same way so greedy choices are clear-cut."""
    config = dataclasses.replace(CONFIG, num_layers=1)
    p = init_params(config, jax.random.key(0))
    return config, jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, p)


@pytest.mark.slow  # ~50 s per method here: generate's decode loop compiles on both paths
@pytest.mark.parametrize("method, mcfg", [("magicpig", MAGICPIG), ("pariskv", PARISKV)])
def test_generate_with_the_kernels_gives_the_xla_tokens(one_layer, method, mcfg):
    """The layer is sparse, with no dense fallback and the retrieval region on the device
    (so the gather-attention kernel runs too); a 30-token prompt leaves 24 keys in
    retrieval and 9 decode steps flush the buffer (U = 3) into the index three times."""
    config, params = one_layer
    prompt = _prompts([30], seed=11)
    cache = CacheConfig(sink=2, local=4, buffer=3, dense_threshold=0, offload=False)
    tokens = {}
    for kernels in ("xla", KERNELS):
        out = jaxkv.generate(params, config, prompt, max_new_tokens=9, eos_ids=(), method=method,
                             method_config=_with(mcfg, kernels), cache_config=cache)
        tokens[kernels] = out.tokens, out.keys_read_fraction
    # Same tokens, and the same keys read at every step (counts from integer selections).
    assert tokens[KERNELS] == tokens["xla"]
    assert len(tokens["xla"][0][0]) == 9
