"""Dense attention: for one KV head, the reference every sparse method is compared with; for
a dense layer of generate(), how its decode step attends (:class:`DenseConfig`)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import models
from jaxkv import native
from jaxkv.attention import common
from pallas_kernels.dispatch import Kernels
from models import fields


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """How generate()'s dense layers attend in a decode step.

    kernels: "auto" or "xla" (``models.prefix_causal_attention``: every slot of the
        cache read, those past the query's position masked) or "native" (``jaxkv.native``'s
        CPU kernel: each sequence's keys up to its position only, float32 or
        bfloat16 read in place). Prefill attends in XLA either way. There is no
        Pallas kernel for dense attention: "pallas" and "interpret" are refused.
    """

    kernels: Kernels = Kernels.AUTO

    def __post_init__(self):
        object.__setattr__(self, "kernels", Kernels.of(self.kernels, "DenseConfig.kernels"))
        fields.check(self)
        if self.kernels in (Kernels.PALLAS, Kernels.INTERPRET):
            raise ValueError(f"DenseConfig.kernels={self.kernels.value!r}: dense attention has no Pallas kernel; "
                             f"use 'auto', 'xla' or 'native'")


def native_decode_attention(q, k_all, v_all, q_positions):
    """``models.prefix_causal_attention`` with a decode step (one query per sequence) in
    ``jaxkv.native.dense_decode``: q [B, 1, Hq, hd], one layer of a ``models.KVCache``,
    q_positions [B, 1]. A query at position p sees keys 0..p. Longer calls (prefill chunks)
    stay in XLA."""
    if q.shape[1] != 1:
        return models.prefix_causal_attention(q, k_all, v_all, q_positions)
    b, _, hq, hd = q.shape
    hkv = k_all.shape[1]
    # A bfloat16 cache's bits, as models.KVCache stores them: cached_attention's bitcast to
    # rows and this one back fold away, and the kernel reads the cache in place (handed the
    # bfloat16 rows, XLA CPU copied the whole layer into them first).
    out = native.dense_decode(q.reshape(b, hkv, hq // hkv, hd), models.stored_rows(k_all), models.stored_rows(v_all),
                              q_positions[:, 0] + 1)
    return out.reshape(b, 1, hq, hd).astype(q.dtype)


def cached_attention(native_kernels: bool):
    """The attention function of a dense layer of generate(): ``models.cached_attention``,
    its decode steps in the CPU kernel when ``native_kernels``."""
    if native_kernels:
        return functools.partial(models.cached_attention, attend=native_decode_attention)
    return models.cached_attention


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
