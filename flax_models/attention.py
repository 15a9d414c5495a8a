"""Attention math in plain jnp: causal prefill attention, decode attention over a KV cache, and the
cache writes. float32 scores and softmax; probabilities rounded to the value dtype before P @ V
(as Hugging Face's eager attention does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(q, k, v, scale: float):
    """q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv] -> [B, T, Hq, Dv] (causal, GQA).

    With right-padded prompts no padding mask is needed: a real query at t < length only sees keys
    at s <= t, which are real too; outputs at padded positions are never used.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhgts,bshd->bthgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, hq, v.shape[-1]).astype(q.dtype)


def decode_attention_core(q, k_cache, v_cache, lengths, scale: float):
    """One new query per sequence against the cache, the new token already written.

    q [B, Hq, D], caches [B, Hkv, S, D|Dv], lengths [B] (tokens before the new one): attends to
    slots 0..lengths[b] inclusive. Returns [B, Hq, Dv] in q.dtype.
    """
    b, hq, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k_cache.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(s_max)[None, :] <= lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v_cache.dtype)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, v_cache, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, v_cache.shape[-1]).astype(q.dtype)


def write_prefix(cache, new):
    """cache [B, H, S, D] <- new [B, T, H, D] at slots 0..T-1."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)
    return jax.lax.dynamic_update_slice(cache, new, (0, 0, 0, 0))


def write_at(cache, new, lengths):
    """cache [B, H, S, D] <- new [B, H, D] at slot lengths[b] of each row (in place when donated)."""

    def one(c, n, pos):
        return jax.lax.dynamic_update_slice(c, n[:, None, :].astype(c.dtype), (0, pos, 0))

    return jax.vmap(one)(cache, new, lengths.astype(jnp.int32))
