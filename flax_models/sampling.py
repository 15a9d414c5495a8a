"""Next-token selection: greedy, or temperature sampling restricted by top-k and/or top-p (nucleus)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax). top_k 0 = off. top_p 1 = off. Hashable: a static jit argument."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits, params: SamplingParams):
    """Temperature-scaled float32 logits with everything outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        srt = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
        keep = before < params.top_p  # the smallest prefix reaching top_p (always the best token)
        threshold = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample(logits, key, params: SamplingParams):
    """logits [B, V] -> token ids [B] int32."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, params), axis=-1).astype(jnp.int32)
