"""What every kernel in this package shares: Triton compiler settings, padding, constants.

Kernels run on the Triton backend, chosen explicitly with
``pallas.triton.CompilerParams`` (without it Pallas lowers GPU kernels to Mosaic
GPU, which has no row gather on Hopper). Triton tiles must have power-of-two
shapes, so wrappers pad the data to whole blocks and slice the result.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Scores of masked-out keys; the same convention as jaxkv.attention.common
# (finite, so a fully masked row gives l = 0 and o = 0 rather than NaN).
MASKED_SCORE = -1e30


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# JAX >= 0.11 warns, when it lowers a pallas_call for Triton, that this backend is
# deprecated. We choose Triton on purpose (see the module docstring); the
# warning is raised at lowering time, outside any call of ours, hence a filter.
warnings.filterwarnings("ignore", message=r"(?is).*triton.*deprecat", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=r"(?is).*deprecat.*triton", category=DeprecationWarning)


def pallas_call(kernel, **kwargs):
    """``pl.pallas_call`` on the Triton backend (its compiler params unless given)."""
    kwargs.setdefault("compiler_params", compiler_params())
    return pl.pallas_call(kernel, **kwargs)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def pad_axis(x: jax.Array, size: int, axis: int = 0, value=0) -> jax.Array:
    """Pad ``x`` along ``axis`` up to ``size`` with ``value``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def check_shape(name: str, x, expected: tuple) -> None:
    """Raise a ValueError naming ``name`` unless x.shape matches (None = any size)."""
    shape = tuple(x.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))
    if not ok:
        want = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name}: expected shape {want}, found {shape}")


def check_dtype(name: str, x, dtypes) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(t) for t in dtypes]:
        raise ValueError(f"{name}: expected dtype in {[str(jnp.dtype(t)) for t in dtypes]}, found {x.dtype}")
