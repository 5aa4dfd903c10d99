"""ParisKV vote kernels vs the lax.top_k reference and a numpy sort; CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import dispatch
from pallas_kernels.vote import N_PATTERNS, vote, vote_reference
from pallas_kernels.testing import INTERPRET, lower_for_cuda, triton_kernels


# The XLA path and the kernel path of the public entry point.
BOTH_PATHS = (dict(kernels="xla"), dict(kernels="interpret" if INTERPRET else "pallas"))


def _problem(seed, n, n_subspaces, max_vote=6, n_patterns=N_PATTERNS):
    rng = np.random.default_rng(seed)
    signs = rng.integers(0, n_patterns, (n, n_subspaces)).astype(np.uint8)
    # Votes 0..max_vote per subspace, as ParisKV's six tiers give: many ties.
    lut = rng.integers(0, max_vote + 1, (n_subspaces, n_patterns)).astype(np.int32)
    return signs, lut


def _assert_same(got, want):
    for field in ("idx", "mask", "votes"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


# A quarter of the profile's examples (5 by default): interpret mode is slow.
@settings(max_examples=settings.default.max_examples // 4)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 700), n_subspaces=st.sampled_from([8, 12, 16]),
       capacity_frac=st.floats(0, 1), valid_frac=st.floats(0, 1), max_vote=st.sampled_from([0, 1, 6]),
       m=st.sampled_from([4, 8]))
def test_kernel_matches_reference(seed, n, n_subspaces, capacity_frac, valid_frac, max_vote, m):
    signs, lut = _problem(seed, n, n_subspaces, max_vote, 2**m)
    capacity = max(1, round(capacity_frac * n))
    n_valid = round(valid_frac * n)
    # Integer outputs, ties included: exact.
    _assert_same(vote(signs, lut, n_valid, capacity=capacity, interpret=INTERPRET),
                 vote_reference(signs, lut, n_valid, capacity=capacity))


@pytest.mark.parametrize("n", [1300, 2100])
def test_kernel_matches_reference_past_one_compact_block(n):
    """N > 1024 and not a multiple of 1024: the compaction pads to whole blocks."""
    signs, lut = _problem(7, n, 8)
    _assert_same(vote(signs, lut, n - 5, capacity=n // 10, interpret=INTERPRET),
                 vote_reference(signs, lut, n - 5, capacity=n // 10))


def test_reference_is_stable_sort():
    """The candidates are the first C keys ordered by (votes descending, key id ascending)."""
    n, capacity, n_valid = 500, 120, 430
    signs, lut = _problem(7, n, 8, max_vote=2)  # totals 0..16 over 430 keys: heavy ties
    totals = lut[np.arange(8)[None, :], signs].sum(1)
    order = sorted(range(n_valid), key=lambda i: (-totals[i], i))[:capacity]
    got = vote_reference(signs, lut, n_valid, capacity=capacity)
    np.testing.assert_array_equal(got.idx, sorted(order))
    np.testing.assert_array_equal(got.votes, totals[sorted(order)])
    assert got.mask.all()


@pytest.mark.parametrize("path", BOTH_PATHS)
@pytest.mark.parametrize("n_valid", [0, 5])
def test_fewer_valid_keys_than_capacity(n_valid, path):
    signs, lut = _problem(8, 300, 16)
    got = dispatch.vote(signs, lut, n_valid, capacity=64, **path)
    np.testing.assert_array_equal(got.mask, np.arange(64) < n_valid)
    np.testing.assert_array_equal(got.idx[:n_valid], np.arange(n_valid))
    assert not got.idx[n_valid:].any() and not got.votes[n_valid:].any()


def test_bad_input_named():
    signs, lut = _problem(0, 20, 8)
    with pytest.raises(ValueError, match="lut"):
        vote(signs, lut[:4], capacity=4)
    with pytest.raises(ValueError, match="lut"):
        vote(signs, np.zeros((8, 512), np.int32), capacity=4)
    with pytest.raises(ValueError, match="signs"):
        vote_reference(signs.astype(np.int32), lut, capacity=4)
    with pytest.raises(ValueError, match="capacity"):
        vote(signs, lut, capacity=21)


@pytest.mark.parametrize("n, n_subspaces", [(32768, 8), (32768, 16), (131072, 16)])  # d = 64, 128
def test_lowers_for_cuda(n, n_subspaces):
    capacity = n // 10  # ParisKV's candidate_ratio for N ≥ 30K
    text = lower_for_cuda(lambda s, l: vote(s, l, capacity=capacity),
                          jax.ShapeDtypeStruct((n, n_subspaces), jnp.uint8),
                          jax.ShapeDtypeStruct((n_subspaces, N_PATTERNS), jnp.int32))
    assert triton_kernels(text) == ["vote_totals", "compact"]
