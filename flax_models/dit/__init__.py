"""A Flux-style DiT (MM-DiT) in Flax NNX whose joint attention runs sequence-parallel through
``jax_cluster.parallel`` when given a plan: double-stream blocks (text and image streams, joint
attention with text tokens first), single-stream blocks (parallel attention and MLP), adaLN-Zero
modulation, QK RMSNorm, interleaved multi-axis RoPE, GELU-tanh MLPs, flow-matching Euler sampling.

    from flax_models.dit import Flux, get_config, sample
    from jax_cluster import parallel as sp
    model = Flux(get_config("tiny"), rngs=nnx.Rngs(0))
    plan = sp.plan("torus", heads=model.cfg.num_heads, num_machines=2)
    latents = sample(model, noise, txt, y=y, guidance=3.5, plan=plan)
"""
from .blocks import DoubleStreamBlock, SingleStreamBlock, attention
from .config import CONFIGS, DiTConfig, get_config
from .model import Flux, init_random, param_count
from .rope import apply_rope, rope_angles
from .sampling import (denoise, euler_step, get_schedule, image_ids, pack, sample, text_ids, unpack,
                       video_ids)

__all__ = ["CONFIGS", "DiTConfig", "DoubleStreamBlock", "Flux", "SingleStreamBlock", "apply_rope", "attention",
           "denoise", "euler_step", "get_config", "get_schedule", "image_ids", "init_random", "pack",
           "param_count", "rope_angles", "sample", "text_ids", "unpack", "video_ids"]
