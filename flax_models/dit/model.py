"""The Flux-style DiT (MM-DiT) in Flax NNX, with random weights."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .blocks import DoubleStreamBlock, LastLayer, SingleStreamBlock
from .config import DiTConfig
from .layers import MLPEmbedder, dense, timestep_embedding
from .rope import rope_angles


class Flux(nnx.Module):
    """Velocity model v(x_t, t | text): packed image latents [B, L_img, in_channels] and text
    features [B, L_txt, context_in_dim] -> velocity [B, L_img, out_channels].

    ``plan`` (a ``jax_cluster.parallel.Plan``) runs every joint attention sequence-parallel;
    L_txt + L_img must then be divisible by the number of devices."""

    def __init__(self, cfg: DiTConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.cfg = cfg
        self.img_in = dense(rngs, cfg.in_channels, h, dtype=dtype)
        self.time_in = MLPEmbedder(256, h, dtype=dtype, rngs=rngs)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, h, dtype=dtype, rngs=rngs) if cfg.vec_in_dim else None
        self.guidance_in = MLPEmbedder(256, h, dtype=dtype, rngs=rngs) if cfg.guidance_embed else None
        self.txt_in = dense(rngs, cfg.context_in_dim, h, dtype=dtype)
        self.double_blocks = nnx.List([DoubleStreamBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.depth)])
        self.single_blocks = nnx.List(
            [SingleStreamBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.depth_single_blocks)])
        self.final_layer = LastLayer(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, img, img_ids, txt, txt_ids, timesteps, y=None, guidance=None, *, plan=None, kernel=None):
        cfg = self.cfg
        dtype = self.img_in.kernel.dtype
        img = self.img_in(img.astype(dtype))
        vec = self.time_in(timestep_embedding(timesteps, 256))
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this config embeds guidance: pass guidance [B]")
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256))
        if self.vector_in is not None:
            if y is None:
                raise ValueError(f"this config takes a pooled text vector y [B, {cfg.vec_in_dim}]")
            vec = vec + self.vector_in(y)
        txt = self.txt_in(txt.astype(dtype))
        cos, sin = rope_angles(jnp.concatenate([txt_ids, img_ids], axis=1), cfg.axes_dim, cfg.theta)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, cos, sin, plan, kernel)
        x = jnp.concatenate([txt, img], axis=1)
        if plan is not None:
            x = jax.lax.with_sharding_constraint(x, plan.sharding(3))
        for block in self.single_blocks:
            x = block(x, vec, cos, sin, plan, kernel)
        return self.final_layer(x[:, txt.shape[1]:], vec)


HOST_INIT_MAX = 1 << 20


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _is_modulation(path: str) -> bool:
    return any(n in path for n in ("['mod']", "['modulation']", "['adaLN_modulation']", "['final_layer']['linear']"))


def init_random(cfg: DiTConfig, *, seed: int = 0, dtype=jnp.float32) -> Flux:
    """A model with random weights made directly in ``dtype`` on the default device: kernels
    N(0, 1/fan_in), biases N(0, 0.02^2), norm scales 1 (adaLN-Zero: modulation and final
    projection 0). One small compiled generator per distinct shape, so real configs are cheap
    to build (Flux needs ~24 GB in bf16)."""
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Flux(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    key = jax.random.key(seed)
    values = []
    for i, (path, leaf) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        shape, dt = tuple(leaf.shape), leaf.dtype
        if "['scale']" in name:
            values.append(jnp.ones(shape, dt))
        elif cfg.adaln_zero_init and _is_modulation(name):
            values.append(jnp.zeros(shape, dt))
        else:
            std = 1.0 / math.sqrt(shape[0]) if "['kernel']" in name else 0.02
            if math.prod(shape) <= HOST_INIT_MAX:  # small: numpy, no compile
                rng = np.random.default_rng([seed, i])
                values.append(jnp.asarray((std * rng.standard_normal(shape)).astype(np.float32), dt))
            else:
                values.append(_normal(jax.random.fold_in(key, i), shape, dt, std))
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), values)
    return nnx.merge(graph, state)


def param_count(cfg: DiTConfig) -> int:
    """Number of parameters, without allocating them."""
    abstract = nnx.eval_shape(lambda: Flux(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
