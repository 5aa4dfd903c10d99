"""RSQ-IP: 4-bit codes of rotated unit directions and the calibrated inner-product estimate.

A rotated, normalised key ``y`` (``‖y‖ = 1``) is split into B subspaces of m
coordinates, ``y_b = r_b·u_b`` with ``‖u_b‖ = 1``. Every coordinate of ``u_b``
gets a 4-bit code ``(sign_bit << 3) | magnitude_index``: the sign bit is set iff
the coordinate is NEGATIVE (as in the Pallas rerank kernel; note ParisKV's
bucket-id bits are the other way round) and the 3-bit index points into the Lloyd–Max
levels of ``|u_j|``. After a random rotation ``u_b`` is uniform on S^(m−1), so
``u_j² ~ Beta(1/2, (m−1)/2)`` and ``|u_j|`` has density ∝ ``(1 − t²)^((m−3)/2)``
on [0, 1]; the levels are the exact Lloyd–Max quantiser of that density.

Calibration: with ``v_b`` the dequantised direction (sign × level centre,
*not* renormalised) and ``α_b = ⟨v_b, u_b⟩``, the per-key weight is
``w_b = ‖k‖·r_b/α_b`` and ``⟨k, q⟩ ≈ ‖q‖·Σ_b w_b⟨v_b, q̃_b⟩``. The ratio
``⟨v_b, q̃_b⟩/⟨v_b, u_b⟩`` does not depend on the scale of ``v_b``, so this is
the same estimate as with unit ``v_b``; leaving ``v_b`` unnormalised saves a
normalisation per subspace on the query path (kernels rely on it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MAGNITUDE_BITS = 3
N_LEVELS = 2**MAGNITUDE_BITS
SIGN_BIT = 1 << MAGNITUDE_BITS

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


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 [..., 2k] of 4-bit codes → uint8 [..., k]; the LOW nibble holds the even coordinate."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: uint8 [..., k] → uint8 [..., 2k]."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantise(codes: jax.Array, centres: np.ndarray) -> jax.Array:
    """4-bit codes (unpacked) → sign × level centre, float32 of the same shape."""
    magnitude = jnp.asarray(centres, jnp.float32)[codes & (N_LEVELS - 1)]
    return jnp.where((codes & SIGN_BIT) != 0, -magnitude, magnitude)


def encode(y: jax.Array, key_norm: jax.Array, m: int, thresholds, centres):
    """RSQ-IP codes and calibration weights of rotated unit keys.

    y: [..., P] rotated normalised keys (P = B·m); key_norm: [...] the raw ‖k‖.
    Returns (packed codes uint8 [..., P/2], weight float32 [..., B]).
    """
    blocks = y.reshape(*y.shape[:-1], -1, m).astype(jnp.float32)
    r = jnp.linalg.norm(blocks, axis=-1)
    u = blocks / jnp.where(r > 0, r, 1.0)[..., None]
    # Cell index = thresholds passed (7 compares beat a binary search on every backend).
    magnitude = jnp.sum(jnp.abs(u)[..., None] >= jnp.asarray(thresholds, jnp.float32), axis=-1)
    codes = magnitude.astype(jnp.uint8) | jnp.where(u < 0, SIGN_BIT, 0).astype(jnp.uint8)
    alpha = jnp.sum(dequantise(codes, centres) * u, axis=-1)  # > 0: v shares u's signs
    # An all-zero subspace carries no inner product: weight 0 (and no 0/0).
    weight = jnp.where(r > 0, key_norm[..., None] * r / jnp.where(r > 0, alpha, 1.0), 0.0)
    return pack_nibbles(codes.reshape(y.shape)), weight


def estimate(packed_codes, weight, q_rot, q_norm, m: int, centres) -> jax.Array:
    """Estimated ⟨k, q⟩ = ‖q‖·Σ_b w_b⟨v_b, q̃_b⟩ per key row.

    packed_codes uint8 [C, P/2], weight [C, B]; q_rot [P] the rotated unit query,
    q_norm its raw norm. Returns float32 [C].
    """
    v = dequantise(unpack_nibbles(packed_codes), centres)
    per_subspace = jnp.sum((v * q_rot.astype(jnp.float32)).reshape(v.shape[0], -1, m), axis=-1)
    return q_norm * jnp.sum(weight * per_subspace, axis=-1)
