"""MagicPIG: collision probability, inverted-index sampling, insertion, the estimator, configs."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import magicpig as mp
from jaxkv.attention.dense import dense
from test_attention_common import TOL, softmax_attention_f64

LAYER_KEY = jax.random.key(7)
SMALL = mp.MagicPIGConfig(K=6, L=20, sink=4, local=16, capacity=1.0, candidate_capacity=20.0)


def log_u_f64(cos, K, L, m):
    """log P(Binomial(L, p^K) >= m), summing every tail term in float64 log space."""
    p = 1.0 - math.acos(min(1.0, max(-1.0, cos))) / math.pi
    if p == 0.0:
        return -math.inf
    log_hit = K * math.log(p)
    log_miss = math.log1p(-math.exp(log_hit)) if log_hit < 0 else -math.inf
    terms = [math.lgamma(L + 1) - math.lgamma(j + 1) - math.lgamma(L - j + 1) + j * log_hit
             + ((L - j) * log_miss if j < L else 0.0) for j in range(m, L + 1)]
    top = max(terms)
    return top if top == -math.inf else top + math.log(sum(math.exp(t - top) for t in terms))


def offset_keys(seed, n, d=16, offset=1.5):
    """Keys in a cone (a shared offset, like real keys), values and a query group."""
    rng = np.random.default_rng(seed)
    keys = (rng.normal(size=(n, d)) + offset).astype(np.float32)
    values = rng.normal(size=(n, d)).astype(np.float32)
    q = (2.0 * rng.normal(size=(3, d))).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values)


def sampled_sets(selection):
    """Per query head, the set of sampled row ids."""
    idx, mask = np.asarray(selection.idx), np.asarray(selection.mask)
    return [set(idx[row].tolist()) for row in mask]


def brute_force_sets(cfg, index, q, keys, n, tables):
    """The sampling rule by direct comparison of all codes (what the index must avoid doing)."""
    key_codes = np.asarray(mp.hash_codes(cfg, mp.hyperplanes(cfg, index), keys[:n] - index.mu))
    q_codes = np.asarray(mp.hash_codes(cfg, mp.hyperplanes(cfg, index), q))
    sets = []
    for g, used in enumerate(np.asarray(tables)):
        hits = np.sum(key_codes[:, :used] == q_codes[g, :used], axis=-1)
        sets.append(set(np.nonzero(hits >= cfg.min_hits)[0].tolist()))
    return sets


# --- collision probability -------------------------------------------------------------

COSINES = np.array([-1.0, -0.999, -0.9, -0.5, -0.1, 0.0, 0.2, 0.5, 0.8, 0.95, 0.9999, 1.0], np.float32)


@pytest.mark.parametrize("K, L, m", [(10, 150, 2), (3, 8, 2), (16, 2, 2), (10, 170, 1), (11, 300, 3), (4, 60, 40),
                                     (2, 12, 10), (10, 33, 2)])
def test_collision_log_prob_matches_float64_binomial_tail(K, L, m):
    got = np.asarray(mp.collision_log_prob(jnp.asarray(COSINES), K, L, m), np.float64)
    want = np.array([log_u_f64(float(c), K, L, m) for c in COSINES])
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    # float32 arccos/log1p carry ~1e-7 relative error, amplified in log p by
    # θ/(π − θ) (≤ 30 at cos = −0.999) and multiplied by m·K: ≤ 1e-4 relative.
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)


def test_collision_log_prob_is_stable_where_the_official_formula_underflows():
    # At cos = −0.9 with K10L150, u ≈ 1e-13: 1 − (1−P)^L − L·P·(1−P)^(L−1)
    # cancels to 0 in float32 (and log(u + 1e-4) reports 1e-4).
    log_u = float(mp.collision_log_prob(jnp.float32(-0.9), 10, 150))
    assert math.isclose(log_u, log_u_f64(-0.9, 10, 150, 2), rel_tol=1e-4)
    assert log_u < math.log(1e-12)


def test_collision_log_prob_clamps_cosines_rounded_past_one():
    # A float32 cosine of parallel vectors can round to 1 + 1e-7 or −1 − 1e-7;
    # an unclamped arccos returns NaN there.
    got = np.asarray(mp.collision_log_prob(jnp.asarray([1.0000001, -1.0000001], jnp.float32), 10, 150))
    assert got[0] == 0.0 and got[1] == -np.inf


def test_collision_log_prob_accepts_per_row_table_counts():
    cos = jnp.asarray([[0.3, 0.6], [0.3, 0.6]])
    got = mp.collision_log_prob(cos, 10, jnp.asarray([[150], [20]]))
    want = [[log_u_f64(float(c), 10, L, 2) for c in (0.3, 0.6)] for L in (150, 20)]
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("K, L, cosines", [
    (3, 8, (-0.3, 0.0, 0.5, 0.9)), pytest.param(10, 150, (0.3, 0.5), marks=pytest.mark.slow)])
def test_u_matches_monte_carlo_over_random_hyperplanes(K, L, cosines):
    cfg = mp.MagicPIGConfig(K=K, L=L)
    d, trials = 8, 2000
    rng = np.random.default_rng(0)
    q = rng.normal(size=d)
    q /= np.linalg.norm(q)
    ortho = rng.normal(size=d)
    ortho -= ortho @ q * q
    ortho /= np.linalg.norm(ortho)
    for c in cosines:
        x = jnp.asarray(np.stack([q, c * q + math.sqrt(1 - c * c) * ortho]), jnp.float32)

        def sampled(key):
            codes = mp.hash_codes(cfg, jax.random.normal(key, (d, K * L)), x)
            return jnp.sum(codes[0] == codes[1]) >= cfg.min_hits

        rate = float(jnp.mean(jax.vmap(sampled)(jax.random.split(jax.random.key(1), trials))))
        u = math.exp(float(mp.collision_log_prob(jnp.float32(c), K, L)))
        se = math.sqrt(u * (1 - u) / trials)
        assert abs(rate - u) <= 3 * se, (c, rate, u, se)


# --- index: selection and insertion -------------------------------------------------------

@pytest.mark.parametrize("layer_key", [None, LAYER_KEY], ids=["shared projection", "own projection"])
def test_selection_is_the_min_hits_rule_per_query_head(layer_key):
    q, keys, _ = offset_keys(0, 280)
    index = mp.build(SMALL, keys, 280, layer_key)
    # Without a key the index holds no matrix and hashes with the seeded one every layer shares.
    assert (index.projection is None) == (layer_key is None)
    sel, stats = mp.select_with_stats(SMALL, index, q)
    want = brute_force_sets(SMALL, index, q, keys, 280, stats.tables_used)
    assert np.all(np.asarray(stats.tables_used) == SMALL.L) and not bool(stats.truncated)
    assert sampled_sets(sel) == want
    assert all(len(s) > 3 for s in want)  # the check is not vacuous
    assert np.asarray(stats.n_sampled).tolist() == [len(s) for s in want]
    # Entries read = Σ over tables of the query's bucket size: Σ_l #{i : code_l(k_i) = code_l(q)}.
    key_codes = np.asarray(mp.hash_codes(SMALL, mp.hyperplanes(SMALL, index), keys - index.mu))
    q_codes = np.asarray(mp.hash_codes(SMALL, mp.hyperplanes(SMALL, index), q))
    assert np.asarray(stats.entries_read).tolist() == [int(np.sum(key_codes == c)) for c in q_codes]
    # Slots are distinct rows, so distinct_rows counts the union.
    assert int(sel.distinct_rows()) == len(set().union(*want))


def test_candidate_overflow_reads_fewer_tables_and_corrects_with_them():
    cfg = dataclasses.replace(SMALL, K=3, L=12, candidate_capacity=100)
    q, keys, _ = offset_keys(1, 300)
    index = mp.build(cfg, keys, 300, LAYER_KEY)
    sel, stats = mp.select_with_stats(cfg, index, q)
    tables = np.asarray(stats.tables_used)
    assert np.all(tables < cfg.L) and np.all(tables >= 2)  # 300/8 keys per bucket: ~3 tables fit
    assert np.all(np.asarray(stats.entries_read) <= 100)
    assert sampled_sets(sel) == brute_force_sets(cfg, index, q, keys, 300, tables)
    rows = keys[sel.idx]
    cos = np.asarray(mp._cosine(q, rows - index.mu))
    got = np.asarray(mp.correction(cfg, index, q, rows, sel))
    mask = np.asarray(sel.mask)
    for g, c in zip(*np.nonzero(mask)):
        assert math.isclose(got[g, c], -log_u_f64(float(cos[g, c]), cfg.K, int(tables[g]), 2), rel_tol=1e-4, abs_tol=1e-5)
    assert np.all(got[~mask] == 0.0)


@pytest.mark.parametrize("capacity", [2, 7])
def test_selection_capacity_overflow_is_flagged_and_drops_the_highest_ids(capacity):
    cfg = dataclasses.replace(SMALL, capacity=capacity)
    q, keys, _ = offset_keys(0, 280)
    index = mp.build(cfg, keys, 280, LAYER_KEY)
    sel, stats = mp.select_with_stats(cfg, index, q)
    assert bool(stats.truncated) and sel.idx.shape == (capacity,)
    # The slots hold the `capacity` lowest ids of the heads' union; each head samples its own among them.
    full = brute_force_sets(cfg, index, q, keys, 280, stats.tables_used)
    assert np.asarray(stats.n_sampled).tolist() == [len(s) for s in full]
    union = sorted(set().union(*full))[:capacity]
    assert np.asarray(sel.idx).tolist() == union
    assert sampled_sets(sel) == [s & set(union) for s in full]
    assert not bool(mp.select_with_stats(SMALL, mp.build(SMALL, keys, 280, LAYER_KEY), q)[1].truncated)


def test_insertion_then_retrieval_equals_building_from_all_keys():
    q, keys, _ = offset_keys(2, 280)
    index = mp.build(SMALL, keys, 50, LAYER_KEY)  # rows 150.. are padding for now
    start = 50
    for count in (64, 30, 64, 0, 64, 8):  # partial chunks: rows past count are ignored
        chunk = jnp.concatenate([keys[start:start + count], jnp.full((64 - count, 16), 9.0)])
        index = mp.insert(SMALL, index, chunk, count)
        start += count
    assert start == 280 and int(index.n) == 280 and int(index.n_dropped) == 0
    fresh = mp.build(SMALL, keys, 280, LAYER_KEY, mu=index.mu)
    for name in ("sorted_ids", "bucket_starts", "projection", "mu"):
        np.testing.assert_array_equal(getattr(index, name), getattr(fresh, name), err_msg=name)
    assert sampled_sets(mp.select(SMALL, index, q)) == sampled_sets(mp.select(SMALL, fresh, q))
    # μ is not retrained: it is still the mean of the first 50 keys.
    np.testing.assert_allclose(index.mu, np.mean(np.asarray(keys[:50]), axis=0), rtol=1e-5, atol=1e-6)


def test_build_past_one_hash_batch_files_every_key_under_its_own_code():
    n = mp.HASH_BATCH + 123  # a full batch and a padded partial one
    _, keys, _ = offset_keys(4, n)
    index = mp.build(SMALL, keys, n, LAYER_KEY)
    codes = np.asarray(mp.hash_codes(SMALL, mp.hyperplanes(SMALL, index), keys - index.mu))  # all rows at once
    starts, ids = np.asarray(index.bucket_starts), np.asarray(index.sorted_ids)
    for table in range(SMALL.L):
        filed = np.repeat(np.arange(2**SMALL.K), np.diff(starts[table]))  # bucket of each slot
        np.testing.assert_array_equal(filed, codes[ids[table], table], err_msg=f"table {table}")
        np.testing.assert_array_equal(np.sort(ids[table]), np.arange(n))


def test_insert_beyond_capacity_counts_the_dropped_keys():
    _, keys, _ = offset_keys(3, 100)
    index = mp.build(SMALL, keys, 80, LAYER_KEY)
    index = mp.insert(SMALL, index, keys[:50], 50)
    assert int(index.n) == 100 and int(index.n_dropped) == 30
    assert int(index.bucket_starts[0, -1]) == 100


def test_bad_shapes_are_rejected_naming_the_tensor():
    _, keys, _ = offset_keys(3, 50)
    index = mp.build(SMALL, keys, 50, LAYER_KEY)
    with pytest.raises(ValueError, match="keys_new must be"):
        mp.insert(SMALL, index, keys[:, :8], 4)
    with pytest.raises(ValueError, match="keys must be"):
        mp.build(SMALL, keys[0], 1, LAYER_KEY)
    with pytest.raises(ValueError, match="projection must be"):
        mp.hash_codes(mp.MagicPIGConfig(), index.projection, keys)


def test_projection_is_one_seeded_standard_normal_matrix():
    cfg = mp.MagicPIGConfig()
    r = mp.projection(cfg, 64)
    assert r.shape == (64, cfg.K * cfg.L) and r.dtype == np.float32 and not r.flags.writeable
    np.testing.assert_array_equal(r, mp.projection(mp.MagicPIGConfig(), 64))  # every layer and head: one matrix
    assert np.mean(r == mp.projection(dataclasses.replace(cfg, seed=cfg.seed + 1), 64)) < 1e-3
    # 96,000 N(0, 1) entries: the mean's standard error is 0.0032 and the variance's 0.0046;
    # the bounds are 5 of them.
    assert abs(float(r.mean())) < 0.016 and abs(float(r.var()) - 1.0) < 0.023


# --- the estimator ------------------------------------------------------------------------

def test_output_equals_dense_when_every_key_is_sampled_with_u_one():
    # Uncentred keys parallel to the queries share every code: all are sampled in
    # all L tables (n_read = N) and u = 1, so the estimate is exact attention.
    cfg = dataclasses.replace(SMALL, center=False)  # capacities hold every key in every table
    rng = np.random.default_rng(4)
    direction = rng.normal(size=16).astype(np.float32)
    keys = jnp.asarray(rng.uniform(0.2, 1.5, size=(300, 1)).astype(np.float32) * direction)
    values = jnp.asarray(rng.normal(size=(300, 16)).astype(np.float32))
    q = jnp.asarray(np.stack([direction, 0.4 * direction, 2.0 * direction]))
    out, n_read = mp.attend(cfg, q, keys, values, LAYER_KEY)
    assert int(n_read) == 300
    np.testing.assert_allclose(out, softmax_attention_f64(q, keys, values), atol=TOL)


def test_estimate_is_the_corrected_softmax_merged_with_the_exact_part():
    cfg = SMALL
    q, keys, values = offset_keys(5, 300)
    out, n_read = mp.attend(cfg, q, keys, values, LAYER_KEY)
    retr_k, retr_v = keys[4:-16], values[4:-16]
    index = mp.build(cfg, retr_k, 280, LAYER_KEY)
    sel = mp.select(cfg, index, q)
    idx, mask = np.asarray(sel.idx), np.asarray(sel.mask)
    want = []
    for g in range(3):
        rows = idx[mask[g]]
        cos = np.asarray(mp._cosine(q[g:g + 1], retr_k[rows] - index.mu))[0]
        lw = np.concatenate([[-log_u_f64(float(c), cfg.K, cfg.L, 2) for c in cos], np.zeros(20)])
        k_g = np.concatenate([retr_k[rows], keys[:4], keys[-16:]])
        v_g = np.concatenate([retr_v[rows], values[:4], values[-16:]])
        want.append(softmax_attention_f64(q[g:g + 1], k_g, v_g, log_weight=lw)[0])
    np.testing.assert_allclose(out, np.stack(want), atol=1e-4)  # −log u differs by ≤1e-4 relative
    assert int(n_read) == 20 + len(set(idx[mask.any(0)].tolist()))


def test_short_context_is_exact():
    q, keys, values = offset_keys(6, 17)
    out, n_read = mp.attend(SMALL, q, keys, values, LAYER_KEY)
    np.testing.assert_allclose(out, dense(q, keys, values)[0], atol=1e-6)
    assert int(n_read) == 17


def test_empty_sample_set_leaves_the_exact_part():
    cfg = dataclasses.replace(SMALL, K=12, L=2, candidate_capacity=2.0)  # two 12-bit matches: P ≈ 280·2^-24 that any key does
    q, keys, values = offset_keys(7, 300)
    out, n_read = mp.attend(cfg, q, keys, values, LAYER_KEY)
    assert int(n_read) == 20
    exact = np.concatenate([np.arange(4), np.arange(284, 300)])
    np.testing.assert_allclose(out, dense(q, keys[exact], values[exact])[0], atol=1e-6)


@pytest.mark.parametrize("case", ["zero query", "zero keys", "identical keys"])
def test_degenerate_inputs_give_finite_outputs(case):
    q, keys, values = offset_keys(8, 300)
    if case == "zero query":
        q = jnp.zeros_like(q)
    elif case == "zero keys":
        keys = jnp.zeros_like(keys)
    else:
        keys = jnp.broadcast_to(keys[:1], keys.shape)
    cfg = dataclasses.replace(SMALL, K=2, L=6, candidate_capacity=6.0)  # coarse codes: degenerate keys do get sampled
    out, n_read = mp.attend(cfg, q, keys, values, LAYER_KEY)
    assert np.all(np.isfinite(out)) and 20 <= int(n_read) <= 300
    if case != "zero query":
        assert int(n_read) > 20  # the degenerate path (cos = 0) was exercised


def test_vmap_over_heads_equals_a_loop_over_heads():
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.normal(size=(2, 3, 16)).astype(np.float32) * 2)
    keys = jnp.asarray(rng.normal(size=(2, 300, 16)).astype(np.float32) + 1)
    values = jnp.asarray(rng.normal(size=(2, 300, 16)).astype(np.float32))
    out, n_read = jax.vmap(lambda *a: mp.attend(SMALL, *a, LAYER_KEY))(q, keys, values)
    for h in range(2):
        out_h, n_h = mp.attend(SMALL, q[h], keys[h], values[h], LAYER_KEY)
        np.testing.assert_allclose(out[h], out_h, atol=1e-6)
        assert int(n_read[h]) == int(n_h)


# --- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize("field, settings", [
    ("K", dict(K=0)), ("K", dict(K=17)), ("K", dict(K=True)), ("L", dict(L=1)),
    ("L", dict(L=1000)),  # K·L = 10,000 hash bits per key
    ("K", dict(K=16, L=300)),  # L·(2^16 + 1) = 19.7M bucket starts per KV head
    ("min_hits", dict(min_hits=0)), ("min_hits", dict(min_hits=151)), ("sink", dict(sink=-1)),
    ("local", dict(local=1.5)), ("seed", dict(seed=-2)), ("dense_layers", dict(dense_layers=(0, -1))),
    ("dense_layers", dict(dense_layers=3)), ("capacity", dict(capacity=0)), ("capacity", dict(capacity=1.5)),
    ("candidate_capacity", dict(candidate_capacity=0.0)), ("center", dict(center="yes"))])
def test_invalid_configs_raise_naming_the_field(field, settings):
    with pytest.raises(ValueError, match=f"MagicPIGConfig.{field} "):
        mp.MagicPIGConfig(**settings)


def test_config_defaults_are_official_and_hashable():
    cfg = mp.MagicPIGConfig(dense_layers=[0, 16])
    assert hash(cfg) == hash(mp.MagicPIGConfig(dense_layers=(0, 16)))
    default = mp.MagicPIGConfig()
    assert (default.K, default.L, default.sink, default.local, default.min_hits) == (10, 150, 4, 64, 2)
    assert default.dense_layers == (0, 16, 32, 48, 64)
    assert mp.is_dense_layer(default, 16) and not mp.is_dense_layer(default, 1)
    assert mp.index_bytes_per_key(default) == 600  # the essay's 600 B of 32-bit ids at L=150
    assert default.sample_capacity(100_000) == 12_500
