"""Rotary position embedding in the Hugging Face split-halves layout.

Head dimension pairs are (j, j + hd/2), not interleaved (j, j+1), so HF weights
load with no permutation. Frequencies follow HF's ``rope_type`` formulas:
``default``, ``linear`` (positions divided by ``factor``) and ``llama3``
(Llama-3.1: long wavelengths divided by ``factor``, short ones kept, a smooth
blend between).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[head_dim/2] float32 angular frequencies; a trace-time constant (the config is static)."""
    hd = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    params = config.rope_parameters
    if params["rope_type"] == "linear":
        inv_freq = inv_freq / params["factor"]
    elif params["rope_type"] == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, params)
    return inv_freq.astype(np.float32)


def _llama3_frequencies(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    # 0 at the long-wavelength edge (fully scaled), 1 at the short edge (unscaled).
    blend = np.clip((old_context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, H, hd] by its token positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, hd/2]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
