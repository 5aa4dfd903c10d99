"""jaxkv.native's CPU kernels (``ParisKVConfig(kernels="native")``,
``MagicPIGConfig(kernels="native")``) against the XLA path.

The coarse stage's rows are integers chosen by integer votes, MagicPIG's sample and its
merged id lists are integers too: they must be the XLA path's exactly. The rerank sums the same float32 products in another order:
relative error ~ P·eps ≈ 1.5e-5 at P = 128 in the worst case, far less in practice;
the bound below is 1e-5 of the largest |score|.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import models
from jaxkv import cache as kvcache
from jaxkv import native
from jaxkv.attention import common, dense, magicpig, pariskv, rsq
from jaxkv.cache import HOST, CacheConfig
from tests.test_generate import _prompts
from tests.test_kernels_end_to_end import one_layer  # noqa: F401  (fixture)

# ParisKV's selection (native.AVX2_TARGETS) is built on an AVX2 CPU too, every other kernel
# only with AVX-512: the tests of those are marked all_kernels.
pytestmark = pytest.mark.skipif(not native.available(*native.AVX2_TARGETS),
                                reason=str(native.unavailable_reason(*native.AVX2_TARGETS)))
all_kernels = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))

SCORE_RTOL = 1e-5
CFG = pariskv.ParisKVConfig(top_k=40, kernels="native")


def _keys(seed, shape):
    rng = np.random.default_rng(seed)
    # Unequal coordinate scales, as real keys have, so the vote tiers differ by subspace.
    return jnp.asarray(rng.standard_normal(shape) * np.linspace(0.3, 3.0, shape[-1]), jnp.float32)


@functools.partial(jax.jit, static_argnames="cfg")
def _steps(cfg, index, q):
    """Candidates, their rerank scores and the final selection for each head (vmap)."""
    def one_head(index, q):
        candidates = pariskv.coarse_candidates(cfg, index, q)
        return candidates, pariskv.rerank_scores(cfg, index, q, candidates), pariskv.select(cfg, index, q)
    return jax.vmap(one_head)(index, q)


# d = 64 and 128 (B = 8, 16 sign bytes); n = cap, most of cap, and fewer valid keys than
# candidates (the invalid rows n, n+1, … fill in, as on the XLA path).
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [3000, 2345, 150])
def test_native_candidates_scores_and_selection_equal_the_xla_path(d, n):
    heads, cap = 2, 3000
    index = jax.vmap(lambda k: pariskv.build(CFG, k, jnp.int32(n)))(_keys(0, (heads, cap, d)))
    q = _keys(1, (heads, 3, d))
    cand_x, score_x, sel_x = _steps(dataclasses.replace(CFG, kernels="xla"), index, q)
    cand_n, score_n, sel_n = _steps(CFG, index, q)
    np.testing.assert_array_equal(cand_n, cand_x)
    assert cand_x.shape == (heads, pariskv.n_candidates(CFG, cap))
    np.testing.assert_allclose(score_n, score_x, rtol=0, atol=SCORE_RTOL * np.abs(score_x).max())
    np.testing.assert_array_equal(sel_n.idx, sel_x.idx)
    np.testing.assert_array_equal(sel_n.mask, sel_x.mask)
    assert int(sel_x.mask.sum()) == heads * min(n, CFG.top_k)


@pytest.mark.parametrize("n", [40_000, 35_000, 20_000, 3_000])
def test_native_candidates_across_vote_blocks(n):
    """The kernel votes in blocks of 16,384 rows, split over threads: 40,000 rows are three
    blocks, the last one partial; the valid rows end inside the last block, or before it
    (blocks with no valid row), or before the 4,000 candidates are reached (the invalid rows
    fill in: their votes must read as -1)."""
    cap, heads = 40_000, 2
    index = jax.vmap(lambda k: pariskv.build(CFG, k, jnp.int32(n)))(_keys(10, (heads, cap, 64)))
    q = _keys(11, (heads, 3, 64))
    candidates = jax.jit(jax.vmap(pariskv.coarse_candidates, in_axes=(None, 0, 0)), static_argnums=0)
    np.testing.assert_array_equal(candidates(CFG, index, q),
                                  candidates(dataclasses.replace(CFG, kernels="xla"), index, q))


# scale 3e37: the scores' range overflows float32, so the kernel ranks all 256 patterns of
# a subspace as one bucket (its fallback), ties included.
@pytest.mark.parametrize("scale", [1.0, 3e37])
@pytest.mark.parametrize("count", [1, 10, 100, 200, 600, 2000, 4000])
def test_native_vote_table_ranks_tied_patterns_as_the_xla_path(count, scale):
    """Integer query coordinates tie many pattern scores exactly (see test_pariskv's
    test_vote_table_ranks_tied_patterns_by_the_lower_pattern): the kernel's ranking of
    ties decides which buckets fill a tier, so its rows must still be the XLA path's.
    The counts put the vote threshold at votes + 1 of 19, 12, 8, 7, 5, 1 and 0 (4,000:
    past the valid rows)."""
    cap, n = 4000, 3500
    q_rot = scale * jnp.asarray(np.r_[np.ones(8), np.arange(8) % 3, -np.ones(8), np.zeros(8)], jnp.float32)
    rng = np.random.default_rng(8)
    counts = jnp.asarray(rng.integers(0, 40, (4, 256)), jnp.int32)
    signs = jnp.asarray(rng.integers(0, 256, (cap, 4)), jnp.uint8)
    cfg = dataclasses.replace(CFG, collision_ratio=0.2)
    table = pariskv.vote_table(cfg, q_rot, jnp.int32(n), counts, cap)
    votes = jnp.where(jnp.arange(cap) < n, jnp.sum(table[jnp.arange(4)[None, :], signs], axis=-1), -1)
    expected = pariskv.most_voted_rows(votes, count, pariskv.N_TIERS * 4)
    scores, caps = pariskv.pattern_scores_and_caps(cfg, q_rot, jnp.int32(n), cap)
    got = native.coarse_rows(signs, scores, counts, caps, jnp.int32(n), count)
    np.testing.assert_array_equal(got, expected)
    assert len(np.unique(np.asarray(table))) > 3  # several tiers in play


# Every padded dimension the kernel serves: each has its own compiled estimate.
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_native_rerank_reads_any_rows_in_any_order(d):
    """Unsorted rows with repeats, the first and last row: the estimate of each row."""
    index = pariskv.build(CFG, _keys(2, (500, d)), jnp.int32(500))
    q_rot, q_norm = pariskv._query(CFG, _keys(3, (d,)))
    _, centres = pariskv._levels(CFG)
    rows = jnp.asarray([499, 0, 17, 17, 256, 3, 499, 128], jnp.int32)
    expected = rsq.estimate(jax.tree.map(lambda x: x[rows], index.codes), q_rot, q_norm, CFG.m, centres)
    got = jax.jit(native.rerank)(index.codes, q_rot, q_norm, centres, rows)
    np.testing.assert_allclose(got, expected, rtol=0, atol=SCORE_RTOL * np.abs(expected).max())
    assert got[2] == got[3] and got[0] == got[6]


@pytest.mark.parametrize("k", [1, 7, 100, 256, 257, 300])
def test_native_top_k_is_lax_top_k_with_its_ties(k):
    """Values with many ties (rounded to halves, with -0 beside +0, which lax.top_k ranks
    below +0) and -inf (invalid candidates), batched."""
    rng = np.random.default_rng(6)
    values = np.round(rng.standard_normal((3, 300)) * 2) / 2
    values[:, rng.choice(300, 40, replace=False)] = -np.inf
    values[2] = -np.inf  # fewer valid values than k: lax.top_k takes the -inf ones by position
    values = jnp.asarray(values, jnp.float32)
    np.testing.assert_array_equal(jax.jit(native.top_k, static_argnums=1)(values, k), jax.lax.top_k(values, k)[1])
    with pytest.raises(ValueError, match="k"):
        native.top_k(values, 301)


@pytest.mark.parametrize("k", [1, 100, 2048])
def test_native_top_k_of_close_rising_values(k):
    """Scores as a step's reranked candidates can be: rising with position and within one
    binade, so the select's first digits are all equal and it needs every pass; a few
    repeated values tie at the k-th."""
    rng = np.random.default_rng(9)
    values = np.float32(1.0) + np.sort(rng.uniform(0, 1e-3, (2, 6000))).astype(np.float32)
    for tied in (slice(5880, 5920), slice(3900, 4000)):  # around the 100th and the 2048th largest
        values[:, tied] = values[:, tied.start, None]
    values = jnp.asarray(values, jnp.float32)
    np.testing.assert_array_equal(jax.jit(native.top_k, static_argnums=1)(values, k), jax.lax.top_k(values, k)[1])


@pytest.mark.parametrize("c", [3_277, 26_214])  # ParisKV's candidates at 16k and 256k keys
@pytest.mark.parametrize("k", [1, 100, 2048])
def test_native_top_k_of_a_long_row(k, c):
    """Rows are first cut to the values within a bound taken from a strided sample of
    min(1024, C/4) of them (unless it would keep half of them): normal scores with ties, -0
    and -inf among them; and a row whose sampled positions hold its largest values, so that
    the sample's bound keeps fewer than k and the kernel must fall back to every value."""
    rng = np.random.default_rng(11)
    normal = np.round(rng.standard_normal(c) * 64) / 64  # many ties
    normal[rng.choice(c, 500, replace=False)] = -np.inf
    normal[rng.choice(c, 50, replace=False)] = -0.0
    misleading = rng.uniform(0, 1, c)
    sample = min(1024, c // 4)
    misleading[np.arange(sample) * c // sample] += 10.0  # the sampled positions: above every other value
    values = jnp.asarray(np.stack([normal, misleading]), jnp.float32)
    np.testing.assert_array_equal(jax.jit(native.top_k, static_argnums=1)(values, k), jax.lax.top_k(values, k)[1])


# Float32 rounding apart: the same products summed in another order (scores over d ≤ 128,
# value sums over a few thousand rows), libm's transcendentals against XLA's in
# MagicPIG's correction (a few ulp each): relative to the largest entry, well under 1e-5.
PARTIAL_RTOL = 1e-5


def _assert_partials_close(got, want):
    np.testing.assert_allclose(got.m, want.m, rtol=1e-5, atol=1e-5)
    for field in ("o", "l"):
        want_x = np.asarray(getattr(want, field))
        np.testing.assert_allclose(getattr(got, field), want_x, rtol=0, atol=PARTIAL_RTOL * np.abs(want_x).max())


def _assert_attends_in_place(attend_in_place, index, q, keys, values, sel, want):
    """attend_in_place (vmapped over heads) gives the gathered rows' partial, and the same
    partial bit for bit with the rows in host memory."""
    in_place = jax.jit(jax.vmap(attend_in_place))
    got = in_place(index, q, keys, values, sel)
    _assert_partials_close(got, want)
    from_host = in_place(index, q, jax.device_put(keys, HOST), jax.device_put(values, HOST), sel)
    for field in ("o", "l", "m"):
        np.testing.assert_array_equal(getattr(from_host, field), getattr(got, field))


# top-k 40 (one of the kernel's 256-slot blocks) and 600 (three, their partials merged);
# n = 30 < 40 leaves slots past the valid keys masked out. The queries at 0.3 of the keys'
# scale spread the weights over most selected rows (exp of their entropy: 11-32 rows of
# 40, 248-405 of 600), so that a dropped or doubled row shows.
@all_kernels
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("top_k, n", [(40, 2900), (600, 2900), (40, 30)])
def test_native_pariskv_attends_its_rows_in_place(d, top_k, n):
    heads, cap = 2, 3000
    cfg = dataclasses.replace(CFG, top_k=top_k)
    keys, values = _keys(20, (heads, cap, d)), _keys(21, (heads, cap, d))
    index = jax.vmap(lambda k: pariskv.build(cfg, k, jnp.int32(n)))(keys)
    q = _keys(22, (heads, 3, d)) * 0.3
    sel = jax.vmap(lambda ix, qq: pariskv.select(cfg, ix, qq))(index, q)
    assert int(sel.mask.sum()) == heads * min(n, top_k)
    want = jax.vmap(lambda qq, k, v, s: common.partial_attention(qq, k[s.idx], v[s.idx], s.mask))(
        q, keys, values, sel)
    _assert_attends_in_place(functools.partial(pariskv.attend_in_place, cfg), index, q, keys, values, sel, want)


# The window is a ring of W + U = 300 slots (two of the kernel's 256-slot blocks): full,
# wrapped at slot 7, partly filled and wrapped (its unused slots hold keys that must not
# count), and holding one row; a bfloat16 cache's window too.
@all_kernels
@pytest.mark.parametrize("win_start, win_len, dtype", [(0, 300, jnp.float32), (7, 300, jnp.float32),
                                                     (250, 120, jnp.float32), (299, 1, jnp.float32),
                                                     (7, 300, jnp.bfloat16), (250, 120, jnp.bfloat16)])
def test_native_window_partial_is_the_xla_partial(win_start, win_len, dtype):
    b, h, d, prompt = 2, 3, 64, 700
    mcfg = dataclasses.replace(CFG, sink=4, local=200)
    ccfg = CacheConfig(sink=4, local=200, buffer=100, dense_threshold=0).resolve(mcfg)
    keys = _keys(30, (b, h, prompt, d)).astype(dtype)
    state = kvcache.regions_from_prefill(keys, _keys(31, keys.shape).astype(dtype), jnp.full((b,), prompt, jnp.int32),
                                         method=pariskv.METHOD, mcfg=mcfg, ccfg=ccfg, capacity=prompt,
                                         key=jax.random.key(0))
    state = dataclasses.replace(state, win_start=jnp.full((b,), win_start, jnp.int32),
                                win_len=jnp.full((b,), win_len, jnp.int32))
    q = _keys(32, (b, h, 3, d)) * 0.3
    assert kvcache.attends_in_place(pariskv.METHOD, mcfg, state.win_k)
    exact = jax.jit(kvcache._exact_partial, static_argnames=("method", "mcfg"))
    got = exact(q, state, method=pariskv.METHOD, mcfg=mcfg)
    want = exact(q, state, method=pariskv.METHOD, mcfg=dataclasses.replace(mcfg, kernels="xla"))
    _assert_partials_close(got, want)


# bfloat16 rows are widened in registers, exactly: the partial of bfloat16 rows, and of their
# bits as uint16 (how the cache stores them), is the partial of their float32 values, bit for
# bit, with and without MagicPIG's correction.
# d = 64 and 128 (whole 16-lane vectors), 24 and 80 (a vector's lanes in part: the
# products' masked tails at 24, the value sums' at both); 600 selected rows: three of the
# kernel's 256-slot blocks.
@all_kernels
@pytest.mark.parametrize("d", [64, 128, 24, 80])
def test_native_attention_reads_bfloat16_rows_as_their_float32_values(d):
    heads, cap, count = 3, 2000, 600
    keys, values = _keys(40, (cap, d)).astype(jnp.bfloat16), _keys(41, (cap, d)).astype(jnp.bfloat16)
    q = _keys(42, (heads, d)) * 0.3
    idx = jnp.asarray(np.sort(np.random.default_rng(43).choice(cap, count, replace=False)), jnp.int32)
    mask = jnp.asarray(np.random.default_rng(44).random((heads, count)) < 0.5)
    mu = jnp.mean(keys.astype(jnp.float32), axis=0)
    used = jnp.full((heads,), 150, jnp.int32)

    def both(rows_k, rows_v):
        correction = dict(K=10, min_hits=2, tail_terms=magicpig.TAIL_TERMS, log_u_floor=magicpig.LOG_U_FLOOR)
        return (native.attend_rows(q, rows_k, rows_v, idx, mask, masked_score=common.MASKED_SCORE),
                native.magicpig_attend(q, rows_k, rows_v, mu, idx, mask, used, masked_score=common.MASKED_SCORE,
                                       **correction))

    got = both(keys, values)
    want = both(keys.astype(jnp.float32), values.astype(jnp.float32))
    as_bits = both(models.stored_rows(keys), models.stored_rows(values))
    for got_partial, want_partial, bits_partial in zip(got, want, as_bits):
        for got_x, want_x, bits_x in zip(got_partial, want_partial, bits_partial):
            np.testing.assert_array_equal(got_x, want_x)
            np.testing.assert_array_equal(bits_x, want_x)
    # and the partial is the gathered rows' (attend_rows: no correction)
    exact = common.partial_attention(q, keys[idx], values[idx], mask)
    _assert_partials_close(common.Partial(*got[0]), exact)


# The value rows are summed for up to four query heads at once, each row read once: G = 1, 2,
# 4, 5 and 7 (a group of four, then the rest), with d's masked tails (24, 80). Every tenth
# slot no head sampled, and its rows are NaN: a row adds only to the heads that sampled it,
# so the partial is the one of the rows with those zeroed.
@all_kernels
@pytest.mark.parametrize("g, d", [(1, 64), (2, 24), (4, 128), (5, 80), (7, 64)])
def test_native_attend_rows_for_any_number_of_query_heads(g, d):
    cap, count = 2000, 600
    rng = np.random.default_rng(47)
    idx = rng.choice(cap, count, replace=False)
    mask = rng.random((g, count)) < 0.5
    mask[:, ::10] = False
    keys, values = np.array(_keys(48, (cap, d))), np.array(_keys(49, (cap, d)))
    unsampled = idx[::10]
    poisoned_keys, poisoned_values = keys.copy(), values.copy()
    poisoned_keys[unsampled] = np.nan
    poisoned_values[unsampled] = np.nan
    keys[unsampled], values[unsampled] = 0.0, 0.0
    q = _keys(50, (g, d)) * 0.3
    idx, mask = jnp.asarray(idx, jnp.int32), jnp.asarray(mask)
    got = native.attend_rows(q, jnp.asarray(poisoned_keys), jnp.asarray(poisoned_values), idx, mask,
                             masked_score=common.MASKED_SCORE)
    want = common.partial_attention(q, jnp.asarray(keys)[idx], jnp.asarray(values)[idx], mask)
    _assert_partials_close(common.Partial(*got), want)


@all_kernels
def test_native_attention_refuses_other_row_types():
    q, idx, mask = _keys(45, (2, 64)), jnp.arange(8, dtype=jnp.int32), jnp.ones((2, 8), bool)
    rows = _keys(46, (16, 64))
    for keys, values in ((rows, rows.astype(jnp.bfloat16)), (rows.astype(jnp.float16), rows.astype(jnp.float16)),
                         (rows.astype(jnp.bfloat16), models.stored_rows(rows.astype(jnp.bfloat16)))):
        with pytest.raises(Exception, match="both float32, bfloat16 or bfloat16 bits"):
            jax.block_until_ready(native.attend_rows(q, keys, values, idx, mask, masked_score=common.MASKED_SCORE))


def test_native_mode_is_validated():
    assert CFG.kernels.uses_native() and not CFG.kernels.uses_pallas()
    assert not pariskv.ParisKVConfig().kernels.uses_native()
    with pytest.raises(ValueError, match="m=8"):
        pariskv.ParisKVConfig(m=4, kernels="native")
    index = pariskv.build(CFG, _keys(4, (300, 256)), jnp.int32(300))  # P = 256: too wide
    with pytest.raises(ValueError, match="P"):
        pariskv.retrieve(CFG, index, _keys(5, (256,)))
    # The kernel walks the tiers in order: caps that do not ascend are refused, not misread.
    signs, scores = jnp.zeros((100, 8), jnp.uint8), jnp.zeros((8, 256), jnp.float32)
    counts = jnp.zeros((8, 256), jnp.int32).at[:, 0].set(100)
    descending = jnp.asarray([6.0, 5, 4, 3, 2, 1])
    with pytest.raises(Exception, match="caps must ascend"):
        native.coarse_rows(signs, scores, counts, descending, jnp.int32(100), 10).block_until_ready()


@pytest.mark.parametrize("method, mcfg", [
    ("pariskv", pariskv.ParisKVConfig(top_k=12, sink=2, local=4, buffer=3)),
    pytest.param("magicpig", magicpig.MagicPIGConfig(K=4, L=8, sink=2, local=4, dense_layers=(), capacity=0.5,
                                                     candidate_capacity=1.0), marks=all_kernels)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_generate_with_native_kernels_gives_the_xla_tokens(one_layer, method, mcfg, dtype):  # noqa: F811
    """A sparse layer with no dense fallback: 24 keys in retrieval, the buffer (U = 3)
    flushed into the index three times in 9 steps (MagicPIG's merge in the kernel, its id
    lists on the device; on the XLA path in host memory); the tiny model's d = 16 is P = 16.
    A bfloat16 model's cache is bfloat16, its retrieval rows kept as bits: the kernels read
    them in place (on an AVX2 CPU ParisKV's rows are gathered and attended in XLA: no
    attention kernel there)."""
    config, params = one_layer
    params = models.cast_params(params, dtype)
    module = {"pariskv": pariskv, "magicpig": magicpig}[method]
    assert module.METHOD.reads_rows_in_place(dataclasses.replace(mcfg, kernels="native"),
                                      models.stored_rows(jnp.zeros((1, 16), dtype))) == native.available()
    prompt = _prompts([30], seed=11)
    cache = CacheConfig(sink=2, local=4, buffer=3, dense_threshold=0)
    tokens = {}
    for kernels in ("xla", "native"):
        out = jaxkv.generate(params, config, prompt, max_new_tokens=9, eos_ids=(), method=method,
                             method_config=dataclasses.replace(mcfg, kernels=kernels), cache_config=cache)
        tokens[kernels] = out.tokens, out.keys_read_fraction
    assert tokens["native"] == tokens["xla"]
    assert len(tokens["xla"][0][0]) == 9


# ---------------------------------------------------------------- dense decode

def _dense_layer(seed, b, hkv, g, d, s, dtype):
    """A decode step's query [B, 1, Hkv·G, d] and one layer's cache, laid out as models.KVCache."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, 1, hkv * g, d)) * 1.5, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, hkv, d, s)), dtype)
    values = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    return q, keys, values


# The kernel's sums are XLA's in another order: scores over d, the softmax by blocks of
# 512 keys merged by chunks of 2048. Relative to the largest output entry, under 1e-5.
DENSE_RTOL = 1e-5


# The value rows are summed 64, 128 or 256 coordinates at a time (d <= 64, <= 128, more), by
# 4, 2 or 1 query heads at once: d = 24, 80 and 288 end in a masked tail (of a vector, of a
# row's 128 coordinates, of a second 256-coordinate slice); G = 5 and 7 take a group of four
# query heads, then the rest, and G = 7 with d = 80 leaves a pass of one head; S crosses the
# 512-key blocks and the 2048-key chunks, and the positions stop mid-block; batch rows see
# different prefixes.
@all_kernels
@pytest.mark.parametrize("hkv, g, d", [(3, 3, 64), (2, 4, 128), (1, 5, 24), (2, 7, 80), (2, 1, 16), (1, 3, 288)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_dense_decode_is_prefix_causal_attention(hkv, g, d, dtype):
    q, keys, values = _dense_layer(60, 2, hkv, g, d, 4500, dtype)
    positions = jnp.asarray([[4499], [2100]], jnp.int32)
    # Over float32 copies of the rows: XLA's bfloat16 path rounds the weights to bfloat16
    # before the value contraction, the kernel keeps them in float32.
    want = models.prefix_causal_attention(q, keys.astype(jnp.float32), values.astype(jnp.float32), positions)
    got = jax.jit(dense.native_decode_attention)(q, keys, values, positions)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=0, atol=DENSE_RTOL * float(jnp.abs(want).max()))


@all_kernels
def test_native_dense_decode_of_a_bfloat16_cache_s_bits_is_that_of_its_rows():
    """A bfloat16 models.KVCache holds its rows' bits (uint16): the kernel reads them as the rows."""
    q, keys, values = _dense_layer(64, 2, 2, 3, 64, 700, jnp.bfloat16)
    qg, visible = q.reshape(2, 2, 3, 64), jnp.asarray([700, 333])
    from_bits = native.dense_decode(qg, models.stored_rows(keys), models.stored_rows(values), visible)
    np.testing.assert_array_equal(from_bits, native.dense_decode(qg, keys, values, visible))


@all_kernels
def test_native_dense_decode_reads_no_key_past_the_position():
    """Keys and values past each row's position are NaN: the output is that of the cache cut at
    the position, so they were not read; a position past the cache sees all of it."""
    q, keys, values = _dense_layer(61, 3, 2, 3, 64, 1500, jnp.float32)
    positions = jnp.asarray([[700], [0], [1600]], jnp.int32)
    seen = jnp.arange(1500)[None, None, :] <= positions[:, :, None]  # [B, 1, S]
    poisoned_k = jnp.where(seen[:, :, None, :], keys, jnp.nan)
    poisoned_v = jnp.where(seen[..., None], values, jnp.nan)
    got = dense.native_decode_attention(q, poisoned_k, poisoned_v, positions)
    want = models.prefix_causal_attention(q, keys, values, positions)
    np.testing.assert_allclose(got, want, rtol=0, atol=DENSE_RTOL * float(jnp.abs(want).max()))
    # position 0: the first value row, exactly
    np.testing.assert_array_equal(got[1, 0].reshape(2, 3, 64), jnp.repeat(values[1, :, 0][:, None], 3, axis=1))


@all_kernels
def test_native_dense_decode_of_no_key_is_zero_and_vmaps():
    q, keys, values = _dense_layer(62, 2, 2, 2, 32, 300, jnp.float32)
    qg = q.reshape(2, 2, 2, 32)
    assert not jnp.any(native.dense_decode(qg, keys, values, jnp.asarray([0, 0])))
    one_by_one = [native.dense_decode(qg[i], keys[i], values[i], 100 + i) for i in range(2)]
    vmapped = jax.vmap(native.dense_decode)(qg, keys, values, jnp.asarray([100, 101]))
    np.testing.assert_array_equal(vmapped, jnp.stack(one_by_one))


@all_kernels
def test_native_dense_decode_refuses_other_layouts():
    q, keys, values = _dense_layer(63, 1, 2, 3, 64, 100, jnp.float32)
    qg = q.reshape(1, 2, 3, 64)
    with pytest.raises(ValueError, match=r"must both be float32, bfloat16 or uint16 \(bfloat16 bits\)"):
        native.dense_decode(qg, keys, values.astype(jnp.bfloat16), 5)
    with pytest.raises(ValueError, match=r"needs keys \[..., 2, 64, S\]"):
        native.dense_decode(qg, keys.swapaxes(-1, -2), values, 5)  # head-major keys
    with pytest.raises(ValueError, match="DenseConfig.kernels must be one of"):
        dense.DenseConfig(kernels="triton")
    with pytest.raises(ValueError, match="dense attention has no Pallas kernel"):
        dense.DenseConfig(kernels="pallas")


@all_kernels
def test_dense_layers_attend_in_the_kernel_when_the_config_asks_for_native_kernels(one_layer):  # noqa: F811
    config = dataclasses.replace(one_layer[0], num_layers=3)

    def uses_kernel(method, mcfg):
        backend = kvcache.make_backend(config, method, mcfg, None, 20, 4)
        return [getattr(f, "keywords", {}).get("attend") is dense.native_decode_attention
                for f in backend.attention]

    assert uses_kernel("dense", dense.DenseConfig(kernels="native")) == [True] * 3
    assert uses_kernel("dense", None) == uses_kernel("dense", dense.DenseConfig()) == [False] * 3
    layers_0_2 = magicpig.MagicPIGConfig(dense_layers=(0, 2))
    assert uses_kernel("magicpig", dataclasses.replace(layers_0_2, kernels="native")) == [True, False, True]
    assert uses_kernel("magicpig", layers_0_2) == [False] * 3


@all_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_generate_with_the_native_dense_kernel_gives_the_xla_tokens(one_layer, dtype):  # noqa: F811
    """Two prompts of different lengths (each row's keys up to its own position), 9 steps."""
    config, params = one_layer
    params = models.cast_params(params, dtype)
    prompts = _prompts([30, 11], seed=12)
    tokens = {kernels: jaxkv.generate(params, config, prompts, max_new_tokens=9, eos_ids=(), method="dense",
                                      method_config=dense.DenseConfig(kernels=kernels)).tokens
              for kernels in ("xla", "native")}
    assert tokens["native"] == tokens["xla"]
    assert [len(t) for t in tokens["xla"]] == [9, 9]


# ---------------------------------------------------------------- MagicPIG

MAGICPIG = magicpig.MagicPIGConfig(kernels="native")


def _magicpig_index(cfg, keys, n):
    """One index per head of keys [H, cap, d] (the projection drawn per head)."""
    return jax.vmap(lambda k, seed: magicpig.build(cfg, k, n, jax.random.key(seed)))(
        keys, jnp.arange(keys.shape[0]))


def _query_group(keys, n, seed):
    """Query heads [H, 3, d] leaning towards some keys, so that many collide."""
    near = keys[:, np.random.default_rng(seed).integers(0, n, 3)]
    return near * 2 + 0.5 * _keys(seed, near.shape)


@functools.partial(jax.jit, static_argnums=0)
def _magicpig_selects(cfgs, index, q):
    def one_head(index, q):
        return [magicpig.select_with_stats(cfg, index, q) for cfg in cfgs]
    return jax.vmap(one_head)(index, q)


# The default (K10L150, a sample capacity of N/8, every table read), then the static
# capacities overflowing: a sample capacity below the union (truncated, lowest ids kept)
# and a candidate capacity that stops heads after a few tables (tables_used < L); other
# hit thresholds and code widths.
@all_kernels
@pytest.mark.parametrize("changes, truncated, stops_early", [
    ({}, False, False), ({"capacity": 40}, True, False), ({"K": 8, "candidate_capacity": 0.05}, False, True),
    ({"min_hits": 1, "K": 6, "L": 20, "capacity": 1.0}, False, False),
    ({"min_hits": 3, "K": 4, "L": 40, "center": False, "capacity": 1.0, "candidate_capacity": 40.0},
     False, False)])
@pytest.mark.parametrize("n", [3000, 1700])
def test_native_magicpig_sample_equals_the_xla_path(changes, truncated, stops_early, n):
    heads, cap, d = 2, 3000, 64
    cfg = dataclasses.replace(MAGICPIG, **changes)
    keys = _keys(6, (heads, cap, d)) + 0.5  # off-centre: centring matters
    index = _magicpig_index(cfg, keys, n)
    q = _query_group(keys, n, 7)
    (sel_x, stats_x), (sel_n, stats_n) = _magicpig_selects((dataclasses.replace(cfg, kernels="xla"), cfg), index, q)
    np.testing.assert_array_equal(sel_n.idx, sel_x.idx)
    np.testing.assert_array_equal(sel_n.mask, sel_x.mask)
    for field in ("tables_used", "entries_read", "n_sampled", "truncated"):
        np.testing.assert_array_equal(getattr(stats_n, field), getattr(stats_x, field))
    # Not vacuous: keys were sampled, and each configuration overflows where it should.
    assert stats_x.n_sampled.min() > 0
    assert bool(stats_x.truncated.any()) == truncated
    assert bool((stats_x.tables_used < cfg.L).any()) == stops_early


# A code bit is the sign of a float32 product summed over d terms in another order than
# XLA's. Each sum is within d·2⁻²⁴·|q|·|r| of the exact product (the recursive-summation
# bound, Σ|q_i r_i| ≤ |q|·|r|), so the two signs can differ only where |cos(q, r)| is below
# twice that: 7.6e-6 at d = 64.
SIGN_MARGIN = 2 * 64 * 2.0**-24


@all_kernels
@pytest.mark.parametrize("own_projection", [False, True])
@pytest.mark.parametrize("changes, tables_read", [
    ({}, "all"), ({"K": 8, "candidate_capacity": 0.05}, "some"), ({"K": 4, "L": 40}, "some"),
    ({"K": 13, "L": 20}, "all"), ({"center": False}, "none")])
def test_native_magicpig_query_buckets_equal_the_xla_path(changes, tables_read, own_projection):
    heads, cap, n, d = 3, 3000, 2500, 64
    cfg = dataclasses.replace(MAGICPIG, **changes)
    keys = _keys(8, (heads, cap, d)) + 0.5
    if tables_read == "none":  # one key repeated: a query equal to it meets a bucket of all n keys first
        keys = jnp.broadcast_to(keys[:, :1], keys.shape)
    index = (_magicpig_index(cfg, keys, n) if own_projection
             else jax.vmap(lambda k: magicpig.build(cfg, k, n))(keys))
    q = _query_group(keys, n, 9) if tables_read != "none" else keys[:, :3]
    codes, tables_used, entries_read = jax.jit(jax.vmap(
        lambda ix, qq: magicpig._native_query_buckets(cfg, ix, qq)))(index, q)

    def xla(index, q, codes):
        hyperplanes = magicpig.hyperplanes(cfg, index)
        want_codes = magicpig.hash_codes(cfg, hyperplanes, q)
        _, _, running, used = magicpig._code_buckets(cfg, index, codes)  # the native codes' buckets
        cosines = (q @ hyperplanes) / (jnp.linalg.norm(q, axis=-1)[:, None] * jnp.linalg.norm(hyperplanes, axis=0))
        return want_codes, used, magicpig._entries_read(running, used), cosines

    want_codes, want_used, want_read, cosines = jax.jit(jax.vmap(xla))(index, q, codes)
    bits = lambda c: (np.asarray(c)[..., None] >> np.arange(cfg.K)) & 1
    decided = np.abs(np.asarray(cosines)).reshape(*codes.shape, cfg.K) > SIGN_MARGIN
    np.testing.assert_array_equal(np.where(decided, bits(codes), 0), np.where(decided, bits(want_codes), 0))
    assert decided.mean() > 0.999  # nearly every bit is compared
    np.testing.assert_array_equal(tables_used, want_used)
    np.testing.assert_array_equal(entries_read, want_read)
    one_head = magicpig._native_query_buckets(cfg, jax.tree.map(lambda a: a[1], index), q[1])  # no vmap
    for got, want in zip(one_head, (codes, tables_used, entries_read)):
        np.testing.assert_array_equal(got, want[1])
    # Not vacuous: each case reads every table, stops early, or reads none (its first bucket
    # holds more than the candidate capacity), as intended.
    used = np.asarray(want_used)
    assert {"all": (used == cfg.L).all(), "some": ((used > 0) & (used < cfg.L)).all(),
            "none": (used == 0).all() and (np.asarray(want_read) == 0).all()}[tables_read]


@functools.partial(jax.jit, static_argnums=0)
def _magicpig_inserts(cfgs, index, keys_new, count):
    return [jax.vmap(lambda ix, k: magicpig.insert(cfg, ix, k, count))(index, keys_new) for cfg in cfgs]


# All U new keys, some, none, and more than the capacity leaves room for (dropped).
@all_kernels
@pytest.mark.parametrize("n, count", [(2000, 64), (2000, 17), (2000, 0), (2980, 64)])
def test_native_magicpig_merge_equals_the_xla_path(n, count):
    heads, cap, d = 2, 3000, 64
    keys = _keys(8, (heads, cap, d))
    index = _magicpig_index(MAGICPIG, keys, n)
    keys_new = _keys(9, (heads, 64, d)) * 1.5
    merged_x, merged_n = _magicpig_inserts((dataclasses.replace(MAGICPIG, kernels="xla"), MAGICPIG), index,
                                           keys_new, count)
    for field in ("sorted_ids", "bucket_starts", "n", "n_dropped"):
        np.testing.assert_array_equal(getattr(merged_n, field), getattr(merged_x, field))
    assert (merged_x.n == min(n + count, cap)).all()
    # The merge equals a build from all the keys at once, with the first build's μ.
    total = min(n + count, cap)
    all_keys = keys.at[:, n:total].set(keys_new[:, :total - n])
    rebuilt = jax.vmap(lambda k, mu, seed: magicpig.build(MAGICPIG, k, total, jax.random.key(seed), mu=mu))(
        all_keys, index.mu, jnp.arange(heads))
    np.testing.assert_array_equal(merged_n.sorted_ids, rebuilt.sorted_ids)
    np.testing.assert_array_equal(merged_n.bucket_starts, rebuilt.bucket_starts)


@all_kernels
def test_native_magicpig_flush_rewrites_the_id_lists_in_place():
    """The cache's flush, compiled with the state donated, writes no new id list: no XLA op
    (copy, fusion) produces an array of their shape, only the merge's in-place call. Before
    the insertion ran under nested vmaps, reshaping [B, H] to B·H pairs made XLA copy
    the lists twice per flush."""
    b, h, d, prompt = 2, 2, 64, 600
    mcfg = dataclasses.replace(MAGICPIG, sink=2, local=8)
    ccfg = CacheConfig(sink=2, local=8, buffer=8, dense_threshold=0).resolve(mcfg)
    keys = _keys(10, (b, h, prompt, d))
    state = jax.jit(lambda k: kvcache.regions_from_prefill(
        k, k * 0.5, jnp.full((b,), prompt, jnp.int32), method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg,
        capacity=prompt, key=jax.random.key(0)))(keys)
    flush = jax.jit(functools.partial(kvcache.flush, method=magicpig.METHOD, mcfg=mcfg, ccfg=ccfg), donate_argnums=0)
    hlo = flush.lower(state).compile().as_text()
    lists = ",".join(map(str, state.index.sorted_ids.shape[-2:]))
    writers = set(re.findall(rf"= s32\[(?:\d+,)*{lists}\]\{{[\d,]*\}} ([\w-]+)\(", hlo))
    assert "custom-call" in hlo and "jaxkv_magicpig_merge" in hlo
    assert writers and not writers & {"copy", "fusion"}, writers


@all_kernels
def test_native_magicpig_is_validated():
    assert MAGICPIG.kernels.uses_native() and not MAGICPIG.kernels.uses_pallas()
    assert magicpig.METHOD.host_config(MAGICPIG) is None and magicpig.METHOD.host_config(magicpig.MagicPIGConfig())
    index = magicpig.build(MAGICPIG, _keys(10, (500, 32)), 500, jax.random.key(0))
    q = _keys(11, (2, 32))
    # A merge that would overflow the id lists is refused, not written past their end.
    codes = jnp.zeros((4, MAGICPIG.L), jnp.int32)
    with pytest.raises(Exception, match="do not fit"):
        native.magicpig_merge(index.sorted_ids, index.bucket_starts, codes, index.n)[0].block_until_ready()


def _gathered_partial(cfg, index, q, keys, values, selection):
    """The XLA path's partial: the rows gathered, corrected, attended."""
    k_rows, v_rows = keys[selection.idx], values[selection.idx]
    log_weight = magicpig.correction(cfg, index, q, k_rows, selection)
    return common.partial_attention(q, k_rows, v_rows, selection.mask, log_weight)




# d = 64 and 128; the sample truncated by its capacity; heads stopped by the candidate
# capacity (each head's u then counts its own tables); three hits needed; one hit, a sample
# over several of the kernel's 256-slot blocks (their partials merged). The queries lean
# towards a few keys, so most sampled rows weigh little; the last case scales them down
# until the weights are nearly flat and every sampled row moves the sums by ~1/its count.
@all_kernels
@pytest.mark.parametrize("changes, d, q_scale", [
    ({}, 64, 1.0), ({}, 128, 1.0), ({"capacity": 40}, 64, 1.0), ({"K": 8, "candidate_capacity": 0.05}, 64, 1.0),
    ({"min_hits": 3, "K": 6, "L": 40, "capacity": 1.0}, 64, 1.0),
    ({"min_hits": 1, "K": 6, "L": 20, "capacity": 1.0}, 64, 1.0),
    ({"min_hits": 1, "K": 6, "L": 20, "capacity": 1.0}, 64, 0.01)])
def test_native_magicpig_attend_equals_gather_and_correct(changes, d, q_scale):
    heads, cap, n = 2, 3000, 2900
    cfg = dataclasses.replace(MAGICPIG, **changes)
    keys = _keys(12, (heads, cap, d)) + 0.5
    values = _keys(13, (heads, cap, d))
    index = _magicpig_index(cfg, keys, n)
    q = _query_group(keys, n, 14) * q_scale
    sel = jax.vmap(lambda ix, qq: magicpig.select(cfg, ix, qq))(index, q)
    assert int(sel.mask.sum()) >= 80  # not vacuous: dozens of sampled rows per head
    want = jax.jit(jax.vmap(functools.partial(_gathered_partial, cfg)))(index, q, keys, values, sel)
    _assert_attends_in_place(functools.partial(magicpig.attend_in_place, cfg), index, q, keys, values, sel, want)


@all_kernels
@pytest.mark.parametrize("tables", [150, 7])
def test_native_magicpig_correction_over_every_angle(tables):
    """Rows at 64 angles to the query, from cos θ = 1 to −1 (u from 1 to 0, both branches of
    the formula and the floor), one-hot values: o / l is each row's corrected softmax weight.
    Row 0 is μ itself (a zero centred key: cos θ taken as 0)."""
    cfg, d = MAGICPIG, 64
    theta = np.linspace(0.0, np.pi, d - 1)
    mu = _keys(15, (d,))
    rows = np.zeros((d, d), np.float32)
    rows[1:, 0], rows[1:, 1] = 3 * np.cos(theta), 3 * np.sin(theta)
    keys = jnp.asarray(rows) + mu
    values = jnp.eye(d, dtype=jnp.float32)
    q = jnp.zeros((1, d), jnp.float32).at[0, 0].set(2.0)
    idx, mask = jnp.arange(d, dtype=jnp.int32), jnp.ones((1, d), bool)
    used = jnp.asarray([tables], jnp.int32)
    o, l, m = native.magicpig_attend(q, keys, values, mu, idx, mask, used, K=cfg.K, min_hits=cfg.min_hits,
                                     tail_terms=magicpig.TAIL_TERMS, log_u_floor=magicpig.LOG_U_FLOOR,
                                     masked_score=common.MASKED_SCORE)
    cos = np.concatenate([[0.0], np.cos(theta)])
    log_u = np.maximum(magicpig.collision_log_prob(jnp.asarray(cos, jnp.float32), cfg.K, tables), magicpig.LOG_U_FLOOR)
    want = jax.nn.softmax(common.scores(q, keys)[0] - log_u)
    # Each path's float32 cosine is a few ulp (~1e-7) off, and near cos θ = −1 log u is
    # ill-conditioned: p ≈ √(2(1 + cos θ))/π, so d log u / d cos θ ≈ K / (1 + cos θ).
    conditioning = cfg.K / np.maximum(1.0 + cos, 1e-3)
    np.testing.assert_array_less(np.abs(o[0] / l[0] - want), (1e-5 + 1e-6 * conditioning) * want + 1e-12)
    assert float(want[-1]) > 0.99  # cos θ = −1: u at its floor, the weight all on it


@all_kernels
def test_native_magicpig_attend_of_an_empty_sample():
    keys = _keys(16, (100, 64))
    o, l, m = native.magicpig_attend(_keys(17, (3, 64)), keys, keys, keys[0], jnp.zeros((50,), jnp.int32),
                                     jnp.zeros((3, 50), bool), jnp.full((3,), 150, jnp.int32), K=10, min_hits=2,
                                     tail_terms=magicpig.TAIL_TERMS, log_u_floor=magicpig.LOG_U_FLOOR,
                                     masked_score=common.MASKED_SCORE)
    empty = common.empty_partial(3, 64)
    for got, want in ((o, empty.o), (l, empty.l), (m, empty.m)):
        np.testing.assert_array_equal(got, want)
