"""ParisKV retrieval: rotation, buckets, six-tier votes, rerank, selection, insertion."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import common, pariskv, rsq
from jaxkv.attention.pariskv import ParisKVConfig

# Jitted once per (config, shape): op-by-op dispatch compiles every primitive and is
# several times slower for these tests on CPU.
build = jax.jit(pariskv.build, static_argnums=0)
insert = jax.jit(pariskv.insert, static_argnums=0)
retrieve = jax.jit(pariskv.retrieve, static_argnums=0)
select = jax.jit(pariskv.select, static_argnums=0)
coarse_votes = jax.jit(pariskv.coarse_votes, static_argnums=0)
rotate = jax.jit(pariskv.rotate, static_argnums=0)
attend = jax.jit(pariskv.attend, static_argnums=0)
vote_table = jax.jit(pariskv.vote_table, static_argnums=(0, 4))
rerank_scores = jax.jit(pariskv.rerank_scores, static_argnums=0)

# Most tests share one config and shape so the compiled programs are reused.
CFG = ParisKVConfig(top_k=20)
CAP, D = 500, 64


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ---------------------------------------------------------------- rotation and buckets

@pytest.mark.parametrize("d", [64, 96, 128])
def test_rotation_is_orthogonal(d):
    cfg = ParisKVConfig()
    basis = rotate(cfg, jnp.eye(d))  # rows: images of the unit vectors
    assert basis.shape == (d, pariskv.padded_dim(d))
    # float32 Hadamard products of ±1/√P entries: errors ~1e-7, so 1e-5 is tight but safe.
    np.testing.assert_allclose(basis @ basis.T, np.eye(d), atol=1e-5)
    x, z = _normal(0, (20, d)), _normal(1, (20, d))
    yx, yz = rotate(cfg, x), rotate(cfg, z)
    np.testing.assert_allclose(jnp.linalg.norm(yx, axis=-1), 1.0, atol=1e-5)
    cosine = jnp.sum(x * z, -1) / (jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(z, axis=-1))
    np.testing.assert_allclose(jnp.sum(yx * yz, -1), cosine, atol=1e-5)
    np.testing.assert_allclose(rotate(cfg, 7.0 * x), yx, atol=1e-6)


def test_rotation_depends_on_seed_only():
    x = _normal(2, (4, 64))
    a = rotate(ParisKVConfig(seed=3), x)
    np.testing.assert_array_equal(a, rotate(ParisKVConfig(seed=3, top_k=7), x))
    assert not np.allclose(a, rotate(ParisKVConfig(seed=4), x))


def test_rotation_diagonal_is_the_seeded_rademacher_draw_compiled_as_a_constant():
    cfg = ParisKVConfig(seed=3)
    expected = jax.random.rademacher(jax.random.key(3), (64,), dtype=jnp.float32)
    np.testing.assert_array_equal(pariskv.rotation_diagonal(cfg, 64), expected)
    # Drawn inside the compiled rotation, the generator's threefry rounds run as a
    # loop on every call (every sparse layer on every decoded token).
    hlo = rotate.lower(cfg, _normal(2, (4, 64))).compile().as_text()
    assert "while" not in hlo and "threefry" not in hlo


@pytest.mark.parametrize("m", [2, 4, 8])
def test_bucket_ids_are_the_sign_patterns(m):
    y = np.array(_normal(3, (50, 64)))
    y[:5, :] = 0.0  # a zero coordinate counts as non-negative
    got = np.asarray(pariskv.bucket_ids(ParisKVConfig(m=m), jnp.asarray(y)))
    for row in range(50):
        for b in range(64 // m):
            expected = sum(1 << j for j in range(m) if y[row, b * m + j] >= 0)
            assert got[row, b] == expected
    assert got.dtype == np.uint8


# ---------------------------------------------------------------- coarse votes

def _reference_votes(keys, n, q, m, collision_ratio, seed=0):
    """Six tiers walked literally, per subspace, over the first n keys (numpy)."""
    cfg = ParisKVConfig(m=m, seed=seed)
    y = np.asarray(rotate(cfg, keys[:n]))
    q_rot = np.asarray(rotate(cfg, q))
    n_sub = y.shape[1] // m
    # Caps in float32, the arithmetic the method itself uses.
    caps = [np.float32(n) * np.float32(collision_ratio) * np.float32(f)
            for f in pariskv.TIER_FRACTIONS]
    votes = np.zeros(n, np.int64)
    for b in range(n_sub):
        block = y[:, b * m:(b + 1) * m]
        bucket = [sum(1 << j for j in range(m) if row[j] >= 0) for row in block]
        count = np.bincount(bucket, minlength=2**m)
        centroid = [np.array([1 if p >> j & 1 else -1 for j in range(m)]) / math.sqrt(m)
                    for p in range(2**m)]
        score = [float(c @ q_rot[b * m:(b + 1) * m]) for c in centroid]
        order = sorted(range(2**m), key=lambda p: (-score[p], p))
        tier, covered, pattern_votes = 0, 0, {}
        for p in order:
            covered += count[p]
            while tier < 6 and covered > caps[tier]:
                tier += 1
            pattern_votes[p] = 6 - tier if tier < 6 else 0
        votes += [pattern_votes[k] for k in bucket]
    return votes


@pytest.mark.parametrize("m, d, cap, n, collision_ratio", [
    (8, D, CAP, 450, None),      # length-adaptive (0.5 below 5K keys), unused rows past n
    (2, 24, 300, 300, 1.0),      # d padded to 32; ratio 1: every key lands in some tier
])
def test_votes_match_brute_force_six_tiers(m, d, cap, n, collision_ratio):
    cfg = dataclasses.replace(CFG, m=m, collision_ratio=collision_ratio)
    keys, q = _normal(4, (cap, d)), _normal(5, (d,))
    index = build(cfg, keys, jnp.int32(n))
    votes = np.asarray(coarse_votes(cfg, index, rotate(cfg, q)))
    ratio = pariskv.resolve_ratios(cfg, cap)[1]
    np.testing.assert_array_equal(votes[:n], _reference_votes(keys, n, q, m, ratio))
    np.testing.assert_array_equal(votes[n:], -1)
    n_sub = pariskv.padded_dim(d) // m
    assert votes[:n].max() <= 6 * n_sub
    if collision_ratio == 1.0:  # the last cap is n: every key gets >= 1 vote per subspace
        assert votes[:n].min() >= n_sub


def test_vote_table_is_the_lut_of_coarse_votes():
    keys, q = _normal(6, (CAP, D)), rotate(CFG, _normal(7, (D,)))
    index = build(CFG, keys, jnp.int32(CAP))
    table = np.asarray(vote_table(CFG, q, index.n, index.bucket_counts, CAP))
    assert table.shape == (8, 256)
    signs = np.asarray(index.signs)
    by_lookup = sum(table[b, signs[:, b]] for b in range(8))
    np.testing.assert_array_equal(by_lookup, coarse_votes(CFG, index, q))


def test_vote_table_ranks_tied_patterns_by_the_lower_pattern():
    # Integer query coordinates make many pattern scores exactly equal (all ones: the
    # score is a popcount), so the order among ties decides which buckets fill a tier.
    m, n_sub, n = 8, 4, 5_000
    q_rot = jnp.asarray(np.r_[np.ones(8), np.arange(8) % 3, -np.ones(8), np.zeros(8)], jnp.float32)
    counts = jnp.asarray(np.random.default_rng(0).integers(0, 40, (n_sub, 2**m)), jnp.int32)
    cfg = dataclasses.replace(CFG, collision_ratio=0.2)
    got = np.asarray(vote_table(cfg, q_rot, jnp.int32(n), counts, CAP))
    caps = [np.float32(n) * np.float32(0.2) * np.float32(f) for f in pariskv.TIER_FRACTIONS]
    for b in range(n_sub):
        qb = np.asarray(q_rot[b * m:(b + 1) * m], np.float64)
        score = [sum(qb[j] if p >> j & 1 else -qb[j] for j in range(m)) for p in range(2**m)]
        assert len(set(score)) < 2**m / 4  # ties are the point
        covered, tier = 0, 0
        for p in sorted(range(2**m), key=lambda p: (-score[p], p)):
            covered += int(counts[b, p])
            while tier < 6 and covered > caps[tier]:
                tier += 1
            assert got[b, p] == (6 - tier if tier < 6 else 0), (b, p)


# ---------------------------------------------------------------- end to end

def _dense(q, k, v):
    s = (q @ k.T) / math.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def test_full_candidates_and_top_k_equal_dense_attention():
    n, d = 300, 64
    cfg = ParisKVConfig(candidate_ratio=1.0, top_k=n, sink=4, local=16)
    q, k, v = _normal(8, (3, d)), _normal(9, (n, d)), _normal(10, (n, d))
    out, n_read = attend(cfg, q, k, v)
    # float32 softmax over 300 keys against float64 numpy: 1e-5 is a few ulps of sums.
    np.testing.assert_allclose(out, _dense(*(np.asarray(a, np.float64) for a in (q, k, v))),
                               atol=1e-5, rtol=1e-5)
    assert int(n_read) == n


def test_insertion_then_retrieval_equals_building_at_once():
    keys = _normal(11, (CAP, D))
    garbage = 100.0 * _normal(12, (CAP, D))  # rows past count / past n must not leak in
    at_once = build(CFG, keys, jnp.int32(CAP))
    grown = build(CFG, jnp.concatenate([keys[:300], garbage[300:]]), jnp.int32(300))
    grown = insert(CFG, grown, jnp.concatenate([keys[300:400], garbage[:50]]), jnp.int32(100))
    grown = insert(CFG, grown, jnp.concatenate([keys[400:], garbage[50:100]]), jnp.int32(100))
    for (path, leaf), expected in zip(jax.tree_util.tree_leaves_with_path(grown), jax.tree.leaves(at_once)):
        np.testing.assert_array_equal(leaf, expected, err_msg=jax.tree_util.keystr(path))
    q = _normal(13, (2, D))
    np.testing.assert_array_equal(retrieve(CFG, grown, q), retrieve(CFG, at_once, q))


def test_insert_drops_rows_beyond_capacity():
    index = build(CFG, _normal(14, (CAP, D)), jnp.int32(CAP - 3))
    index = insert(CFG, index, _normal(15, (150, D)), jnp.int32(5))
    assert int(index.n) == CAP
    np.testing.assert_array_equal(index.bucket_counts.sum(axis=1), CAP)


def test_planted_neighbours_are_retrieved_from_codes():
    planted = CFG.top_k
    q = _normal(16, (4, D))
    direction = q.mean(0) / jnp.linalg.norm(q.mean(0))
    rows = jax.random.choice(jax.random.key(18), CAP, (planted,), replace=False)
    keys = _normal(17, (CAP, D)).at[rows].set(8.0 * direction + 0.5 * _normal(19, (planted, D)))
    got = retrieve(CFG, build(CFG, keys, jnp.int32(CAP)), q)
    assert set(np.asarray(got).tolist()) == set(np.asarray(rows).tolist())


def test_selection_uses_the_group_mean_query_and_masks_unused_rows():
    keys, q = _normal(20, (CAP, D)), _normal(21, (3, D))
    index = build(CFG, keys, jnp.int32(12))
    sel = select(CFG, index, q)
    same = select(CFG, index, jnp.broadcast_to(q.mean(0), q.shape))
    np.testing.assert_array_equal(sel.idx, same.idx)
    assert sel.idx.shape == sel.mask.shape == (CFG.top_k,)
    idx, mask = np.asarray(sel.idx), np.asarray(sel.mask)
    assert mask.sum() == 12
    np.testing.assert_array_equal(np.sort(idx[mask]), np.arange(12))
    assert pariskv.METHOD.correction(CFG, index, q, keys[sel.idx], sel) is None


def test_empty_index_selects_nothing():
    index = build(CFG, _normal(27, (CAP, D)), jnp.int32(0))
    sel = select(CFG, index, _normal(28, (3, D)))
    assert not bool(sel.mask.any())
    np.testing.assert_array_equal(index.bucket_counts, 0)


def test_select_vmaps_over_batch_and_heads_under_jit():
    keys, q = _normal(22, (2, 3, CAP, D)), _normal(23, (2, 3, 2, D))

    def one_head(k, qq):
        return pariskv.select(CFG, pariskv.build(CFG, k, jnp.int32(CAP)), qq).idx

    batched = np.asarray(jax.jit(jax.vmap(jax.vmap(one_head)))(keys, q))
    for b in range(2):
        for h in range(3):
            alone = select(CFG, build(CFG, keys[b, h], jnp.int32(CAP)), q[b, h]).idx
            np.testing.assert_array_equal(batched[b, h], alone)


def test_official_levels_switch_codes_with_the_official_table():
    keys = _normal(24, (CAP, D))
    official = build(dataclasses.replace(CFG, official_levels=True), keys, jnp.int32(CAP))
    derived = build(CFG, keys, jnp.int32(CAP))
    u = np.asarray(rotate(CFG, keys)).reshape(CAP, -1, 8)
    u = np.abs(u / np.linalg.norm(u, axis=-1, keepdims=True)).reshape(CAP, D)
    magnitude = np.asarray(rsq.magnitude_cells(official.codes.magnitudes))
    np.testing.assert_array_equal(
        magnitude, np.searchsorted(rsq.OFFICIAL_M8_THRESHOLDS, u, side="right"))
    assert not np.array_equal(official.codes.magnitudes, derived.codes.magnitudes)


# ---------------------------------------------------------------- sizes and config

def test_index_bytes_per_key_counts_the_stored_rows():
    cfg = ParisKVConfig()
    index = pariskv.empty_index(cfg, 10, 128)
    per_row = sum(x.nbytes for x in jax.tree.leaves(index.codes)) // 10
    # sign bytes (the bucket ids) 16 + 3-bit magnitudes 48 + bf16 scale 2 + 4-bit weights 8.
    assert pariskv.index_bytes_per_key(cfg, 128) == per_row == 16 + 48 + 2 + 8


@pytest.mark.parametrize("capacity, expected", [
    (4_999, (0.5, 0.5)), (5_000, (0.25, 0.3)), (9_999, (0.25, 0.3)),
    (10_000, (0.2, 0.25)), (29_999, (0.2, 0.25)), (30_000, (0.1, 0.2)),
])
def test_length_adaptive_ratios_follow_design(capacity, expected):
    assert pariskv.resolve_ratios(ParisKVConfig(), capacity) == expected
    assert pariskv.resolve_ratios(ParisKVConfig(candidate_ratio=0.7), capacity)[0] == 0.7


def test_candidate_count_is_static_and_bounded():
    cfg = ParisKVConfig(top_k=100)
    assert pariskv.n_candidates(cfg, 4_000) == 2_000
    assert pariskv.n_candidates(cfg, 150) == 100  # never below the final top-k
    assert pariskv.n_candidates(cfg, 60) == 60    # never above the capacity
    assert pariskv.n_candidates(ParisKVConfig(candidate_ratio=0.013), 1_000_000) == 13_000


@pytest.mark.parametrize("field, value", [
    ("m", 1), ("m", 9), ("top_k", 0), ("candidate_ratio", 0.0), ("candidate_ratio", 1.5),
    ("collision_ratio", -0.1), ("sink", -1), ("local", -1), ("buffer", -2),
    ("official_levels", True), ("dense_layers", [0, -1]),  # a list is a tuple; a layer is >= 0
])
def test_invalid_config_raises_naming_the_field(field, value):
    kwargs = {field: value}
    if field == "official_levels":
        kwargs["m"] = 4
    with pytest.raises(ValueError, match=field):
        ParisKVConfig(**kwargs)


def test_m_must_divide_padded_head_dim():
    with pytest.raises(ValueError, match="m=8"):
        pariskv.rotate(ParisKVConfig(m=8), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="m=8"):
        pariskv.build(ParisKVConfig(m=8), jnp.ones((5, 4)), jnp.int32(5))
    assert pariskv.n_subspaces(ParisKVConfig(m=4), 6) == 2  # 6 pads to 8


# ---------------------------------------------------------------- kernel layouts

def test_index_layout_matches_the_pallas_kernels_references():
    rerank = pytest.importorskip("pallas_kernels.rsq_rerank")
    vote = pytest.importorskip("pallas_kernels.vote")
    cfg = CFG
    keys, q = _normal(25, (CAP, D)), _normal(26, (2, D))
    index = build(cfg, keys, jnp.int32(CAP))
    q_mean = q.mean(0)
    candidates = jnp.arange(0, CAP, 3)
    _, centres = rsq.lloyd_max_levels(8)
    nibbles, weight = rsq.kernel_layout(index.codes, cfg.m)
    kernel_scores = rerank.rsq_rerank_reference(
        rotate(cfg, q_mean), jnp.linalg.norm(q_mean), nibbles, weight,
        jnp.asarray(centres, jnp.float32), candidates)
    # Same float32 arithmetic in a different order: 1e-5 relative.
    np.testing.assert_allclose(kernel_scores, rerank_scores(cfg, index, q, candidates),
                               rtol=1e-5, atol=1e-5)
    lut = vote_table(cfg, rotate(cfg, q_mean), index.n, index.bucket_counts, CAP)
    np.testing.assert_array_equal(vote.vote_totals_reference(index.signs, lut),
                                  coarse_votes(cfg, index, rotate(cfg, q_mean)))


@pytest.mark.parametrize("n, k, dtype", [
    (20_000, 30, jnp.int32),     # two stages, many ties, N not a multiple of the block
    (20_000, 30, jnp.float32),   # two stages, with -inf entries
    (3_000, 30, jnp.int32),      # too small: plain lax.top_k
])
def test_top_indices_is_exactly_lax_top_k(n, k, dtype):
    if dtype == jnp.int32:
        values = jax.random.randint(jax.random.key(29), (n,), -1, 12)
    else:
        values = _normal(30, (n,)).at[::7].set(-jnp.inf)
    np.testing.assert_array_equal(jax.jit(pariskv.top_indices, static_argnums=1)(values, k),
                                  jax.lax.top_k(values, k)[1])


@pytest.mark.parametrize("n_valid, count, top", [
    (5_000, 500, 12),   # many ties at the threshold
    (5_000, 500, 48),   # N_TIERS·B at m = 8, d = 64: the bound the coarse stage passes
    (300, 500, 12),     # fewer valid rows than candidates: invalid rows n, n+1, … fill
    (5_000, 5_000, 12),  # every row
    (300, 200, 12),     # fewer rows than one block of the tie search
    (3_000, 2_990, 3),  # the last ties lie in the last, partial block
])
def test_most_voted_rows_is_lax_top_k_set_in_ascending_order(n_valid, count, top):
    n = max(n_valid, count)
    votes = jax.random.randint(jax.random.key(31), (n,), 0, top + 1)
    votes = jnp.where(jnp.arange(n) < n_valid, votes, -1)  # unused rows vote -1, as coarse_votes gives
    rows = jax.jit(pariskv.most_voted_rows, static_argnums=(1, 2))(votes, count, top)
    np.testing.assert_array_equal(rows, np.sort(np.asarray(jax.lax.top_k(votes, count)[1])))


@pytest.mark.parametrize("tied", [common.WORD_BITS, common.WORD_BITS - 1, 3 * common.WORD_BITS + 1])
def test_most_voted_rows_when_the_ties_end_at_or_near_a_word_boundary(tied):
    # One row above the threshold, far after the ties; the first `tied` zero-vote rows complete the set.
    votes = jnp.zeros(300, jnp.int32).at[200].set(5)
    rows = pariskv.most_voted_rows(votes, tied + 1, 48)
    np.testing.assert_array_equal(rows, np.r_[np.arange(tied), 200])
