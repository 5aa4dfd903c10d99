"""Weight matrices kept in their llama.cpp GGUF blocks (Q4_1, Q8_0) instead of dequantised.

A decode step multiplies a few rows by every weight matrix, so its time is the time to
read them: SmolLM2's matrices are 538 MB in float32 and 96 MB as the GGUF's blocks.
:class:`QuantizedMatrix` stands in a :class:`~models.params.Params` field for the float32
array the blocks dequantise to (same ``shape``, ``dtype`` float32), and the decoder's
products go through :func:`contract` and :func:`unembed`: on the CPU, for up to
``KERNEL_MAX_ROWS`` rows, the native kernel reads the blocks and expands them in
registers; otherwise (a prefill, another backend, no native kernels) the blocks are
dequantised with ``jnp`` and multiplied as before. Both give the dequantised matrix's
product up to float32 rounding (other summation orders).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from models import native

BLOCK = 32  # inputs per block, both formats
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # float16 d (and m for Q4_1), then the codes
KERNEL_MAX_ROWS = 16  # more rows (a prefill): dequantise once and let XLA's GEMM run


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: its blocks are an array
class QuantizedMatrix:
    """An [N, K] matrix (N outputs, K inputs, as HF and GGUF store it) in GGUF blocks.

    blocks: uint8 [..., N, K/32 · block bytes]; leading axes stack layers.
    fmt: "q4_1" or "q8_0". logical: the per-matrix shape of the field it stands for.
    n_in: how many leading axes of ``logical`` are inputs (our layout ``[in..., out...]``);
    None when ``logical`` is ``[N, K]`` itself (the embedding).
    """

    blocks: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    logical: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    n_in: int | None = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.blocks.shape[:-2], *self.logical)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def outputs(self) -> int:
        return self.blocks.shape[-2]

    @property
    def inputs(self) -> int:
        return self.blocks.shape[-1] // BLOCK_BYTES[self.fmt] * BLOCK


def from_gguf_blocks(data: np.ndarray, fmt: str, rows: int, cols: int) -> QuantizedMatrix:
    """A GGUF tensor's raw blocks (uint8 [rows, cols/32 · block bytes]) as an [rows, cols] matrix."""
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"GGUF blocks of {fmt!r}: only {sorted(BLOCK_BYTES)} are kept quantised")
    expected = (rows, cols // BLOCK * BLOCK_BYTES[fmt])
    if cols % BLOCK or tuple(data.shape) != expected:
        raise ValueError(f"{fmt} blocks of a [{rows}, {cols}] matrix must be uint8 {expected}, got {data.shape}")
    return QuantizedMatrix(jnp.asarray(np.ascontiguousarray(data, np.uint8)), fmt, (rows, cols), None)


def permute_rows(matrix: QuantizedMatrix, order: np.ndarray) -> QuantizedMatrix:
    """The matrix with its output rows reordered (rows are whole blocks)."""
    return dataclasses.replace(matrix, blocks=matrix.blocks[..., order, :])


def in_our_layout(matrix: QuantizedMatrix, shape: tuple[int, ...], n_in: int | None) -> QuantizedMatrix:
    """The HF-layout [N, K] matrix standing for the field of our ``shape`` (see ``models.hf``)."""
    expected = matrix.logical if n_in is None else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if n_in == 0 or expected != matrix.logical:
        raise ValueError(f"a quantised [N, K] = {matrix.logical} matrix cannot stand for a field of shape {shape}")
    return dataclasses.replace(matrix, logical=tuple(shape), n_in=n_in)


def stack(matrices: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Per-layer matrices of one field, stacked on a leading layer axis."""
    first = matrices[0]
    if any((m.fmt, m.logical, m.n_in) != (first.fmt, first.logical, first.n_in) for m in matrices):
        raise ValueError("stacked quantised matrices must share their format and shape")
    return dataclasses.replace(first, blocks=jnp.stack([m.blocks for m in matrices]))


def dequantize(matrix: QuantizedMatrix) -> jax.Array:
    """float32 [..., N, K]: d·q + m (Q4_1) or d·q (Q8_0) per block, as ``gguf.quants`` computes."""
    blocks = matrix.blocks.reshape(*matrix.blocks.shape[:-1], -1, BLOCK_BYTES[matrix.fmt])
    d = _halves(blocks[..., 0:2])
    if matrix.fmt == "q4_1":
        codes = blocks[..., 4:]
        q = jnp.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(jnp.float32)
        values = d * q + _halves(blocks[..., 2:4])
    else:
        values = d * jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    return values.reshape(*matrix.blocks.shape[:-1], matrix.inputs)


def _halves(pair: jax.Array) -> jax.Array:
    """uint8 [..., 2] little-endian float16 -> float32 [..., 1]."""
    return jax.lax.bitcast_convert_type(pair, jnp.float16).astype(jnp.float32)[..., None]


def as_array(w) -> jax.Array:
    """The float32 array in our layout that ``w`` stands for (an array passes through)."""
    if not isinstance(w, QuantizedMatrix):
        return w
    dense = dequantize(w)
    if w.n_in is None:
        return dense
    lead = dense.shape[:-2]
    dense = jnp.swapaxes(dense, -1, -2)  # [..., K, N]
    return dense.reshape(*lead, *w.logical)


def dequantize_params(tree):
    """Every QuantizedMatrix in a pytree replaced by its float32 array."""
    return jax.tree.map(as_array, tree, is_leaf=lambda x: isinstance(x, QuantizedMatrix))


def is_quantized(tree) -> bool:
    return any(isinstance(x, QuantizedMatrix)
               for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedMatrix)))


def contract(x: jax.Array, w, n_in: int, subscripts: str) -> jax.Array:
    """x's last n_in axes against w's first n_in (w in our ``[in..., out...]`` layout).

    An array w: ``jnp.einsum(subscripts, x, w)``, the decoder's product as written. A
    QuantizedMatrix: its product, in x's dtype.
    """
    if not isinstance(w, QuantizedMatrix):
        return jnp.einsum(subscripts, x, w)
    if w.n_in != n_in:
        raise ValueError(f"a quantised matrix with {w.n_in} input axes used with {n_in}")
    lead, out_shape = x.shape[:x.ndim - n_in], w.logical[n_in:]
    y = _times_transposed(x.reshape(*lead, w.inputs), w)
    return y.reshape(*lead, *out_shape).astype(x.dtype)


def unembed(hidden: jax.Array, embedding) -> jax.Array:
    """hidden [..., D] against an embedding [V, D]: float32 logits [..., V]."""
    if not isinstance(embedding, QuantizedMatrix):
        return jnp.einsum("...d,vd->...v", hidden, embedding, preferred_element_type=jnp.float32)
    return _times_transposed(hidden, embedding)


def take_rows(embedding, tokens: jax.Array) -> jax.Array:
    """Rows ``tokens`` of an embedding [V, D] (only those rows dequantised)."""
    if not isinstance(embedding, QuantizedMatrix):
        return jnp.take(embedding, tokens, axis=0)
    return dequantize(dataclasses.replace(embedding, blocks=jnp.take(embedding.blocks, tokens, axis=0)))


def _times_transposed(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [..., K] · W[N, K]ᵀ -> float32 [..., N]."""
    rows = math.prod(x.shape[:-1])
    if rows <= KERNEL_MAX_ROWS and w.blocks.ndim == 2 and _native_kernel_usable():
        y = native.quantized_matmul(x.reshape(rows, w.inputs).astype(jnp.float32), w.blocks, q4_1=w.fmt == "q4_1")
        return y.reshape(*x.shape[:-1], w.outputs)
    return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), dequantize(w))


def _native_kernel_usable() -> bool:
    return jax.default_backend() == "cpu" and native.available()
