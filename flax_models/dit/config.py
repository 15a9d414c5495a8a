"""Configurations of the Flux-style DiT: the real shapes (random weights) and tiny CPU ones."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DiTConfig:
    """A Flux-style MM-DiT: ``depth`` double-stream blocks then ``depth_single_blocks``
    single-stream blocks over the joint [text; image] sequence."""

    in_channels: int = 64  # packed latent channels (16 latent channels x 2 x 2 patch)
    out_channels: int | None = None  # default: in_channels
    vec_in_dim: int | None = 768  # pooled text vector (CLIP); None: no vector input
    context_in_dim: int = 4096  # text token features (T5)
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE dims per position axis, sum = head_dim
    theta: float = 10000.0
    qkv_bias: bool = True
    guidance_embed: bool = True
    adaln_zero_init: bool = False  # True: modulation weights start at 0 (training init)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"sum(axes_dim)={sum(self.axes_dim)} must equal head_dim={self.head_dim}")
        if any(d % 2 for d in self.axes_dim):
            raise ValueError(f"every entry of axes_dim={self.axes_dim} must be even (rotated pairs)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def out_dim(self) -> int:
        return self.out_channels or self.in_channels


CONFIGS = {
    # Flux.1-dev: 24 heads x 128, 19 double + 38 single blocks (about 11.9B parameters)
    "flux": DiTConfig(),
    "flux-schnell": DiTConfig(guidance_embed=False),
    # CogVideoX-like video DiT: 30 heads x 64, 30 joint-attention blocks, (t, h, w) RoPE
    "cogvideox": DiTConfig(in_channels=64, vec_in_dim=None, context_in_dim=4096, hidden_size=1920,
                           num_heads=30, depth=0, depth_single_blocks=30, axes_dim=(16, 24, 24),
                           guidance_embed=False),
    # tiny: run anywhere in seconds
    "tiny": DiTConfig(in_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64, num_heads=4,
                      depth=2, depth_single_blocks=2, axes_dim=(4, 6, 6)),
    "tiny-video": DiTConfig(in_channels=16, vec_in_dim=None, context_in_dim=32, hidden_size=96, num_heads=6,
                            depth=1, depth_single_blocks=2, axes_dim=(4, 6, 6), guidance_embed=False),
}


def get_config(name: str, **overrides) -> DiTConfig:
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown DiT config {name!r}; configs: {sorted(CONFIGS)}") from None
    return replace(cfg, **overrides) if overrides else cfg
