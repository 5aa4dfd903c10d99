"""Numerical safety of every attention method and kernel reference under adversarial inputs.

Hypothesis draws the inputs (profile "default": 20 examples; "long": 500 —
``pytest --hypothesis-profile=long tests/test_numerics_fuzz.py``). Shapes are
fixed per method so each compiles once; what varies is the data: query and
key norms from 1e-12 to 1e6, all-equal keys, a key equal to minus the query,
bf16 inputs with large scores.

Properties:
* every output is finite and lies in the per-coordinate range of the values
  (any softmax-weighted estimate — MagicPIG's importance-corrected one too —
  is a convex combination of the values it read);
* contexts of 0, 1, S+W−1, S+W tokens are attended exactly (equal to dense);
  S+W+1 tokens puts one key in the retrieval region;
* NaN is propagated, never hidden: a NaN query or a NaN in an exactly
  attended key makes that output NaN (documented in docs/reliability.md).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxkv.attention import common, dense, hybrid, magicpig, pariskv, pqcache, topk
from pallas_kernels import gather_attention as gather_kernel
from pallas_kernels import simhash as simhash_kernel

G, D = 2, 16
SINK, LOCAL = 2, 6
N = SINK + LOCAL + 24  # 24 keys in the retrieval region

# Small settings of every method (official defaults are far larger than 24 retrieval keys).
METHODS = {
    "magicpig": (magicpig.METHOD, magicpig.MagicPIGConfig(K=4, L=8, sink=SINK, local=LOCAL)),
    "pariskv": (pariskv.METHOD, pariskv.ParisKVConfig(top_k=4, sink=SINK, local=LOCAL)),
    "pqcache": (pqcache.METHOD,
                pqcache.PQCacheConfig(n_centroids=4, kmeans_iters=3, top_k=4, sink=SINK, local=LOCAL)),
    "topk": (topk.METHOD, topk.TopKConfig(top_k=4, sink=SINK, local=LOCAL)),
    "hybrid": (hybrid.METHOD, hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=2), sink=SINK, local=LOCAL)),
    "hybrid_lsh": (hybrid.METHOD, hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=2), tail="lsh",
                                                      magicpig=magicpig.MagicPIGConfig(K=4, L=8),
                                                      sink=SINK, local=LOCAL)),
}


@functools.partial(jax.jit, static_argnames=("name",))
def attend(name, q, keys, values):
    method, cfg = METHODS[name]
    return method.attend(cfg, q, keys, values, jax.random.key(1))


SCALES = st.sampled_from([1e-12, 1e-6, 1.0, 1e3, 1e6])
PATTERNS = st.sampled_from(["random", "all_equal", "minus_query", "bf16_large_scores"])


def adversarial_inputs(seed, q_scale, k_scale, pattern, n=N):
    rq, rk, rv = jax.random.split(jax.random.key(seed), 3)
    q = q_scale * jax.random.normal(rq, (G, D), jnp.float32)
    k = k_scale * jax.random.normal(rk, (n, D), jnp.float32)
    v = jax.random.normal(rv, (n, D), jnp.float32)
    if pattern == "all_equal":
        k = jnp.broadcast_to(k[:1], k.shape)
    elif pattern == "minus_query":
        k = k.at[SINK + 3].set(-q[0] * (k_scale / max(q_scale, 1e-30)))
    elif pattern == "bf16_large_scores":
        # Scores of order 1e4: exp overflows unless the max is subtracted first.
        q = (300.0 * q / jnp.linalg.norm(q, axis=-1, keepdims=True)).astype(jnp.bfloat16)
        k = (300.0 * k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-30)).astype(jnp.bfloat16)
        v = v.astype(jnp.bfloat16)
    return q, k, v


def assert_in_value_range(out, v):
    """out[G, d] within [min v, max v] per coordinate, up to float32 rounding of the weighted sum.

    Tolerance: a convex combination of at most N = 32 float32 terms is off by at
    most ~N·2^-24 of max|v| (≈ 2e-6); 1e-5·max|v| leaves margin.
    """
    v = np.asarray(v, np.float32)
    out = np.asarray(out)
    assert np.all(np.isfinite(out)), out
    tol = 1e-5 * np.max(np.abs(v))
    assert np.all(out >= v.min(axis=0) - tol) and np.all(out <= v.max(axis=0) + tol)


@pytest.mark.parametrize("name", ["dense", *METHODS])
@given(seed=st.integers(0, 2**31 - 1), q_scale=SCALES, k_scale=SCALES, pattern=PATTERNS)
def test_output_is_finite_and_a_convex_combination_of_values(name, seed, q_scale, k_scale, pattern):
    q, k, v = adversarial_inputs(seed, q_scale, k_scale, pattern)
    out = dense.dense(q, k, v)[0] if name == "dense" else attend(name, q, k, v)[0]
    assert_in_value_range(out, v)


@pytest.mark.parametrize("name", ["dense", *METHODS])
def test_all_equal_keys_give_the_mean_of_what_was_read(name):
    """Equal keys have equal scores: dense (and the exact-only short context) is the plain mean."""
    q, k, v = adversarial_inputs(0, 1.0, 1.0, "all_equal", n=SINK + LOCAL)
    out = dense.dense(q, k, v)[0] if name == "dense" else attend(name, q, k, v)[0]
    # 8 equal weights: the mean is exact to float32 rounding (a few ulps of |v| ~ 1).
    np.testing.assert_allclose(out, jnp.broadcast_to(jnp.mean(v, axis=0), out.shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("n", [0, 1, SINK + LOCAL - 1, SINK + LOCAL, SINK + LOCAL + 1])
def test_context_lengths_around_the_exact_regions(name, n):
    q, k, v = adversarial_inputs(3, 1.0, 1.0, "random", n=n)
    out, n_read = attend(name, q, k, v)
    if n == 0:
        # Nothing to attend: the documented empty result is zeros, not NaN.
        np.testing.assert_array_equal(out, np.zeros((G, D)))
        assert int(n_read) == 0
        return
    assert_in_value_range(out, v)
    if n <= SINK + LOCAL or name != "magicpig":
        # Every key is exact, or the top-k retrievers (k >= 1) read the single retrieval key:
        # the result is dense attention (float32 rounding: 1e-6 on values of order 1).
        np.testing.assert_allclose(out, dense.dense(q, k, v)[0], rtol=0, atol=1e-6)
        assert int(n_read) == n


@pytest.mark.parametrize("name", ["dense", *METHODS])
def test_nan_query_propagates(name):
    q, k, v = adversarial_inputs(4, 1.0, 1.0, "random")
    q = q.at[0, 5].set(jnp.nan)
    out = dense.dense(q, k, v)[0] if name == "dense" else attend(name, q, k, v)[0]
    assert np.all(np.isnan(np.asarray(out[0]))), "a NaN query head must give a NaN output"


@pytest.mark.parametrize("name", ["dense", *METHODS])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_exact_key_propagates(name, bad):
    """A NaN sink key makes every head NaN; an Inf one scores +inf (NaN out) or -inf (weight 0, exact limit)."""
    q, k, v = adversarial_inputs(5, 1.0, 1.0, "random")
    k = k.at[0, 2].set(bad)  # a sink key: always attended
    out = np.asarray(dense.dense(q, k, v)[0] if name == "dense" else attend(name, q, k, v)[0])
    for g in range(G):
        if np.isnan(bad) or q[g, 2] > 0:
            assert np.all(np.isnan(out[g])), out[g]
        else:
            assert np.all(np.isfinite(out[g])), out[g]


# --------------------------------------------------------------------------- kernel references


@given(seed=st.integers(0, 2**31 - 1), q_scale=SCALES, k_scale=SCALES, use_weight=st.booleans())
def test_gather_attention_reference_matches_partial_attention(seed, q_scale, k_scale, use_weight):
    q, k, v = adversarial_inputs(seed, q_scale, k_scale, "random")
    rng = np.random.default_rng(seed)
    idx = jnp.asarray(rng.permutation(N)[:12], jnp.int32)
    mask = jnp.asarray(rng.random((G, 12)) < 0.7)
    log_weight = jnp.asarray(rng.normal(size=(G, 12)) * 30, jnp.float32) if use_weight else None
    o, l, m = gather_kernel.gather_attention_reference(q, k, v, idx, mask, log_weight)
    want = common.partial_attention(q, k[idx], v[idx], mask, log_weight)
    got = common.finalize(common.Partial(o, l, m))
    assert np.all(np.isfinite(np.asarray(got)))
    # Same float32 formula up to summation order: 1e-5 relative to |v| ~ 1.
    np.testing.assert_allclose(got, common.finalize(want), rtol=0, atol=1e-5)


@given(seed=st.integers(0, 2**31 - 1), exponent=st.integers(-60, 60))
def test_simhash_reference_is_invariant_to_power_of_two_scaling(seed, exponent):
    """Scaling x by 2^e is exact in floating point, so every sign (and code) must be unchanged."""
    rx, rp = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(rx, (8, D), jnp.float32)
    proj = jax.random.normal(rp, (D, 4 * 8), jnp.float32)
    codes = simhash_kernel.simhash_reference(x, proj, n_bits=4)
    scaled = simhash_kernel.simhash_reference(x * jnp.float32(2.0**exponent), proj, n_bits=4)
    np.testing.assert_array_equal(codes, scaled)


@given(cos=st.floats(-2.0, 2.0, allow_nan=False), k=st.integers(1, 16), tables=st.integers(2, 300))
def test_magicpig_collision_log_prob_is_finite_and_a_log_probability(cos, k, tables):
    """log u is finite (−inf only at cos θ = −1, where p = 0) and a log-probability, for every (K, L).

    Exactly ≤ 0: the float32 log-space sums carry rounding (the long profile once
    found +1.9e-6 at cos = 1, K = 1, L = 16), so the function clamps at 0.
    """
    log_u = float(magicpig.collision_log_prob(jnp.float32(cos), k, tables, 2))
    assert log_u <= 0.0 and (np.isfinite(log_u) or cos <= -1.0), log_u
