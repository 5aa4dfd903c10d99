"""Self-contained orbax checkpoints of a converted model.

Layout of a checkpoint directory::

    config.json           HF-style config (ModelConfig.to_hf)
    jaxkv_tokenizer.json  Tokenizer.to_json, when a tokenizer was saved
    params/               orbax arrays (the params_to_dict tree)
    jaxkv_checkpoint.json manifest: format, dtype, sha256 of every tensor; written last

Everything is written into a hidden temporary sibling directory that is
renamed into place only when complete, so an interrupted save leaves no
directory at ``path`` (and a directory without its manifest is refused).
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models import quantized
from models.config import ModelConfig
from models.errors import ModelError, ModelNotFoundError
from models.params import Params, check_params, check_tree, param_shapes, params_from_dict, params_to_dict
from models.tokenizer import Tokenizer

MANIFEST = "jaxkv_checkpoint.json"
TOKENIZER_FILE = "jaxkv_tokenizer.json"
_FORMAT = "jaxkv-model/1"


def save(path, config: ModelConfig, params: Params, tokenizer: Tokenizer | None = None) -> None:
    """Write a checkpoint directory at ``path`` (which must not exist yet), atomically.

    Weight matrices held in GGUF blocks (:mod:`models.quantized`) are saved as the
    float32 arrays they stand for.
    """
    path = pathlib.Path(path)
    if path.exists():
        raise FileExistsError(f"checkpoint path {path} already exists; choose a new path or remove it")
    params = quantized.dequantize_params(params)
    dtype = _uniform_dtype(params)
    check_params(config, params, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.partial-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        tree = params_to_dict(params)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save((staging / "params").absolute(), tree)
        checkpointer.wait_until_finished()
        (staging / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
        if tokenizer is not None:
            (staging / TOKENIZER_FILE).write_text(tokenizer.to_json())
        manifest = {"format": _FORMAT, "dtype": jnp.dtype(dtype).name, "sha256": _digests(tree)}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def restore(path) -> tuple[ModelConfig, Params]:
    """(config, params) from a checkpoint written by :func:`save`, verified against its config and digests."""
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    config = ModelConfig.from_hf(path / "config.json")
    dtype = jnp.dtype(manifest["dtype"])
    if not (path / "params").is_dir():
        raise ModelError(f"{path}: the params/ directory is missing (a damaged checkpoint)")
    checkpointer = ocp.StandardCheckpointer()
    saved = _saved_array_metadata(checkpointer.metadata((path / "params").absolute()))
    try:
        check_tree(param_shapes(config), saved, dtype)
    except ModelError as err:
        raise ModelError(f"{path}: {err} (config.json or the manifest does not match the saved tensors)") from None
    target = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config),
                          is_leaf=lambda x: isinstance(x, tuple))
    tree = checkpointer.restore((path / "params").absolute(), target)
    digests = _digests(tree)
    for name, digest in digests.items():
        if manifest["sha256"].get(name) != digest:
            raise ModelError(f"{path}: tensor {name!r} does not match its saved sha256 (tampered or corrupted)")
    return config, params_from_dict(tree)


def restore_tokenizer(path) -> Tokenizer | None:
    """The tokenizer saved with a checkpoint, or None if it was saved without one."""
    path = pathlib.Path(path)
    _read_manifest(path)
    file = path / TOKENIZER_FILE
    return Tokenizer.from_json(file.read_text()) if file.exists() else None


def is_checkpoint(path) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def _read_manifest(path: pathlib.Path) -> dict:
    if not path.is_dir():
        raise ModelNotFoundError(f"no checkpoint directory at {path}")
    if not is_checkpoint(path):
        raise ModelError(f"{path}: no {MANIFEST}; not a complete jaxkv checkpoint (interrupted save?)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as err:
        raise ModelError(f"{path / MANIFEST}: not valid JSON ({err})") from err
    if manifest.get("format") != _FORMAT:
        raise ModelError(f"{path / MANIFEST}: expected format {_FORMAT!r}, found {manifest.get('format')!r}")
    return manifest


def _uniform_dtype(params: Params):
    dtypes = {jnp.dtype(x.dtype) for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise ModelError(f"params: expected one dtype for every tensor, found {sorted(d.name for d in dtypes)}")
    return dtypes.pop()


def _digests(tree: dict) -> dict[str, str]:
    """sha256 of every tensor's bytes, keyed by its path in the tree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): hashlib.sha256(np.asarray(x).tobytes()).hexdigest() for p, x in flat}


def _saved_array_metadata(metadata):
    """The tree of saved array metadata (shape, dtype) across orbax metadata API versions."""
    item = getattr(metadata, "item_metadata", metadata)
    return getattr(item, "tree", item)
