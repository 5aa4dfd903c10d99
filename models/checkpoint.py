"""Self-contained orbax checkpoints of a converted model.

Layout of a checkpoint directory::

    config.json           HF-style config (ModelConfig.to_hf)
    jaxkv_tokenizer.json  Tokenizer.to_json, when a tokenizer was saved
    params/               orbax arrays (the params_to_dict tree)
    jaxkv_checkpoint.json manifest: format, dtype, sha256 of every tensor, and the
                          size and sha256 of every file under params/; written last

The directory is written whole or not at all (:func:`models.files.atomic_directory`).
:func:`restore` checks every file under params/ against the manifest (present, size,
sha256) before orbax reads any array, then each tensor against its digest.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models import files, quantized
from models.config import ModelConfig
from models.errors import ModelError, ModelNotFoundError
from models.params import Params, check_params, check_tree, param_shapes, params_from_dict, params_to_dict
from models.tokenizer import Tokenizer

MANIFEST = "jaxkv_checkpoint.json"
TOKENIZER_FILE = "jaxkv_tokenizer.json"
PARAMS_DIR = "params"
_FORMAT = "jaxkv-model/2"
# Format 1 lacks the file list: its arrays are checked by their tensor digests only.
_READABLE_FORMATS = ("jaxkv-model/1", _FORMAT)
_HASH_CHUNK = 1 << 22


def save(path, config: ModelConfig, params: Params, tokenizer: Tokenizer | None = None) -> None:
    """Write a checkpoint directory at ``path`` (which must not exist yet), atomically.

    Weight matrices held in GGUF blocks (:mod:`models.quantized`) are saved as the
    float32 arrays they stand for. Ctrl-C during orbax's array write takes effect when
    that write ends (it runs on orbax's threads and cannot stop midway); then, as on
    any exception, nothing is left at ``path`` or beside it.
    """
    path = pathlib.Path(path)
    if path.exists():
        raise FileExistsError(f"checkpoint path {path} already exists; choose a new path or remove it")
    params = quantized.dequantize_params(params)
    dtype = _uniform_dtype(params)
    check_params(config, params, dtype)
    tree = params_to_dict(params)
    digests = _digests(tree)
    with files.atomic_directory(path) as staging:
        with files.deferred_signals():
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save((staging / PARAMS_DIR).absolute(), tree)
            checkpointer.wait_until_finished()
        (staging / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
        if tokenizer is not None:
            (staging / TOKENIZER_FILE).write_text(tokenizer.to_json())
        manifest = {"format": _FORMAT, "dtype": jnp.dtype(dtype).name, "sha256": digests,
                    "files": _file_records(staging)}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))


def restore(path) -> tuple[ModelConfig, Params]:
    """(config, params) from a checkpoint written by :func:`save`, verified against its config and digests.

    Raises:
        ModelNotFoundError: no directory at ``path``.
        ModelError: not a complete checkpoint, or damaged: the message names the file
            (missing, of the wrong size, or not matching its sha256) or the tensor.
    """
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    config = ModelConfig.from_hf(path / "config.json")
    return config, _restore_params(path, manifest, config)


def restore_tokenizer(path) -> Tokenizer | None:
    """The tokenizer saved with a checkpoint, or None if it was saved without one."""
    path = pathlib.Path(path)
    _read_manifest(path)
    file = path / TOKENIZER_FILE
    if not file.exists():
        return None
    try:
        return Tokenizer.from_json(file.read_text(encoding="utf-8"))
    except (ModelError, UnicodeDecodeError) as err:
        raise ModelError(f"{file}: {err}") from None


def is_checkpoint(path) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def _restore_params(path: pathlib.Path, manifest: dict, config: ModelConfig) -> Params:
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise ModelError(f"{path}: the params/ directory is missing (a damaged checkpoint)")
    if "files" in manifest:
        _verify_files(path, manifest["files"])
    dtype = _manifest_dtype(path, manifest)
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = _saved_array_metadata(checkpointer.metadata(params_dir.absolute()))
        try:
            check_tree(param_shapes(config), saved, dtype)
        except ModelError as err:
            raise ModelError(f"{path}: {err} (config.json or the manifest does not match the saved tensors)") from None
        target = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config),
                              is_leaf=lambda x: isinstance(x, tuple))
        tree = checkpointer.restore(params_dir.absolute(), target)
    except ModelError:
        raise
    except Exception as err:  # orbax / TensorStore: a format-1 checkpoint has no file list to check first
        raise ModelError(f"{params_dir}: the saved arrays cannot be read ({_first_line(err)})") from None
    for name, digest in _digests(tree).items():
        if manifest["sha256"].get(name) != digest:
            raise ModelError(f"{path}: tensor {name!r} does not match its saved sha256 (tampered or corrupted)")
    return params_from_dict(tree)


def _read_manifest(path: pathlib.Path) -> dict:
    if not path.is_dir():
        raise ModelNotFoundError(f"no checkpoint directory at {path}")
    if not is_checkpoint(path):
        raise ModelError(f"{path}: no {MANIFEST}; not a complete jaxkv checkpoint (interrupted save?)")
    file = path / MANIFEST
    manifest = files.read_json(file)
    if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ModelError(f"{file}: expected format {_FORMAT!r}, found {found!r}")
    if not isinstance(manifest.get("sha256"), dict):
        raise ModelError(f"{file}: key 'sha256' must map tensor names to digests")
    records = manifest.get("files", {})
    if not isinstance(records, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
            for r in records.values()):
        raise ModelError(f"{file}: key 'files' must map file names to {{'size': int, 'sha256': str}}")
    return manifest


def _manifest_dtype(path: pathlib.Path, manifest: dict):
    name = manifest.get("dtype")
    try:
        if isinstance(name, str):
            return jnp.dtype(name)
    except TypeError:
        pass
    raise ModelError(f"{path / MANIFEST}: key 'dtype' is not a dtype name: {name!r}")


def _file_records(root: pathlib.Path) -> dict[str, dict]:
    """{path under root: {"size", "sha256"}} of every file under root/params/."""
    return {file.relative_to(root).as_posix(): {"size": file.stat().st_size, "sha256": _file_digest(file)}
            for file in sorted((root / PARAMS_DIR).rglob("*")) if file.is_file()}


def _verify_files(path: pathlib.Path, records: dict[str, dict]) -> None:
    """Every file the manifest lists is present with its size (all checked first: cheap), then its sha256."""
    for name, record in records.items():
        file = path / name
        if not file.is_file():
            raise ModelError(f"{file}: missing (the checkpoint is damaged)")
        size = file.stat().st_size
        if size != record["size"]:
            raise ModelError(f"{file}: {size} bytes where the manifest records {record['size']} "
                             "(truncated or damaged)")
    for name, record in records.items():
        if _file_digest(path / name) != record["sha256"]:
            raise ModelError(f"{path / name}: sha256 does not match the manifest (damaged or modified)")


def _file_digest(file: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


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
