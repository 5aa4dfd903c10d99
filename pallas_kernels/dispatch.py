"""One entry point per kernel, and the kernel-backend setting every method and dense attention share.

Each entry point runs the Pallas kernel or its plain-jnp reference, as the
:class:`Kernels` setting says; both compute the same thing (the tests hold the
kernels to their references).
"""
from __future__ import annotations

import enum

import jax

from pallas_kernels import collide as _collide
from pallas_kernels import gather_attention as _gather
from pallas_kernels import rsq_rerank as _rerank
from pallas_kernels import simhash as _simhash
from pallas_kernels import vote as _vote

Collisions = _collide.Collisions
Candidates = _vote.Candidates
merge_partials = _gather.merge_partials


class Kernels(enum.StrEnum):
    """Which implementation runs a step that has kernels (a config's ``kernels`` field).

    auto: the Pallas kernels on a GPU backend, XLA elsewhere. xla: XLA always.
    pallas: the Pallas kernels, compiled. interpret: the Pallas kernels in interpret
    mode (how they are tested on a CPU). native: ``jaxkv.native``'s CPU kernels for
    the steps a method has them for, XLA for the rest (never Pallas).

    A str: ``Kernels.NATIVE == "native"``, and its repr is the string's, so configs
    read and print as they are written.
    """

    AUTO = "auto"
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"
    NATIVE = "native"

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def of(cls, value, name: str = "kernels") -> Kernels:
        """``value`` (a Kernels or its string) as a Kernels; ValueError naming ``name`` otherwise."""
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{name} must be one of {tuple(k.value for k in cls)}, got {value!r}")

    def uses_pallas(self) -> bool:
        """Whether the Pallas kernels run (on the current backend, for ``auto``)."""
        if self is Kernels.AUTO:
            return jax.default_backend() == "gpu"
        return self in (Kernels.PALLAS, Kernels.INTERPRET)

    def uses_native(self) -> bool:
        """Whether ``jaxkv.native``'s CPU kernels run the steps they exist for."""
        return self is Kernels.NATIVE


def _pallas(kernels) -> tuple[bool, bool]:
    """(run the Pallas kernel, in interpret mode) for a Kernels setting or its string."""
    kernels = Kernels.of(kernels)
    return kernels.uses_pallas(), kernels is Kernels.INTERPRET


def simhash(x, proj, *, n_bits: int, kernels: Kernels | str = Kernels.AUTO):
    """SimHash codes of x by ``proj`` (``simhash.simhash_reference``)."""
    pallas, interpret = _pallas(kernels)
    if pallas:
        return _simhash.simhash(x, proj, n_bits=n_bits, interpret=interpret)
    return _simhash.simhash_reference(x, proj, n_bits=n_bits)


def collide(query_codes, sorted_ids, bucket_start, *, capacity: int, bucket_capacity: int,
            min_hits: int = 2, kernels: Kernels | str = Kernels.AUTO):
    """Keys in at least ``min_hits`` of the query's buckets (``collide.collide_reference``)."""
    kwargs = dict(capacity=capacity, bucket_capacity=bucket_capacity, min_hits=min_hits)
    pallas, interpret = _pallas(kernels)
    if pallas:
        return _collide.collide(query_codes, sorted_ids, bucket_start, interpret=interpret, **kwargs)
    return _collide.collide_reference(query_codes, sorted_ids, bucket_start, **kwargs)


def vote(signs, lut, n_valid=None, *, capacity: int, kernels: Kernels | str = Kernels.AUTO):
    """The keys with the most coarse votes (``vote.vote_reference``)."""
    pallas, interpret = _pallas(kernels)
    if pallas:
        return _vote.vote(signs, lut, n_valid, capacity=capacity, interpret=interpret)
    return _vote.vote_reference(signs, lut, n_valid, capacity=capacity)


def rsq_rerank(q_rot, q_norm, codes, weight, centres, idx, *, kernels: Kernels | str = Kernels.AUTO):
    """RSQ-IP estimates of the rows idx (``rsq_rerank.rsq_rerank_reference``)."""
    pallas, interpret = _pallas(kernels)
    if pallas:
        return _rerank.rsq_rerank(q_rot, q_norm, codes, weight, centres, idx, interpret=interpret)
    return _rerank.rsq_rerank_reference(q_rot, q_norm, codes, weight, centres, idx)


def gather_attention(q, k, v, idx, mask, log_weight=None, *, kernels: Kernels | str = Kernels.AUTO):
    """(o [G, d], l [G], m [G]) over rows idx of k, v for one KV head."""
    pallas, interpret = _pallas(kernels)
    if pallas:
        return _gather.gather_attention(q, k, v, idx, mask, log_weight, interpret=interpret)
    return _gather.gather_attention_reference(q, k, v, idx, mask, log_weight)


def gather_attention_heads(q, k, v, idx, mask, log_weight=None, *, exact=None,
                           kernels: Kernels | str = Kernels.AUTO):
    """:func:`gather_attention` per KV head (leading axis H on every argument):
    q [H, G, d], k, v [H, N, d], idx [H, C], mask [H, C] or [H, G, C], log_weight
    None or [H, (G,) C]. ``exact``, an optional partial (o [H, G, d], l [H, G],
    m [H, G]) over other keys (sink, local, buffer), is merged in."""
    def one_head(q, k, v, idx, mask, log_weight):
        return gather_attention(q, k, v, idx, mask, log_weight, kernels=kernels)

    weight_axis = None if log_weight is None else 0
    parts = jax.vmap(one_head, in_axes=(0, 0, 0, 0, 0, weight_axis))(q, k, v, idx, mask, log_weight)
    if exact is None:
        return parts
    return jax.vmap(merge_partials)(parts, tuple(exact))
