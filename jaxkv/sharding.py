"""Sharded decoding on a JAX mesh: a ``data`` axis for the batch, a ``model`` axis for heads,
and optionally a ``context`` axis that splits each sparse layer's retrieval region.

What lives where (PartitionSpecs over the mesh axes ``("data", "model")``):

- parameters: the query-head axis of ``wq``/``bq``/``wo`` and the KV-head axis of
  ``wk``/``wv``/``bk``/``bv`` on ``model`` (query heads are grouped by KV head,
  so splitting Hkv into equal blocks splits Hq the same way; ``wqkv``/``bqkv``,
  q, k and v joined per KV head by ``models.unstack_layers``, on their KV-head
  axis, whole groups to a device); the MLP's hidden axis F on ``model`` when it
  divides (Megatron style), replicated otherwise; embeddings, norms and the output
  bias replicated.
- caches: batch on ``data``, KV heads on ``model``, for the dense cache and for
  every leaf of the four-region cache (:class:`jaxkv.cache.RegionKV`): the exact
  regions, the retrieval region (which keeps its ``pinned_host`` memory kind)
  and the method's index (leaves with leading ``[B, Hkv]``); per-row counters
  ``[B]`` on ``data``.

Attention never mixes KV heads or rows, so each layer's attention step runs
under :func:`jax.shard_map` on its own block of rows and heads: the retrieval
gathers, the index lookups and the flushes read only the device's (and its
host's) shard, with no collective. The projections, the MLP and the LM head
are left to XLA's partitioner (the ``wo`` and ``w_down`` contractions over the
sharded axis end in an all-reduce over ``model``).

With a ``context`` axis (``make_mesh(data, model, context=C)``) the retrieval region
of every sparse layer is split into C contiguous shards (``jaxkv.attention.shards``):
its K/V, index and row count (``cache.RETRIEVAL_FIELDS``) get a leading shard axis on
``context``; sink and window stay whole on every shard, which attends them alike.
Each shard selects its rows among the one-device selection with the method's
``select_sharded`` and attends them; the partials merge by log-sum-exp.

All of this happens at the boundary of generate()'s jitted programs
(:class:`MeshJit`: arguments placed and declared as in_shardings); generate()
uses this module only when given a mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from jaxkv import cache as kvcache

DATA, MODEL, CONTEXT = "data", "model", "context"
AXES = (DATA, MODEL)
CONTEXT_AXES = (DATA, MODEL, CONTEXT)

# Per-layer parameter specs without the leading layer axis; absent names are replicated.
_HEAD_SHARDED = {
    "wq": P(None, MODEL, None), "wk": P(None, MODEL, None), "wv": P(None, MODEL, None),
    "wo": P(MODEL, None, None), "bq": P(MODEL, None), "bk": P(MODEL, None), "bv": P(MODEL, None),
    # joined per KV head (models.params.join_projections): a shard holds whole GQA groups
    "wqkv": P(None, MODEL, None, None), "bqkv": P(MODEL, None, None),
}
_MLP_SHARDED = {"w_gate": P(None, MODEL), "w_up": P(None, MODEL), "w_down": P(MODEL, None)}


def make_mesh(data: int, model: int, devices=None, *, context: int | None = None) -> Mesh:
    """A ``(data, model)`` mesh over the first data·model devices (default: all visible devices);
    with ``context``, a ``(data, model, context)`` mesh over data·model·context of them."""
    devices = jax.devices() if devices is None else list(devices)
    shape = (data, model) if context is None else (data, model, context)
    size = math.prod(shape)
    if min(shape) < 1 or size > len(devices):
        raise ValueError(f"mesh {shape} needs {size} devices; {len(devices)} are visible")
    return jax.make_mesh(shape, CONTEXT_AXES[: len(shape)], axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=devices[:size])


def has_context(mesh) -> bool:
    """Whether the mesh splits retrieval regions over a ``context`` axis."""
    return CONTEXT in mesh.axis_names


def context_split(mesh) -> tuple[str, int] | None:
    """(``context``, its size) for a mesh with that axis, else None."""
    return (CONTEXT, mesh.shape[CONTEXT]) if has_context(mesh) else None


def validate_mesh(mesh: Mesh, config: models.ModelConfig, batch: int | None = None) -> None:
    """Raise ValueError unless `mesh` has Auto axes (data, model) or (data, model, context) that
    divide the batch (if given) and the KV heads."""
    if tuple(mesh.axis_names) not in (AXES, CONTEXT_AXES):
        raise ValueError(f"mesh axes must be {AXES} or {CONTEXT_AXES}, found {tuple(mesh.axis_names)} "
                         "(build one with jaxkv.sharding.make_mesh)")
    explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind != jax.sharding.AxisType.Auto]
    if explicit:
        raise ValueError(f"mesh axes {explicit} are not AxisType.Auto: jaxkv lets XLA partition "
                         "the model (build the mesh with jaxkv.sharding.make_mesh)")
    data, model = mesh.shape[DATA], mesh.shape[MODEL]
    if batch is not None and batch % data:
        raise ValueError(f"batch of {batch} prompts does not split over the mesh's data axis of "
                         f"size {data}: give a multiple of {data} prompts (pad with copies of one)")
    if config.num_kv_heads % model:
        raise ValueError(f"num_kv_heads = {config.num_kv_heads} does not split over the mesh's model "
                         f"axis of size {model}: use a model axis that divides it")


# ----------------------------------------------------------------------------
# Partition specs.


def param_specs(params: models.Params, mesh: Mesh) -> models.Params:
    """A Params-shaped tree of PartitionSpecs (see the module docstring); layers stacked or split."""
    split = models.layers_are_split(params)
    first_layer = params.layers[0] if split else params.layers
    sharded = dict(_HEAD_SHARDED)
    if first_layer.w_gate.shape[-1] % mesh.shape[MODEL] == 0:
        sharded.update(_MLP_SHARDED)
    stacked = () if split else (None,)  # None: the stacked layer axis

    def layer_spec(name, leaf):
        if leaf is None:
            return None
        return P(*stacked, *sharded[name]) if name in sharded else P()

    def layers_spec(layer):
        return models.LayerParams(**{f.name: layer_spec(f.name, getattr(layer, f.name))
                                     for f in dataclasses.fields(layer)})

    replicated = lambda x: None if x is None else P()  # noqa: E731
    layers = tuple(map(layers_spec, params.layers)) if split else layers_spec(params.layers)
    return models.Params(embed=P(), layers=layers, final_norm=P(), unembed=replicated(params.unembed))


def _region_specs(state: kvcache.RegionKV, context: bool) -> kvcache.RegionKV:
    """Leaves lead with [B, Hkv], the per-row counters with [B]; with ``context`` the
    retrieval fields lead with the shard axis [C] first."""
    def spec(x, sharded):
        per_row = x.ndim == (2 if sharded else 1)
        return P(*((CONTEXT,) if sharded else ()), DATA, *(() if per_row else (MODEL,)))

    return kvcache.RegionKV(**{
        f.name: jax.tree.map(functools.partial(spec, sharded=context and f.name in kvcache.RETRIEVAL_FIELDS),
                             getattr(state, f.name))
        for f in dataclasses.fields(state)})


def cache_specs(states, context: bool = False):
    """PartitionSpecs for a decode state: a stacked dense cache, or a tuple of per-layer states.

    Dense caches (models.KVCache) have leading [L, B, Hkv] (stacked) or [B, Hkv]
    (one layer), whole on every ``context`` shard; every RegionKV leaf has leading
    [B, Hkv] except the per-row counters [B], and with ``context`` (a mesh with that
    axis) its retrieval fields lead with the shard axis.
    """
    if isinstance(states, models.KVCache):
        spec = P(None, DATA, MODEL, None, None) if states.k.ndim == 5 else P(DATA, MODEL, None, None)
        return models.KVCache(k=spec, v=spec)
    if isinstance(states, kvcache.RegionKV):
        return _region_specs(states, context)
    if isinstance(states, (tuple, list)):
        return type(states)(cache_specs(s, context) for s in states)
    raise TypeError(f"cache_specs: no partition rule for a {type(states).__name__}")


def _retrieval_fields(state: kvcache.RegionKV, change) -> kvcache.RegionKV:
    """The state with ``change`` applied to every leaf of its retrieval fields."""
    return dataclasses.replace(state, **{name: jax.tree.map(change, getattr(state, name))
                                         for name in kvcache.RETRIEVAL_FIELDS})


def _add_shard_axis(state):
    """A shard's own RegionKV as its block of the global state (a leading shard axis of 1)."""
    if not isinstance(state, kvcache.RegionKV):
        return state
    return _retrieval_fields(state, lambda x: x[None])


def _drop_shard_axis(state):
    """The block of a shard (leading shard axis of 1) as its own RegionKV."""
    if not isinstance(state, kvcache.RegionKV):
        return state
    return _retrieval_fields(state, lambda x: x[0])


# ----------------------------------------------------------------------------
# Placement.


def _put(x, sharding: NamedSharding):
    """x placed with `sharding`; across several hosts every process passes the same global x."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def place(tree, specs, mesh: Mesh):
    """Put every leaf of `tree` on `mesh` by its spec, keeping its memory kind (pinned_host stays)."""

    def one(x, spec):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        return _put(x, NamedSharding(mesh, spec, memory_kind=kind))

    return jax.tree.map(one, tree, specs, is_leaf=lambda s: isinstance(s, P))


def shard_params(params: models.Params, config: models.ModelConfig, mesh: Mesh,
                 batch: int | None = None) -> models.Params:
    """Parameters on the mesh, after validate_mesh(mesh, config, batch)."""
    if models.quantized.is_quantized(params):
        raise ValueError("weights held in GGUF blocks (models.load(..., keep_quantized=True)) are not split over "
                         "a mesh; load them dequantised (keep_quantized=False) to shard them")
    validate_mesh(mesh, config, batch)
    return place(params, param_specs(params, mesh), mesh)


def shard_states(states, mesh: Mesh):
    """A decode state (dense cache or per-layer states) on the mesh."""
    return place(states, cache_specs(states, has_context(mesh)), mesh)


# ----------------------------------------------------------------------------
# Attention and index building per shard.


_Q_SPEC = P(DATA, None, MODEL, None)  # q, k, v [B, T, H, hd]


@dataclasses.dataclass(frozen=True)
class LocalAttention:
    """A layer's attention step run under shard_map on each device's rows and KV heads.

    check_vma is off: the cache's lax.cond branches mix per-row and per-head
    values, which the varying-axes type check rejects although every shard's
    result is its own. The per-row read counter of a RegionKV is a mean over KV
    heads: its per-shard means are averaged over ``model`` (equal head counts
    per shard, so this is the mean over all heads).
    """

    attend: object
    mesh: Mesh

    def __call__(self, q, k, v, positions, state, *layer):
        """An AttentionFn, or a StackedAttentionFn when given the layer index (replicated)."""
        specs = cache_specs(state, has_context(self.mesh))
        return jax.shard_map(
            self._local, mesh=self.mesh,
            in_specs=(_Q_SPEC, _Q_SPEC, _Q_SPEC, P(DATA, None), specs, *(P() for _ in layer)),
            out_specs=(_Q_SPEC, specs), check_vma=False)(q, k, v, positions, state, *layer)

    def _local(self, q, k, v, positions, state, *layer):
        if not isinstance(state, kvcache.RegionKV):
            return self.attend(q, k, v, positions, state, *layer)
        context = has_context(self.mesh)
        # The dense-fallback decision spans the whole batch, as on one device.
        out, state = self.attend(q, k, v, positions, _drop_shard_axis(state) if context else state,
                                 batch_axis=DATA)
        state = dataclasses.replace(state, keys_read=jax.lax.pmean(state.keys_read, MODEL))
        return out, _add_shard_axis(state) if context else state


def per_shard(attention, mesh: Mesh):
    """A generate() attention (one callable or one per layer) run per shard."""
    if callable(attention):
        return LocalAttention(attention, mesh)
    return tuple(LocalAttention(a, mesh) for a in attention)


def regions_per_shard(staging: models.KVCache, lengths, *, backend: kvcache.Backend, mesh: Mesh):
    """backend.from_prefill per shard: each device splits and indexes its own rows and KV heads
    (and with a ``context`` axis, its own part of each retrieval region)."""
    context = has_context(mesh)

    def local(staging, lengths):
        return tuple(_add_shard_axis(s) if context else s for s in backend.from_prefill(staging, lengths))

    # The shapes of a whole region tell the specs (a shard's own place is known only inside).
    whole = dataclasses.replace(backend, context=None)
    shapes = jax.eval_shape(lambda st, ln: tuple(map(_add_shard_axis, whole.from_prefill(st, ln))) if context
                            else whole.from_prefill(st, ln), staging, lengths)
    out_specs = cache_specs(shapes, context)
    return jax.shard_map(local, mesh=mesh, in_specs=(cache_specs(staging), P(DATA)),
                         out_specs=out_specs, check_vma=False)(staging, lengths)


# ----------------------------------------------------------------------------
# Programs on a mesh: placement at the jit boundary.


def argument_specs(x, mesh: Mesh):
    """PartitionSpecs for an argument of a generate() program, by what it is.

    Parameters by :func:`param_specs`, decode caches by :func:`cache_specs`, any
    other dataclass field by field; arrays with a leading batch axis on ``data``,
    scalars replicated.
    """
    if isinstance(x, models.Params):
        return param_specs(x, mesh)
    if isinstance(x, (models.KVCache, kvcache.RegionKV, tuple, list)):
        return cache_specs(x, has_context(mesh))
    if dataclasses.is_dataclass(x):
        return type(x)(**{f.name: argument_specs(getattr(x, f.name), mesh) for f in dataclasses.fields(x)})
    return P() if np.ndim(x) == 0 else P(DATA)


class MeshJit:
    """``jax.jit(fun)`` for a mesh, with in_shardings taken from its arguments.

    Each positional argument is placed on the mesh by :func:`argument_specs`
    (keeping its memory kind: pinned_host stays) and the program is jitted with
    those shardings as ``in_shardings``, one jitted function per distinct
    placement and static keyword arguments (jit takes no keyword arguments
    beside in_shardings, so they are bound first). Outputs keep the shardings
    XLA propagates (shard_map's out_specs for attention), which the next
    program takes as they are.
    """

    def __init__(self, fun, mesh: Mesh, *, donate_argnames=()):
        self._fun, self._mesh = fun, mesh
        positional = list(inspect.signature(fun).parameters)
        self._donate = tuple(positional.index(name) for name in donate_argnames)
        self._jitted: dict = {}

    def _placed(self, args, static):
        args = tuple(place(a, argument_specs(a, self._mesh), self._mesh) for a in args)
        shardings = jax.tree.map(lambda x: x.sharding, args)
        key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)), tuple(sorted(static.items())))
        if key not in self._jitted:
            self._jitted[key] = jax.jit(functools.partial(self._fun, **static), in_shardings=shardings,
                                        donate_argnums=self._donate)
        return self._jitted[key], args

    def __call__(self, *args, **static):
        jitted, args = self._placed(args, static)
        return jitted(*args)

    def lower(self, *args, **static):
        jitted, args = self._placed(args, static)
        return jitted.lower(*args)


# ----------------------------------------------------------------------------
# Fetching results and measuring placement.


def fetch(x) -> np.ndarray:
    """A (possibly multi-host) sharded array as one numpy array on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def bytes_per_device(tree) -> dict[str, int]:
    """Largest bytes any one device holds of `tree`'s arrays, per memory kind ("device", "pinned_host")."""
    held: dict[tuple[str, object], int] = {}
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind or "device"
        for shard in leaf.addressable_shards:
            key = (kind, shard.device)
            held[key] = held.get(key, 0) + shard.data.nbytes
    out: dict[str, int] = {}
    for (kind, _), n in held.items():
        out[kind] = max(out.get(kind, 0), n)
    return out


__all__ = [
    "AXES", "CONTEXT", "CONTEXT_AXES", "DATA", "MODEL", "LocalAttention", "MeshJit", "argument_specs",
    "bytes_per_device", "cache_specs", "context_split", "fetch", "has_context", "make_mesh", "param_specs",
    "per_shard", "place", "regions_per_shard", "shard_params", "shard_states", "validate_mesh",
]
