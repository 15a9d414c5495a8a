"""Double-stream and single-stream DiT blocks with joint attention (text tokens first)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import DiTConfig
from .layers import Modulation, RMSNorm, dense, gelu_tanh, layer_norm, modulate
from .rope import apply_rope


def attention(q, k, v, cos, sin, plan=None, kernel=None):
    """RoPE then non-causal attention of q, k, v [B, L, H, D] -> [B, L, H*D].

    With ``plan`` (a :class:`jax_cluster.parallel.Plan`) the attention runs sequence-parallel
    on the plan's mesh through ``jax_cluster.parallel``; otherwise on one device."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if plan is None:
        o = jax.nn.dot_product_attention(q, k, v)
    else:
        o = plan(q, k, v, kernel=kernel)
    b, l, h, d = o.shape
    return o.reshape(b, l, h * d)


class QKNorm(nnx.Module):
    def __init__(self, dim: int, *, dtype):
        self.query_norm = RMSNorm(dim, dtype=dtype)
        self.key_norm = RMSNorm(dim, dtype=dtype)

    def __call__(self, q, k, v):
        return self.query_norm(q).astype(v.dtype), self.key_norm(k).astype(v.dtype)


def _split_qkv(qkv, heads: int):
    b, l, _ = qkv.shape
    qkv = qkv.reshape(b, l, 3, heads, -1)  # features laid out as (3, H, D)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


class _Stream(nnx.Module):
    """The per-stream weights of a double-stream block (image or text)."""

    def __init__(self, cfg: DiTConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.mod = Modulation(h, True, dtype=dtype, zero=cfg.adaln_zero_init, rngs=rngs)
        self.qkv = dense(rngs, h, 3 * h, dtype=dtype, bias=cfg.qkv_bias)
        self.norm = QKNorm(cfg.head_dim, dtype=dtype)
        self.proj = dense(rngs, h, h, dtype=dtype)
        self.mlp_in = dense(rngs, h, cfg.mlp_hidden, dtype=dtype)
        self.mlp_out = dense(rngs, cfg.mlp_hidden, h, dtype=dtype)

    def qkv_of(self, x, mod, heads):
        q, k, v = _split_qkv(self.qkv(modulate(x, mod)), heads)
        q, k = self.norm(q, k, v)
        return q, k, v

    def finish(self, x, attn, mod1, mod2):
        x = x + mod1.gate * self.proj(attn)
        return x + mod2.gate * self.mlp_out(gelu_tanh(self.mlp_in(modulate(x, mod2))))


class DoubleStreamBlock(nnx.Module):
    """Separate weights for text and image; one attention over [text; image]."""

    def __init__(self, cfg: DiTConfig, *, dtype, rngs: nnx.Rngs):
        self.heads = cfg.num_heads
        self.img = _Stream(cfg, dtype=dtype, rngs=rngs)
        self.txt = _Stream(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, img, txt, vec, cos, sin, plan=None, kernel=None):
        im1, im2 = self.img.mod(vec)
        tm1, tm2 = self.txt.mod(vec)
        iq, ik, iv = self.img.qkv_of(img, im1, self.heads)
        tq, tk, tv = self.txt.qkv_of(txt, tm1, self.heads)
        q, k, v = (jnp.concatenate(p, axis=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
        attn = attention(q, k, v, cos, sin, plan, kernel)
        lt = txt.shape[1]
        return self.img.finish(img, attn[:, lt:], im1, im2), self.txt.finish(txt, attn[:, :lt], tm1, tm2)


class SingleStreamBlock(nnx.Module):
    """Shared weights over the joint sequence; attention and MLP in parallel from one linear."""

    def __init__(self, cfg: DiTConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.heads = cfg.num_heads
        self.hidden = h
        self.modulation = Modulation(h, False, dtype=dtype, zero=cfg.adaln_zero_init, rngs=rngs)
        self.linear1 = dense(rngs, h, 3 * h + cfg.mlp_hidden, dtype=dtype)
        self.linear2 = dense(rngs, h + cfg.mlp_hidden, h, dtype=dtype)
        self.norm = QKNorm(cfg.head_dim, dtype=dtype)

    def __call__(self, x, vec, cos, sin, plan=None, kernel=None):
        (mod,) = self.modulation(vec)
        y = self.linear1(modulate(x, mod))
        q, k, v = _split_qkv(y[..., :3 * self.hidden], self.heads)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, cos, sin, plan, kernel)
        out = self.linear2(jnp.concatenate([attn, gelu_tanh(y[..., 3 * self.hidden:])], axis=-1))
        return x + mod.gate * out


class LastLayer(nnx.Module):
    def __init__(self, cfg: DiTConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.adaLN_modulation = dense(rngs, h, 2 * h, dtype=dtype, zero=cfg.adaln_zero_init)
        self.linear = dense(rngs, h, cfg.out_dim, dtype=dtype, zero=cfg.adaln_zero_init)

    def __call__(self, x, vec):
        shift, scale = jnp.split(self.adaLN_modulation(jax.nn.silu(vec))[:, None, :], 2, axis=-1)
        return self.linear((1 + scale) * layer_norm(x) + shift)
