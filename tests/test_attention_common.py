"""jaxkv.attention.common: partial attention, log-sum-exp merge and finalize against float64 numpy; the row compaction helpers against numpy."""
import numpy as np
import jax.numpy as jnp
import pytest

from jaxkv.attention import common


def softmax_attention_f64(q, k, v, log_weight=None, mask=None):
    s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T / np.sqrt(q.shape[-1])
    if log_weight is not None:
        s = s + log_weight
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ np.asarray(v, np.float64)


def random_qkv(seed, g=3, n=40, d=16, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(g, d)).astype(np.float32) * scale,
            rng.normal(size=(n, d)).astype(np.float32),
            rng.normal(size=(n, d)).astype(np.float32))


# float32 softmax and sums over ≤ 40 unit-scale terms: errors of a few ulps
# of the O(1) outputs; 1e-5 leaves a margin of ~10×.
TOL = 1e-5


@pytest.mark.parametrize("bounds", [(0, 40), (0, 10, 40), (0, 1, 17, 39, 40)])
def test_merge_of_disjoint_parts_equals_full_attention(bounds):
    q, k, v = random_qkv(0, scale=3.0)
    parts = [common.partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    out = common.finalize(common.merge(*parts))
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v), atol=TOL)


def test_empty_partial_is_the_identity_of_merge():
    q, k, v = random_qkv(1)
    part = common.partial_attention(q, k, v)
    merged = common.merge(common.empty_partial(3, 16), part, common.empty_partial(3, 16))
    np.testing.assert_allclose(merged.o, part.o, rtol=1e-6)
    np.testing.assert_allclose(merged.l, part.l, rtol=1e-6)


def test_fully_masked_rows_finalize_to_zero_without_nan():
    q, k, v = random_qkv(2)
    mask = np.ones((3, 40), bool)
    mask[1] = False
    out = np.asarray(common.finalize(common.partial_attention(q, k, v, mask=mask)))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_allclose(out[[0, 2]], softmax_attention_f64(q, k, v)[[0, 2]], atol=TOL)


def test_log_weight_is_added_to_the_scores():
    q, k, v = random_qkv(3)
    lw = np.random.default_rng(3).uniform(-5, 5, size=(3, 40)).astype(np.float32)
    out = common.finalize(common.partial_attention(q, k, v, log_weight=lw))
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v, log_weight=lw), atol=TOL)


def test_huge_scores_stay_finite_and_exact():
    # Scores of order 1e4: exp would overflow without the running max.
    q, k, v = random_qkv(4, scale=3000.0)
    out = common.finalize(common.merge(common.partial_attention(q, k[:20], v[:20]),
                                       common.partial_attention(q, k[20:], v[20:])))
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v), atol=TOL)


def test_distinct_rows_counts_the_union_over_heads():
    mask = jnp.array([[True, False, False, True], [True, True, False, False]])
    sel = common.Selection(idx=jnp.arange(4), mask=mask)
    assert int(sel.distinct_rows()) == 3


def _mask(seed, n, density):
    return np.random.default_rng(seed).random(n) < density


def _unpack(words, n):
    return np.unpackbits(np.asarray(words).view(np.uint8), bitorder="little")[:n].astype(bool)


@pytest.mark.parametrize("n", [1, 32, 100, 5_000])
def test_pack_words_puts_row_32w_plus_j_in_bit_j_of_word_w(n):
    mask = _mask(n, n, 0.4)
    words = common.pack_words(jnp.asarray(mask))
    assert words.dtype == jnp.uint32 and words.shape == (-(-n // 32),)
    np.testing.assert_array_equal(_unpack(words, words.size * 32), np.r_[mask, np.zeros(-n % 32, bool)])


@pytest.mark.parametrize("n, density, keep", [
    (5_000, 0.3, 1), (5_000, 0.3, 700), (5_000, 0.02, 60),
    (96, 1.0, 32),   # the last bit of a full word
    (96, 1.0, 33),   # the first bit of the next
    (96, 1.0, 0),    # none
    (300, 0.5, 1_000),  # more than there are: all
])
def test_first_set_bits_keeps_the_first_trues_in_row_order(n, density, keep):
    mask = _mask(n + keep, n, density)
    want = mask & (np.cumsum(mask) <= keep)
    got = common.first_set_bits(common.pack_words(jnp.asarray(mask)), keep)
    np.testing.assert_array_equal(_unpack(got, n), want)


@pytest.mark.parametrize("n, density", [(1, 1.0), (100, 0.5), (5_000, 0.01), (5_000, 0.9), (64, 0.0)])
def test_set_bits_through_is_the_running_count_of_the_rows(n, density):
    mask = _mask(n, n, density)
    got = common.set_bits_through(common.pack_words(jnp.asarray(mask)))
    assert got.dtype == jnp.int32 and got.shape == (-(-n // 32) * 32,)
    np.testing.assert_array_equal(np.asarray(got)[:n], np.cumsum(mask))
    np.testing.assert_array_equal(np.asarray(got)[n:], mask.sum())  # the padding rows are False


@pytest.mark.parametrize("n, density, size, fill", [
    (5_000, 0.3, 1_500, 0),    # exactly or about as many Trues as slots
    (5_000, 0.3, 200, 0),      # more Trues than slots: the first ones
    (5_000, 0.01, 200, 5_000),  # fewer: the rest is fill
    (7, 0.0, 3, -1),           # none
    (0, 0.0, 3, -1),           # no rows
    (70, 1.0, 0, 0),           # no slots
    (100, 1.0, 100, 0),        # all True, a partial last word
])
def test_compact_rows_is_nonzero_with_size_and_fill(n, density, size, fill):
    mask = _mask(n + size, n, density)
    rows = np.flatnonzero(mask)[:size]
    want = np.r_[rows, np.full(size - rows.size, fill)]
    np.testing.assert_array_equal(common.compact_rows(jnp.asarray(mask), size, fill), want)
