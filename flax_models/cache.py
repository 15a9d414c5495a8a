"""Decode caches (DESIGN.md): per layer k and v [B, H_kv, S_max, head_dim], lengths[b] = tokens
already cached; the next token goes to slot lengths[b] at RoPE position lengths[b]. MLA keeps one
latent per token instead: [B, 1, S_max, kv_lora_rank + rope_dim] (one shared "KV head").

Caches are pytrees (jax.tree_util.register_dataclass), passed to jitted steps with donation so the
updates happen in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: tuple  # per layer [B, H_kv, S_max, D]
    v: tuple  # per layer [B, H_kv, S_max, Dv]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, *, num_layers, batch, num_kv_heads, max_len, head_dim, dtype, v_head_dim=None):
        k = tuple(jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros((batch, num_kv_heads, max_len, v_head_dim or head_dim), dtype) for _ in range(num_layers))
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentCache:
    latent: tuple  # per layer [B, 1, S_max, kv_lora_rank + rope_dim]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, *, num_layers, batch, max_len, latent_dim, dtype):
        latent = tuple(jnp.zeros((batch, 1, max_len, latent_dim), dtype) for _ in range(num_layers))
        return cls(latent=latent, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.latent[0].shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.latent)
