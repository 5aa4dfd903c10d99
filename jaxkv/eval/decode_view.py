"""Evaluate a method on captured tensors the way the four-region cache uses it.

The last Q captured positions are treated as Q decode steps after a prefill of
the first N − Q tokens: the method's index is built once over the retrieval
region [S, N − Q − W) of the prefill, and query t attends exactly to the sink,
the local window before the prefill's end and the decode tokens up to t (the
update buffer) — which is precisely the cache state generate() would have.
So every query sees its causal context, and budgets count the exact set too.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.attention import common


def dense_truth(keys, values, queries, positions):
    """Exact causal attention for one KV head: queries [G, Q, d] at positions [Q] → [G, Q, d]."""
    n = keys.shape[0]

    def one(q, t):
        mask = jnp.arange(n) <= t
        return common.finalize(common.partial_attention(q, keys, values, mask))

    return jax.vmap(one, in_axes=(1, 0), out_axes=1)(queries, positions)


def method_outputs(method, cfg, keys, values, queries, positions, key):
    """One KV head: (outputs [G, Q, d], keys read [Q], retrieval rows read [Q]) of ``method``
    (a ``jaxkv.attention.method.SparseMethod``) with config ``cfg``.

    keys, values [N, d]; queries [G, Q, d] at positions [Q] = the last Q positions.
    """
    n, q_len = keys.shape[0], positions.shape[0]
    s, w = cfg.sink, cfg.local
    n_prefill = n - q_len
    start, end = s, n_prefill - w
    if end <= start:
        raise ValueError(f"a context of {n} tokens is too short for sink {s} + local {w} + {q_len} queries")
    retr_k, retr_v = keys[start:end], values[start:end]
    index = method.build(cfg, retr_k, retr_v, jnp.int32(end - start), key)
    exact_k = jnp.concatenate([keys[:s], keys[end:]])
    exact_v = jnp.concatenate([values[:s], values[end:]])
    exact_pos = jnp.concatenate([jnp.arange(s), jnp.arange(end, n)])

    def one(q, t):
        exact_mask = exact_pos <= t
        sel = method.select(cfg, index, q)
        k_rows, v_rows = retr_k[sel.idx], retr_v[sel.idx]
        sel = dataclasses.replace(sel, log_weight=method.correction(cfg, index, q, k_rows, sel))
        part = common.merge(common.partial_attention(q, exact_k, exact_v, exact_mask),
                            common.attend_selection(q, k_rows, v_rows, sel))
        retrieved = sel.distinct_rows()
        return common.finalize(part), jnp.sum(exact_mask) + retrieved, retrieved

    return jax.vmap(one, in_axes=(1, 0), out_axes=(1, 0, 0))(queries, positions)


def relative_error(estimate, truth):
    """‖ô − o‖ / ‖o‖ over the last axis."""
    return jnp.linalg.norm(estimate - truth, axis=-1) / jnp.maximum(jnp.linalg.norm(truth, axis=-1), 1e-30)
