"""Multi-axis rotary embedding with interleaved pairs (Flux): position axis i rotates
``axes_dim[i]`` consecutive channels as pairs (x[2j], x[2j+1]) by angle pos_i * theta^(-2j/d_i)."""
from __future__ import annotations

import jax.numpy as jnp


def inv_frequencies(axes_dim, theta: float) -> list:
    """Inverse frequencies per axis: theta ** (-(0, 2, 4, ..) / d_i), fp32."""
    return [1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d) for d in axes_dim]


def rope_angles(ids, axes_dim, theta: float):
    """(cos, sin), each fp32 [B, L, head_dim / 2], for integer/float position ids [B, L, n_axes]."""
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(f"ids have {ids.shape[-1]} position axes, axes_dim has {len(axes_dim)}")
    angles = jnp.concatenate(
        [ids[..., i:i + 1].astype(jnp.float32) * f for i, f in enumerate(inv_frequencies(axes_dim, theta))],
        axis=-1,
    )
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs of x [B, L, H, D] by angles [B, L, D/2]; computed in fp32."""
    xf = x.astype(jnp.float32)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
