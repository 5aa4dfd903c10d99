"""The sparse-method interface: every hook the four-region cache (``jaxkv.cache``) calls.

A method subclasses :class:`SparseMethod`, implements ``build``, ``insert`` and
``select``, overrides the hooks whose defaults do not fit, and is registered by
name in :mod:`jaxkv.attention.registry`. Every hook works on ONE KV head; the
cache vmaps them over batch and heads. docs/adding_a_method.md walks through one.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.attention import common
from pallas_kernels.dispatch import Kernels


class Regions(NamedTuple):
    """A method's default sizes of the exact regions, in tokens (``jaxkv.cache.CacheConfig``).

    buffer None: as large as the local window the cache resolves.
    """

    sink: int
    local: int
    buffer: int | None


class SparseMethod(abc.ABC):
    """A sparse attention method as the cache drives it: hooks over one KV head.

    ``cfg`` is always an instance of :attr:`config_class` (a frozen, hashable
    dataclass, static under ``jit``); ``index`` a pytree of arrays whose shapes
    do not depend on data. Instances hold no state: two instances of one class
    are equal, so either serves as a static ``jit`` argument.

    The default hooks read the config fields ``sink``, ``local``, ``buffer`` and
    ``dense_layers``; a method whose config lacks one overrides that hook.
    """

    config_class: ClassVar[type]
    # Whether correction() of a slot depends only on that slot's row and mask: the cache
    # may then gather, correct and attend the selection a block of slots at a time.
    slot_wise_correction: ClassVar[bool] = False

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    # ------------------------------------------------------------ the index

    @abc.abstractmethod
    def build(self, cfg, keys: jax.Array, values: jax.Array, n, key: jax.Array | None) -> Any:
        """The index over the first ``n`` rows of a retrieval region.

        Args:
          keys, values: [cap, d]; rows at or past ``n`` are padding. ``cap`` is the
            index's static capacity.
          n: int32 scalar (data, not static), the rows in use.
          key: a PRNG key for a randomised index, or None (the cache passes None:
            a method then seeds itself from its config).
        Returns:
          The index: a pytree of arrays (a registered dataclass).
        """

    @abc.abstractmethod
    def insert(self, cfg, index, keys_new: jax.Array, values_new: jax.Array, count) -> Any:
        """The index with the first ``count`` rows of keys_new appended as rows n, n+1, ...

        Called at every flush of the update buffer. Args: keys_new, values_new [U, d];
        count an int32 scalar in [0, U]. Returns the index (same shapes as given).
        """

    @abc.abstractmethod
    def select(self, cfg, index, q: jax.Array) -> common.Selection:
        """The retrieval rows to read for the query group q [G, d].

        Returns:
          A :class:`common.Selection` of static capacity (idx [C], mask [C] or [G, C],
          optionally ``rest``: a partial estimated from the index alone over rows
          not read).
        """

    def splits_context(self, cfg) -> bool:
        """Whether :meth:`select_sharded` serves this config: the retrieval region may then be
        split over a mesh's ``context`` axis (``jaxkv.sharding``)."""
        return False

    def select_sharded(self, cfg, index, q: jax.Array, context) -> common.Selection:
        """:meth:`select` with the retrieval region split into contiguous shards, run on each
        inside ``shard_map`` over ``context.axis`` (``context``: a
        :class:`jaxkv.attention.shards.ContextShards`; ``index`` this shard's, built over its rows).

        Returns this shard's part of the rows ``select`` picks over the whole region: idx its
        local rows, mask False on the other shards' (:func:`jaxkv.attention.shards.shard_selection`).
        Only called where :meth:`splits_context` holds.
        """
        raise NotImplementedError(f"{type(self).__name__} does not split its retrieval region")

    def build_sharded(self, cfg, keys: jax.Array, values: jax.Array, n, key: jax.Array | None, context) -> Any:
        """:meth:`build` of a shard's rows (inside ``shard_map``, see :meth:`select_sharded`); the
        default builds from them alone, right for an index whose rows do not depend on the others."""
        return self.build(cfg, keys, values, n, key)

    def insert_sharded(self, cfg, index, keys_new: jax.Array, values_new: jax.Array, count, context) -> Any:
        """:meth:`insert` into a shard's index (``count`` 0 on the shards a flush does not
        write; every shard calls it); the default inserts alone."""
        return self.insert(cfg, index, keys_new, values_new, count)

    def correction_sharded(self, cfg, index, q: jax.Array, k_rows: jax.Array, selection: common.Selection,
                           context) -> jax.Array | None:
        """:meth:`correction` of a shard's part of a selection (see :meth:`select_sharded`)."""
        return self.correction(cfg, index, q, k_rows, selection)

    def correction(self, cfg, index, q: jax.Array, k_rows: jax.Array,
                   selection: common.Selection) -> jax.Array | None:
        """Added to the scores of the selected rows: None (read as they are) or [G, C].

        Args: k_rows [C, d], the selection's key rows. A sampler returns
        −log(inclusion probability), so the cache's softmax is the importance-weighted estimate.
        """
        return None

    # ------------------------------------------------------------ how the cache sizes and places it

    def regions(self, cfg) -> Regions:
        """Default sink, local and update-buffer sizes (a CacheConfig field overrides each)."""
        return Regions(cfg.sink, cfg.local, cfg.buffer)

    def dense_layers(self, cfg) -> tuple[int, ...]:
        """Layers generate() keeps dense for this method."""
        return tuple(cfg.dense_layers)

    def top_k(self, cfg) -> int:
        """Rows a top-k retriever reads per step, 0 for a sampler: the default dense threshold
        (contexts attended exactly) is max(2000, sink + local + 2·top_k)."""
        return 0

    def kernels(self, cfg) -> Kernels:
        """Which kernels run this config's steps; the cache reads it for the attention over the
        selection (Pallas gather-attention) and for the dense layers (``native``)."""
        return Kernels.XLA

    def host_config(self, cfg):
        """None (default): with offload the index stays on the device, ``select`` runs there
        and only the selected rows come from host memory. Otherwise the config to run the
        method with in host memory: the index then lives beside the retrieval rows and the
        insertion, selection and attention over the selected rows run as host computations
        (only the query crosses in, the partial out). See docs/architecture.md, "Data movement"."""
        return None

    def inserts_in_place(self, cfg) -> bool:
        """Whether ``insert`` rewrites index buffers in place (a CPU kernel aliasing its
        output to its input): the cache then vmaps it over [B, H] without a reshape."""
        return False

    def reads_rows_in_place(self, cfg, keys: jax.Array) -> bool:
        """Whether :meth:`attend_in_place` serves this config and retrieval region (keys
        [cap, d] as the cache holds them) instead of gather, correction and attention."""
        return False

    def attend_in_place(self, cfg, index, q: jax.Array, keys: jax.Array, values: jax.Array,
                        selection: common.Selection) -> common.Partial:
        """The partial of q [G, d] over the selection's rows of keys, values [cap, d], read
        where they lie, corrected as :meth:`correction` says. Only called where
        :meth:`reads_rows_in_place` holds."""
        raise NotImplementedError(f"{type(self).__name__} does not attend in place")

    # ------------------------------------------------------------ a whole context, as a study uses it

    def attend(self, cfg, q: jax.Array, keys: jax.Array, values: jax.Array, key: jax.Array | None = None):
        """The method's estimate for q [G, d] over a whole context keys, values [N, d].

        The first ``sink`` and last ``local`` keys are attended exactly; the index is
        built over the rest and its selection merged in (key None: PRNG key 0).
        Returns (output [G, d] float32, distinct keys read).
        """
        sink, local, _ = self.regions(cfg)
        n = keys.shape[0]
        start, end = common.exact_and_retrieval_split(n, sink, local)
        exact_k = jnp.concatenate([keys[:start], keys[end:]])
        exact_v = jnp.concatenate([values[:start], values[end:]])
        parts = [common.partial_attention(q, exact_k, exact_v)]
        n_read = jnp.int32(exact_k.shape[0])
        if end > start:
            key = jax.random.key(0) if key is None else key
            retr_k, retr_v = keys[start:end], values[start:end]
            index = self.build(cfg, retr_k, retr_v, jnp.int32(end - start), key)
            sel = self.select(cfg, index, q)
            k_rows, v_rows = retr_k[sel.idx], retr_v[sel.idx]
            sel = dataclasses.replace(sel, log_weight=self.correction(cfg, index, q, k_rows, sel))
            parts.append(common.attend_selection(q, k_rows, v_rows, sel))
            n_read = n_read + sel.distinct_rows()
        return common.finalize(common.merge(*parts)), n_read


class IndexFunctions(NamedTuple):
    """A method module's index functions over keys alone (the values are not indexed)."""

    build: Callable  # (cfg, keys [cap, d], n, key) -> index
    insert: Callable  # (cfg, index, keys_new [U, d], count) -> index
    select: Callable  # (cfg, index, q [G, d]) -> common.Selection


class KeyRetriever(SparseMethod):
    """A top-k retriever whose index models the keys alone, from its module's
    :class:`IndexFunctions`: no correction, ``cfg.top_k`` rows read per step."""

    functions: ClassVar[IndexFunctions]

    def build(self, cfg, keys, values, n, key):
        return self.functions.build(cfg, keys, n, key)

    def insert(self, cfg, index, keys_new, values_new, count):
        return self.functions.insert(cfg, index, keys_new, count)

    def select(self, cfg, index, q):
        return self.functions.select(cfg, index, q)

    def top_k(self, cfg):
        return cfg.top_k
