"""Hugging Face checkpoints: the tensor-name table, shape validation, safetensors loading.

Every importer (safetensors here, GGUF in :mod:`models.gguf_import`) produces
tensors under their HF names and HF layouts and hands them to
:func:`params_from_hf_tensors`, which validates names and shapes against the
config and converts to the :class:`~models.params.Params` layout.
"""
from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Callable, Iterable

import jax.numpy as jnp
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from models import quantized
from models.config import ModelConfig
from models.errors import ModelError, ModelNotFoundError
from models.files import read_json
from models.params import param_shapes, params_from_dict

# field -> (HF name, how the HF tensor maps to ours). The mapping is the number
# of leading *input* axes of our layout for a Linear weight (HF stores
# [out, in], we store [in..., out...]); 0 for a bias we split into heads;
# None where the layouts are the same.
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", None),
    "wq": ("self_attn.q_proj.weight", 1),
    "wk": ("self_attn.k_proj.weight", 1),
    "wv": ("self_attn.v_proj.weight", 1),
    "wo": ("self_attn.o_proj.weight", 2),
    "bq": ("self_attn.q_proj.bias", 0),
    "bk": ("self_attn.k_proj.bias", 0),
    "bv": ("self_attn.v_proj.bias", 0),
    "bo": ("self_attn.o_proj.bias", None),
    "q_norm": ("self_attn.q_norm.weight", None),
    "k_norm": ("self_attn.k_norm.weight", None),
    "mlp_norm": ("post_attention_layernorm.weight", None),
    "w_gate": ("mlp.gate_proj.weight", 1),
    "w_up": ("mlp.up_proj.weight", 1),
    "w_down": ("mlp.down_proj.weight", 1),
}
_GLOBAL_TENSORS = {
    "embed": ("model.embed_tokens.weight", None),
    "final_norm": ("model.norm.weight", None),
    "unembed": ("lm_head.weight", None),
}
# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_tensor_table(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], int | None]]:
    """HF tensor name -> (path into params_to_dict, our per-tensor shape, axis mapping)."""
    shapes = param_shapes(config)
    table = {}
    for field, (name, n_in) in _GLOBAL_TENSORS.items():
        if field in shapes:
            table[name] = ((field,), shapes[field], n_in)
    for field, shape in shapes["layers"].items():
        suffix, n_in = _LAYER_TENSORS[field]
        for i in range(config.num_layers):
            table[f"model.layers.{i}.{suffix}"] = (("layers", field, i), shape[1:], n_in)
    return table


def hf_shape(shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    """The HF shape of a tensor whose shape in our layout is ``shape``."""
    if n_in is None:
        return shape
    if n_in == 0:
        return (math.prod(shape),)
    return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def to_our_layout(tensor, shape: tuple[int, ...], n_in: int | None):
    """Convert an HF-layout tensor (already shape-checked) to our layout."""
    return tensor.reshape(shape) if not n_in else tensor.T.reshape(shape)


def params_from_hf_tensors(config: ModelConfig, names: Iterable[str], get_tensor: Callable, dtype, *,
                           source: str):
    """Validate the HF tensor names and shapes, then build Params in ``dtype``.

    names: every tensor the checkpoint holds; get_tensor(name) returns it
    (numpy or jax, or a :class:`~models.quantized.QuantizedMatrix` kept as is) in HF layout. ``source`` names the checkpoint in errors.
    """
    table = hf_tensor_table(config)
    names = set(names)
    missing = sorted(set(table) - names)
    if missing:
        raise ModelError(f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
    extra = sorted(n for n in names - set(table)
                   if not _IGNORED.fullmatch(n) and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if extra:
        raise ModelError(f"{source}: unexpected tensor {extra[0]!r} for this config ({len(extra)} unexpected in all)")
    per_layer: dict[str, list] = {}
    tree: dict = {"layers": {}}
    for name in tqdm(sorted(table, key=_natural_order), desc=f"converting {pathlib.Path(source).name}",
                     unit="tensor", leave=False):
        path, shape, n_in = table[name]
        tensor = get_tensor(name)
        if tuple(tensor.shape) != hf_shape(shape, n_in):
            raise ModelError(f"{source}: tensor {name!r}: expected shape {hf_shape(shape, n_in)}, "
                             f"found {tuple(tensor.shape)}")
        if isinstance(tensor, quantized.QuantizedMatrix):
            converted = quantized.in_our_layout(tensor, shape, n_in)
        else:
            converted = jnp.asarray(to_our_layout(tensor, shape, n_in), dtype=dtype)
        if path[0] == "layers":
            per_layer.setdefault(path[1], []).append(converted)
        else:
            tree[path[0]] = converted
    tree["layers"] = {field: quantized.stack(layers) if isinstance(layers[0], quantized.QuantizedMatrix)
                      else jnp.stack(layers) for field, layers in per_layer.items()}
    return params_from_dict(tree)


def _natural_order(name: str):
    """Sort key putting layer 2 before layer 10, so per-layer lists stack in layer order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_hf(path, dtype=jnp.float32):
    """(config, params) from a local HF model directory (single or sharded safetensors)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ModelNotFoundError(f"no Hugging Face model directory at {path}")
    config = ModelConfig.from_hf(path)
    files = _safetensors_files(path)
    handles = {file: _open_safetensors(file) for file in files}
    where = {name: handle for handle in handles.values() for name in handle.keys()}

    def get_tensor(name):
        try:
            return where[name].get_tensor(name)
        except SafetensorError as err:
            raise ModelError(f"{path}: cannot read tensor {name!r} ({err}); is the file truncated?") from err

    params = params_from_hf_tensors(config, where, get_tensor, dtype, source=str(path))
    return config, params


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{index}: key 'weight_map' must map tensor names to file names")
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = [path / "model.safetensors"]
    for file in files:
        if not file.exists():
            raise ModelNotFoundError(f"checkpoint file {file} does not exist")
    return files


def _open_safetensors(file: pathlib.Path):
    try:
        return safe_open(str(file), framework="flax")
    except (SafetensorError, OSError) as err:
        raise ModelError(f"{file}: not a readable safetensors file ({err}); is it truncated?") from err
