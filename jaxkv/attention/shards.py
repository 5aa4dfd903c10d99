"""The retrieval region split over a mesh axis: what a shard knows, and the collectives that
make a shard's selection and attention add up to one device's.

Every function here runs inside ``jax.shard_map`` over :attr:`ContextShards.axis`
(``jaxkv.sharding``'s ``context`` axis); docs/sharding.md says what crosses per step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.attention.common import Partial, Selection


@dataclasses.dataclass(frozen=True)
class ContextShards:
    """The retrieval region of one-device capacity ``capacity`` in ``count`` contiguous shards.

    Shard c holds the rows after shard c − 1's: flushes go to the lowest shard holding fewer
    than ``rows_per_shard`` rows, and one may carry it past that into a slack of ``buffer``
    rows, so a shard's store has :attr:`local_capacity` rows and the shards together keep
    every row in position order. Static (a ``jit`` argument).
    """

    axis: str
    count: int
    capacity: int  # the one-device retrieval capacity: what a method's static sizes read
    rows_per_shard: int
    buffer: int

    @staticmethod
    def split(axis: str, count: int, capacity: int, buffer: int) -> "ContextShards":
        """``count`` shards of a region of ``capacity`` rows, the last ``buffer`` of them slack."""
        rows = max(1, -(-max(capacity - buffer, 0) // count))
        return ContextShards(axis=axis, count=count, capacity=capacity, rows_per_shard=rows, buffer=buffer)

    @property
    def local_capacity(self) -> int:
        return self.rows_per_shard + self.buffer

    def index(self) -> jax.Array:
        """This shard's place on the axis (int32)."""
        return jax.lax.axis_index(self.axis)

    def order(self, local_rows: jax.Array) -> jax.Array:
        """A key that orders rows of every shard by position: shard first, then row."""
        return self.index() * self.local_capacity + local_rows

    def owns(self, order: jax.Array) -> jax.Array:
        """Whether rows given by :meth:`order` keys lie in this shard."""
        return order // self.local_capacity == self.index()

    def local_row(self, order: jax.Array) -> jax.Array:
        """The row in its own shard of an :meth:`order` key."""
        return order % self.local_capacity

    def total(self, x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, self.axis)

    def before(self, x: jax.Array) -> jax.Array:
        """The sum of x over the shards before this one (0 on the first)."""
        every = jax.lax.all_gather(x, self.axis)
        earlier = (jnp.arange(self.count) < self.index()).reshape(-1, *([1] * x.ndim))
        return jnp.sum(jnp.where(earlier, every, 0), axis=0)

    def first_open(self, local_len: jax.Array) -> jax.Array:
        """Per batch row (local_len [B], rows each shard holds), the shard the next flush writes:
        the lowest one below ``rows_per_shard`` (the last when all are full)."""
        full = jax.lax.all_gather(local_len >= self.rows_per_shard, self.axis)  # [count, B]
        return jnp.where(jnp.all(full, axis=0), self.count - 1, jnp.argmin(full.astype(jnp.int32), axis=0))


def merge_partials(part: Partial, shards: ContextShards) -> Partial:
    """``common.merge`` of every shard's partial over its own rows (disjoint), on every shard.

    The only data of a step that crosses shards besides the selection's scores and rows:
    per query head, o [d], l and m.
    """
    m = jax.lax.pmax(part.m, shards.axis)
    scale = jnp.exp(part.m - m)
    return Partial(o=shards.total(part.o * scale[..., None]), l=shards.total(part.l * scale), m=m)


def best_of_shards(scores: jax.Array, order: jax.Array, k: int, shards: ContextShards):
    """The k best of every shard's candidates (scores [n] descending, then order [n] ascending:
    lax.top_k's ties to the lower row), on every shard: (scores [k], order keys [k]).

    Each shard passes its own best ``min(k, n)``: together they hold the k best of all.
    """
    every_score = jax.lax.all_gather(scores, shards.axis).reshape(-1)
    every_order = jax.lax.all_gather(order, shards.axis).reshape(-1)
    negated, order = jax.lax.sort((-every_score, every_order), num_keys=2)
    return -negated[:k], order[:k]


def shard_selection(scores: jax.Array, order: jax.Array, shards: ContextShards) -> Selection:
    """This shard's part of a selection given as :func:`best_of_shards` returns it (scores −inf:
    no row): idx its local rows, mask False on the other shards' rows."""
    mine = shards.owns(order) & (scores > -jnp.inf)
    return Selection(idx=jnp.where(mine, shards.local_row(order), 0).astype(jnp.int32), mask=mine)
