"""Keys and values for contexts longer than the model can prefill here, fitted to SmolLM2's real ones.

The fit (one layer of SmolLM2-135M-Instruct, a dense prefill of real Wikipedia
text, after RoPE as the cache holds them):

- per KV head, the mean and full covariance of the keys and of the values at
  positions >= SINK (a Gaussian per head: it keeps the large shared key offset
  and the anisotropy that decide how keys fall into LSH / sign-pattern buckets,
  not RoPE's position dependence, which a Gaussian over all positions averages);
- the first SINK tokens' real keys and values, placed first (the attention sink);
- the real queries of the last position (the query group of each KV head).

Other head shapes reuse these statistics: a head of dimension a multiple of
64 concatenates consecutive SmolLM2 heads (block-diagonal covariance), and the
query group cycles through the real query heads. What this preserves is the
geometry between queries and keys, which sets how many keys a MagicPIG query's
buckets hold and how ParisKV's votes spread; the cost of every other stage
depends on shapes only.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SINK = 4
FIT_LAYER = 15  # not one of MagicPIG's dense layers (0, 16)
FIT_TOKENS = 2048


@dataclasses.dataclass
class HeadStatistics:
    """Per KV head: key/value mean [H, d], Cholesky factors [H, d, d], sink rows [H, SINK, d], queries [H, G, d]."""

    key_mean: np.ndarray
    key_chol: np.ndarray
    value_mean: np.ndarray
    value_chol: np.ndarray
    sink_keys: np.ndarray
    sink_values: np.ndarray
    queries: np.ndarray


def _cholesky(x: np.ndarray) -> np.ndarray:
    """Cholesky factor of the covariance of rows x[N, d] (a tiny ridge keeps it positive definite)."""
    cov = np.cov(x, rowvar=False)
    return np.linalg.cholesky(cov + 1e-6 * np.trace(cov) / cov.shape[0] * np.eye(cov.shape[0]))


def fit_smollm2(cache_file: Path, n_tokens: int = FIT_TOKENS, layer: int = FIT_LAYER) -> HeadStatistics:
    """Fit the statistics from a SmolLM2 prefill (cached in ``cache_file``, an .npz)."""
    if cache_file.exists():
        with np.load(cache_file) as data:
            return HeadStatistics(**{f.name: data[f.name] for f in dataclasses.fields(HeadStatistics)})
    import models
    from jaxkv.eval import capture, text

    config, params, tokenizer = models.load(models.default_model_path())
    _, ids = text.long_text(tokenizer, n_tokens)
    captured = capture.capture(params, config, ids[:n_tokens], n_queries=1)
    keys, values = captured.keys[layer], captured.values[layer]  # [H, N, d]
    stats = HeadStatistics(
        key_mean=keys[:, SINK:].mean(axis=1), key_chol=np.stack([_cholesky(k[SINK:]) for k in keys]),
        value_mean=values[:, SINK:].mean(axis=1), value_chol=np.stack([_cholesky(v[SINK:]) for v in values]),
        sink_keys=keys[:, :SINK], sink_values=values[:, :SINK],
        queries=captured.queries[layer, :, :, 0])  # [H, G, d]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(cache_file, **dataclasses.asdict(stats))
    return stats


def _block_diag(blocks: list[np.ndarray]) -> np.ndarray:
    d = sum(b.shape[0] for b in blocks)
    out = np.zeros((d, d), blocks[0].dtype)
    at = 0
    for b in blocks:
        out[at:at + b.shape[0], at:at + b.shape[0]] = b
        at += b.shape[0]
    return out


def for_shape(stats: HeadStatistics, n_kv_heads: int, head_dim: int, group: int) -> HeadStatistics:
    """Statistics for n_kv_heads heads of head_dim (a multiple of the fitted one) with `group` query heads each."""
    heads, base_group, d = stats.queries.shape
    if head_dim % d:
        raise ValueError(f"head_dim must be a multiple of the fitted head dim {d}, got {head_dim}")
    parts = head_dim // d
    sources = [[(h * parts + j) % heads for j in range(parts)] for h in range(n_kv_heads)]

    def cat(x, axis=-1):
        return np.stack([np.concatenate([x[s] for s in src], axis=axis) for src in sources])

    queries = np.stack([
        np.stack([np.concatenate([stats.queries[s, g % base_group] for s in src]) for g in range(group)])
        for src in sources])
    return HeadStatistics(
        key_mean=cat(stats.key_mean), key_chol=np.stack([_block_diag([stats.key_chol[s] for s in src]) for src in sources]),
        value_mean=cat(stats.value_mean),
        value_chol=np.stack([_block_diag([stats.value_chol[s] for s in src]) for src in sources]),
        sink_keys=cat(stats.sink_keys), sink_values=cat(stats.sink_values), queries=queries)


@functools.partial(jax.jit, static_argnames=("n",))
def _gaussian_rows(key, mean, chol, sink, n: int):
    """[n, H, d]: the sink rows, then n − SINK draws of N(mean_h, chol_h chol_hᵀ) per head."""
    z = jax.random.normal(key, (n - sink.shape[1], mean.shape[0], mean.shape[1]), jnp.float32)
    draws = jnp.einsum("nhe,hde->nhd", z, chol) + mean
    return jnp.concatenate([jnp.swapaxes(sink, 0, 1), draws], axis=0)


def synthesise(stats: HeadStatistics, n: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Staging keys and values [1, H, n, d] float32 (head-major, the layout of a prefilled dense cache)."""
    if n <= SINK:
        raise ValueError(f"n must exceed the {SINK} sink tokens, got {n}")
    k_key, v_key = jax.random.split(jax.random.key(seed))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    k = _gaussian_rows(k_key, f32(stats.key_mean), f32(stats.key_chol), f32(stats.sink_keys), n)
    v = _gaussian_rows(v_key, f32(stats.value_mean), f32(stats.value_chol), f32(stats.sink_values), n)
    return jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None]
