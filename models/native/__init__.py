"""The CPU kernel for products with weight matrices kept in their GGUF blocks (``weights_cpu.cc``).

Built on first use (``build.KernelLibrary``: a C++ compiler and a CPU with AVX-512 VBMI,
VBMI2, GFNI and BMI2); :func:`available` says whether it is, :func:`unavailable_reason`
why not. ``models.quantized`` calls :func:`quantized_matmul` for decode-sized products.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from models.native.build import KernelLibrary, NativeUnavailable

__all__ = ["LIBRARY", "NativeUnavailable", "available", "quantized_matmul", "unavailable_reason"]

LIBRARY = KernelLibrary("models.native", "models_cpu", [pathlib.Path(__file__).parent / "weights_cpu.cc"],
                        {"models_quantized_matmul": "QuantizedMatmul"})


def unavailable_reason() -> str | None:
    """None once the kernel is registered (building it if needed); else why it cannot be."""
    return LIBRARY.unavailable_reason()


def available() -> bool:
    """Whether the kernel is built and registered (building it if needed)."""
    return LIBRARY.available()


def quantized_matmul(x: jax.Array, blocks: jax.Array, *, q4_1: bool) -> jax.Array:
    """x float32 [..., M, K] times the [N, K] matrix whose GGUF blocks (Q4_1 if ``q4_1``,
    else Q8_0) are blocks uint8 [..., N, K/32 · block bytes]: float32 [..., M, N], the
    blocks expanded in registers. The dequantised matrix's sums up to float32 rounding."""
    LIBRARY.load("models_quantized_matmul")
    call = jax.ffi.ffi_call("models_quantized_matmul",
                            jax.ShapeDtypeStruct((*x.shape[:-1], blocks.shape[-2]), jnp.float32),
                            vmap_method="broadcast_all")
    return call(x.astype(jnp.float32), blocks, q4_1=np.int64(q4_1))
