"""PQCache baseline: seeded k-means at prefill, frozen centroids, top-k by PQ score."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import pqcache
from jaxkv.attention.pqcache import PQCacheConfig

# Jitted once per (config, shape): op-by-op dispatch is several times slower here.
build = jax.jit(pqcache.build, static_argnums=0)
insert = jax.jit(pqcache.insert, static_argnums=0)
retrieve = jax.jit(pqcache.retrieve, static_argnums=0)
select = jax.jit(pqcache.select, static_argnums=0)
attend = jax.jit(pqcache.attend, static_argnums=0)

CFG = PQCacheConfig(n_sub=2, n_centroids=16, kmeans_iters=8, top_k=30)
CAP, D = 400, 32


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _nearest_centroid_codes(keys, centroids):
    """Brute-force argmin of squared distance per subspace (numpy float64)."""
    parts = np.asarray(keys, np.float64).reshape(len(keys), centroids.shape[0], -1)
    c = np.asarray(centroids, np.float64)
    dist = ((parts[:, :, None, :] - c[None]) ** 2).sum(-1)
    return dist.argmin(-1)


def _distortion(keys, centroids):
    parts = np.asarray(keys, np.float64).reshape(len(keys), centroids.shape[0], -1)
    codes = _nearest_centroid_codes(keys, centroids)
    recon = np.asarray(centroids, np.float64)[np.arange(centroids.shape[0]), codes]
    return ((parts - recon) ** 2).sum()


def test_index_layout():
    index = build(CFG, _normal(0, (CAP, D)), jnp.int32(CAP))
    assert index.codes.shape == (CAP, 2) and index.codes.dtype == jnp.uint8
    assert index.centroids.shape == (2, 16, D // 2)
    assert pqcache.index_bytes_per_key(CFG, D) == index.codes.nbytes // CAP


def test_codes_are_nearest_centroids_and_kmeans_only_lowers_distortion():
    keys = _normal(1, (CAP, D))
    distortions = []
    for iters in (1, 3, 8):
        index = build(PQCacheConfig(n_sub=2, n_centroids=16, kmeans_iters=iters), keys,
                      jnp.int32(CAP))
        # Codes agree with a brute-force nearest-centroid search (float ties are measure-zero).
        np.testing.assert_array_equal(index.codes, _nearest_centroid_codes(keys, index.centroids))
        distortions.append(_distortion(keys, index.centroids))
    # Lloyd iterations never increase the quantisation error (float slack 1e-9 relative).
    assert distortions[0] >= distortions[1] * (1 - 1e-9) >= distortions[2] * (1 - 1e-9)
    assert distortions[2] < distortions[0]


def test_new_keys_use_the_prefill_centroids_which_never_change():
    prefill, drifted = _normal(2, (CAP, D)), 3.0 + _normal(3, (100, D))
    index = build(CFG, jnp.concatenate([prefill[:300], drifted]), jnp.int32(300))
    grown = insert(CFG, index, drifted, jnp.int32(100))
    np.testing.assert_array_equal(grown.centroids, index.centroids)
    np.testing.assert_array_equal(grown.codes[:300], index.codes[:300])
    np.testing.assert_array_equal(grown.codes[300:], _nearest_centroid_codes(drifted, index.centroids))
    assert int(grown.n) == 400


def test_centroids_come_only_from_valid_rows():
    keys = jnp.concatenate([_normal(4, (200, D)), 1e6 + _normal(5, (200, D))])
    index = build(CFG, keys, jnp.int32(200))
    assert float(jnp.max(jnp.abs(index.centroids))) < 100.0


def test_pq_score_is_query_dot_reconstructed_key():
    keys, q = _normal(6, (CAP, D)), _normal(7, (3, D))
    index = build(CFG, keys, jnp.int32(CAP))
    recon = np.concatenate(
        [np.asarray(index.centroids)[s, np.asarray(index.codes)[:, s]] for s in range(2)], axis=-1)
    expected = recon @ np.asarray(q, np.float64).mean(0)
    # float32 dot products of 32 O(1) terms: 1e-5 relative.
    np.testing.assert_allclose(pqcache.scores(CFG, index, q), expected, rtol=1e-5, atol=1e-5)
    top = np.asarray(retrieve(CFG, index, q))
    assert set(top.tolist()) == set(np.argsort(-expected)[:30].tolist())


def test_recall_is_one_when_top_k_covers_every_key():
    cfg = PQCacheConfig(n_centroids=16, kmeans_iters=8, top_k=CAP)
    index = build(cfg, _normal(8, (CAP, D)), jnp.int32(CAP))
    assert set(np.asarray(retrieve(cfg, index, _normal(9, (2, D)))).tolist()) == set(range(CAP))


def test_top_k_covering_everything_equals_dense_attention():
    n = 300
    cfg = PQCacheConfig(n_centroids=16, kmeans_iters=8, top_k=n, sink=4, local=16)
    q, k, v = (np.asarray(_normal(s, shape), np.float64)
               for s, shape in ((10, (3, D)), (11, (n, D)), (12, (n, D))))
    out, n_read = attend(cfg, jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                         jnp.asarray(v, jnp.float32))
    s = q @ k.T / math.sqrt(D)
    w = np.exp(s - s.max(-1, keepdims=True))
    # float32 softmax over 300 keys against float64: 1e-5.
    np.testing.assert_allclose(out, (w / w.sum(-1, keepdims=True)) @ v, atol=1e-5, rtol=1e-5)
    assert int(n_read) == n


def test_unused_rows_are_masked_never_selected():
    keys, q = _normal(13, (CAP, D)), _normal(14, (2, D))
    few = select(CFG, build(CFG, keys, jnp.int32(10)), q)
    assert int(few.mask.sum()) == 10
    np.testing.assert_array_equal(np.sort(np.asarray(few.idx)[np.asarray(few.mask)]), np.arange(10))
    many = select(CFG, build(CFG, keys, jnp.int32(200)), q)
    assert bool(many.mask.all()) and int(many.idx.max()) < 200


def test_fewer_keys_than_centroids_still_builds():
    index = build(CFG, _normal(15, (CAP, D)), jnp.int32(5))
    assert np.isfinite(np.asarray(index.centroids)).all()
    assert int(np.asarray(index.codes[:5]).max()) < 16


def test_build_is_deterministic_given_the_seed():
    keys = _normal(16, (CAP, D))
    a, b = build(CFG, keys, jnp.int32(CAP)), build(CFG, keys, jnp.int32(CAP))
    np.testing.assert_array_equal(a.centroids, b.centroids)


@pytest.mark.parametrize("field, value", [
    ("n_sub", 0), ("n_centroids", 0), ("n_centroids", 257), ("kmeans_iters", 0),
    ("top_k", 0), ("sink", -1), ("local", -1),
])
def test_invalid_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PQCacheConfig(**{field: value})


def test_n_sub_must_divide_head_dim():
    with pytest.raises(ValueError, match="n_sub=3"):
        pqcache.build(PQCacheConfig(n_sub=3), jnp.ones((70, 32)), jnp.int32(70))
