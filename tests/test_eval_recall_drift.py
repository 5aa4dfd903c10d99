"""The recall and drift studies' bookkeeping, on small synthetic tensors.

Recall values are fractions of k = 10 target rows computed from integer counts,
so exact agreement with an independent set computation is expected (1e-6 only
absorbs float32 division).
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import magicpig, pariskv, pqcache
from jaxkv.eval import drift, recall
from jaxkv.eval.capture import Captured

K = 10
SINK, LOCAL = 2, 8
# One configuration for every test, so the jitted study functions compile once.
# PQCache: 64 centroids ≥ the 40-key pools below, so every key is its own
# centroid and PQ scores are exact. ParisKV: every key is a coarse candidate.
# MagicPIG: one bit per table, 64 tables, no centring: a key with q·k > 0 has
# p ≥ 1/2 per table, so it misses ≥ 2 collisions with probability < 65·2^-64.
EXACT_METHODS = recall.Methods(
    pariskv=pariskv.ParisKVConfig(top_k=K, sink=SINK, local=LOCAL, candidate_ratio=1.0),
    pqcache=pqcache.PQCacheConfig(top_k=K, sink=SINK, local=LOCAL),
    magicpig=magicpig.MagicPIGConfig(K=1, L=64, sink=SINK, local=LOCAL, center=False, capacity=1.0,
                                     candidate_capacity=64.0),
    k=K,
)
TYPICAL_METHODS = recall.Methods(
    pariskv=pariskv.ParisKVConfig(top_k=K, sink=SINK, local=LOCAL),
    pqcache=pqcache.PQCacheConfig(top_k=K, sink=SINK, local=LOCAL, n_centroids=8),
    magicpig=magicpig.MagicPIGConfig(K=4, L=16, sink=SINK, local=LOCAL, capacity=1.0, candidate_capacity=16.0),
    k=K,
)


def _normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_vote_recall_is_the_average_over_every_tie_break():
    rng = np.random.default_rng(0)
    k = 4
    votes = rng.integers(0, 4, size=(6, 12))  # few distinct totals: many ties
    truth = np.stack([rng.choice(12, size=k, replace=False) for _ in votes])  # the target: k rows
    got = jax.jit(jax.vmap(recall.vote_recall, in_axes=(0, 0, None)), static_argnums=2)(
        jnp.asarray(votes, jnp.int32), jnp.asarray(truth), k)
    for v, t, g in zip(votes, truth, np.asarray(got)):
        kth = np.sort(v)[::-1][k - 1]
        above, tied = set(np.flatnonzero(v > kth)), np.flatnonzero(v == kth)
        outcomes = [len((above | set(pick)) & set(t)) / k
                    for pick in itertools.combinations(tied, k - len(above))]
        assert g == pytest.approx(np.mean(outcomes), abs=1e-6)


def _reference_recalls(methods, indexes, pool, q):
    """Set intersections in numpy, from the methods' own retrieve/select."""
    pool_np, q_np = np.asarray(pool, np.float64), np.asarray(q, np.float64)
    head_truth = [set(np.argsort(-(pool_np @ qg))[:K]) for qg in q_np]
    mean_truth = set(np.argsort(-(pool_np @ q_np.mean(0)))[:K])
    found = {
        "pariskv": set(np.asarray(pariskv.retrieve(methods.pariskv, indexes.pariskv, q)).tolist()),
        "pariskv_candidates": set(np.asarray(
            pariskv.coarse_candidates(methods.pariskv, indexes.pariskv, q)).tolist()),
        "pqcache": set(np.asarray(pqcache.retrieve(methods.pqcache, indexes.pqcache, q)).tolist()),
    }
    out = {name: ([len(rows & t) / K for t in head_truth], len(rows & mean_truth) / K)
           for name, rows in found.items()}
    sel = magicpig.select(methods.magicpig, indexes.magicpig, q)
    idx, mask = np.asarray(sel.idx), np.asarray(sel.mask)
    per_head = [set(idx[m].tolist()) for m in mask]
    out["magicpig"] = ([len(s & t) / K for s, t in zip(per_head, head_truth)],
                       len(set().union(*per_head) & mean_truth) / K)
    return out


_layer_recalls_and_indexes = jax.jit(
    lambda methods, pool, queries, key: (recall.layer_recalls(methods, pool, queries, key),
                                         jax.vmap(lambda p: recall.build_indexes(methods, p, p.shape[0], key))(pool)),
    static_argnums=0)


@pytest.mark.parametrize("methods", [
    pytest.param(EXACT_METHODS, id="exact"),
    pytest.param(TYPICAL_METHODS, id="typical", marks=pytest.mark.slow),  # a second compile: ~25 s CPU
])
def test_query_recalls_agree_with_set_intersections(methods):
    pool, queries = _normal(3, 2, 40, 16), _normal(4, 2, 3, 5, 16)
    got, indexes = _layer_recalls_and_indexes(methods, pool, queries, jax.random.key(0))
    head, position = 1, 2
    want = _reference_recalls(methods, jax.tree.map(lambda x: x[head], indexes), pool[head],
                              queries[head, :, position])
    for name, (per_head, mean) in want.items():
        np.testing.assert_allclose(np.asarray(got[name][0][head, position]), per_head, atol=1e-6, err_msg=name)
        assert float(got[name][1][head, position]) == pytest.approx(mean, abs=1e-6), name
    if methods is EXACT_METHODS:
        for name in ("pariskv_candidates", "magicpig"):
            np.testing.assert_array_equal(np.asarray(got[name][0]), 1.0, err_msg=name)
        # PQ scores are exact here, but PQCache ranks by the group mean: full recall of that target.
        np.testing.assert_array_equal(np.asarray(got["pqcache"][1]), 1.0)


def _capture(n_tokens, first_query, seed=5, layers=1, heads=2, group=3, d=16):
    q_len = n_tokens - first_query
    return Captured(keys=np.asarray(_normal(seed, layers, heads, n_tokens, d)),
                    values=np.asarray(_normal(seed + 1, layers, heads, n_tokens, d)),
                    queries=np.asarray(_normal(seed + 2, layers, heads, group, q_len, d)),
                    query_positions=np.arange(first_query, n_tokens))


def test_restrict_takes_the_prefix_and_its_last_queries():
    full = _capture(60, 30)
    part = recall.restrict(full, 50, 4)
    np.testing.assert_array_equal(part.keys, full.keys[:, :, :50])
    np.testing.assert_array_equal(part.queries, full.queries[:, :, :, 16:20])
    np.testing.assert_array_equal(part.query_positions, np.arange(46, 50))
    with pytest.raises(ValueError, match="need a larger capture"):
        recall.restrict(full, 40, 20)  # queries from 20 on: the capture starts at 30


def test_oracle_retriever_reads_k_keys_and_is_exact_when_k_covers_the_pool():
    cap = _capture(60, 56)
    keys, values, queries = (jnp.asarray(x[0]) for x in (cap.keys, cap.values, cap.queries))
    positions = jnp.asarray(cap.query_positions)
    pool = 60 - 4 - LOCAL - SINK
    small = recall.OracleRetrieverConfig(K, per_head=False, sink=SINK, local=LOCAL)
    _, read = recall.layer_errors(recall.ORACLE_RETRIEVER, small, keys, values, queries, positions, jax.random.key(0))
    exact = SINK + LOCAL + np.arange(1, 5)  # sink + local + the decode tokens up to each query
    np.testing.assert_array_equal(np.asarray(read), np.broadcast_to(exact + K, (2, 4)))
    whole = recall.OracleRetrieverConfig(pool, per_head=True, sink=SINK, local=LOCAL)
    err, read = recall.layer_errors(recall.ORACLE_RETRIEVER, whole, keys, values, queries, positions,
                                    jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(read), np.broadcast_to(positions + 1, (2, 4)))
    # Every key attended: only float32 rounding of the split softmax remains.
    assert float(jnp.max(err)) < 1e-5


def test_methods_must_share_the_exact_set():
    with pytest.raises(ValueError, match="Methods.pqcache has sink 4, local 512"):
        recall.Methods(pariskv=pariskv.ParisKVConfig(sink=SINK, local=LOCAL), pqcache=pqcache.PQCacheConfig(),
                       magicpig=magicpig.MagicPIGConfig(sink=SINK, local=LOCAL), k=K)


def test_capacity_view_equals_building_at_that_capacity():
    keys = _normal(6, 70, 16)
    n0, n = 40, 60
    key = jax.random.key(3)
    built = recall.build_indexes(TYPICAL_METHODS, keys, n0, key)
    grown = recall.insert_keys(TYPICAL_METHODS, built, keys[n0:n], n - n0)
    view = drift.at_capacity(grown, n)
    direct = pariskv.build(TYPICAL_METHODS.pariskv, keys[:n], n)
    for got, want in zip(jax.tree.leaves(view.pariskv), jax.tree.leaves(direct)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    direct = magicpig.build(TYPICAL_METHODS.magicpig, keys[:n], n, key, mu=built.magicpig.mu)
    for got, want in zip(jax.tree.leaves(view.magicpig), jax.tree.leaves(direct)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(view.pqcache.centroids), np.asarray(built.pqcache.centroids))


def test_checkpoint_steps():
    assert drift.checkpoint_steps(1000, 400, 250, 8) == [0, 250, 500]
    with pytest.raises(ValueError, match="no decode steps"):
        drift.checkpoint_steps(405, 400, 250, 8)


@pytest.mark.slow  # one compile per pool size: ~30 s CPU; the capacity view it relies on is tested above
def test_drift_study_pools_grow_and_exact_settings_keep_full_recall():
    cap = _capture(100, 60, layers=1)
    result = drift.study(cap, EXACT_METHODS, prefill=60, step=20, per_step=4, log=lambda *_: None)
    steps = [c["decode_step"] for c in result["checkpoints"]]
    assert steps == [0, 20]
    assert [c["pool_keys"] for c in result["checkpoints"]] == [50, 70]
    # Every pool key is a candidate: recall 1 means the targets are drawn from exactly the indexed keys.
    for c in result["checkpoints"]:
        assert c["pariskv_candidates/head"]["mean"] == 1.0
        assert c["magicpig/head"]["mean"] == 1.0
