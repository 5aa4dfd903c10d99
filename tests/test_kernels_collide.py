"""MagicPIG collide kernels vs the plain-jnp reference and a brute-force count; CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import dispatch
from pallas_kernels.collide import collide, collide_reference
from pallas_kernels.testing import INTERPRET, lower_for_cuda, triton_kernels

FIELDS = ("idx", "mask", "n_hits", "overflow", "truncated")
# The XLA path and the kernel path of the public entry point.
BOTH_PATHS = (dict(kernels="xla"), dict(kernels="interpret" if INTERPRET else "pallas"))


def _index(codes: np.ndarray, n_bits: int):
    """Inverted index (sorted_ids [L, N], bucket_start [L, 2^K + 1]) of codes [N, L], in numpy."""
    sorted_ids = np.argsort(codes.T, axis=1, kind="stable").astype(np.int32)
    sizes = np.stack([np.bincount(c, minlength=2**n_bits) for c in codes.T])
    bucket_start = np.concatenate([np.zeros((codes.shape[1], 1), np.int64), np.cumsum(sizes, 1)], 1)
    return sorted_ids, bucket_start.astype(np.int32)


def _problem(seed, n, n_bits, n_tables):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**n_bits, (n, n_tables))
    query = rng.integers(0, 2**n_bits, (n_tables,))
    return codes, query.astype(np.uint16), *_index(codes, n_bits)


def _assert_same(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


# A quarter of the profile's examples (5 by default): interpret mode is slow.
@settings(max_examples=settings.default.max_examples // 4)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 400), n_bits=st.integers(1, 5),
       n_tables=st.integers(1, 24), capacity=st.integers(1, 80), bucket_capacity=st.integers(1, 100),
       min_hits=st.integers(1, 3))
def test_kernel_matches_reference(seed, n, n_bits, n_tables, capacity, bucket_capacity, min_hits):
    _, query, sorted_ids, bucket_start = _problem(seed, n, n_bits, n_tables)
    kw = dict(capacity=capacity, bucket_capacity=bucket_capacity, min_hits=min_hits)
    # Integer outputs: exact.
    _assert_same(collide(query, sorted_ids, bucket_start, interpret=INTERPRET, **kw),
                 collide_reference(query, sorted_ids, bucket_start, **kw))


@pytest.mark.parametrize("seed, min_hits", [(0, 1), (1, 2), (2, 3)])
def test_reference_is_brute_force_count(seed, min_hits):
    """Without truncation, the selection is every key matching in ≥ min_hits tables, ascending."""
    n, n_bits, n_tables = 300, 3, 12
    codes, query, sorted_ids, bucket_start = _problem(seed, n, n_bits, n_tables)
    hits = np.sum(codes == query[None, :], axis=1)
    want = np.flatnonzero(hits >= min_hits)
    capacity = 16
    got = collide_reference(query, sorted_ids, bucket_start, capacity=capacity,
                            bucket_capacity=n, min_hits=min_hits)
    assert len(want) > capacity  # so the overflow path is exercised
    np.testing.assert_array_equal(got.idx, want[:capacity])
    np.testing.assert_array_equal(got.n_hits, hits[want[:capacity]])
    assert got.mask.all() and got.overflow == len(want) - capacity and got.truncated == 0


@pytest.mark.parametrize("path", BOTH_PATHS)
def test_truncation_reads_first_entries_and_reports_drops(path):
    n, n_bits, n_tables, bucket_capacity = 200, 2, 6, 10
    codes, query, sorted_ids, bucket_start = _problem(3, n, n_bits, n_tables)
    sizes = np.sum(codes == query[None, :], axis=0)            # query bucket size per table
    kept = np.zeros(n, np.int64)
    for l in range(n_tables):
        start = bucket_start[l, query[l]]
        kept[sorted_ids[l, start:start + min(sizes[l], bucket_capacity)]] += 1
    want = np.flatnonzero(kept >= 2)
    got = dispatch.collide(query, sorted_ids, bucket_start, capacity=n, bucket_capacity=bucket_capacity,
                           **path)
    assert got.truncated == np.sum(np.maximum(sizes - bucket_capacity, 0)) > 0
    np.testing.assert_array_equal(np.asarray(got.idx)[np.asarray(got.mask)], want)


def test_empty_selection():
    """min_hits above the number of tables: nothing selected, every slot masked and zero."""
    _, query, sorted_ids, bucket_start = _problem(4, 50, 2, 3)
    got = collide(query, sorted_ids, bucket_start, capacity=8, bucket_capacity=50, min_hits=4,
                  interpret=INTERPRET)
    assert not got.mask.any() and not got.idx.any() and not got.n_hits.any() and got.overflow == 0


def test_bad_input_named():
    _, query, sorted_ids, bucket_start = _problem(5, 20, 2, 3)
    with pytest.raises(ValueError, match="query_codes"):
        collide(query[:2], sorted_ids, bucket_start, capacity=4, bucket_capacity=4)
    with pytest.raises(ValueError, match="bucket_start"):
        collide_reference(query, sorted_ids, bucket_start[:, :4], capacity=4, bucket_capacity=4)
    with pytest.raises(ValueError, match="min_hits"):
        collide(query, sorted_ids, bucket_start, capacity=4, bucket_capacity=4, min_hits=0)


@pytest.mark.parametrize("n_bits, n_tables", [(10, 150), (11, 300)])  # MagicPIG K10L150, K11L300
def test_lowers_for_cuda(n_bits, n_tables):
    n = 32768
    text = lower_for_cuda(
        lambda *a: collide(*a, capacity=2048, bucket_capacity=512),
        jax.ShapeDtypeStruct((n_tables,), jnp.uint16), jax.ShapeDtypeStruct((n_tables, n), jnp.int32),
        jax.ShapeDtypeStruct((n_tables, 2**n_bits + 1), jnp.int32))
    assert triton_kernels(text) == ["collide_count", "compact"]
