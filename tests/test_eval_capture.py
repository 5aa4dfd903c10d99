"""jaxkv.eval.capture: the studies' keys, values and queries are the model's own."""
import jax
import jax.numpy as jnp
import numpy as np

import models
from helpers_tiny_models import tiny_config
from jaxkv.eval import capture


def test_capture_holds_the_keys_and_values_a_dense_forward_caches():
    """Captured K and V, head-major [L, Hkv, n, hd], equal models.forward's cache over the same tokens.

    The capture prefills in chunks of 8 (the last one padded), the forward in one
    call: float32 sums in a different order, so 1e-5 on O(1) values.
    """
    config = tiny_config(num_layers=2)
    params = models.init_params(config, jax.random.key(0))
    tokens = np.arange(3, 23)
    captured = capture.capture(params, config, tokens, n_queries=4, chunk=8)
    _, cache = models.forward(params, config, jnp.asarray(tokens)[None], models.init_cache(config, 1, len(tokens)))
    assert captured.keys.shape == (config.num_layers, config.num_kv_heads, len(tokens), config.head_dim)
    np.testing.assert_allclose(captured.keys, np.asarray(models.transpose_keys(cache.k[:, 0])), rtol=0, atol=1e-5)
    np.testing.assert_allclose(captured.values, np.asarray(cache.v[:, 0]), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(captured.query_positions, np.arange(16, 20))
