"""RSQ-IP: 4-bit codes of rotated unit directions and the calibrated inner-product estimate.

A rotated, normalised key ``y`` (``‖y‖ = 1``) is split into B subspaces of m
coordinates, ``y_b = r_b·u_b`` with ``‖u_b‖ = 1``. Every coordinate of ``u_b``
gets 4 bits: a sign and a 3-bit index into the Lloyd–Max levels of ``|u_j|``.
After a random rotation ``u_b`` is uniform on S^(m−1), so
``u_j² ~ Beta(1/2, (m−1)/2)`` and ``|u_j|`` has density ∝ ``(1 − t²)^((m−3)/2)``
on [0, 1]; the levels are the exact Lloyd–Max quantiser of that density.

Calibration: with ``v_b`` the dequantised direction (sign × level centre,
*not* renormalised) and ``α_b = ⟨v_b, u_b⟩``, the per-key weight is
``w_b = ‖k‖·r_b/α_b`` and ``⟨k, q⟩ ≈ ‖q‖·Σ_b w_b⟨v_b, q̃_b⟩``. The ratio
``⟨v_b, q̃_b⟩/⟨v_b, u_b⟩`` does not depend on the scale of ``v_b``, so this is
the same estimate as with unit ``v_b``; leaving ``v_b`` unnormalised saves a
normalisation per subspace on the query path (kernels rely on it).

Storage (:class:`RSQCodes`, 38 B per key at d = 64, 74 B at d = 128): the sign
bits once, one byte per subspace (ParisKV's bucket id); the 3-bit magnitudes as
three bit planes; the B weights as one bfloat16 scale (‖k‖·max_b(r_b/α_b)/15) times
a 4-bit multiple per subspace (docs/results/implementation_notes.md, "RSQ-IP codes").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

MAGNITUDE_BITS = 3
N_LEVELS = 2**MAGNITUDE_BITS
SIGN_BIT = 1 << MAGNITUDE_BITS  # in the Pallas rerank kernel's nibbles: set iff NEGATIVE
WEIGHT_LEVELS = 15  # a subspace weight is scale × {0, 1, …, 15}

# Official amy-77/ParisKV table for m = 8 (Lloyd's algorithm stopped early).
OFFICIAL_M8_THRESHOLDS = (0.0843, 0.1698, 0.2578, 0.3499, 0.4487, 0.5585, 0.6901)
OFFICIAL_M8_CENTRES = (0.0420, 0.1266, 0.2130, 0.3025, 0.3973, 0.5001, 0.6169, 0.7633)

# Gauss–Legendre rule per cell; 64 nodes integrate the smooth θ-integrands to ~1e-16.
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(64)
_LLOYD_TOLERANCE = 1e-13
_LLOYD_MAX_ITERS = 200_000


def _cell_mass_and_moment(lo: np.ndarray, hi: np.ndarray, m: int):
    """∫ f and ∫ t·f over cells [lo, hi] of t = |u_j|, f(t) ∝ (1 − t²)^((m−3)/2).

    Substituting t = sin θ gives integrands cos^(m−2) θ and sin θ·cos^(m−2) θ,
    which are smooth on [0, π/2] for every m ≥ 2 (the t-form is singular at 1 for m = 2).
    """
    a, b = np.arcsin(lo)[:, None], np.arcsin(hi)[:, None]
    theta = 0.5 * (b - a) * _NODES + 0.5 * (b + a)
    w = 0.5 * (b - a) * _WEIGHTS
    base = np.cos(theta) ** (m - 2)
    return np.sum(w * base, axis=1), np.sum(w * base * np.sin(theta), axis=1)


@functools.lru_cache(maxsize=None)
def lloyd_max_levels(m: int) -> tuple[np.ndarray, np.ndarray]:
    """Converged Lloyd–Max (thresholds [7], centres [8]) for |u_j|, u uniform on S^(m−1)."""
    if m < 2:
        raise ValueError(f"m must be >= 2 for the Beta(1/2, (m-1)/2) prior, got m={m}")
    thresholds = np.arange(1, N_LEVELS) / N_LEVELS  # any ordered start converges (log-concave)
    for _ in range(_LLOYD_MAX_ITERS):
        edges = np.concatenate([[0.0], thresholds, [1.0]])
        mass, moment = _cell_mass_and_moment(edges[:-1], edges[1:], m)
        centres = moment / mass
        new_thresholds = 0.5 * (centres[:-1] + centres[1:])
        converged = np.max(np.abs(new_thresholds - thresholds)) < _LLOYD_TOLERANCE
        thresholds = new_thresholds
        if converged:
            return thresholds, centres
    raise RuntimeError(f"Lloyd–Max levels for m={m} did not converge")


def magnitude_levels(m: int, official: bool) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds, centres) used for codes: derived for any m, or the official m=8 table."""
    if official:
        if m != 8:
            raise ValueError(f"official_levels=True exists only for m=8, got m={m}")
        return np.asarray(OFFICIAL_M8_THRESHOLDS), np.asarray(OFFICIAL_M8_CENTRES)
    return lloyd_max_levels(m)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RSQCodes:
    """The codes of keys [...] (P = B·m padded coordinates).

    Two arrays: the sign bytes, which the coarse stage scans for every key, and one
    record per key of everything the rerank reads for a candidate (its magnitude planes,
    weight codes and scale), so a candidate touches few cache lines
    (docs/results/implementation_notes.md, "RSQ-IP codes").
    """

    signs: jax.Array   # uint8 [..., B]: bit j ⇔ coordinate b·m + j ≥ 0 (ParisKV's bucket id)
    record: jax.Array  # uint8 [..., 3P/8 + ⌈B/2⌉ + 2]: magnitudes | weight_codes | scale's two bytes

    @property
    def _plane_bytes(self) -> int:  # P/8
        return (self.record.shape[-1] - SCALE_BYTES - _weight_bytes(self.signs.shape[-1])) // MAGNITUDE_BITS

    @property
    def magnitudes(self) -> jax.Array:
        """uint8 [..., 3, P/8]: bit plane i, bit t of byte c = bit i of coordinate 8c + t's cell."""
        planes = self.record[..., :MAGNITUDE_BITS * self._plane_bytes]
        return planes.reshape(*planes.shape[:-1], MAGNITUDE_BITS, self._plane_bytes)

    @property
    def weight_codes(self) -> jax.Array:
        """uint8 [..., ⌈B/2⌉]: 4-bit multiples of scale, low nibble = even subspace."""
        start = MAGNITUDE_BITS * self._plane_bytes
        return self.record[..., start:start + _weight_bytes(self.signs.shape[-1])]

    @property
    def scale(self) -> jax.Array:
        """bfloat16 [...]: ‖k‖·max_b(r_b/α_b)/15."""
        return jax.lax.bitcast_convert_type(self.record[..., -SCALE_BYTES:], jnp.bfloat16)


SCALE_BYTES = 2  # a bfloat16, little-endian in the record (as every backend stores it)


def _weight_bytes(n_subspaces: int) -> int:
    return -(-n_subspaces // 2)


def pack_codes(signs: jax.Array, magnitudes: jax.Array, scale: jax.Array, weight_codes: jax.Array) -> RSQCodes:
    """RSQCodes of the parts: signs [..., B], magnitudes [..., 3, P/8], scale bfloat16 [...], weight_codes [..., ⌈B/2⌉]."""
    planes = magnitudes.reshape(*magnitudes.shape[:-2], -1)
    scale_bytes = jax.lax.bitcast_convert_type(scale.astype(jnp.bfloat16), jnp.uint8)
    return RSQCodes(signs=signs, record=jnp.concatenate([planes, weight_codes, scale_bytes], axis=-1))


def empty_codes(capacity: int, p: int, m: int) -> RSQCodes:
    b = p // m
    return RSQCodes(signs=jnp.zeros((capacity, b), jnp.uint8),
                    record=jnp.zeros((capacity, bytes_per_key(p, m) - b), jnp.uint8))


def bytes_per_key(p: int, m: int) -> int:
    b = p // m
    return b + MAGNITUDE_BITS * p // 8 + _weight_bytes(b) + SCALE_BYTES


def sign_bytes(y: jax.Array, m: int) -> jax.Array:
    """Sign pattern per subspace: y[..., P] → uint8 [..., P/m], bit j ⇔ y[b·m + j] ≥ 0."""
    return _pack_bits(y >= 0, m)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 [..., 2k] of 4-bit codes → uint8 [..., k]; the LOW nibble holds the even coordinate."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: uint8 [..., k] → uint8 [..., 2k]."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _bits(x: jax.Array, n: int) -> jax.Array:
    """uint8 [..., k] → its low n bits, uint8 [..., k·n] (bit t of byte c at c·n + t)."""
    bits = (x[..., None] >> jnp.arange(n, dtype=jnp.uint8)) & 1
    return bits.reshape(*x.shape[:-1], x.shape[-1] * n)


def _pack_bits(bits: jax.Array, n: int = 8) -> jax.Array:
    """0/1 [..., n·k] → uint8 [..., k], bit t of byte c from position c·n + t (inverse of :func:`_bits`)."""
    grouped = bits.reshape(*bits.shape[:-1], -1, n).astype(jnp.uint8)
    return jnp.sum(grouped << jnp.arange(n, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def magnitude_cells(magnitudes: jax.Array) -> jax.Array:
    """Bit planes uint8 [..., 3, P/8] → each coordinate's cell index, uint8 [..., P]."""
    planes = _bits(magnitudes, 8)  # [..., 3, P]
    return sum(planes[..., i, :] << i for i in range(MAGNITUDE_BITS)).astype(jnp.uint8)


def dequantise(signs: jax.Array, magnitudes: jax.Array, m: int, centres) -> jax.Array:
    """sign × level centre of every coordinate, float32 [..., P]."""
    magnitude = jnp.asarray(centres, jnp.float32)[magnitude_cells(magnitudes)]
    return jnp.where(_bits(signs, m) != 0, magnitude, -magnitude)


def subspace_weights(codes: RSQCodes, n_subspaces: int) -> jax.Array:
    """w_b, float32 [..., B], from the scale and the 4-bit multiples."""
    multiples = unpack_nibbles(codes.weight_codes)[..., :n_subspaces].astype(jnp.float32)
    return codes.scale.astype(jnp.float32)[..., None] * multiples


def _quantise_weights(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., B] ≥ 0 → (bfloat16 scale [...], 4-bit multiples packed [..., ⌈B/2⌉])."""
    scale = (jnp.max(weight, axis=-1) / WEIGHT_LEVELS).astype(jnp.bfloat16)
    # Divide by the rounded scale, so the multiples absorb its rounding.
    step = scale.astype(jnp.float32)[..., None]
    multiples = jnp.clip(jnp.round(weight / jnp.where(step > 0, step, 1.0)), 0, WEIGHT_LEVELS)
    if weight.shape[-1] % 2:
        multiples = jnp.pad(multiples, [(0, 0)] * (weight.ndim - 1) + [(0, 1)])
    return scale, pack_nibbles(multiples.astype(jnp.uint8))


def encode(y: jax.Array, key_norm: jax.Array, m: int, thresholds, centres) -> RSQCodes:
    """RSQ-IP codes of rotated unit keys y[..., P] (P = B·m); key_norm [...] the raw ‖k‖."""
    blocks = y.reshape(*y.shape[:-1], -1, m).astype(jnp.float32)
    r = jnp.linalg.norm(blocks, axis=-1)
    u = blocks / jnp.where(r > 0, r, 1.0)[..., None]
    # Cell index = thresholds passed (7 compares beat a binary search on every backend).
    cells = jnp.sum(jnp.abs(u)[..., None] >= jnp.asarray(thresholds, jnp.float32), axis=-1).astype(jnp.uint8)
    cells = cells.reshape(y.shape)
    magnitudes = jnp.stack([_pack_bits((cells >> i) & 1) for i in range(MAGNITUDE_BITS)], axis=-2)
    signs = sign_bytes(y, m)
    v = dequantise(signs, magnitudes, m, centres).reshape(blocks.shape)
    alpha = jnp.sum(v * u, axis=-1)  # > 0: v shares u's signs
    # An all-zero subspace carries no inner product: weight 0 (and no 0/0).
    weight = jnp.where(r > 0, key_norm[..., None] * r / jnp.where(r > 0, alpha, 1.0), 0.0)
    scale, weight_codes = _quantise_weights(weight)
    return pack_codes(signs, magnitudes, scale, weight_codes)


def reconstruct(codes: RSQCodes, m: int, centres) -> jax.Array:
    """The keys as the codes describe them, in the rotated space: w_b·v_b per subspace, float32 [C, P].

    ⟨reconstruct(codes), q̃⟩ is RSQ-IP's estimate of ⟨k, q⟩/‖q‖ (q̃ the rotated unit query).
    """
    v = dequantise(codes.signs, codes.magnitudes, m, centres)
    weights = subspace_weights(codes, v.shape[-1] // m)
    return (v.reshape(*v.shape[:-1], -1, m) * weights[..., None]).reshape(v.shape)


def _level(centres: jax.Array, planes: list[jax.Array]) -> jax.Array:
    """centres[cell] for cell = Σ_i planes[i]·2^i (bool arrays), by selects, lowest bit first.

    Selects vectorise on XLA CPU; a gather from the 8-entry table per element does not.
    """
    choices = [centres[k] for k in range(N_LEVELS)]
    for bit in planes:
        choices = [jnp.where(bit, high, low) for low, high in zip(choices[0::2], choices[1::2])]
    return choices[0]


def estimate(codes: RSQCodes, q_rot, q_norm, m: int, centres) -> jax.Array:
    """Estimated ⟨k, q⟩ = ‖q‖·Σ_b w_b⟨v_b, q̃_b⟩ for code rows [C, ...].

    q_rot [P] the rotated unit query, q_norm its raw norm. Returns float32 [C].
    Each ⟨v_b, q̃_b⟩ is summed coordinate by coordinate over [C] columns, which
    XLA CPU fuses into one vectorised loop (faster than dequantising [C, P] for a dot,
    as :func:`reconstruct` does). The weighted sum over b is a reduction on purpose: a
    purely elementwise estimate gets fused into its consumers (the top-k's block maxima
    and gathers) and recomputed there (docs/results/implementation_notes.md, "RSQ-IP codes").
    """
    centres = jnp.asarray(centres, jnp.float32)
    q = q_rot.astype(jnp.float32)
    n_sub = codes.signs.shape[-1]

    def bit(byte, t):
        return ((byte >> t) & 1) != 0

    def along(b):
        total = 0.0
        for j in range(m):
            p = b * m + j
            level = _level(centres, [bit(codes.magnitudes[..., i, p // 8], p % 8) for i in range(MAGNITUDE_BITS)])
            total = total + jnp.where(bit(codes.signs[..., b], j), level, -level) * q[p]
        return total

    per_subspace = jnp.stack([along(b) for b in range(n_sub)], axis=-1)
    return q_norm * jnp.sum(per_subspace * subspace_weights(codes, n_sub), axis=-1)


def kernel_layout(codes: RSQCodes, m: int) -> tuple[jax.Array, jax.Array]:
    """Rows [C] in the Pallas rerank kernel's layout: (nibbles uint8 [C, P/2], weight float32 [C, B]).

    A nibble is (negative << 3) | cell, the low nibble the even coordinate.
    """
    negative = (_bits(codes.signs, m) == 0).astype(jnp.uint8)
    nibbles = pack_nibbles(magnitude_cells(codes.magnitudes) | (negative << MAGNITUDE_BITS))
    return nibbles, subspace_weights(codes, codes.signs.shape[-1])
