"""Flow-matching sampling: position ids, 2x2 latent packing, the shifted schedule, Euler steps."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx


def image_ids(batch: int, h: int, w: int):
    """Position ids [B, h*w, 3] = (0, row, col) of packed image tokens."""
    rows, cols = jnp.meshgrid(jnp.arange(h), jnp.arange(w), indexing="ij")
    ids = jnp.stack([jnp.zeros_like(rows), rows, cols], -1).reshape(1, h * w, 3)
    return jnp.broadcast_to(ids, (batch, h * w, 3)).astype(jnp.float32)


def video_ids(batch: int, t: int, h: int, w: int):
    """Position ids [B, t*h*w, 3] = (frame, row, col)."""
    f, r, c = jnp.meshgrid(jnp.arange(t), jnp.arange(h), jnp.arange(w), indexing="ij")
    ids = jnp.stack([f, r, c], -1).reshape(1, t * h * w, 3)
    return jnp.broadcast_to(ids, (batch, t * h * w, 3)).astype(jnp.float32)


def text_ids(batch: int, length: int, axes: int = 3):
    return jnp.zeros((batch, length, axes), jnp.float32)


def pack(latents, patch: int = 2):
    """[B, C, H, W] -> [B, (H/p)(W/p), C p p] tokens."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack(tokens, h: int, w: int, patch: int = 2):
    """Inverse of :func:`pack` for a latent of height h and width w."""
    b, _, d = tokens.shape
    c = d // (patch * patch)
    x = tokens.reshape(b, h // patch, w // patch, c, patch, patch)
    return x.transpose(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def time_shift(mu: float, sigma: float, t):
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def get_schedule(num_steps: int, image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15,
                 shift: bool = True) -> list[float]:
    """Times from 1 (noise) to 0 (data); with ``shift``, resolution-dependent time shift
    (mu linear in the token count between 256 and 4096 tokens)."""
    ts = [1 - i / num_steps for i in range(num_steps + 1)]
    if shift:
        mu = base_shift + (max_shift - base_shift) * (image_seq_len - 256) / (4096 - 256)
        ts = [time_shift(mu, 1.0, t) if 0 < t < 1 else t for t in ts]
    return ts


def _euler(graph, state, img, img_ids, txt, txt_ids, y, guidance, t_curr, t_prev, plan, kernel):
    """x_{t_prev} = x_{t_curr} + (t_prev - t_curr) v(x_{t_curr}, t_curr)."""
    model = nnx.merge(graph, state)
    b = img.shape[0]
    t = jnp.full((b,), t_curr, jnp.float32)
    g = None if guidance is None else jnp.full((b,), guidance, jnp.float32)
    pred = model(img, img_ids, txt, txt_ids, t, y, g, plan=plan, kernel=kernel)
    return (img.astype(jnp.float32) + (t_prev - t_curr) * pred.astype(jnp.float32)).astype(img.dtype)


@functools.lru_cache(maxsize=32)
def _step_fn(graph, plan, kernel, options):
    step = functools.partial(_euler, graph, plan=plan, kernel=kernel)
    return jax.jit(step, compiler_options=dict(options) if options else None)


def euler_step(model, img, img_ids, txt, txt_ids, t_curr, t_prev, *, y=None, guidance=None, plan=None,
               kernel=None, compiler_options=None):
    """One Euler step of the flow (jitted once per model structure, plan and kernel)."""
    graph, state = nnx.split(model)
    opts = tuple(sorted(compiler_options.items())) if compiler_options else None
    return _step_fn(graph, plan, kernel, opts)(state, img, img_ids, txt, txt_ids, y, guidance,
                                                jnp.float32(t_curr), jnp.float32(t_prev))


def denoise(model, img, img_ids, txt, txt_ids, timesteps, *, y=None, guidance=None, plan=None, kernel=None,
            compiler_options=None):
    """Euler integration of the flow from t = timesteps[0] to timesteps[-1]."""
    for t_curr, t_prev in zip(timesteps[:-1], timesteps[1:]):
        img = euler_step(model, img, img_ids, txt, txt_ids, t_curr, t_prev, y=y, guidance=guidance, plan=plan,
                         kernel=kernel, compiler_options=compiler_options)
    return img


def sample(model, noise, txt, *, y=None, guidance=None, num_steps: int = 4, plan=None, kernel=None, patch=2):
    """Generate latents [B, C, H, W] from Gaussian ``noise`` of that shape and text features."""
    b, _, h, w = noise.shape
    img = pack(noise, patch)
    ids = image_ids(b, h // patch, w // patch)
    ts = get_schedule(num_steps, img.shape[1])
    out = denoise(model, img, ids, txt, text_ids(b, txt.shape[1]), ts, y=y, guidance=guidance, plan=plan,
                  kernel=kernel)
    return unpack(out, h, w, patch)
