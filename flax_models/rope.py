"""Rotary position embeddings: inverse frequencies for each scaling scheme, and their application.

The inverse frequencies are computed here, in Python (numpy, float64, then float32), and passed as an
array to the attention code and to the fused kernels (DESIGN.md): Llama-3 scaling and YaRN never reach
a kernel. Layouts: ``"half"`` rotates dimension i with i + rotary_dim/2 (GPT-NeoX/Llama "rotate_half"),
``"interleaved"`` rotates the pairs (2i, 2i+1) (DeepSeek, GPT-J).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from .config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    # The dimension index whose wavelength fits `rotations` full turns in max_pos positions.
    return dim * math.log(max_pos / (rotations * 2.0 * math.pi)) / (2.0 * math.log(base))


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(rope: RopeConfig, rotary_dim: int) -> tuple[tuple[float, ...], float]:
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    idx = np.arange(0, rotary_dim, 2, dtype=np.float64)
    inv = 1.0 / (rope.theta ** (idx / rotary_dim))
    attention_factor = 1.0
    kind = rope.rope_type
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / rope.factor
    elif kind == "llama3":
        old = rope.original_max_position_embeddings
        if old is None:
            raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2.0 * math.pi / inv
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1.0 - smooth) * inv / rope.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / rope.factor, np.where(wavelen < high_wavelen, inv, mid))
    elif kind == "yarn":
        old = rope.original_max_position_embeddings
        lo = _yarn_correction_dim(rope.beta_fast, rotary_dim, rope.theta, old)
        hi = _yarn_correction_dim(rope.beta_slow, rotary_dim, rope.theta, old)
        if rope.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001
        # ramp = 0 -> keep the original frequency (extrapolate), 1 -> divide by factor (interpolate)
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        inv = (inv / rope.factor) * ramp + inv * (1.0 - ramp)
        if rope.attention_factor is not None:
            attention_factor = float(rope.attention_factor)
        elif rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(rope.factor)
    else:  # config parsing rejects others
        raise ValueError(f"unsupported rope_type {kind!r}")
    return tuple(float(v) for v in inv.astype(np.float32)), float(attention_factor)


def inv_frequencies(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """float32 [rotary_dim // 2] inverse frequencies."""
    return np.asarray(_inv_freq_cached(rope, rotary_dim)[0], dtype=np.float32)


def attention_factor(rope: RopeConfig, rotary_dim: int) -> float:
    """Multiplier applied to cos and sin (YaRN's mscale ratio; 1 for the other schemes)."""
    return _inv_freq_cached(rope, rotary_dim)[1]


def cos_sin(positions, inv_freq, factor: float = 1.0):
    """cos and sin of positions[..., None] * inv_freq, float32 [..., rotary_dim // 2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x, cos, sin, layout: str = "half"):
    """Rotates the first ``2 * cos.shape[-1]`` features of x [..., D]; the rest pass through.

    cos/sin broadcast against x[..., :rotary_dim // 2]. Computed in float32, returned in x.dtype.
    """
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].astype(jnp.float32)
    if layout == "half":
        a, b = xr[..., : rd // 2], xr[..., rd // 2 :]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    elif layout == "interleaved":
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(xr.shape)
    else:
        raise ValueError(f"rope layout must be 'half' or 'interleaved', got {layout!r}")
    out = out.astype(x.dtype)
    if rd == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rd:]], axis=-1)
