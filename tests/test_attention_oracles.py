"""Dense attention and the three oracles against float64 numpy references and their statistics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import oracles
from jaxkv.attention.dense import dense
from test_attention_common import TOL, random_qkv, softmax_attention_f64

SEEDS = 2000  # Monte-Carlo repetitions: standard errors ≈ 2% of the spread


def peaked_qkv(seed=0, g=2, n=48, d=8):
    """Scores spread over a few units, so weights range over orders of magnitude."""
    return random_qkv(seed, g=g, n=n, d=d, scale=2.5)


def weights_f64(q, k):
    s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def over_seeds(fn, seeds=SEEDS):
    keys = jax.random.split(jax.random.key(42), seeds)
    return jax.jit(jax.vmap(fn))(keys)


def assert_unbiased(estimates, exact):
    """Every coordinate's mean over seeds within 4.5 standard errors of the exact value."""
    est = np.asarray(estimates, np.float64)
    se = est.std(0, ddof=1) / np.sqrt(est.shape[0])
    z = np.abs(est.mean(0) - exact) / np.maximum(se, 1e-12)
    assert z.max() < 4.5, f"max z-score {z.max():.2f}"


def test_dense_matches_float64_softmax_and_counts_reads():
    q, k, v = random_qkv(0)
    out, n_read = dense(q, k, v)
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v), atol=TOL)
    assert int(n_read) == 40
    mask = np.zeros((3, 40), bool)
    mask[0, :5], mask[1, 3:9], mask[2, 30:] = True, True, True
    out, n_read = dense(q, k, v, jnp.asarray(mask))
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v, mask=mask), atol=TOL)
    assert int(n_read) == 9 + 10


@pytest.mark.parametrize("shapes, name", [
    (((4,), (10, 4), (10, 4)), "q"), (((2, 4), (10, 5), (10, 5)), "k"), (((2, 4), (10, 4), (9, 4)), "v")])
def test_dense_rejects_bad_shapes_naming_the_tensor(shapes, name):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=f"^{name} must"):
        dense(q, k, v)


def test_topk_oracle_is_exact_attention_over_each_heads_top_keys():
    q, k, v = peaked_qkv()
    budget = 7
    top = np.argsort(-weights_f64(q, k), axis=-1)[:, :budget]
    mask = np.zeros((2, 48), bool)
    np.put_along_axis(mask, top, True, axis=-1)
    out, n_read = oracles.topk_oracle(q, k, v, budget)
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v, mask=mask), atol=TOL)
    assert int(n_read) == np.any(mask, 0).sum()
    out, n_read = oracles.topk_oracle(q, k, v, 1000)
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v), atol=TOL)
    assert int(n_read) == 48


@pytest.mark.parametrize("budget", [4, 64])
def test_sampling_oracle_is_unbiased_with_error_shrinking_like_one_over_sqrt_b(budget):
    q, k, v = peaked_qkv()
    w, exact = weights_f64(q, k), softmax_attention_f64(q, k, v)
    est, _ = over_seeds(lambda key: oracles.sampling_oracle(q, k, v, budget, key, count="draws"))
    assert_unbiased(est, exact)
    # The mean of B i.i.d. draws has E‖ô − o‖² = Σ_i w_i ‖v_i − o‖² / B exactly.
    sq_err = np.sum((np.asarray(est, np.float64) - exact) ** 2, axis=-1)
    predicted = np.einsum("gn,gn->g", w, np.sum((v[None] - exact[:, None]) ** 2, -1)) / budget
    se = sq_err.std(0, ddof=1) / np.sqrt(SEEDS)
    assert np.all(np.abs(sq_err.mean(0) - predicted) < 4 * se), (sq_err.mean(0), predicted, se)


def test_draws_for_distinct_is_the_smallest_count_reaching_the_budget():
    q, k, _ = peaked_qkv()
    w = weights_f64(q, k)
    for budget in (1, 5, 20):
        m = np.asarray(oracles.draws_for_distinct(jnp.asarray(w, jnp.float32), budget, 4096))
        expected = lambda draws: np.sum(1 - (1 - w) ** draws[:, None], axis=-1)
        assert np.all(expected(m) >= budget - 1e-3) and np.all(expected(m - 1) < budget + 1e-3), (budget, m)
    # A budget above the number of keys cannot be reached: the cap is used.
    assert np.all(np.asarray(oracles.draws_for_distinct(jnp.asarray(w, jnp.float32), 49, 300)) == 300)


def test_sampling_oracle_distinct_budget_is_unbiased_and_reads_the_budget_on_average():
    q, k, v = peaked_qkv(g=1)
    budget = 12
    est, n_read = over_seeds(lambda key: oracles.sampling_oracle(q, k, v, budget, key))
    assert_unbiased(est, softmax_attention_f64(q, k, v))
    # The draw count M makes the expected distinct count lie in [budget, budget + 1).
    n_read = np.asarray(n_read, np.float64)
    se = n_read.std(ddof=1) / np.sqrt(SEEDS)
    assert budget - 4 * se <= n_read.mean() < budget + 1 + 4 * se


def test_hybrid_oracle_is_unbiased_and_reads_its_top_half():
    q, k, v = peaked_qkv()
    est, n_read = over_seeds(lambda key: oracles.hybrid_oracle(q, k, v, 10, key))
    assert_unbiased(est, softmax_attention_f64(q, k, v))
    assert np.all(np.asarray(n_read) >= 5)


def test_hybrid_oracle_is_exact_when_the_top_half_covers_everything():
    q, k, v = peaked_qkv()
    out, n_read = oracles.hybrid_oracle(q, k, v, 96, jax.random.key(0))
    np.testing.assert_allclose(out, softmax_attention_f64(q, k, v), atol=TOL)
    assert int(n_read) == 48


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_oracles_reject_bad_budgets(budget):
    q, k, v = peaked_qkv()
    for call in (lambda: oracles.topk_oracle(q, k, v, budget),
                 lambda: oracles.sampling_oracle(q, k, v, budget, jax.random.key(0)),
                 lambda: oracles.hybrid_oracle(q, k, v, budget, jax.random.key(0))):
        with pytest.raises(ValueError, match="budget"):
            call()


def test_sampling_oracle_rejects_unknown_count_mode():
    q, k, v = peaked_qkv()
    with pytest.raises(ValueError, match="count"):
        oracles.sampling_oracle(q, k, v, 4, jax.random.key(0), count="unique")


def test_masked_oracles_only_see_the_visible_keys():
    """A causal mask hides keys completely: masked values (set huge here) never leak in."""
    rng = np.random.default_rng(42)
    n, visible, d = 200, 120, 16
    q = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    v = np.asarray(rng.standard_normal((n, d)), np.float32)
    v[visible:] = 1e6
    v = jnp.asarray(v)
    mask = jnp.arange(n) < visible
    top, read = oracles.topk_oracle(q, k, v, 30, mask=mask)
    top_sub, read_sub = oracles.topk_oracle(q, k[:visible], v[:visible], 30)
    np.testing.assert_allclose(np.asarray(top), np.asarray(top_sub), rtol=1e-6, atol=1e-6)
    assert int(read) == int(read_sub)
    bound = float(jnp.max(jnp.abs(v[:visible])))
    for fn in (oracles.sampling_oracle, oracles.hybrid_oracle):
        out, read = fn(q, k, v, 40, jax.random.key(0), mask=mask)
        # Averages of visible values only: inside their range, far from 1e6.
        assert float(jnp.max(jnp.abs(out))) <= bound + 1e-5
        assert int(read) <= visible
    # Fewer visible keys than the budget: TopK reads only the visible ones.
    _, read = oracles.topk_oracle(q, k, v, 150, mask=mask)
    assert int(read) == visible
