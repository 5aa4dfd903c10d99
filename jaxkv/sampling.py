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
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches p: a token stays if the mass
    # strictly before it is < p (so the most likely token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    sorted_keep = mass_before < p
    keep = jnp.zeros_like(sorted_keep).at[
        jnp.arange(logits.shape[0])[:, None], order].set(sorted_keep)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Choose one token per row of logits [B, V] → int32 [B]."""
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k is not None:
        logits = _keep_top_k(logits, min(cfg.top_k, logits.shape[-1]))
    if cfg.top_p is not None:
        logits = _keep_top_p(logits, cfg.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
