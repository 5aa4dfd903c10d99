"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import fields

MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature == 0 means greedy (deterministic)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        fields.check(self, temperature=fields.NON_NEGATIVE, top_k=fields.at_least(1), top_p=fields.FRACTION)
        # Below this, logits / temperature can overflow float32 to inf (NaN after softmax).
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"SamplingConfig.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")


def _keep_top_k(logits, k):
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def _keep_top_p(logits, p):
    """logits [B, V] with every token outside the row's nucleus of mass p ([B, 1] or a scalar) at -inf."""
    sorted_logits = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches p: a token stays if the mass
    # strictly before it is < p (so the most likely token always stays). The
    # cut is a logit value, not a scatter of the sorted order: rows stay apart
    # when the batch is split over devices.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(mass_before < p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                top_k: int | None = None) -> jax.Array:
    """One token per row of logits [B, V] → int32 [B], each row by its own settings.

    Args:
      logits: [B, V] next-token logits.
      keys: [B] PRNG keys, one per row.
      temperature: [B]; 0 is greedy (argmax), otherwise the row draws at that temperature.
      top_p: [B] nucleus mass per row (1 keeps every token).
      top_k: keep only the k most likely tokens of every drawing row (static; None: all).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawing = temperature > 0

    def draw(logits):
        scaled = logits.astype(jnp.float32) / jnp.where(drawing, temperature, 1.0)[:, None]
        if top_k is not None:
            scaled = _keep_top_k(scaled, min(top_k, scaled.shape[-1]))
        # The nucleus sorts the vocabulary: only when a row asks for it.
        scaled = jax.lax.cond(jnp.any(top_p < 1), lambda x: _keep_top_p(x, top_p[:, None]), lambda x: x, scaled)
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(drawing), draw, lambda _: greedy, logits)
    return jnp.where(drawing, drawn, greedy)
