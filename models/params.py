"""Decoder parameters: a dataclass pytree with the layers stacked on a leading axis.

Layouts are chosen for einsum (input dimension first, heads explicit):
``wq [L, D, Hq, hd]``, ``wo [L, Hq, hd, D]``, ``w_down [L, F, D]`` … The
embedding and the untied output matrix are both ``[V, D]`` (as in HF).
Optional parts (biases, q/k norms, untied output) are None when the config
has no such part; :func:`param_shapes` is the single statement of which
parts exist and their shapes, used by every loader and by restore.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.errors import ModelError
from models.quantized import QuantizedMatrix


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """One decoder layer's weights, each with a leading num_layers axis (none once split).

    Split per layer, q, k and v may be joined into one matrix (:func:`join_projections`);
    the three are then None.
    """

    attn_norm: jax.Array      # [L, D]
    wq: jax.Array | None      # [L, D, Hq, hd]
    wk: jax.Array | None      # [L, D, Hkv, hd]
    wv: jax.Array | None      # [L, D, Hkv, hd]
    wo: jax.Array             # [L, Hq, hd, D]
    mlp_norm: jax.Array       # [L, D]
    w_gate: jax.Array         # [L, D, F]
    w_up: jax.Array           # [L, D, F]
    w_down: jax.Array         # [L, F, D]
    bq: jax.Array | None = None      # [L, Hq, hd]   when attention_bias
    bk: jax.Array | None = None      # [L, Hkv, hd]  when attention_bias
    bv: jax.Array | None = None      # [L, Hkv, hd]  when attention_bias
    bo: jax.Array | None = None      # [L, D]        when attention_out_bias
    q_norm: jax.Array | None = None  # [L, hd]       when qk_norm
    k_norm: jax.Array | None = None  # [L, hd]       when qk_norm
    wqkv: jax.Array | None = None    # [D, Hkv, G + 2, hd]  joined: KV head n's G query heads, its key, its value
    bqkv: jax.Array | None = None    # [Hkv, G + 2, hd]     joined biases, when attention_bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    """All decoder weights; ``layers`` stacked, or per layer after :func:`unstack_layers`."""

    embed: jax.Array                 # [V, D]
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: jax.Array            # [D]
    unembed: jax.Array | None = None  # [V, D], None when the embeddings are tied


def layer_params(params: Params, index: int) -> LayerParams:
    """Layer ``index``'s weights, whether the layers are stacked or per layer."""
    if layers_are_split(params):
        return params.layers[index]
    return jax.tree.map(lambda w: w[index], params.layers)


def unstack_layers(params: Params, num_layers: int, join: bool = True) -> Params:
    """The same weights with one LayerParams per layer instead of one stacked LayerParams.

    For jitted loops over tokens: XLA CPU copies a layer's slice of a stacked
    weight before each matmul that reads it, so slicing inside the loop copies
    every weight on every token. Called in front of the loop, the slices are
    copied once per call (while the loop runs, the weights are held twice).
    join: each layer's q, k and v read as one matrix (:func:`join_projections`).
    """
    layers = tuple(layer_params(params, i) for i in range(num_layers))
    return dataclasses.replace(params, layers=tuple(map(join_projections, layers)) if join else layers)


def join_projections(layer: LayerParams) -> LayerParams:
    """One layer's q, k and v matrices as one ``wqkv`` [D, Hkv, G + 2, hd] (KV head n's G
    query heads, then its key and its value head; biases likewise): a decode step multiplies
    its row by one matrix where it multiplied by three: XLA CPU runs a small matrix's product
    on one thread, a larger one on all (docs/results/implementation_notes.md, "The decoder";
    gate and up gain nothing joined and stay apart). Left as they are when one of them is in
    GGUF blocks (models.quantized, its own kernel) or joined already.
    """
    parts = (layer.wq, layer.wk, layer.wv)
    if not any(w is None or isinstance(w, QuantizedMatrix) for w in parts):
        layer = dataclasses.replace(
            layer, wq=None, wk=None, wv=None, bq=None, bk=None, bv=None,
            wqkv=_join_by_kv_head(parts),
            bqkv=None if layer.bq is None else _join_by_kv_head((layer.bq, layer.bk, layer.bv)))
    return layer


def _join_by_kv_head(parts) -> jax.Array:
    """q [..., Hq, hd], k and v [..., Hkv, hd] as one [..., Hkv, G + 2, hd]: KV head n's G query
    heads (query head h reads KV head h // G), then its key head and its value head."""
    kv_heads = parts[1].shape[-2]
    return jnp.concatenate([w.reshape(*w.shape[:-2], kv_heads, -1, w.shape[-1]) for w in parts], axis=-2)


def activation_dtype(params: Params):
    """The dtype of activations and KV caches for these params: the final norm's (weight
    matrices may be held in GGUF blocks, :mod:`models.quantized`)."""
    return params.final_norm.dtype


def cast_params(params: Params, dtype) -> Params:
    """The same params with every floating-point array in ``dtype`` (a bfloat16 model's
    weights, and so its activations and cache); GGUF blocks (uint8) stay as they are."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def layers_are_split(params: Params) -> bool:
    """Whether ``params`` holds one LayerParams per layer (:func:`unstack_layers`)."""
    return isinstance(params.layers, tuple)


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each present LayerParams field, without the leading layer axis."""
    d, hd, f = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hkv = config.num_heads, config.num_kv_heads
    shapes = {
        "attn_norm": (d,), "wq": (d, hq, hd), "wk": (d, hkv, hd), "wv": (d, hkv, hd),
        "wo": (hq, hd, d), "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    if config.attention_bias:
        shapes.update(bq=(hq, hd), bk=(hkv, hd), bv=(hkv, hd))
    if config.attention_out_bias:
        shapes["bo"] = (d,)
    if config.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def param_shapes(config: ModelConfig) -> dict:
    """Nested dict (the layout of :func:`params_to_dict`) of every present tensor's shape."""
    v, d = config.vocab_size, config.hidden_size
    shapes = {
        "embed": (v, d),
        "final_norm": (d,),
        "layers": {k: (config.num_layers, *s) for k, s in layer_shapes(config).items()},
    }
    if not config.tie_word_embeddings:
        shapes["unembed"] = (v, d)
    return shapes


def params_to_dict(params: Params) -> dict:
    """Plain nested dict of the present tensors (None parts dropped)."""
    def present(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None}
    return {**present(params), "layers": present(params.layers)}


def params_from_dict(tree: dict) -> Params:
    """Inverse of :func:`params_to_dict`."""
    return Params(**{**tree, "layers": LayerParams(**tree["layers"])})


def check_params(config: ModelConfig, params: Params, dtype=None) -> None:
    """Raise ModelError naming the first tensor whose presence, shape or dtype differs from the config."""
    check_tree(param_shapes(config), params_to_dict(params), dtype)


def check_tree(expected: dict, found: dict, dtype=None, prefix: str = "") -> None:
    """Compare a nested dict of arrays (or shape/dtype structs) against expected shapes."""
    for name in sorted(set(expected) | set(found)):
        path = f"{prefix}{name}"
        if name not in found:
            raise ModelError(f"tensor {path!r} is missing (expected shape {_shape_of(expected[name])})")
        if name not in expected:
            raise ModelError(f"tensor {path!r} is not part of this config's parameters")
        if isinstance(expected[name], dict):
            check_tree(expected[name], found[name], dtype, prefix=f"{path}.")
            continue
        shape = tuple(found[name].shape)
        if shape != expected[name]:
            raise ModelError(f"tensor {path!r}: expected shape {expected[name]}, found {shape}")
        if dtype is not None and jnp.dtype(found[name].dtype) != jnp.dtype(dtype):
            raise ModelError(f"tensor {path!r}: expected dtype {jnp.dtype(dtype)}, found {found[name].dtype}")


def _shape_of(entry):
    return "(a group of tensors)" if isinstance(entry, dict) else entry


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal, std 0.02; norms at 1) for tests and benchmarks."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    named_shapes, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config), is_leaf=is_shape)
    sizes = [math.prod(shape) for _, shape in named_shapes]
    # One draw cut into pieces: a single RNG kernel compiles far faster than one per tensor.
    draws = jnp.split(0.02 * jax.random.normal(key, (sum(sizes),), dtype), np.cumsum(sizes)[:-1])
    leaves = [
        jnp.ones(shape, dtype) if "norm" in jax.tree_util.keystr(path) else draw.reshape(shape)
        for (path, shape), draw in zip(named_shapes, draws)
    ]
    return params_from_dict(jax.tree.unflatten(treedef, leaves))
