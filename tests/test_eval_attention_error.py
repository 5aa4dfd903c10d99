"""The attention-error study's machinery on small synthetic captures."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import magicpig, topk
from jaxkv.eval import attention_error, decode_view
from jaxkv.eval.capture import Captured


def _captured(layers=1, heads=2, g=2, n=300, q=4, d=16, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((layers, heads, n, d)).astype(np.float32)
    values = rng.standard_normal((layers, heads, n, d)).astype(np.float32)
    queries = rng.standard_normal((layers, heads, g, q, d)).astype(np.float32)
    return Captured(keys, values, queries, np.arange(n - q, n))


def test_decode_view_reading_everything_is_exact():
    c = _captured()
    k, v, q = (jnp.asarray(x[0, 0]) for x in (c.keys, c.values, c.queries))
    pos = jnp.asarray(c.query_positions)
    cfg = topk.TopKConfig(top_k=1000, sink=4, local=16)
    out, read, retrieved = decode_view.method_outputs(topk.METHOD, cfg, k, v, q, pos, jax.random.key(0))
    truth = decode_view.dense_truth(k, v, q, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(truth), rtol=1e-5, atol=1e-6)
    # Causal: query t reads exactly t + 1 keys when everything is retrieved.
    np.testing.assert_array_equal(np.asarray(read), np.asarray(pos) + 1)


def test_study_rows_and_table():
    c = _captured(n=400)
    rows = attention_error.study(c, budgets=(0.05, 0.5), magicpig_settings=((6, 8),), log=lambda *_: None)
    names = [(r.method, r.setting) for r in rows]
    assert ("topk", "5%") in names and ("magicpig", "K6L8 uncentred") not in names
    by = {(r.method, r.setting): r for r in rows}
    # More budget, less error, for the deterministic TopK oracle.
    assert by[("topk", "50%")].error < by[("topk", "5%")].error
    assert abs(by[("topk", "50%")].keys_read_fraction - 0.5) < 0.02
    assert all(np.isfinite(r.error) for r in rows)
    assert "| magicpig | K6L8" in attention_error.markdown(rows)
