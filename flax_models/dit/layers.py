"""Building blocks of the Flux-style DiT: embedders, adaLN modulation, QK RMSNorm, LayerNorm."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


def dense(rngs, din, dout, *, dtype, bias=True, zero=False) -> nnx.Linear:
    """x @ W (+ b), W [in, out]; ``zero``: weights and bias start at 0 (adaLN-Zero)."""
    kw = {"kernel_init": nnx.initializers.zeros_init()} if zero else {}
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs, **kw)


def timestep_embedding(t, dim: int, max_period: float = 10000.0, time_factor: float = 1000.0):
    """Sinusoidal embedding [B, dim] of times t [B] in [0, 1] (scaled by ``time_factor``), fp32."""
    t = time_factor * jnp.asarray(t, jnp.float32)
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


def layer_norm(x, eps: float = 1e-6):
    """LayerNorm without affine parameters, in fp32."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


class MLPEmbedder(nnx.Module):
    def __init__(self, din: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.in_layer = dense(rngs, din, hidden, dtype=dtype)
        self.out_layer = dense(rngs, hidden, hidden, dtype=dtype)

    def __call__(self, x):
        return self.out_layer(jax.nn.silu(self.in_layer(x.astype(self.in_layer.kernel.dtype))))


class RMSNorm(nnx.Module):
    """RMSNorm over the head dimension with a learned scale (QK norm), fp32 math."""

    def __init__(self, dim: int, *, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        rrms = jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + 1e-6)
        return (xf * rrms * self.scale.value.astype(jnp.float32)).astype(x.dtype)


class ModulationOut(NamedTuple):
    shift: jax.Array  # [B, 1, hidden]
    scale: jax.Array
    gate: jax.Array


def modulate(x, mod: ModulationOut):
    """adaLN: (1 + scale) * LayerNorm(x) + shift."""
    return (1 + mod.scale) * layer_norm(x) + mod.shift


class Modulation(nnx.Module):
    """adaLN(-Zero) modulation from the conditioning vector: 1 or 2 (shift, scale, gate) triples."""

    def __init__(self, hidden: int, double: bool, *, dtype, zero: bool, rngs: nnx.Rngs):
        self.count = 2 if double else 1
        self.lin = dense(rngs, hidden, 3 * self.count * hidden, dtype=dtype, zero=zero)

    def __call__(self, vec) -> list[ModulationOut]:
        out = jnp.split(self.lin(jax.nn.silu(vec))[:, None, :], 3 * self.count, axis=-1)
        return [ModulationOut(*out[3 * i:3 * i + 3]) for i in range(self.count)]
