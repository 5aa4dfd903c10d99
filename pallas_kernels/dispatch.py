"""One entry point per kernel: the Pallas kernel on a GPU backend, the XLA reference elsewhere.

Both paths compute the same thing (the tests hold the kernels to their
references). ``use_kernel`` overrides the choice; ``interpret=True`` runs the
kernel in Pallas interpret mode, which is how the kernels are tested on CPU.
"""
from __future__ import annotations

import jax

from pallas_kernels import collide as _collide
from pallas_kernels import gather_attention as _gather
from pallas_kernels import rsq_rerank as _rerank
from pallas_kernels import simhash as _simhash
from pallas_kernels import vote as _vote

Collisions = _collide.Collisions
Candidates = _vote.Candidates
merge_partials = _gather.merge_partials


def kernel_path(use_kernel: bool | None, interpret: bool) -> bool:
    """Whether to run the Pallas kernel: forced by interpret/use_kernel, else on GPU."""
    if interpret:
        return True
    if use_kernel is None:
        return jax.default_backend() == "gpu"
    return use_kernel


def simhash(x, proj, *, n_bits: int, use_kernel: bool | None = None, interpret: bool = False):
    if kernel_path(use_kernel, interpret):
        return _simhash.simhash(x, proj, n_bits=n_bits, interpret=interpret)
    return _simhash.simhash_reference(x, proj, n_bits=n_bits)


def collide(query_codes, sorted_ids, bucket_start, *, capacity: int, bucket_capacity: int,
            min_hits: int = 2, use_kernel: bool | None = None, interpret: bool = False):
    kwargs = dict(capacity=capacity, bucket_capacity=bucket_capacity, min_hits=min_hits)
    if kernel_path(use_kernel, interpret):
        return _collide.collide(query_codes, sorted_ids, bucket_start, interpret=interpret, **kwargs)
    return _collide.collide_reference(query_codes, sorted_ids, bucket_start, **kwargs)


def vote(signs, lut, n_valid=None, *, capacity: int, use_kernel: bool | None = None,
         interpret: bool = False):
    if kernel_path(use_kernel, interpret):
        return _vote.vote(signs, lut, n_valid, capacity=capacity, interpret=interpret)
    return _vote.vote_reference(signs, lut, n_valid, capacity=capacity)


def rsq_rerank(q_rot, q_norm, codes, weight, centres, idx, *, use_kernel: bool | None = None,
               interpret: bool = False):
    if kernel_path(use_kernel, interpret):
        return _rerank.rsq_rerank(q_rot, q_norm, codes, weight, centres, idx, interpret=interpret)
    return _rerank.rsq_rerank_reference(q_rot, q_norm, codes, weight, centres, idx)


def gather_attention(q, k, v, idx, mask, log_weight=None, *, use_kernel: bool | None = None,
                     interpret: bool = False):
    """(o [G, d], l [G], m [G]) over rows idx of k, v for one KV head."""
    if kernel_path(use_kernel, interpret):
        return _gather.gather_attention(q, k, v, idx, mask, log_weight, interpret=interpret)
    return _gather.gather_attention_reference(q, k, v, idx, mask, log_weight)


def gather_attention_heads(q, k, v, idx, mask, log_weight=None, *, exact=None,
                           use_kernel: bool | None = None, interpret: bool = False):
    """:func:`gather_attention` per KV head (leading axis H on every argument):
    q [H, G, d], k, v [H, N, d], idx [H, C], mask [H, C] or [H, G, C], log_weight
    None or [H, (G,) C]. ``exact``, an optional partial (o [H, G, d], l [H, G],
    m [H, G]) over other keys (sink, local, buffer), is merged in."""
    def one_head(q, k, v, idx, mask, log_weight):
        return gather_attention(q, k, v, idx, mask, log_weight, use_kernel=use_kernel, interpret=interpret)

    weight_axis = None if log_weight is None else 0
    parts = jax.vmap(one_head, in_axes=(0, 0, 0, 0, 0, weight_axis))(q, k, v, idx, mask, log_weight)
    if exact is None:
        return parts
    return jax.vmap(merge_partials)(parts, tuple(exact))
