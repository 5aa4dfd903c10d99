"""Dense attention for one KV head: the reference every sparse method is compared with."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention import common


def check_qkv(q, k, v) -> None:
    """Raise ValueError unless q is [G, d] and k, v are [N, d] with matching d and N."""
    if q.ndim != 2:
        raise ValueError(f"q must be [G, d] (one KV head's query group), got shape {q.shape}")
    if k.ndim != 2 or k.shape[1] != q.shape[1]:
        raise ValueError(f"k must be [N, d={q.shape[1]}] to match q {q.shape}, got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got shape {v.shape}")


def dense(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None):
    """Exact attention of q[G, d] over k, v [N, d].

    mask: None, [N] or [G, N] bool (False = key not attended).
    Returns (out [G, d] float32, n_read): n_read is the number of distinct keys
    attended by at least one query head (N without a mask).
    """
    check_qkv(q, k, v)
    if mask is not None and mask.shape not in ((k.shape[0],), (q.shape[0], k.shape[0])):
        raise ValueError(
            f"mask must be [N={k.shape[0]}] or [G={q.shape[0]}, N={k.shape[0]}], got shape {mask.shape}")
    out = common.finalize(common.partial_attention(q, k, v, mask))
    if mask is None:
        return out, jnp.int32(k.shape[0])
    read = mask if mask.ndim == 1 else jnp.any(mask, axis=0)
    return out, jnp.sum(read.astype(jnp.int32))
