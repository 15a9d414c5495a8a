"""attention_decode with XLA's own ops: the same step as the fused kernel, in the input
dtype with fp32 accumulation (no fp32 copies of weights or caches, unlike the reference).

The tuner weighs it against the kernel's cluster sizes, so ``impl="auto"`` is never slower
than plain XLA where the kernel loses (batch 16 and GQA on H100: see
benchmarks/results/attention_decode.md). Same contract as the kernel: the caches change only
at slot lengths[b]; rows with lengths outside [0, S_max) give NaN and write nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cluster.reference import _norm_f32, _rope


def _write_slot(cache, new, pos, valid):
    """cache [B, H, S, D] with new [B, H, D] at slot pos[b] where valid[b] (in place when
    donated: one dynamic_update_slice per row; an invalid row rewrites the slot's own value)."""
    def one(c, n, p, ok):
        cur = jax.lax.dynamic_slice(c, (0, p, 0), (c.shape[0], 1, c.shape[2]))[:, 0]
        return jax.lax.dynamic_update_slice(c, jnp.where(ok, n, cur)[:, None], (0, p, 0))
    return jax.vmap(one)(cache, new.astype(cache.dtype), pos, valid)


def attention_decode_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, num_q_heads,
                         num_kv_heads, norm, norm_weight, norm_bias, eps, qkv_bias, o_bias,
                         residual, rotary_dim, rope_layout, scale):
    f32, dt = jnp.float32, x.dtype
    batch = x.shape[0]
    _, hkv, max_seq, dh = k_cache.shape
    hq, group = num_q_heads, num_q_heads // num_kv_heads
    h = x if norm is None else _norm_f32(x, norm, norm_weight, norm_bias, eps).astype(x.dtype)
    qkv = jnp.dot(h, w_qkv, preferred_element_type=f32)
    if qkv_bias is not None:
        qkv = qkv + qkv_bias.astype(f32)
    valid = (lengths >= 0) & (lengths < max_seq)
    pos = jnp.where(valid, lengths, 0)
    q = _rope(qkv[:, : hq * dh].reshape(batch, hq, dh), pos[:, None], inv_freq, rotary_dim, rope_layout)
    k = _rope(qkv[:, hq * dh:(hq + hkv) * dh].reshape(batch, hkv, dh), pos[:, None], inv_freq,
              rotary_dim, rope_layout)
    v = qkv[:, (hq + hkv) * dh:].reshape(batch, hkv, dh)
    k_cache = _write_slot(k_cache, k, pos, valid)
    v_cache = _write_slot(v_cache, v, pos, valid)
    qg = (q * scale).astype(dt).reshape(batch, hkv, group, dh)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k_cache, preferred_element_type=f32)
    s = jnp.where(jnp.arange(max_seq) <= pos[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(dt)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, v_cache, preferred_element_type=f32)
    y = jnp.dot(o.reshape(batch, hq * dh).astype(dt), w_o, preferred_element_type=f32)
    if o_bias is not None:
        y = y + o_bias.astype(f32)
    if residual:
        y = y + x.astype(f32)
    y = jnp.where(valid[:, None], y, jnp.nan)
    return y.astype(dt), k_cache, v_cache
