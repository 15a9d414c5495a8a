"""Basic layers: linear ([in, out] weights), embedding, RMSNorm, LayerNorm, SwiGLU and GELU MLPs.

Each layer has a functional form (used by :mod:`flax_models.ops`, which receives raw weight arrays)
and an NNX module that owns the parameters. Matmuls accumulate in float32 and round the result to the
activation dtype; norms compute in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

_INIT_STD = 0.02


# ----------------------------------------------------------------------------- functional forms
def dense(x, w, b=None):
    """x @ w (+ b), float32 accumulation, result in x.dtype."""
    y = jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x, weight, eps: float):
    """Hugging Face Llama RMSNorm: normalise in float32, cast back to x.dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def layer_norm(x, weight, bias, eps: float):
    """LayerNorm in float32 (mean, variance, affine), result in x.dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def silu(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


def gelu(x, approximate: bool = False):
    """GELU: exact (erf) by default as in GPT-NeoX's "gelu", tanh form for "gelu_new"/"gelu_fast"."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=approximate).astype(x.dtype)


# ----------------------------------------------------------------------------- modules
def _param(rngs: nnx.Rngs, shape, dtype, std=_INIT_STD):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out]."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.kernel = _param(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def bias_value(self):
        return None if self.bias is None else self.bias[...]

    def __call__(self, x):
        return dense(x, self.kernel[...], self.bias_value())


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = _param(rngs, (vocab, dim), dtype)

    def __call__(self, ids):
        # On Explicit mesh axes a gather's output sharding must be given: the ids' rows.
        sharding = jax.typeof(ids).sharding
        rows = isinstance(sharding, NamedSharding) and any(a is not None for a in sharding.spec)
        out = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, None)) if rows else None
        return self.embedding[...].at[ids].get(mode="fill", out_sharding=out)  # as jnp.take: NaN rows past the vocab

    def attend(self, h):
        """Tied output projection: h @ embedding.T, float32 logits."""
        return jnp.matmul(h, self.embedding[...].T.astype(h.dtype), preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)) with [in, out] kernels."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.gate = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.up = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.down = Linear(hidden, dim, bias=bias, dtype=dtype, rngs=rngs)

    def weights(self) -> dict:
        return dict(
            w_gate=self.gate.kernel[...], w_up=self.up.kernel[...], w_down=self.down.kernel[...],
            b_gate=self.gate.bias_value(), b_up=self.up.bias_value(), b_down=self.down.bias_value(),
        )


class GeluMLP(nnx.Module):
    """fc_out(gelu(fc_in(x))) with biases (GPT-NeoX)."""

    def __init__(self, dim: int, hidden: int, *, approximate: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.fc_in = Linear(dim, hidden, bias=True, dtype=dtype, rngs=rngs)
        self.fc_out = Linear(hidden, dim, bias=True, dtype=dtype, rngs=rngs)
        self.approximate = approximate

    def weights(self) -> dict:
        return dict(
            w_in=self.fc_in.kernel[...], b_in=self.fc_in.bias_value(),
            w_out=self.fc_out.kernel[...], b_out=self.fc_out.bias_value(),
        )
