"""Gather-attention kernel (split-K) vs its reference, jaxkv's Partial convention and dense
softmax attention; GQA groups, masks, importance weights; CUDA lowering."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxkv.attention import common
from pallas_kernels._common import MASKED_SCORE
from pallas_kernels.gather_attention import gather_attention, gather_attention_reference
from pallas_kernels.testing import INTERPRET, lower_for_cuda, triton_kernels

EPS32 = np.finfo(np.float32).eps


def _problem(seed, g, d, n, c, per_head_mask, live_prob, weight_kind, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((g, d)).astype(np.float32)
    k = rng.standard_normal((n, d)).astype(dtype)
    v = rng.standard_normal((n, d)).astype(dtype)
    idx = rng.permutation(n)[:c].astype(np.int32) if c <= n else rng.integers(0, n, c).astype(np.int32)
    mask = rng.random((g, c) if per_head_mask else (c,)) < live_prob
    if per_head_mask:
        mask[0] = False  # a fully masked query head
    weight = {None: None, "vec": rng.standard_normal(c), "per_head": rng.standard_normal((g, c))}[weight_kind]
    return q, k, v, idx, mask, None if weight is None else weight.astype(np.float32)


def _tolerances(q, k, v, idx, mask, weight, m):
    """Bounds on float32 rounding for scores (a length-d dot product: d·eps·Σ|q_i k_i|) and for the
    sums over C slots (C·eps·Σ|terms|), times 4 for two implementations and exp's own rounding."""
    g, d = q.shape
    rows = np.clip(idx, 0, len(k) - 1)
    kk, vv = k[rows].astype(np.float64), v[rows].astype(np.float64)
    s = q.astype(np.float64) @ kk.T / math.sqrt(d)
    if weight is not None:
        s = s + np.broadcast_to(weight, s.shape)
    live = np.broadcast_to(mask, s.shape)
    p = np.where(live, np.exp(np.where(live, s, -np.inf) - np.asarray(m, np.float64)[:, None]), 0)
    score_err = 4 * d * EPS32 * (np.abs(q) @ np.abs(kk).T / math.sqrt(d) + (0 if weight is None else np.abs(weight)))
    slots = len(idx) + 1
    rel = 4 * slots * EPS32 + np.max(np.where(live, score_err, 0), initial=0)
    return rel * (p @ np.abs(vv)), rel * p.sum(1), np.max(np.where(live, score_err, 0), axis=1, initial=0)


def _assert_close(got, want, problem):
    (o, l, m), (o_r, l_r, m_r) = [tuple(np.asarray(x) for x in t) for t in (got, want)]
    tol_o, tol_l, tol_m = _tolerances(*problem, m_r)
    assert np.all(np.abs(o - o_r) <= tol_o + 1e-30)
    assert np.all(np.abs(l - l_r) <= tol_l + 1e-30)
    assert np.all(np.abs(m - m_r) <= tol_m)
    dead = ~np.broadcast_to(problem[4], (len(m_r), len(problem[3]))).any(1)
    # Fully masked heads: exactly the empty partial.
    assert np.all(o[dead] == 0) and np.all(l[dead] == 0) and np.all(m[dead] == MASKED_SCORE)


# A quarter of the profile's examples (5 by default): interpret mode is slow.
@settings(max_examples=settings.default.max_examples // 4)
@given(seed=st.integers(0, 2**31), g=st.integers(1, 8), d=st.sampled_from([64, 128]),
       n=st.integers(1, 300), c=st.integers(0, 200), per_head_mask=st.booleans(),
       live_prob=st.sampled_from([0.0, 0.6, 1.0]), weight_kind=st.sampled_from([None, "vec", "per_head"]),
       block=st.sampled_from([16, 32]), n_splits=st.sampled_from([None, 1, 3]),
       dtype=st.sampled_from([np.float32, jnp.bfloat16]))
def test_kernel_matches_reference(seed, g, d, n, c, per_head_mask, live_prob, weight_kind, block,
                                  n_splits, dtype):
    problem = _problem(seed, g, d, n, c, per_head_mask, live_prob, weight_kind, dtype)
    got = gather_attention(*problem, block=block, n_splits=n_splits, interpret=INTERPRET)
    _assert_close(got, gather_attention_reference(*problem), problem)


@pytest.mark.parametrize("per_head_mask, weight_kind", [(False, None), (True, "per_head"), (False, "vec")])
def test_reference_matches_jaxkv_partial(per_head_mask, weight_kind):
    """The reference is jaxkv.attention.common.partial_attention over the gathered rows."""
    problem = _problem(1, 4, 64, 120, 70, per_head_mask, 0.6, weight_kind)
    q, k, v, idx, mask, weight = problem
    want = common.partial_attention(q, k[idx], v[idx], mask, weight)
    _assert_close(gather_attention_reference(*problem), (want.o, want.l, want.m), problem)


def test_all_keys_is_dense_softmax_attention():
    """Selecting every key, unmasked and unweighted, gives softmax(q·k/√d)·v (float64 numpy)."""
    q, k, v, _, _, _ = _problem(2, 3, 64, 100, 0, False, 1.0, None)
    idx, mask = np.arange(100, dtype=np.int32)[::-1].copy(), np.ones(100, bool)
    o, l, _ = gather_attention(q, k, v, idx, mask, block=16, n_splits=3, interpret=INTERPRET)
    s = q.astype(np.float64) @ k.T.astype(np.float64) / 8.0
    w = np.exp(s - s.max(1, keepdims=True))
    want = (w / w.sum(1, keepdims=True)) @ v
    # Outputs are O(1); the float32 error of a 100-term softmax average is < 1e-5.
    np.testing.assert_allclose(np.asarray(o) / np.asarray(l)[:, None], want, atol=1e-5)


def test_empty_selection_is_empty_partial():
    q, k, v, idx, mask, _ = _problem(3, 2, 64, 10, 0, False, 1.0, None)
    o, l, m = gather_attention(q, k, v, idx, mask, interpret=INTERPRET)
    assert o.shape == (2, 64) and not o.any() and not l.any() and np.all(m == MASKED_SCORE)


def test_bad_input_named():
    q, k, v, idx, mask, _ = _problem(4, 2, 64, 10, 5, False, 1.0, None)
    with pytest.raises(ValueError, match="mask"):
        gather_attention(q, k, v, idx, mask[:3])
    with pytest.raises(ValueError, match="^v: "):
        gather_attention_reference(q, k, v[:, :32], idx, mask)
    with pytest.raises(ValueError, match="log_weight"):
        gather_attention(q, k, v, idx, mask, np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="head dim"):
        gather_attention(q[:, :48], k[:, :48], v[:, :48], idx, mask)


@pytest.mark.parametrize("kv_heads, group, d, dtype", [
    (3, 3, 64, jnp.float32),    # SmolLM2-135M: 3 KV heads × 64, GQA 3
    (8, 4, 128, jnp.bfloat16),  # Llama-8B-like: 8 KV heads × 128, GQA 4
])
def test_lowers_for_cuda(kv_heads, group, d, dtype):
    n, c = 32768, 2048
    f = jax.vmap(lambda *a: gather_attention(*a))  # one KV head per vmapped call
    text = lower_for_cuda(
        f, jax.ShapeDtypeStruct((kv_heads, group, d), jnp.float32),
        jax.ShapeDtypeStruct((kv_heads, n, d), dtype), jax.ShapeDtypeStruct((kv_heads, n, d), dtype),
        jax.ShapeDtypeStruct((kv_heads, c), jnp.int32), jax.ShapeDtypeStruct((kv_heads, group, c), jnp.bool_),
        jax.ShapeDtypeStruct((kv_heads, group, c), jnp.float32))
    assert triton_kernels(text) == ["gather_attention"]
